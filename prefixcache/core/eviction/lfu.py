"""``lfu``: fewest hits first, LRU among equals.

A hit is a prefix lookup adopting the block (``on_hit``, whatever its ``ref_cnt``);
the count starts at 0 when the block enters the cache and is forgotten when it leaves.
"""

from __future__ import annotations

from prefixcache.core.eviction.base import KeyedPolicy


class LFUPolicy(KeyedPolicy):
    """Evict the candidate with the fewest hits since it was cached (ties: LRU)."""

    name = "lfu"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.hits = [0] * num_blocks

    def on_cached(self, block, block_hash, request, position) -> None:
        super().on_cached(block, block_hash, request, position)
        self.hits[block.block_id] = 0

    def on_hit(self, block, request) -> None:
        self.hits[block.block_id] += 1

    def key(self, block) -> tuple[int, int]:
        bid = block.block_id
        return (self.hits[bid], self.released_at[bid])
