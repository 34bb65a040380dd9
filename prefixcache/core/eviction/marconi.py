"""``marconi``: Marconi's FLOP-aware eviction score (Pan et al., MLSys'25, "Marconi:
Prefix Caching for the Era of Hybrid LLMs", arXiv 2411.19379, section 4.2) over cached
blocks of any KV cache group.

Marconi scores a cache entry by ``utility = recency + alpha * FLOP efficiency`` and
evicts the lowest; FLOP efficiency is the compute a hit on the entry saves per byte
the entry holds. In a hybrid model the two kinds of state differ in both:

* an **attention** block (full or sliding window) at chain position ``p`` holds
  ``block_size`` tokens' K/V (per-token size) and a hit saves those tokens' compute
  for its layers: the projections and MLP (``2 x params_per_layer`` FLOPs a token)
  plus attention over the keys before them (``4 x q_heads x head_dim`` a key; ``p *
  block_size`` and more keys for full attention, at most the window for a sliding
  window), so deeper blocks save a little more;
* a **state** block (a ``mamba`` group: one state snapshot after ``(p + 1) *
  block_size`` tokens) has a fixed size, and a hit on it saves the whole prefix's
  compute for its layers (``(p + 1) * block_size`` tokens x ``2 x params_per_layer``;
  the scan, linear in tokens, is left out), so a deep state is worth far more than a
  shallow one.

Both are per layer (a group's layer count cancels in FLOPs / bytes). The group of each
block comes from the pool (``needs_groups``: ``set_groups`` / ``on_cached_group``, the
hash index's hybrid coordinator); a manager that tells no groups (one full-attention
group, the radix tree) gets a full-attention block at every position, so the score
degrades to recency plus a small position (prefix length) term.

Normalisation (option ``normalization``):

* ``"running"`` (the default): both terms are normalised by running scales so that a
  block's key is fixed when it becomes a candidate (a heap, O(log n) per operation, as
  every keyed policy): recency is the block's release stamp over ``recency_window``
  clock ticks (default ``2 x num_blocks``: a pool's worth of cache-and-release ticks,
  about the span of the candidates' stamps), efficiency is over the largest efficiency
  any cached block has had so far (so it lies in (0, 1]).
* ``"minmax"``: Marconi's own rule: at each eviction both terms are min-max normalised
  over the current candidates (recency: ``(stamp - min) / (max - min)``; a term whose
  candidates are all equal counts 0), so a block's utility moves as the candidates
  change. O(candidates) per eviction (numpy over the live candidates; no heap).

In both, ``alpha = 0`` is exactly LRU and ties fall back to LRU order (then the order
the blocks became candidates). NOTE: Marconi tunes alpha per workload by replaying past
requests (its "retrospective" grid search); here it is an option (default 1.0).

Options (checked before anything is built): ``alpha`` (a finite real >= 0), ``model``
(a ``prefixcache.cost_model.MODEL_PRESETS`` name or a ``ModelShape``: the per-layer
shape), ``state_bytes_per_layer`` (a state snapshot's bytes per layer; default
Mamba2's with expand 2, d_state 128, d_conv 4: ``(2 d_model x 128 + 4 x (2 d_model +
256)) x dtype_bytes``), ``recency_window`` (clock ticks, a positive int; ``"running"``
only), ``normalization`` (``"running"`` or ``"minmax"``).
"""

from __future__ import annotations

import math

import numpy as np

from prefixcache._validate import check_positive_int
from prefixcache.core.eviction.base import KeyedPolicy, PolicyError
from prefixcache.core.eviction.cost import DEFAULT_MODEL, model_shape

NORMALIZATIONS = ("running", "minmax")

# Mamba2's state shape defaults (expand, d_state, d_conv) for state_bytes_per_layer.
_MAMBA2_EXPAND, _MAMBA2_D_STATE, _MAMBA2_D_CONV = 2, 128, 4


def _positive_int(name: str, v) -> int:
    # The one rule for a size (numpy ints accepted, bools refused), named for this policy.
    return check_positive_int(f"marconi: {name}", v)


