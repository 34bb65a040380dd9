"""The remote tier: one store of block hashes shared by several replicas.

A ``RemoteStore`` (Mooncake Store / LMCache server style) sits at the bottom of each
replica's chain; the same object is handed to every replica's manager
(``KVCacheManager(..., remote=store)``, ``simulate_cluster(..., remote_bytes=...)``), so a
block one replica demoted is a hit for another. It is inclusive: a load copies the
page to the replica's device and the store keeps it (most recently used); a demotion of
a block the store holds copies nothing. A prefix-cache reset of one replica leaves the
store as it is. Loads are charged at its ``link``. Replicas sharing a store hold one
kind of key: all of one full-attention group, or all of one multi-group layout
(``(hash, group)`` keys).
"""

from __future__ import annotations

from prefixcache.core.tiers.base import REMOTE_LINK, BudgetTier


class RemoteStore(BudgetTier):
    """A shared, inclusive store of block hashes.

    Args:
        remote_bytes: its budget in bytes (``remote_bytes // page_bytes`` blocks).
        **options: ``page_bytes`` (one block's KV page, every layer, bytes),
            ``block_size``, ``eviction``, ``eviction_options``, ``link`` (as
            ``BudgetTier``).
    """

    name = "remote"
    medium = "REMOTE"
    link = REMOTE_LINK
    inclusive = True
    budget_arg = "remote_bytes"

    def __init__(self, remote_bytes: int, **options):
        super().__init__(remote_bytes, **options)

    @property
    def remote_bytes(self) -> int:
        return self.num_bytes
