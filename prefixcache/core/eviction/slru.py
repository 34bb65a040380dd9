"""``slru``: segmented LRU as SGLang's ``SLRUStrategy`` (protected_threshold=2).

A cached block starts in the probationary segment; from its second hit on it is in
the protected segment. Probationary candidates are evicted before protected ones,
each segment in LRU order. Hits count as in ``lfu`` (reset when the block is cached).
"""

from __future__ import annotations

from prefixcache.core.eviction.lfu import LFUPolicy

PROTECTED_THRESHOLD = 2  # SGLang's default: protected after the second hit


class SLRUPolicy(LFUPolicy):
    """Evict probationary (< 2 hits) before protected candidates; LRU inside each."""

    name = "slru"

    def key(self, block) -> tuple[bool, int]:
        bid = block.block_id
        return (self.hits[bid] >= PROTECTED_THRESHOLD, self.released_at[bid])
