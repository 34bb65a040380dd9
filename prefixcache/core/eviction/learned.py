"""``learned``: a small MLP scores the candidates; the highest score is evicted first.

Learning-Relaxed-Belady style (Song et al., NSDI 2020): the model predicts each
candidate's distance to its next use (``log1p`` of the number of requests until a
later prompt holds the block, as the offline ``belady`` policy sees it) from features a
real cache keeps, and the candidate predicted to be reused last goes first. Training
(jax + optax, on the first part of a trace, labels from ``belady``) is in
``experiments/learned_policy.py``; this class only scores, with numpy, from given
parameters: ``prefixcache.core`` never imports jax.

Features (``FEATURES``; times in ticks of the policy's logical clock -- one per block
cached, hit or released -- divided by the pool's blocks, so a trace and a pool of
another size see the same scale): ``recency`` (since the last release), ``frequency``
(hits since cached), ``depth`` (the block's position in its chain), ``saved_tokens``
(the prefix tokens a hit on it completes: ``(depth + 1) * block_size``), ``since_hit``
(since the last hit, or since cached if none) and ``age`` (since cached); each
``log1p``-transformed, then standardized with the training set's mean and std. The tier
a block sits in is not a feature: a policy serves one tier, so within one policy it is a
constant (a trained model would learn nothing from it).

Inference is batched on the host at eviction time: the first ``pop`` after any change
scores every candidate in one matrix product and ranks them; the following pops (a
request allocating several blocks) take the next ones from that ranking until a
notification or a new candidate invalidates it. Ties fall to LRU order.

With ``sample=k`` (LRB's own scheme: it scores 64 random candidates per eviction) each
``pop`` instead draws ``k`` distinct candidates uniformly from a generator seeded by
``seed`` and evicts the highest-scored of them: a cost per eviction independent of the
pool's size, a victim that is the best of the sample only.

Options: ``params`` (a path to the ``.npz`` the training wrote, or a mapping of its
arrays: ``mean``, ``std`` (one per feature), ``w0``, ``b0``, ``w1``, ``b1``, ...: dense
layers, ReLU between them, one output), ``sample`` (an int >= 0; 0, the default: rank
every candidate) and ``seed`` (an int, default 0; read with ``sample`` only).
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping

import numpy as np

from prefixcache._validate import check_count, check_int, check_positive_int
from prefixcache.core.eviction.base import EvictionPolicy, PolicyError

FEATURES = ("recency", "frequency", "depth", "saved_tokens", "since_hit", "age")


def load_params(params) -> dict[str, np.ndarray]:
    """``params`` (a ``.npz`` path or a mapping of arrays) checked: ``mean`` and ``std``
    of ``len(FEATURES)``, ``std > 0``, layers ``w0, b0, w1, b1, ...`` chained from
    ``len(FEATURES)`` inputs to one output, all finite. ``ValueError`` / ``TypeError``
    naming ``params`` otherwise."""
    if isinstance(params, (str, os.PathLike)):
        path = os.fspath(params)
        if not os.path.isfile(path):
            raise ValueError(f"learned: params file {path!r} does not exist")
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k]) for k in z.files}
    elif isinstance(params, Mapping):
        arrays = {str(k): np.asarray(v) for k, v in params.items()}
    else:
        raise TypeError(f"learned: params must be a path to an .npz or a mapping of arrays, "
                        f"got {type(params).__name__}")
    n_in = len(FEATURES)
    out: dict[str, np.ndarray] = {}
    for k in ("mean", "std"):
        if k not in arrays or arrays[k].shape != (n_in,):
            raise ValueError(f"learned: params need {k!r} of shape ({n_in},) (one per "
                             f"feature {FEATURES})")
        out[k] = arrays[k].astype(np.float64)
    if not np.all(out["std"] > 0):
        raise ValueError("learned: params 'std' must be > 0")
    n_layers = 0
    while f"w{n_layers}" in arrays:
        n_layers += 1
    if n_layers == 0:
        raise ValueError("learned: params hold no layer ('w0', 'b0', ...)")
    width = n_in
    for i in range(n_layers):
        w, b = arrays[f"w{i}"], arrays.get(f"b{i}")
        if w.ndim != 2 or w.shape[0] != width or b is None or b.shape != (w.shape[1],):
            raise ValueError(f"learned: params layer {i}: 'w{i}' must be ({width}, k) and "
                             f"'b{i}' (k,), got {w.shape} and "
                             f"{None if b is None else b.shape}")
        out[f"w{i}"], out[f"b{i}"] = w.astype(np.float64), b.astype(np.float64)
        width = w.shape[1]
    if width != 1:
        raise ValueError(f"learned: params' last layer must have 1 output, got {width}")
    if not all(np.all(np.isfinite(a)) for a in out.values()):
        raise ValueError("learned: params hold non-finite values")
    return out


def mlp_scores(params: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The MLP's output for each row of ``x`` (raw features, ``(n, len(FEATURES))``):
    standardized, dense layers with ReLU between them (numpy; the training's jax
    forward pass computes the same function)."""
    h = (x - params["mean"]) / params["std"]
    i = 0
    while f"w{i}" in params:
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if f"w{i + 1}" in params:
            h = np.maximum(h, 0.0)
        i += 1
    return h[:, 0]


