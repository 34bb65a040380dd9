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

Normalisation. Marconi min-max normalises both terms over the candidates at each
eviction. Here both are normalised by running scales so that a block's key is fixed
when it becomes a candidate (a heap, O(log n) per operation, as every keyed policy):
recency is the block's release stamp over ``recency_window`` clock ticks (default
``2 x num_blocks``: a pool's worth of cache-and-release ticks, about the span of the
candidates' stamps), efficiency is over the largest efficiency any cached block has
had so far (so it lies in (0, 1]). ``alpha = 0`` is exactly LRU; ties fall back to LRU
order. NOTE: Marconi tunes alpha per workload by replaying past requests (its
"retrospective" grid search); here it is an option (default 1.0).

Options (checked before anything is built): ``alpha`` (a finite real >= 0), ``model``
(a ``prefixcache.cost_model.MODEL_PRESETS`` name or a ``ModelShape``: the per-layer
shape), ``state_bytes_per_layer`` (a state snapshot's bytes per layer; default
Mamba2's with expand 2, d_state 128, d_conv 4: ``(2 d_model x 128 + 4 x (2 d_model +
256)) x dtype_bytes``), ``recency_window`` (clock ticks, a positive int).
"""

from __future__ import annotations

import math

from prefixcache._validate import check_positive_int
from prefixcache.core.eviction.base import KeyedPolicy
from prefixcache.core.eviction.cost import DEFAULT_MODEL, model_shape

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
        recency_window: clock ticks one unit of recency spans (None: 2 x num_blocks).
    """

    name = "marconi"
    needs_block_size = True
    needs_groups = True

    def __init__(self, num_blocks: int, *, block_size: int, alpha: float = 1.0,
                 model=DEFAULT_MODEL, state_bytes_per_layer: int | None = None,
                 recency_window: int | None = None):
        super().__init__(num_blocks)

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


__all__ = ["MarconiPolicy"]
