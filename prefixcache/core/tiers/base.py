"""The tier chain under the device pool: device -> host -> disk -> remote.

A cached block the device evicts is demoted to the host tier (``tiers/host.py``); a
block the host tier evicts is demoted to the next tier of the chain (``disk``, then
``remote``, then any tier of the user's own), and so on down; the last tier's
evictions are gone for good. A lookup walks the request's block hashes: device hit?
else host hit? else the first lower tier that holds the hash? else stop. A hit below
the host is a ``TierHit`` placeholder in ``get_computed_blocks``' list (``block_id ==
-1`` until ``allocate_slots`` loads it into a fresh device block, as a ``HostHit``).

Under a multi-group manager (``kv_cache_groups``: full attention + sliding window, state
groups; ``core/hybrid.py``) every entry is one block of one group, held under the pool's
``(block hash, group id)`` key (the digest followed by 4 group bytes), exactly as the
host tier's ``GroupHostTier`` holds it: the chain is built with ``group_bytes=4``, and
its transfers (``TierTransfer.key`` the plain digest, ``.group`` the group), KV events
(the plain digest, ``group_idx``) and page names (``KeyTier.page_key``) split each key
into its digest and group.

Every tier below the host is a ``KeyTier``: a map of block hashes with a capacity in
blocks, its own eviction policy (``prefixcache.core.eviction``: ``lru`` is an ordered
map, any other policy a policy object over internal slots), and its ``link`` (a
``TierLink``: what one load costs, read by the cost model, the DES and the
experiments). A tier is exclusive (``inclusive = False``: a load moves the block up
and frees the entry, as the host tier's; the device computing a hash the tier holds
drops the tier's copy) or inclusive (``inclusive = True``: a load copies, the entry
stays: a ``remote`` store shared by several replicas).

A tier's policy hears each stored entry as ``on_cached`` / ``on_release`` of the request
that cached the block on the device (an ``_Origin``: its ``priority``, its
``retention`` hints and the block's ``position`` in its chain, kept by the host tier
while a tier below has a policy object; an entry of unknown origin, such as a page
found on the disk at start, has priority 0, no hints, depth 0), so ``hinted``,
``priority`` and the depth-aware policies rank lower-tier entries as they rank device
blocks.

The transfers a manager records go to one ordered list (the host tier's): device <->
host copies are ``HostTransfer``s, every copy that touches a lower tier a
``TierTransfer``. Apply them in list order before the step computes.

Invariants (``TierChain.check_invariants``):
    * no hash is on the device and in an exclusive lower tier, nor in the host and in an
      exclusive lower tier;
    * each tier's entries are at most its capacity; the policy's candidates are
      exactly its unpinned entries (none pinned outside ``allocate_slots``).

A tier of one's own (a slower memory, a different store) is one class: subclass
``KeyTier``, set ``name`` (the attribution key: ``hit_tokens_by_tier[name]``, the
replay's ``hit_tokens_<name>``), ``medium`` (its KV events' medium) and ``link``; pass
it where a tier name goes (``KVCacheManager(..., tiers=({"tier": MyTier,
"num_blocks": 64},))``) or register it in ``prefixcache.core.tiers.TIERS``.
"""

from __future__ import annotations

import collections
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from prefixcache.core.block_pool import InvariantError
from prefixcache.core.eviction import (
    DEFAULT_POLICY,
    get_policy_class,
    make_policy,
    online_policy_names,
    policy_name,
)
from prefixcache.core.events import BlockRemoved, BlockStored

TIER_STORE = "store"  # a demotion down the chain
TIER_LOAD = "load"  # a promotion into a device page
TIER_NAMES = ("device", "host", "disk", "remote")  # the built-in chain, top first


