"""``length``: blocks at later positions in their request go first (Mooncake's
LengthAware eviction), LRU among equals.

A block's position is its index in the block table of the request that cached it
(0 = first block). In a hash chain it is a property of the content: every request
that hits the block holds it at the same index.
"""

from __future__ import annotations

from prefixcache.core.eviction.base import KeyedPolicy


class LengthPolicy(KeyedPolicy):
    """Evict the deepest candidate first (ties: LRU)."""

    name = "length"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.position = [0] * num_blocks

    def on_cached(self, block, block_hash, request, position) -> None:
        super().on_cached(block, block_hash, request, position)
        self.position[block.block_id] = position

    def key(self, block) -> tuple[int, int]:
        bid = block.block_id
        return (-self.position[bid], self.released_at[bid])
