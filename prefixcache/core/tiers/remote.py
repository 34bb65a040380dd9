"""The remote tier: one store of block hashes shared by several replicas.

A ``RemoteStore`` (Mooncake Store / LMCache server style) sits at the bottom of each
replica's chain; the same object is handed to every replica's manager
(``KVCacheManager(..., remote=store)``, ``simulate_cluster(..., remote_bytes=...)``), so a
block one replica demoted is a hit for another. It is inclusive: a load copies the
page to the replica's device and the store keeps it (most recently used); a demotion of
a block the store holds copies nothing. A prefix-cache reset of one replica leaves the
store as it is. Loads are charged at its ``link``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefixcache.core.eviction import DEFAULT_POLICY
from prefixcache.core.tiers.base import REMOTE_LINK, KeyTier, TierLink
from prefixcache.core.tiers.disk import blocks_for_bytes


class RemoteStore(KeyTier):
    """A shared, inclusive store of block hashes.

    Args:
        remote_bytes: its budget in bytes (``remote_bytes // page_bytes`` blocks).
        page_bytes: one block's KV page (every layer), bytes.
        block_size, eviction, eviction_options, link: as ``KeyTier``.
    """

    name = "remote"
    medium = "REMOTE"
    link = REMOTE_LINK
    inclusive = True

    def __init__(self, remote_bytes: int, *, page_bytes: int, block_size: int = 16,
                 eviction: str | type = DEFAULT_POLICY,
                 eviction_options: Mapping[str, Any] | None = None,
                 link: TierLink | None = None):
        super().__init__(blocks_for_bytes("remote_bytes", remote_bytes, page_bytes),
                         block_size=block_size, eviction=eviction,
                         eviction_options=eviction_options, link=link)
        self.remote_bytes = remote_bytes
        self.page_bytes = page_bytes
