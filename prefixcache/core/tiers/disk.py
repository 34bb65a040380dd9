"""The disk tier: block hashes under the host tier, bounded by bytes.

In the manager (and so in the replay, the DES and the cluster) a disk tier is keys
only: which blocks the disk holds, its own eviction policy, its link. The engine keeps
the pages in files named by the block's key (``TierTransfer.key``) and checks them
when it loads one: it sets ``validator`` to its page store's check, and a lookup that
reaches a disk entry whose check fails drops the entry (``num_corrupt``; the lookup
stops there and the block is a miss, counted ``corrupt_disk`` by miss accounting), so a
corrupted page is never served. Keys are content hashes, so a store reused across
restarts of the same model, block size and hash algorithm pre-populates the tier with
``preload(keys)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prefixcache.core.eviction import DEFAULT_POLICY
from prefixcache.core.tiers.base import DISK_LINK, KeyTier, TierLink


def blocks_for_bytes(arg: str, num_bytes, page_bytes) -> int:
    """The pages of ``page_bytes`` that ``num_bytes`` holds (``ValueError`` naming
    ``arg`` when that is not at least one)."""
    if type(num_bytes) is not int or num_bytes < 0:
        raise ValueError(f"{arg} must be a non-negative int (bytes), got {num_bytes!r}")
    if type(page_bytes) is not int or page_bytes <= 0:
        raise ValueError(f"{arg}={num_bytes} needs page_bytes (the bytes of one block's KV "
                         f"page, every layer), a positive int; got {page_bytes!r}")
    n = num_bytes // page_bytes
    if n <= 0:
        raise ValueError(f"{arg}={num_bytes} holds no page of page_bytes={page_bytes}")
    return n


class DiskTier(KeyTier):
    """Block hashes on disk (exclusive: a load moves the block up).

    Args:
        disk_bytes: the tier's budget in bytes; it holds ``disk_bytes // page_bytes``
            blocks.
        page_bytes: one block's KV page (every layer), bytes.
        block_size, eviction, eviction_options, link: as ``KeyTier``.
        validator: ``callable(key: int) -> bool`` checking a page before it is served
            (``None``: every entry is served).
        key_bytes: the digest length of the block hashes (``preload`` turns int keys
            into hashes with it).
    """

    name = "disk"
    medium = "DISK"
    link = DISK_LINK
    inclusive = False

    def __init__(self, disk_bytes: int, *, page_bytes: int, block_size: int = 16,
                 eviction: str | type = DEFAULT_POLICY,
                 eviction_options: Mapping[str, Any] | None = None,
                 link: TierLink | None = None,
                 validator: Callable[[int], bool] | None = None, key_bytes: int = 32):
        super().__init__(blocks_for_bytes("disk_bytes", disk_bytes, page_bytes),
                         block_size=block_size, eviction=eviction,
                         eviction_options=eviction_options, link=link)
        self.disk_bytes = disk_bytes
        self.page_bytes = page_bytes
        self.validator = validator
        self.key_bytes = key_bytes
        self.num_corrupt = 0

    def lookup(self, h: bytes) -> bool:
        v = self.validator
        if v is None or v(int.from_bytes(h, "big")):
            return True
        # NOTE: a page that fails its check is dropped here (never served, never found
        # again): the lookup stops at it.
        self.discard(h)
        self.num_discarded -= 1  # (counted as corrupt, not as a device recompute)
        self.num_corrupt += 1
        return False

    def preload(self, keys: Iterable) -> int:
        """Add the blocks whose pages the store already holds (int keys or hashes), in
        order (the policy sees the first as the oldest); entries beyond the capacity
        evict the oldest. Returns the entries held after."""
        for k in keys:
            if type(k) is int:
                h = k.to_bytes(self.key_bytes, "big")
            elif isinstance(k, (bytes, bytearray)):
                h = bytes(k)
            else:
                raise ValueError(f"DiskTier.preload: keys must be ints or bytes, got {k!r}")
            self.put(h)
        return len(self)