class TierLink(NamedTuple):
    """The path between a tier and the device: loading ``n`` pages of ``page_bytes``
    takes ``latency_s + n * page_bytes / bandwidth_bytes_per_s`` seconds."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def load_time(self, num_pages: int, page_bytes: float) -> float:
        """Seconds to load ``num_pages`` pages of ``page_bytes`` (0 for no page)."""
        if num_pages <= 0:
            return 0.0
        return self.latency_s + num_pages * page_bytes / self.bandwidth_bytes_per_s


# Default links (a PCIe 5 x16 host link, an NVMe SSD, a 100 Gb/s RDMA network store).
HOST_LINK = TierLink(50e9, 10e-6)
DISK_LINK = TierLink(6e9, 100e-6)
REMOTE_LINK = TierLink(12.5e9, 1e-3)


class TierTransfer(NamedTuple):
    """One page copy that touches a tier below the host, in the order recorded.

    Attributes:
        kind: ``"store"`` (a demotion down the chain) or ``"load"`` (a promotion into
            device page ``dst_id``).
        src, dst: ``"device"``, ``"host"``, ``"disk"``, ``"remote"`` (or a user tier's
            name).
        src_id, dst_id: a device block id, a host slot, or for the lower tiers the
            block's ``key``.
        key: the block's cache key as an int (its content hash: the block hash,
            big-endian; under a multi-group manager the digest without the group
            bytes); file names ``f"{key:064x}"``-style are stable across restarts
            for the same model, block size and hash algorithm.
        group: the KV cache group (0 for one full-attention group); ``(key, group)``
            names one page.
    """

    kind: str
    src: str
    src_id: int
    dst: str
    dst_id: int
    key: int
    group: int = 0


def key_of(block_hash: bytes) -> int:
    """A block hash as the int key of ``TierTransfer`` (big-endian)."""
    return int.from_bytes(block_hash, "big")


class TierHit:
    """A prefix-hit block found in a tier below the host (an entry of
    ``get_computed_blocks``).

    Attributes:
        block_hash: the hash it was found under.
        tier: the tier object holding it.
        block_id: ``-1`` until ``allocate_slots`` promotes it; then the id of the
            device block it was loaded into.
    """

    __slots__ = ("block_hash", "tier", "block_id")

    # (a promotion takes one free device block: see ``HostHit.ref_cnt``)
    ref_cnt = 0

    def __init__(self, block_hash: bytes, tier: KeyTier):
        self.block_hash = block_hash
        self.tier = tier
        self.block_id = -1

    def __repr__(self) -> str:
        h = getattr(self, "block_hash", None)
        h = h.hex()[:12] if isinstance(h, (bytes, bytearray)) else repr(h)
        t = getattr(getattr(self, "tier", None), "name", None)
        return f"TierHit(tier={t!r}, block_id={getattr(self, 'block_id', None)!r}, block_hash={h})"


class Tier(Protocol):
    """What a tier below the host provides to the chain (``KeyTier`` implements it; the
    host tier, ``tiers/host.py``, has the slot-level API the managers' fast paths use).

    Attributes:
        name, medium, link, inclusive: as ``KeyTier``'s class attributes.
        num_blocks: capacity in blocks.
        entries: the held hashes (a mapping; pinned ones excepted), read by lookups.
    """

    name: str
    medium: str
    link: TierLink
    inclusive: bool
    num_blocks: int
    entries: Mapping

    def lookup(self, h: bytes) -> bool:
        """``h`` can be served now (else the tier dropped it)."""

    def put(self, h: bytes):
        """Store ``h``: ``None``, the evicted hash, ``h`` (refused) or ``False`` (held)."""

    def pin(self, h: bytes) -> None:
        """Keep ``h`` while a promotion takes device blocks."""

    def take(self, h: bytes) -> None:
        """The pinned ``h`` was loaded (free it, or keep it if inclusive)."""

    def discard(self, h: bytes) -> None:
        """Drop ``h`` (the device computed it again)."""

    def clear(self) -> None:
        """Forget every entry."""

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` on any inconsistency."""


class _Slot:
    """One entry of a ``KeyTier`` as its policy sees it (``block_id``: an internal
    slot number, never a transfer's id)."""

    __slots__ = ("block_id", "block_hash", "origin")

    def __init__(self, i: int):
        self.block_id = i
        self.block_hash: bytes | None = None
        self.origin: _Origin | None = None  # what the entry was demoted with


class _Origin:
    """What a tier's policy's ``on_cached`` / ``on_release`` / ``on_hit`` read of a
    request for a block demoted long after its request left: the priority and the
    retention hints (``RetentionHints`` or ``None``) of the request that cached the
    block on the device, and the block's depth in its chain (``position``, the
    policy's ``position`` argument)."""

    __slots__ = ("priority", "retention", "position")

    def __init__(self, priority: int = 0, retention=None, position: int = 0):
        self.priority = priority
        self.retention = retention
        self.position = position


_ORIGIN = _Origin()  # (a block whose request is unknown: priority 0, no hints, depth 0)


def check_tier_policy(arg: str, eviction) -> type:
    """The tier policy's class; ``ValueError`` naming ``arg`` for an unknown or offline
    policy."""
    try:
        cls = get_policy_class(eviction)
    except ValueError as e:
        raise ValueError(f"{arg}: {e}") from None
    if cls.needs_future:
        raise ValueError(f"{arg}={policy_name(eviction)!r} needs the trace's future; use one "
                         f"of {online_policy_names()}")
    return cls


class KeyTier:
    """A tier below the host: block hashes with a capacity in blocks and an eviction
    policy of its own. Subclass it for a tier of one's own (the module docstring).

    Class attributes:
        name: the tier's name (attribution, transfers, miss reasons ``evicted_<name>``).
        medium: its KV events' ``medium``.
        link: its ``TierLink``.
        inclusive: a load copies (the entry stays) instead of moving the block up.

    Args:
        num_blocks: capacity in blocks (> 0).
        block_size: tokens per block.
        eviction: the tier's policy (a name or class; not one that needs the future).
        eviction_options: its options.
        link: overrides the class's ``link``.

    Attributes:
        num_stored, num_loaded, num_evicted, num_dropped, num_discarded: cumulative
            counts (demotions in, promotions out, entries the policy dropped, demotions
            refused while every entry is pinned, entries dropped because the device
            computed the hash again).
    """

    name = "tier"
    medium = "TIER"
    link = DISK_LINK
    inclusive = False
    # Bytes of the group id at the end of each held hash: 0 under one full-attention
    # group, 4 under a multi-group manager (set by its ``TierChain``).
    group_bytes = 0

    def __init__(self, num_blocks: int, *, block_size: int = 16,
                 eviction: str | type = DEFAULT_POLICY,
                 eviction_options: Mapping[str, Any] | None = None,
                 link: TierLink | None = None):
        if type(num_blocks) is not int or num_blocks <= 0:
            raise ValueError(f"{self.name} tier: num_blocks must be a positive int, "
                             f"got {num_blocks!r}")
        check_tier_policy(f"{self.name}_eviction", eviction)
        if link is not None:
            if not isinstance(link, TierLink):
                raise ValueError(f"{self.name} tier: link must be a TierLink, got {link!r}")
            self.link = link
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.eviction = eviction
        options = dict(eviction_options or {})
        # ``lru`` is the ordered map's own order (no policy object) unless
        # ``{"fast_path": False}`` asks for the keyed policy (a test pins the two equal).
        fast_path = options.pop("fast_path", True) if eviction == DEFAULT_POLICY else True
        self.policy = None
        if eviction != DEFAULT_POLICY or options or not fast_path:
            try:
                self.policy = make_policy(eviction, num_blocks=num_blocks,
                                          block_size=block_size, **options)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{self.name}_eviction={eviction!r}, {self.name}_eviction_options="
                              f"{eviction_options!r}: {e}") from None
        # hash -> slot of each unpinned entry; without a policy object its order is the
        # eviction order (least recently stored or touched first).
        self.entries: OrderedDict[bytes, _Slot] = OrderedDict()
        self._pinned: dict[bytes, _Slot] = {}
        self._slots = [_Slot(i) for i in range(num_blocks)]
        self._free = collections.deque(range(num_blocks))
        self.num_stored = 0
        self.num_loaded = 0
        self.num_evicted = 0
        self.num_dropped = 0
        self.num_discarded = 0
        # The origin of the entry the last ``put`` evicted (read by the chain, which
        # hands it on with the evicted hash).
        self.evicted_origin: _Origin | None = None

    def __len__(self) -> int:
        return len(self.entries) + len(self._pinned)

    def __contains__(self, h) -> bool:
        return h in self.entries or h in self._pinned

    def keys(self):
        """The held hashes (pinned ones excepted)."""
        return self.entries.keys()

    def page_key(self, h: bytes) -> tuple[int, int]:
        """``(key, group)`` of the hash ``h``: its page's name in a page store (the
        digest as a big-endian int, and the group id; group 0 under one group)."""
        n = self.group_bytes
        if n:
            return int.from_bytes(h[:-n], "big"), int.from_bytes(h[-n:], "big")
        return int.from_bytes(h, "big"), 0

    # ----------------------------------------------------------------- lookup
    def lookup(self, h: bytes) -> bool:
        """``h`` can be served from this tier now (a subclass may refuse an entry it
        cannot serve, e.g. a disk page that fails its check: then it drops it)."""
        return h in self.entries

    # ------------------------------------------------------------ transitions
    def put(self, h: bytes, origin: _Origin | None = None):
        """Store ``h`` (a demotion from above; ``origin``: the request that cached it,
        as the tier above kept it, ``None``: unknown). Returns ``None`` (stored), the
        hash the policy evicted to make room (stored; the caller demotes it further,
        with ``evicted_origin``), or ``h`` itself (refused: every entry is pinned). An
        inclusive tier that holds ``h`` already refreshes it and returns ``False``."""
        entries = self.entries
        if h in entries or h in self._pinned:
            if self.policy is None and h in entries:
                entries.move_to_end(h)
            return False
        old = None
        if self._free:
            slot = self._slots[self._free.popleft()]
        elif self.policy is None:
            if not entries:
                self.num_dropped += 1
                return h
            old, slot = entries.popitem(False)
            self.evicted_origin = slot.origin
            self.num_evicted += 1
        elif len(self.policy):
            slot = self.policy.pop()
            old = slot.block_hash
            del entries[old]
            self.policy.on_evicted(slot)
            self.evicted_origin = slot.origin
            self.num_evicted += 1
        else:
            self.num_dropped += 1
            return h
        slot.block_hash = h
        slot.origin = origin
        entries[h] = slot
        if self.policy is not None:
            o = origin if origin is not None else _ORIGIN
            self.policy.on_cached(slot, h, o, o.position)
            self.policy.on_release(slot, o, o.position)
            self.policy.add(slot)
        self.num_stored += 1
        return old

    def pin(self, h: bytes) -> None:
        """Keep ``h`` from being evicted while a promotion takes device blocks."""
        slot = self.entries.pop(h)
        self._pinned[h] = slot
        if self.policy is not None:
            self.policy.discard(slot)

    def take(self, h: bytes) -> None:
        """The pinned ``h`` was loaded into the device: an exclusive tier frees it, an
        inclusive one keeps it (most recently used)."""
        slot = self._pinned.pop(h)
        self.num_loaded += 1
        if self.inclusive:
            self.entries[h] = slot
            if self.policy is not None:
                o = slot.origin if slot.origin is not None else _ORIGIN
                self.policy.on_hit(slot, o)
                self.policy.on_release(slot, o, o.position)
                self.policy.add(slot)
            return
        self._release(slot)

    def discard(self, h: bytes) -> None:
        """Drop the entry ``h`` (the device computed it again, or it is unservable)."""
        slot = self.entries.pop(h)
        if self.policy is not None:
            self.policy.discard(slot)
        self._release(slot)
        self.num_discarded += 1

    def _release(self, slot: _Slot) -> None:
        if self.policy is not None:
            self.policy.on_evicted(slot)
        slot.block_hash = None
        slot.origin = None
        self._free.append(slot.block_id)

    def clear(self) -> None:
        """Forget every entry."""
        for slot in self.entries.values():
            slot.block_hash = None
        self.entries = OrderedDict()
        self._free = collections.deque(range(self.num_blocks))
        if self.policy is not None:
            self.policy.clear()

    def eviction_order(self) -> list[bytes]:
        """The held hashes, the next one the policy evicts first."""
        if self.policy is None:
            return list(self.entries)
        return [self._slots[i].block_hash for i in self.policy.candidate_ids()]

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the tier and hash on any inconsistency."""
        if self._pinned:
            raise InvariantError(f"{self.name} tier: entries {len(self._pinned)} are still "
                                 "pinned outside allocate_slots")
        if len(self.entries) + len(self._free) != self.num_blocks:
            raise InvariantError(f"{self.name} tier: {len(self.entries)} entries + "
                                 f"{len(self._free)} free != {self.num_blocks}")
        for h, slot in self.entries.items():
            if slot.block_hash != h:
                raise InvariantError(f"{self.name} tier: {h.hex()} -> slot {slot.block_id} "
                                     f"holding {slot.block_hash!r}")
        if self.policy is not None:
            self.policy.check_invariants([s.block_id for s in self.entries.values()])


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


class BudgetTier(KeyTier):
    """A ``KeyTier`` sized by a byte budget: ``num_bytes // page_bytes`` blocks (the
    disk tier and the remote store).

    Class attributes:
        budget_arg: the budget's keyword in the subclass's signature (``"disk_bytes"``,
            ``"remote_bytes"``), named by the errors.

    Args:
        num_bytes: the budget in bytes.
        page_bytes: one block's KV page (every layer), bytes.
        block_size, eviction, eviction_options, link: as ``KeyTier``.
    """

    budget_arg = "num_bytes"

    def __init__(self, num_bytes: int, *, page_bytes: int, block_size: int = 16,
                 eviction: str | type = DEFAULT_POLICY,
                 eviction_options: Mapping[str, Any] | None = None,
                 link: TierLink | None = None):
        super().__init__(blocks_for_bytes(self.budget_arg, num_bytes, page_bytes),
                         block_size=block_size, eviction=eviction,
                         eviction_options=eviction_options, link=link)
        self.num_bytes = num_bytes
        self.page_bytes = page_bytes


class TierChain:
    """The tiers below a manager's host tier, top first, and the manager's view of
    them: demotion down the chain, lookup, promotion, attribution counters.

    Args:
        tiers: the ``KeyTier`` objects, top (next below the host) first.
        record: appends one recorded copy to the manager's transfer list (in order
            with the host tier's ``HostTransfer``s).
        events_owner: the object whose ``events`` list the manager's events go to (the
            pool, or the radix manager; read at each event: ``take_events`` swaps the
            list), or ``None`` (events off).
        event_hash: the pool's digest -> event hash conversion.
        block_size: tokens per block (the event's ``block_size``).
        group_bytes: the group id's bytes at the end of each hash (0: one
            full-attention group; 4: a multi-group manager's ``(hash, group)`` keys).
        layout: the manager's KV cache groups (``None``: one full-attention group);
            managers sharing a tier (a remote store) must have the same.
    """

    def __init__(self, tiers: list[KeyTier], *, record: Callable[[TierTransfer], None],
                 events_owner=None, event_hash=None, block_size: int = 16,
                 group_bytes: int = 0, layout=None):
        names = [t.name for t in tiers]
        dup = [n for n in names if names.count(n) > 1 or n in ("device", "host")]
        if dup:
            raise ValueError(f"tiers: each tier below the host needs its own name, got {names}")
        for t in tiers:  # (a store shared by managers holds one layout's keys)
            if "key_layout" in vars(t) and t.key_layout != layout:
                raise ValueError(
                    f"the {t.name} tier is shared with a manager of another group layout "
                    f"({t.key_layout!r}, this one's {layout!r}): a group id names a "
                    "different group in each; managers sharing a tier need the same "
                    "kv_cache_groups")
        for t in tiers:
            t.group_bytes = group_bytes
            t.key_layout = layout
        self.group_bytes = group_bytes
        self.tiers = tiers
        self._record = record
        self._owner = events_owner
        self.events = events_owner is not None  # (events on)
        self._event_hash = event_hash
        self.block_size = block_size
        self.exclusive = [t for t in tiers if not t.inclusive]
        # A tier with a policy object reads what the host kept of each entry's request
        # (``demote``'s ``origin``): the owner then asks the host to keep it.
        self.wants_origin = any(t.policy is not None for t in tiers)
        # Miss accounting's hook: hashes a tier dropped for good -> that tier's name.
        self.evicted_by: dict | None = None
        self.num_corrupt = 0

    def __bool__(self) -> bool:
        return True

    def get(self, name: str) -> KeyTier | None:
        """The tier named ``name`` (``"disk"``, ``"remote"``, ...), or ``None``."""
        return next((t for t in self.tiers if t.name == name), None)

    def _split(self, h: bytes) -> tuple[bytes, int]:
        """``(digest, group id)`` of a held hash (``(h, 0)`` under one group)."""
        n = self.group_bytes
        if n:
            return h[:-n], int.from_bytes(h[-n:], "big")
        return h, 0

    # ------------------------------------------------------------------ events
    def _stored(self, tier: KeyTier, h: bytes, parent=None) -> None:
        digest, group = self._split(h)
        self._owner.events.append(BlockStored(
            block_hashes=[self._event_hash(digest)], parent_block_hash=None, token_ids=[],
            block_size=self.block_size, lora_id=None, medium=tier.medium, lora_name=None,
            group_idx=group))

    def _removed(self, tier: KeyTier, h: bytes) -> None:
        digest, group = self._split(h)
        self._owner.events.append(BlockRemoved(block_hashes=[self._event_hash(digest)],
                                               medium=tier.medium, group_idx=group))

    # --------------------------------------------------------------- demotion
    def demote(self, h: bytes, src: str, src_id, origin: _Origin | None = None) -> None:
        """The tier ``src`` (``"host"``: slot ``src_id``) evicted ``h``: store it in the
        first tier below that takes it (cascading the evictions that makes room for),
        recording each copy; a hash no tier takes is dropped (miss accounting).
        ``origin``: the request that cached ``h`` (its priority and retention hints,
        for the tiers' policies), ``None`` when the tier above did not keep it."""
        digest, group = self._split(h)
        key = key_of(digest)
        i = 0
        tiers = self.tiers
        while i < len(tiers):
            tier = tiers[i]
            old = tier.put(h, origin)
            if old is False:  # an inclusive tier holds it already: nothing to copy
                return
            if old is h:  # refused (every entry pinned): try the next tier
                i += 1
                continue
            if old is not None:
                # NOTE: the evicted entry moves down first (its bytes leave before the
                # new ones arrive), so the copies apply in list order.
                if self.events:
                    self._removed(tier, old)
                self._cascade(old, i, tier.evicted_origin)
            self._record(TierTransfer(TIER_STORE, src, src_id if src == "host" else key,
                                      tier.name, key, key, group))
            if self.events:
                self._stored(tier, h)
            return
        if self.evicted_by is not None:
            self.evicted_by[h] = src

    def _cascade(self, h: bytes, i: int, origin: _Origin | None) -> None:
        """Tier ``i`` evicted ``h`` (demoted with ``origin``): demote it to tier
        ``i + 1`` and below."""
        tiers = self.tiers
        digest, group = self._split(h)
        key = key_of(digest)
        src = tiers[i].name
        for j in range(i + 1, len(tiers)):
            tier = tiers[j]
            old = tier.put(h, origin)
            if old is False:
                return
            if old is h:
                continue
            if old is not None:
                if self.events:
                    self._removed(tier, old)
                self._cascade(old, j, tier.evicted_origin)
            self._record(TierTransfer(TIER_STORE, src, key, tier.name, key, key, group))
            if self.events:
                self._stored(tier, h)
            return
        if self.evicted_by is not None:
            self.evicted_by[h] = src

    # ----------------------------------------------------------------- lookup
    def find(self, h: bytes) -> KeyTier | None:
        """The first tier that can serve ``h`` now, or ``None``."""
        for tier in self.tiers:
            if h in tier.entries:
                if tier.lookup(h):
                    return tier
                # (unservable: the tier dropped it; the lookup stops here)
                self.num_corrupt += 1
                if self.evicted_by is not None:
                    self.evicted_by[h] = "corrupt_" + tier.name
                return None
        return None

    # -------------------------------------------------------------- promotion
    def check_hit(self, b: TierHit) -> bool:
        """``b`` is a current hit of this chain."""
        return b.block_id == -1 and b.tier in self.tiers and b.block_hash in b.tier.entries

    def load(self, hit: TierHit, block_id: int) -> None:
        """Promote the pinned ``hit`` into device block ``block_id`` (record the load)."""
        tier = hit.tier
        h = hit.block_hash
        tier.take(h)
        digest, group = self._split(h)
        key = key_of(digest)
        self._record(TierTransfer(TIER_LOAD, tier.name, key, "device", block_id, key, group))
        if self.events and not tier.inclusive:
            self._removed(tier, h)

    def discard_cached(self, hashes) -> None:
        """The device cached ``hashes`` (computed): drop the exclusive tiers' copies."""
        for tier in self.exclusive:
            entries = tier.entries
            if entries and not entries.keys().isdisjoint(hashes):
                for h in hashes:
                    if h in entries:
                        tier.discard(h)
                        if self.events:
                            self._removed(tier, h)

    def clear(self) -> None:
        """A prefix-cache reset: forget the exclusive tiers' entries (a shared inclusive
        store keeps what other replicas stored)."""
        for tier in self.exclusive:
            tier.clear()

    def check_invariants(self, device_cached, host_cached) -> None:
        for tier in self.tiers:
            tier.check_invariants()
            if tier.inclusive:
                continue
            for h in tier.entries:
                if h in device_cached:
                    raise InvariantError(f"hash {h.hex()} is on the device and in the "
                                         f"{tier.name} tier")
                if h in host_cached:
                    raise InvariantError(f"hash {h.hex()} is in the host and the "
                                         f"{tier.name} tier")