class BlockFeatures:
    """The per-block statistics the features come from, kept from the policy
    notifications (shared by ``LearnedPolicy`` and the training's recorder).

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.clock = 0
        self.released_at = np.zeros(num_blocks, np.int64)
        self.cached_at = np.zeros(num_blocks, np.int64)
        self.last_hit = np.zeros(num_blocks, np.int64)  # cached_at until the first hit
        self.hits = np.zeros(num_blocks, np.int64)
        self.depth = np.zeros(num_blocks, np.int64)

    def cached(self, bid: int, position) -> None:
        self.clock += 1
        self.cached_at[bid] = self.last_hit[bid] = self.clock
        self.hits[bid] = 0
        self.depth[bid] = position if position is not None else 0

    def hit(self, bid: int) -> None:
        self.clock += 1
        self.hits[bid] += 1
        self.last_hit[bid] = self.clock

    def released(self, bid: int) -> None:
        self.clock += 1
        self.released_at[bid] = self.clock

    def matrix(self, bids: np.ndarray) -> np.ndarray:
        """``(len(bids), len(FEATURES))`` raw features (``log1p`` applied)."""
        now = self.clock
        scale = float(self.num_blocks)
        depth = self.depth[bids]
        cols = (
            (now - self.released_at[bids]) / scale,
            self.hits[bids],
            depth,
            (depth + 1) * self.block_size,
            (now - self.last_hit[bids]) / scale,
            (now - self.cached_at[bids]) / scale,
        )
        return np.log1p(np.stack(cols, axis=1).astype(np.float64))


class LearnedPolicy(EvictionPolicy):
    """Evict the candidate the MLP predicts is reused last (see the module docstring).

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block (the manager passes its own).
        params: the trained parameters (an ``.npz`` path or a mapping of arrays).
    """

    name = "learned"
    needs_block_size = True

    def __init__(self, num_blocks: int, *, block_size: int, params=None, sample: int = 0,
                 seed: int = 0):
        self.sample = check_count("learned: sample", sample)
        self.seed = check_int("learned: seed", seed)
        if params is None:
            raise ValueError("learned needs params: eviction_options={'params': PATH} "
                             "(the .npz experiments/learned_policy.py writes)")
        self.params = load_params(params)
        block_size = check_positive_int("learned: block_size", block_size)
        super().__init__(num_blocks)
        self.features = BlockFeatures(num_blocks, block_size)
        self._cands: dict[int, object] = {}  # block id -> block
        self._ranked: list[int] = []  # the last ranking, the next victim at _next
        self._next = 0
        self._stale = True  # a notification or a new candidate since the ranking
        self.num_scored = 0  # candidates scored (inference rows), for cost reports
        self.num_rankings = 0  # batched inferences
        self._rng = random.Random(self.seed)

    # -- notifications -----------------------------------------------------------
    def on_cached(self, block, block_hash, request, position) -> None:
        self.features.cached(block.block_id, position)
        self._stale = True

    def on_hit(self, block, request) -> None:
        self.features.hit(block.block_id)
        self._stale = True

    def on_release(self, block, request, position) -> None:
        self.features.released(block.block_id)
        self._stale = True

    # -- candidates --------------------------------------------------------------
    def add(self, block) -> None:
        bid = block.block_id
        if bid in self._cands:
            raise PolicyError(f"learned: block {bid} is already a candidate")
        self._cands[bid] = block
        self._stale = True

    def discard(self, block) -> None:
        if self._cands.pop(block.block_id, None) is None:
            raise PolicyError(f"learned: block {block.block_id} is not a candidate")

    def rank(self) -> list[int]:
        """The candidates' ids, the next victim first: highest score first, ties in
        LRU order (one batched inference)."""
        if not self._cands:
            return []
        bids = np.fromiter(self._cands, np.int64, len(self._cands))
        scores = mlp_scores(self.params, self.features.matrix(bids))
        order = np.lexsort((self.features.released_at[bids], -scores))
        return bids[order].tolist()

    def pop(self):
        if not self._cands:
            raise PolicyError("learned: pop() with no candidates")
        if self.sample and len(self._cands) > self.sample:
            # (list() keeps insertion order: the draw is a function of the seed and the
            # operations; a ranking from before stays a superset of the candidates)
            bids = np.array(self._rng.sample(list(self._cands), self.sample), np.int64)
            scores = mlp_scores(self.params, self.features.matrix(bids))
            best = np.lexsort((self.features.released_at[bids], -scores))[0]
            self.num_scored += len(bids)
            self.num_rankings += 1
            return self._cands.pop(int(bids[best]))
        if self._stale:
            self._ranked, self._next, self._stale = self.rank(), 0, False
            self.num_scored += len(self._ranked)
            self.num_rankings += 1
        ranked, cands = self._ranked, self._cands
        while True:  # (a candidate discarded since the ranking is skipped)
            bid = ranked[self._next]
            self._next += 1
            block = cands.pop(bid, None)
            if block is not None:
                return block

    def __len__(self) -> int:
        return len(self._cands)

    def clear(self) -> None:
        self._cands = {}
        self._ranked, self._next, self._stale = [], 0, True

    def candidate_ids(self) -> list[int]:
        """The candidates by score (with ``sample``, ``pop`` takes the best of a draw)."""
        return self.rank()