class MarconiPolicy(KeyedPolicy):
    """Recency + alpha x FLOP efficiency, per KV cache group (module docstring).

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block (the manager passes its own).
        alpha: the weight of FLOP efficiency (finite, >= 0; 0 is LRU).
        model: a ``MODEL_PRESETS`` name or a ``ModelShape`` (per-layer FLOPs and KV).
        state_bytes_per_layer: bytes of one state snapshot per layer (None: Mamba2's).
        recency_window: clock ticks one unit of recency spans (None: 2 x num_blocks;
            ``"running"`` only).
        normalization: ``"running"`` (fixed keys, a heap) or ``"minmax"`` (Marconi's
            min-max over the candidates at each eviction).
    """

    name = "marconi"
    needs_block_size = True
    needs_groups = True

    def __init__(self, num_blocks: int, *, block_size: int, alpha: float = 1.0,
                 model=DEFAULT_MODEL, state_bytes_per_layer: int | None = None,
                 recency_window: int | None = None, normalization: str = "running"):
        super().__init__(num_blocks)
        if not isinstance(normalization, str) or normalization not in NORMALIZATIONS:
            raise ValueError(f"marconi: normalization must be one of {NORMALIZATIONS}, "
                             f"got {normalization!r}")
        if normalization == "minmax" and recency_window is not None:
            raise ValueError("marconi: recency_window is the running normalisation's "
                             "scale; normalization='minmax' takes none")

        block_size = _positive_int("block_size", block_size)
        if (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                or not math.isfinite(alpha) or alpha < 0):
            raise ValueError(f"marconi: alpha must be a finite number >= 0, got {alpha!r}")
        shape = model_shape("marconi", model)
        if state_bytes_per_layer is None:
            d_inner = _MAMBA2_EXPAND * shape.d_model
            state_bytes_per_layer = (
                d_inner * _MAMBA2_D_STATE
                + _MAMBA2_D_CONV * (d_inner + 2 * _MAMBA2_D_STATE)) * shape.dtype_bytes
        state_bytes_per_layer = _positive_int("state_bytes_per_layer", state_bytes_per_layer)
        if recency_window is None:
            recency_window = 2 * num_blocks
        recency_window = _positive_int("recency_window", recency_window)
        self.block_size = block_size
        self.alpha = float(alpha)
        self.model = model if isinstance(model, str) else "custom"
        self.state_bytes_per_layer = state_bytes_per_layer
        self.recency_window = recency_window
        self._shape = shape
        # Per token per layer: projections + MLP; per key attended: QK^T and AV.
        self._linear = 2.0 * shape.params_per_layer
        self._per_key = 4.0 * shape.num_q_heads * shape.head_dim
        self._attn_bytes = float(block_size * 2 * shape.num_kv_heads * shape.head_dim
                                 * shape.dtype_bytes)
        # The groups' models: (kind, window) per group id; one full-attention group
        # until set_groups says otherwise.
        self._models: list[tuple[str, int | None]] = [("attention", None)]
        self._eff: list[list[float]] = [[]]  # per group: efficiency by position (lazy)
        self.efficiency_scale = 0.0  # the largest efficiency a cached block has had
        self.efficiency = [0.0] * num_blocks  # of each cached block
        self.group = [0] * num_blocks
        self.score = [0.0] * num_blocks  # the utility at add() (the key's first term)
        self.normalization = normalization
        # "minmax": the candidates in numpy (the heap is not used): live flags, the
        # release stamp and efficiency each had when it became a candidate, and the
        # order it did (the last tie-break); the block objects by id.
        self._minmax = normalization == "minmax"
        if self._minmax:
            self._mm_live = np.zeros(num_blocks, dtype=bool)
            self._mm_stamp = np.zeros(num_blocks, dtype=np.float64)
            self._mm_eff = np.zeros(num_blocks, dtype=np.float64)
            self._mm_order = np.zeros(num_blocks, dtype=np.int64)
            self._mm_block: list = [None] * num_blocks

    # -- the FLOP / byte model ---------------------------------------------------------
    def set_groups(self, groups) -> None:
        """One model per group: attention (full, or with its window) or state."""
        models = []
        for i, g in enumerate(groups):
            kind = g.spec.kind
            if kind == "full_attention":
                models.append(("attention", None))
            elif kind == "sliding_window":
                models.append(("attention", int(g.spec.sliding_window)))
            elif kind == "mamba":
                models.append(("state", None))
            else:
                raise ValueError(f"marconi: no FLOP model for KV cache group {i} of kind "
                                 f"{kind!r} (known: full_attention, sliding_window, mamba)")
        if not models:
            raise ValueError("marconi: set_groups needs at least one group")
        self._models = models
        self._eff = [[] for _ in models]

    def _block_efficiency(self, group_id: int, position: int) -> float:
        kind, window = self._models[group_id]
        bs = self.block_size
        if kind == "state":  # the whole prefix's compute, at a fixed size
            return (position + 1) * bs * self._linear / self.state_bytes_per_layer
        first = position * bs  # tokens first .. first + bs - 1; token t sees t + 1 keys
        if window is None:
            keys = bs * first + bs * (bs + 1) // 2
        else:
            keys = sum(min(t + 1, window) for t in range(first, first + bs))
        return (bs * self._linear + self._per_key * keys) / self._attn_bytes

    def efficiency_of(self, group_id: int, position: int) -> float:
        """FLOPs a hit on group ``group_id``'s block at ``position`` saves, per byte it
        holds (per layer)."""
        vals = self._eff[group_id]
        while len(vals) <= position:
            vals.append(self._block_efficiency(group_id, len(vals)))
        return vals[position]

    # -- notifications -----------------------------------------------------------------
    def on_cached(self, block, block_hash, request, position) -> None:
        self.on_cached_group(block, block_hash, request, position, 0)

    def on_cached_group(self, block, block_hash, request, position, group_id) -> None:
        super().on_cached(block, block_hash, request, position)
        bid = block.block_id
        e = self.efficiency_of(group_id, position)
        self.group[bid] = group_id
        self.efficiency[bid] = e
        if e > self.efficiency_scale:
            self.efficiency_scale = e

    def key(self, block) -> tuple[float, int]:
        bid = block.block_id
        stamp = self.released_at[bid]
        s = stamp / self.recency_window
        if self.alpha and self.efficiency_scale:
            s += self.alpha * self.efficiency[bid] / self.efficiency_scale
        self.score[bid] = s
        return (s, stamp)

    def current_key(self, block) -> tuple[float, int]:
        # NOTE: the efficiency scale may have grown since add(): the key stays as set.
        bid = block.block_id
        return (self.score[bid], self.released_at[bid])

    # -- "minmax": the candidates in numpy, utilities at each eviction --------------
    def utilities(self, block_ids) -> np.ndarray:
        """Marconi's min-max utilities of candidates ``block_ids`` (as at an eviction
        now: recency and efficiency each min-max normalised over ALL candidates)."""
        if not self._minmax:
            raise ValueError("marconi: utilities() is the minmax normalisation's")
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        live = np.flatnonzero(self._mm_live)
        bad = ids[~np.isin(ids, live)]
        if len(bad):
            raise ValueError(f"marconi: blocks {bad[:10].tolist()} are not candidates")
        if not len(ids):
            return np.zeros(0)
        return self._utilities(live)[1][np.searchsorted(live, ids)]

    def _utilities(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        st = self._mm_stamp[ids]
        u = st - st.min()
        span = u.max()
        if span > 0:
            u /= span
        else:
            u[:] = 0.0
        if self.alpha:
            ef = self._mm_eff[ids]
            e = ef - ef.min()
            espan = e.max()
            if espan > 0:
                u += self.alpha * (e / espan)
        return st, u

    def _order(self) -> np.ndarray:
        """The live candidates' ids, the next victim first (utility, then stamp, then
        the order they became candidates)."""
        ids = np.flatnonzero(self._mm_live)
        if not len(ids):
            return ids
        st, u = self._utilities(ids)
        return ids[np.lexsort((self._mm_order[ids], st, u))]

    def add(self, block) -> None:
        if not self._minmax:
            return KeyedPolicy.add(self, block)
        bid = block.block_id
        if self._mm_live[bid]:
            raise PolicyError(f"{self.name}: block {bid} is already a candidate")
        self._next_token += 1
        self._mm_live[bid] = True
        self._mm_stamp[bid] = self.released_at[bid]
        self._mm_eff[bid] = self.efficiency[bid]
        self._mm_order[bid] = self._next_token
        self._mm_block[bid] = block
        self._n += 1
        return None

    def discard(self, block) -> None:
        if not self._minmax:
            return KeyedPolicy.discard(self, block)
        bid = block.block_id
        if not self._mm_live[bid]:
            raise PolicyError(f"{self.name}: block {bid} is not a candidate")
        self._mm_live[bid] = False
        self._mm_block[bid] = None
        self._n -= 1
        return None

    def pop(self):
        if not self._minmax:
            return KeyedPolicy.pop(self)
        ids = np.flatnonzero(self._mm_live)
        if not len(ids):
            raise PolicyError(f"{self.name}: pop() with no candidates")
        st, u = self._utilities(ids)
        # the smallest utility; among equal ones the oldest stamp, then the first added
        m = np.flatnonzero(u == u.min())
        if len(m) > 1:
            m = m[np.lexsort((self._mm_order[ids[m]], st[m]))]
        bid = int(ids[m[0]])
        block = self._mm_block[bid]
        self._mm_live[bid] = False
        self._mm_block[bid] = None
        self._n -= 1
        return block

    def clear(self) -> None:
        KeyedPolicy.clear(self)
        if self._minmax:
            self._mm_live[:] = False
            self._mm_block = [None] * self.num_blocks

    def candidate_ids(self) -> list[int]:
        if not self._minmax:
            return KeyedPolicy.candidate_ids(self)
        return self._order().tolist()

    def check_invariants(self, candidate_ids) -> None:
        if not self._minmax:
            return KeyedPolicy.check_invariants(self, candidate_ids)
        live = np.flatnonzero(self._mm_live)
        if len(live) != self._n:
            raise PolicyError(f"{self.name}: {len(live)} live candidates but {self._n} "
                              "counted")
        for bid in live.tolist():
            b = self._mm_block[bid]
            if b is None or b.block_id != bid:
                raise PolicyError(f"{self.name}: candidate {bid} holds no block of its id")
            if (self._mm_stamp[bid] != self.released_at[bid]
                    or self._mm_eff[bid] != self.efficiency[bid]):
                raise PolicyError(
                    f"{self.name}: candidate block {bid} was added with stamp "
                    f"{self._mm_stamp[bid]} / efficiency {self._mm_eff[bid]} but has "
                    f"{self.released_at[bid]} / {self.efficiency[bid]} now (metadata "
                    "changed without a rekey)")
        # (the candidate-set comparison of every policy)
        super(KeyedPolicy, self).check_invariants(candidate_ids)
        return None


__all__ = ["MarconiPolicy"]
