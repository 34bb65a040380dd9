"""``priority``: blocks of lower-priority requests go first (SGLang's priority
eviction), LRU among equals.

``Request(..., priority=p)`` (an int, default 0; larger = more important). SGLang
evicts the node with the LOWEST priority value first. A block shared by several
requests takes the highest priority among the requests that cached, hit or released
it since it entered the cache (a shared system prompt used by an important tenant is
kept as long as that tenant's own blocks).
"""

from __future__ import annotations

from prefixcache.core.eviction.base import KeyedPolicy


class PriorityPolicy(KeyedPolicy):
    """Evict the candidate with the lowest block priority (ties: LRU)."""

    name = "priority"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.priority = [0] * num_blocks

    def on_cached(self, block, block_hash, request, position) -> None:
        super().on_cached(block, block_hash, request, position)
        self.priority[block.block_id] = request.priority

    def on_hit(self, block, request) -> None:
        bid = block.block_id
        if request is not None and request.priority > self.priority[bid]:
            self.priority[bid] = request.priority

    def on_release(self, block, request, position) -> None:
        super().on_release(block, request, position)
        self.on_hit(block, request)

    def key(self, block) -> tuple[int, int]:
        bid = block.block_id
        return (self.priority[bid], self.released_at[bid])
