"""``pgdsf``: Prefix-aware Greedy-Dual-Size-Frequency, RAGCache's policy (Jin et al.,
arXiv 2404.12457, section 5.2), over cached blocks.

RAGCache keeps the KV of retrieved documents in a prefix tree and evicts by
``Priority = Clock + Frequency x Cost / Size``: GreedyDual-Size (``cost``, the policy in
``cost.py``) with the access count as a multiplier (GDSF, Cherkasova 1998). Its
*prefix-aware* cost is the compute a hit on the node saves, which depends on where in
the prefix the node sits. Here:

* ``Cost / Size`` is ``cost``'s value: the prefill FLOPs a hit on a block at position
  ``p`` saves (attention over ``p`` cached blocks grows with ``p``) per byte of KV the
  block holds;
* ``Frequency`` is 1 + the hits since the block was cached (``on_hit``);
* ``Clock`` is GreedyDual's inflation ``L``: it rises to the victim's priority at each
  eviction, so blocks that are not reused age out.

The smallest priority is evicted; ties fall back to LRU order. ``frequency_cap``
(default none) bounds the multiplier, as some GDSF variants do to forget old
popularity.
"""

from __future__ import annotations

from prefixcache.core.eviction.base import HitCounts
from prefixcache.core.eviction.cost import DEFAULT_MODEL, CostPolicy


class PGDSFPolicy(HitCounts, CostPolicy):
    """GreedyDual-Size-Frequency over prefill FLOPs saved per byte (module docstring).

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block (the manager passes its own).
        model: a ``prefixcache.sim.cost_model.MODEL_PRESETS`` name, or a ``ModelShape``.
        frequency_cap: None, or the largest frequency multiplier (an int >= 1).
    """

    name = "pgdsf"

    def __init__(self, num_blocks: int, *, block_size: int, model=DEFAULT_MODEL,
                 frequency_cap: int | None = None):
        super().__init__(num_blocks, block_size=block_size, model=model)
        if frequency_cap is not None and (
                isinstance(frequency_cap, bool) or not isinstance(frequency_cap, int)
                or frequency_cap < 1):
            raise ValueError(f"pgdsf: frequency_cap must be None or an int >= 1, "
                             f"got {frequency_cap!r}")
        self.frequency_cap = frequency_cap

    def frequency(self, block_id: int) -> int:
        f = 1 + self.hits[block_id]
        cap = self.frequency_cap
        return f if cap is None or f <= cap else cap

    def key(self, block) -> tuple[float, int]:
        bid = block.block_id
        h = self.inflation + self.frequency(bid) * self.value(self.position[bid])
        self.h[bid] = h
        return (h, self.released_at[bid])
