"""``lru``: least recently released first (vLLM's free-queue order).

The hash-chain ``BlockPool`` runs ``lru`` on its intrusive free queue directly (the fast
path, unchanged); this keyed form is what the radix index uses, and a test pins it to
the free queue's order.
"""

from __future__ import annotations

from prefixcache.core.eviction.base import KeyedPolicy


class LRUPolicy(KeyedPolicy):
    """Evict the candidate whose last reference was dropped earliest."""

    name = "lru"

    def key(self, block) -> int:
        return self.released_at[block.block_id]
