"""``fifo``: first cached, first evicted; a hit does not refresh a block."""

from __future__ import annotations

from prefixcache.core.eviction.base import KeyedPolicy


class FIFOPolicy(KeyedPolicy):
    """Evict the candidate that entered the cache earliest (ties: LRU)."""

    name = "fifo"

    def key(self, block) -> tuple[int, int]:
        bid = block.block_id
        return (self.cached_at[bid], self.released_at[bid])
