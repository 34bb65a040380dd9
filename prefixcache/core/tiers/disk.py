"""The disk tier: block hashes under the host tier, bounded by bytes.

In the manager (and so in the replay, the DES and the cluster) a disk tier is keys
only: which blocks the disk holds, its own eviction policy, its link. The engine keeps
the pages in files named by the block's key and group (``TierTransfer.key`` /
``.group``; ``DiskTier.page_key``) and checks them when it loads one: it sets
``validator`` to its page store's check, and a lookup that reaches a disk entry whose
check fails drops the entry (``num_corrupt``; the lookup stops there and the block is a
miss, counted ``corrupt_disk`` by miss accounting), so a corrupted page is never
served. Keys are content hashes, so a store reused across restarts of the same model,
block size and hash algorithm pre-populates the tier with ``preload(keys)``.

Under a multi-group manager (``kv_cache_groups``) an entry is one block of one group
(the pool's ``(hash, group)`` key): its page is named by the plain digest and the group,
the validator is called with both (``validator(key, group)``), and ``preload`` takes
``(key, group)`` pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prefixcache.core.tiers.base import DISK_LINK, BudgetTier


class DiskTier(BudgetTier):
    """Block hashes on disk (exclusive: a load moves the block up).

    Args:
        disk_bytes: the tier's budget in bytes; it holds ``disk_bytes // page_bytes``
            blocks.
        validator: checks a page before it is served: ``callable(key: int) -> bool``
            under one full-attention group, ``callable(key: int, group: int) -> bool``
            under a multi-group manager (``page_key``); ``None``: every entry is
            served.
        key_bytes: the digest length of the block hashes (``preload`` turns int keys
            into hashes with it).
        **options: ``page_bytes`` (one block's KV page, every layer, bytes),
            ``block_size``, ``eviction``, ``eviction_options``, ``link`` (as
            ``BudgetTier``).
    """

    name = "disk"
    medium = "DISK"
    link = DISK_LINK
    inclusive = False
    budget_arg = "disk_bytes"

    def __init__(self, disk_bytes: int, *, validator: Callable[..., bool] | None = None,
                 key_bytes: int = 32, **options):
        super().__init__(disk_bytes, **options)
        self.validator = validator
        self.key_bytes = key_bytes
        self.num_corrupt = 0

    @property
    def disk_bytes(self) -> int:
        return self.num_bytes

    def lookup(self, h: bytes) -> bool:
        v = self.validator
        if v is None or (v(*self.page_key(h)) if self.group_bytes
                         else v(int.from_bytes(h, "big"))):
            return True
        # NOTE: a page that fails its check is dropped here (never served, never found
        # again): the lookup stops at it.
        self.discard(h)
        self.num_discarded -= 1  # (counted as corrupt, not as a device recompute)
        self.num_corrupt += 1
        return False

    def page_hash(self, key: int, group: int = 0) -> bytes | None:
        """The hash this tier holds page ``(key, group)`` under (``page_key``'s
        inverse), or ``None`` when no entry of this tier can have that name (a key
        wider than ``key_bytes``, a group other than 0 under one group)."""
        if not 0 <= key < 1 << (8 * self.key_bytes):
            return None
        n = self.group_bytes
        if n:
            if not 0 <= group < 1 << (8 * n):
                return None
            return key.to_bytes(self.key_bytes, "big") + group.to_bytes(n, "big")
        return key.to_bytes(self.key_bytes, "big") if group == 0 else None

    def preload(self, keys: Iterable) -> int:
        """Add the blocks whose pages the store already holds (int keys, ``(key,
        group)`` pairs, or hashes), in order (the policy sees the first as the oldest);
        entries beyond the capacity evict the oldest. Returns the entries held after."""
        for k in keys:
            if type(k) is int:
                h = self.page_hash(k)
            elif type(k) is tuple and len(k) == 2 and all(type(x) is int for x in k):
                h = self.page_hash(*k)
            elif isinstance(k, (bytes, bytearray)):
                h = bytes(k)
            else:
                raise ValueError(f"DiskTier.preload: keys must be ints, (key, group) pairs "
                                 f"or bytes, got {k!r}")
            if h is None:
                raise ValueError(f"DiskTier.preload: {k!r} is not a page of this tier "
                                 f"({self.key_bytes}-byte keys, "
                                 f"{'any group' if self.group_bytes else 'group 0'})")
            self.put(h)
        return len(self)
