"""``lfu``: fewest hits first, LRU among equals.

A hit is a prefix lookup adopting the block (``on_hit``, whatever its ``ref_cnt``);
the count starts at 0 when the block enters the cache and is forgotten when it leaves.
"""

from __future__ import annotations

from prefixcache.core.eviction.base import HitCounts, KeyedPolicy


class LFUPolicy(HitCounts, KeyedPolicy):
    """Evict the candidate with the fewest hits since it was cached (ties: LRU)."""

    name = "lfu"

    def key(self, block) -> tuple[int, int]:
        bid = block.block_id
        return (self.hits[bid], self.released_at[bid])
