"""The host-memory tier: cached blocks the device evicted, kept in host slots.

``KVCacheManager(..., num_host_blocks=N)`` (the contract is in the
manager's docstring) adds a second, exclusive tier under the device's prefix cache:

* **Demotion** -- when the device pool evicts a cached block to reuse it (vLLM's
  ``_maybe_evict_cached_block``) and no other device block still holds its hash, the
  hash moves to a free host slot: ``HostTransfer("store", block_id, host_slot)``. A
  full host first evicts one entry chosen by the host policy (``make_policy`` from
  ``prefixcache.core.eviction``; that entry is gone for good, ``BlockRemoved(medium=
  "CPU")``).
* **Lookup** -- ``get_computed_blocks`` follows the hash chain block by block: device
  hit? else host hit? else stop. A host hit is a ``HostHit`` placeholder in the
  returned block list (``block_id == -1``); ``num_computed_tokens`` counts it.
* **Promotion** -- ``allocate_slots`` gives each host hit a fresh device block,
  records ``HostTransfer("load", block_id, host_slot)``, sets the placeholder's
  ``block_id`` to that device block (so a scheduler that builds block tables from the
  hit list needs no change), caches the device block under the hash
  (``BlockStored(medium="GPU")``) and frees the host slot (``BlockRemoved(medium=
  "CPU")``). On failure (``None``) nothing changes, host entries included.

The radix index (``KVCacheManager(index="radix", num_host_blocks=N)``,
``prefixcache/core/radix.py``) drives the same ``HostTier``: its evicted leaves are
demoted, its lookups continue here by block hash after the tree walk, its admissions
promote (the module docstring there, "Host tier").

Multi-group layouts (``KVCacheManager(kv_cache_groups=..., num_host_blocks=N)``: full
attention + sliding window, ``core/hybrid.py``) drive a ``GroupHostTier``: its entries
are the hybrid pool's ``(block hash, group id)`` keys, so one host slot holds one block
of one group (one page of each KV array: vLLM's hybrid layouts have one page size and
every shared array holds one layer of each group), and every rule above holds per
group key -- demotion of a cached block of ANY group, a lookup that counts a group's
host entry as that group's hit (each single-type manager's ``get_cached``: a sliding
window's window must be all device-or-host hits), promotion of the host hits a group
keeps (a sliding window's slots before the window are nulled, never loaded), the
exclusive contract, pins, ``num_dropped`` / ``num_discarded`` and ``medium="CPU"``
events (plain digest + ``group_idx``). Its transfers are ``GroupHostTransfer``s whose
``group`` names the group (``HostTransfer.group`` is 0 for one group). A replay or
engine hit of L tokens is split by tier per block position: a position loaded in any
group counts as host-hit tokens. A state-space (Mamba) group's block is one state
snapshot, demoted and promoted whole under its key like any block. The tiers below the
host (``attach_lower``: disk, remote, a user's) hold the same keys (``TierChain(
group_bytes=4)``): what the host evicts goes down the chain per key, a group's lookup
falls through to them (a ``TierHit``), and a position loaded from several tiers counts
for the slowest. The radix index's layout manager does not take a host tier
(``indexes.COMBINATION_RULES``).

The transfers are sequential copies, to apply in list order before the step computes
(``KVCacheManager.take_host_transfers``). Their order is safe by construction: a host
entry being promoted is pinned (out of the host policy's candidates) while the device
blocks for it are taken, so the demotions those evictions cause never store into a
slot that is about to be loaded; its slot is freed only after its load is recorded.
Two rare cases keep the tiers exclusive: a demotion while the host is full of pinned
entries is dropped (``num_dropped``: the block is gone, as without a tier), and a
block the device computes and caches while the host holds its hash (a prompt that
cannot hit its own last block, a chain whose parent was evicted) drops the host copy
(``num_discarded``, ``BlockRemoved(medium="CPU")``).

Host policy: ``lru`` (the default) evicts the least recently demoted entry, kept as
the insertion order of the hash -> slot ``OrderedDict`` (the fast path, no policy
object; ``host_eviction_options={"fast_path": False}`` runs the keyed ``lru`` policy
instead, and a test pins the two to the same results). Any other policy is built by
``make_policy`` and notified as the protocol says
(``prefixcache/core/eviction/base.py``): a demotion is ``on_cached`` + ``on_release``
+ ``add`` of the slot (``fifo`` then equals ``lru``: a host entry enters once);
``length`` and ``cost`` see the block's chain position and ``priority`` the priority
of the request that cached it on the device (recorded by the tiered pool when it
caches a block, only for such policies); a host hit is not a policy hit (the entry
leaves the host at once). A policy that needs the trace's future (``needs_future``,
e.g. ``belady``) is not offered for the host.
"""

from __future__ import annotations

import collections
from collections import OrderedDict
from collections.abc import Mapping
from itertools import islice
from typing import Any, NamedTuple

from prefixcache._validate import ArgumentTypeError, check_count, check_host_memory
from prefixcache.core.block_pool import (
    HOST_BYTES_PER_BLOCK,
    BlockPool,
    InvariantError,
)
from prefixcache.core.eviction import (
    DEFAULT_POLICY,
    get_policy_class,
    is_policy_class,
    make_policy,
    online_policy_names,
    policy_name,
)
from prefixcache.core.eviction.base import EvictionPolicy
from prefixcache.core.events import MEDIUM_CPU, BlockRemoved, BlockStored
from prefixcache.core.groups.base import _KEY_BYTES
from prefixcache.core.tiers.base import HOST_LINK, TierChain, TierHit, _Origin

HOST_STORE = "store"  # device page block_id -> host slot (at demotion)
HOST_LOAD = "load"  # host slot -> device page block_id (at promotion)


class HostTransfer(NamedTuple):
    """One page copy between the tiers, in the order recorded.

    Attributes:
        kind: ``"store"`` (device page ``block_id`` -> host slot ``host_slot``) or
            ``"load"`` (host slot ``host_slot`` -> device page ``block_id``).
        block_id: the device block (page) id.
        host_slot: the host slot id, ``0 .. num_host_blocks - 1``.
        group: the KV cache group whose arrays (layers) the copy moves: ``0`` (a class
            attribute) for one full-attention group; a multi-group manager's transfers
            (``GroupHostTier``) carry their group's id. NOTE: an attribute, not a
            fourth tuple element, so every caller that unpacks ``kind, block_id,
            host_slot`` stays unchanged; equality of two group transfers includes it.
    """

    kind: str
    block_id: int
    host_slot: int
    group = 0  # (not a field: see the docstring)


class GroupHostTransfer(HostTransfer):
    """A ``HostTransfer`` of group ``group``'s arrays (a multi-group manager's)."""

    def __new__(cls, kind: str, block_id: int, host_slot: int, group: int):
        t = tuple.__new__(cls, (kind, block_id, host_slot))
        t.group = group
        return t

    def __eq__(self, other):
        return tuple.__eq__(self, other) is True and getattr(other, "group", 0) == self.group

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash((tuple(self), self.group))

    def __repr__(self) -> str:
        return (f"HostTransfer(kind={self.kind!r}, block_id={self.block_id!r}, "
                f"host_slot={self.host_slot!r}, group={self.group!r})")


class HostBlock:
    """One host slot (the host policy sees it as a block: ``block_id`` is the slot).

    Attributes:
        block_id: the slot id, ``0 .. num_host_blocks - 1``.
        block_hash: the hash it holds, ``None`` while the slot is free.
    """

    __slots__ = ("block_id", "block_hash")

    def __init__(self, slot: int):
        self.block_id = slot
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return f"HostBlock(slot={self.block_id}, block_hash={h})"


class HostHit:
    """A prefix-hit block found in the host tier (an entry of ``get_computed_blocks``).

    Attributes:
        block_hash: the hash it was found under.
        host_slot: the host slot holding it.
        block_id: ``-1`` until ``allocate_slots`` promotes it; then the id of the
            device block it was loaded into (what a block table needs).
    """

    __slots__ = ("block_hash", "host_slot", "block_id")

    # NOTE: a host hit takes one free device block when it is promoted, as an unused
    # (free-queue) device hit does when it is touched: the multi-group managers' count
    # of the blocks an admission takes (``SingleTypeManager.blocks_to_allocate``,
    # ``b.ref_cnt == 0``) reads it so.
    ref_cnt = 0

    def __init__(self, block_hash: bytes, host_slot: int):
        self.block_hash = block_hash
        self.host_slot = host_slot
        self.block_id = -1

    def __repr__(self) -> str:
        # (any field may be a caller's garbage: the error messages print this)
        h = getattr(self, "block_hash", None)
        h = h.hex()[:12] if isinstance(h, (bytes, bytearray)) else repr(h)
        return (f"HostHit(host_slot={getattr(self, 'host_slot', None)!r}, "
                f"block_id={getattr(self, 'block_id', None)!r}, block_hash={h})")


def check_host_args(num_host_blocks, host_eviction, host_eviction_options) -> tuple[int, dict]:
    """Validate the manager's host-tier arguments (before anything is built).

    Returns:
        ``(num_host_blocks as int, the host policy's options as a dict)``.

    Raises:
        ArgumentTypeError / ValueError naming the argument.
    """
    num_host_blocks = check_count("num_host_blocks", num_host_blocks)
    # The slots' bookkeeping only (the KV pages are the engine's): refused up front.
    check_host_memory(f"a host tier of num_host_blocks={num_host_blocks}",
                      num_host_blocks * HOST_BYTES_PER_BLOCK)
    if not isinstance(host_eviction, str) and not is_policy_class(host_eviction):
        raise ArgumentTypeError(
            f"host_eviction must be a policy name (str) or an EvictionPolicy subclass, "
            f"got {host_eviction!r}")
    try:
        host_cls = get_policy_class(host_eviction)  # unknown -> ValueError naming the choices
    except ValueError as e:
        raise ValueError(f"host_eviction: {e}") from None
    if host_cls.needs_future:  # the property, never the name
        raise ValueError(
            f"host_eviction={policy_name(host_eviction)!r} is not supported for the host "
            "tier (it needs "
            f"the trace's future); use one of {online_policy_names()}")
    if host_eviction_options is None:
        options: dict = {}
    elif isinstance(host_eviction_options, Mapping):
        options = dict(host_eviction_options)
    else:
        raise ArgumentTypeError(
            "host_eviction_options must be a mapping or None, got "
            f"{type(host_eviction_options).__name__}")
    return num_host_blocks, options


def check_tier_args(num_host_blocks, host_eviction, host_eviction_options,
                    enable_caching) -> tuple[int, dict]:
    """``check_host_args``, then a tier needs prefix caching: the one-group managers'
    (hash and radix index) host-tier checks. Same return value."""
    num_host_blocks, options = check_host_args(num_host_blocks, host_eviction,
                                               host_eviction_options)
    if num_host_blocks and not enable_caching:
        raise ValueError(
            f"num_host_blocks={num_host_blocks} needs prefix caching (enable_caching=True)")
    return num_host_blocks, options


def make_host_tier(num_host_blocks: int, host_eviction, host_options: dict, *,
                   block_size: int, num_device_blocks: int, enable_events,
                   tier_class: type | None = None) -> "HostTier | None":
    """The manager's ``HostTier`` (``None`` for ``num_host_blocks == 0``; ``tier_class``:
    ``HostTier`` unless given, ``GroupHostTier`` for group keys), built before any of
    the manager's state: a bad host policy option raises here."""
    if not num_host_blocks:
        return None
    return (tier_class or HostTier)(
        num_host_blocks, block_size=block_size, num_device_blocks=num_device_blocks,
        eviction=host_eviction, eviction_options=host_options,
        enable_events=bool(enable_events))


class HostTier:
    """The host index: hash -> host slot, the free slots, the host policy.

    The first tier of the chain (``prefixcache.core.tiers``): ``lower`` is the
    ``TierChain`` below it (``None``: the host is the last tier), ``link`` its default
    link (the DES charges host loads at ``cost_model.host_link``).

    Invariants (``check_invariants``):
        * every occupied slot maps to exactly one hash and the hash back to it;
        * occupied + free slots == ``num_host_blocks`` (each slot once);
        * the policy's candidates are exactly the occupied slots (none pinned
          outside ``allocate_slots``);
        * no hash is cached on the device too (checked with the pool).

    Args:
        num_host_blocks: host slots (> 0).
        block_size: tokens per block.
        num_device_blocks: the device pool's blocks (sizes the per-block metadata).
        eviction: the host policy's name; ``eviction_options`` its options.
        enable_events: queue ``BlockStored`` / ``BlockRemoved`` with ``medium="CPU"``.
        event_hash: the pool's digest -> event hash conversion.
    """

    name = "host"
    medium = MEDIUM_CPU
    link = HOST_LINK
    group_bytes = 0  # (the group id's bytes at the end of each key: see GroupHostTier)

    def __init__(self, num_host_blocks: int, *, block_size: int, num_device_blocks: int,
                 eviction: str = DEFAULT_POLICY, eviction_options: Mapping[str, Any] | None = None,
                 enable_events: bool = False, event_hash=None):
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.eviction = eviction
        options = dict(eviction_options or {})
        fast_path = options.pop("fast_path", True) if eviction == DEFAULT_POLICY else True
        # The host policy; None = the lru fast path (the map's insertion order).
        self.policy: EvictionPolicy | None = None
        if eviction != DEFAULT_POLICY or options or not fast_path:
            try:
                self.policy = make_policy(eviction, num_blocks=num_host_blocks,
                                          block_size=block_size, **options)
            except (TypeError, ValueError) as e:  # (an option of the wrong name or value)
                raise type(e)(f"host_eviction={eviction!r}, host_eviction_options="
                              f"{eviction_options!r}: {e}") from None
        # NOTE: chain positions, priorities and retention hints are recorded per device
        # block (for the policy's on_cached / on_release) only when there is a policy
        # object here or in a tier below (``keep_origins``).
        self.track_origin = self.policy is not None
        # Per host slot: the ``_Origin`` its entry was demoted with, handed on to the
        # tiers below when the host evicts it (``None``: not kept, see ``keep_origins``).
        self.slot_origin: list | None = None
        self.slots = [HostBlock(i) for i in range(num_host_blocks)]
        # hash -> slot of every host entry (pinned ones excepted); with the lru fast
        # path its order is the eviction order (least recently demoted first).
        # NOTE: measured against a plain dict + a queue of (slot, stamp) with lazy
        # deletion: the same instruction count, more code.
        self.hash_to_slot: OrderedDict[bytes, HostBlock] = OrderedDict()
        self._pinned: dict[bytes, HostBlock] = {}  # entries a promotion is loading
        # NOTE: free slots are reused in FIFO order (deterministic; slot 0 first).
        self.free_slots: collections.deque[int] = collections.deque(range(num_host_blocks))
        # NOTE: recorded flat, two ints per copy: a store as (block_id, host_slot), a
        # load as (-1 - block_id, host_slot) -- no object per demotion (a NamedTuple's
        # Python-level __new__ was ~10% of a tiered replay, a tuple is GC-tracked);
        # take_transfers decodes them into HostTransfers.
        self.transfers: list[int] = []
        self.enable_events = enable_events
        self._event_hash = event_hash
        # Set by the owner: the tiered pool, or the radix manager (CPU events go to its
        # ``events`` list).
        self.pool: BlockPool | None = None
        # Per device block: chain position and request priority when it was cached
        # (what the host policy is told at demotion).
        self.device_position = [0] * num_device_blocks
        self.device_priority = [0] * num_device_blocks
        self.device_retention: list = [None] * num_device_blocks
        # Cumulative counters (never reset).
        self.num_stored = 0  # demotions (store transfers)
        self.num_loaded = 0  # promotions (load transfers)
        self.num_evicted = 0  # host entries dropped by the host policy
        self.num_dropped = 0  # demotions refused: host full, every entry pinned
        self.num_discarded = 0  # host entries dropped because the device cached the hash
        # Miss accounting's hook (as ``BlockPool.evicted_by``): entries the host policy
        # drops are set to "host" in it (the tiered pool's reset hands it the new dict).
        self.evicted_by: dict | None = None
        # The tiers below (``tiers.base.TierChain``; None: the host is the last tier):
        # an entry the host policy evicts is demoted there.
        self.lower = None

    def __len__(self) -> int:
        return len(self.hash_to_slot) + len(self._pinned)

    # ----------------------------------------------------------------- lookup
    def hit_run(self, hashes, start: int, stop: int, device: dict | None = None) -> list:
        """A lookup's run of hits below the device, one call per lookup: for each hash
        of ``hashes[start:stop]`` in order, a device block when ``device`` (the pool's
        hash -> block map; ``None``: the caller's index holds none past ``start``)
        holds it, else a ``HostHit`` when the host holds it, else a ``TierHit`` of the
        first tier below that can serve it; the run stops at the first hash no tier
        holds. Changes no entry (a lower tier may drop one it cannot serve, as
        ``TierChain.find``)."""
        out: list = []
        append = out.append
        host_get = self.hash_to_slot.get
        find = self.lower.find if self.lower is not None else None
        dev_get = device.get if device is not None else None
        for h in islice(hashes, start, stop):
            if dev_get is not None:
                b = dev_get(h)
                if b is not None:
                    if type(b) is dict:  # (duplicates of one hash: any of them)
                        b = next(iter(b.values()))
                    append(b)
                    continue
            slot = host_get(h)
            if slot is not None:
                append(HostHit(h, slot.block_id))
                continue
            tier = find(h) if find is not None else None
            if tier is None:
                break
            append(TierHit(h, tier))
        return out

    # ----------------------------------------------------------------- events
    def _removed(self, h: bytes, group: int = 0) -> None:
        self.pool.events.append(
            BlockRemoved(block_hashes=[self._event_hash(h)], medium=MEDIUM_CPU,
                         group_idx=group))

    # ------------------------------------------------------------ transitions
    def store(self, block_id: int, h: bytes, parent: bytes | None) -> None:
        """Demote: the device block ``block_id`` lost hash ``h`` (no device block
        holds it any more); keep it in a host slot (record the store)."""
        on_host = self.hash_to_slot
        policy = self.policy
        free = self.free_slots
        if free:
            slot = self.slots[free.popleft()]
        else:
            if policy is None:
                if not on_host:  # every host entry is pinned by the promotion in progress
                    self.num_dropped += 1
                    return
                old, slot = on_host.popitem(False)  # the least recently demoted
            elif len(policy):
                slot = policy.pop()
                old = slot.block_hash
                del on_host[old]
                policy.on_evicted(slot)
            else:
                self.num_dropped += 1
                return
            self.num_evicted += 1
            if self.lower is not None:  # (recorded before this store reuses the slot)
                so = self.slot_origin
                self.lower.demote(old, "host", slot.block_id,
                                  so[slot.block_id] if so is not None else None)
            elif self.evicted_by is not None:
                self.evicted_by[old] = "host"
            if self.enable_events:
                self._removed(old)
        slot.block_hash = h
        on_host[h] = slot
        if self.track_origin:
            pos = self.device_position[block_id]
            origin = _Origin(self.device_priority[block_id], self.device_retention[block_id],
                             pos)
            if self.slot_origin is not None:
                self.slot_origin[slot.block_id] = origin
            if policy is not None:
                policy.on_cached(slot, h, origin, pos)
                policy.on_release(slot, origin, pos)
                policy.add(slot)
        self.transfers += (block_id, slot.block_id)
        self.num_stored += 1
        if self.enable_events:
            self._stored(h, parent)

    def attach_lower(self, tiers, *, events_owner, event_hash, block_size: int,
                     layout=None) -> None:
        """Put the tiers below the host (``tiers``, built by ``build_lower_tiers``) under
        this tier as one ``TierChain``: what the host evicts goes down it, and its copies
        join this tier's transfers. ``events_owner``: the object whose ``events`` the
        chain's events join (None: events off); ``layout``: the manager's KV cache
        groups (None: one full-attention group)."""
        self.lower = TierChain(tiers, record=self.record_tier_transfer,
                               events_owner=events_owner, event_hash=event_hash,
                               block_size=block_size, group_bytes=self.group_bytes,
                               layout=layout)
        if self.lower.wants_origin:
            self.keep_origins()

    def keep_origins(self) -> None:
        """Keep each entry's ``_Origin`` (its request's priority and retention hints)
        for the tiers below, whose policies read them when the host evicts the entry:
        called by the owner when it attaches a ``lower`` chain with a policy object."""
        self.track_origin = True
        if self.slot_origin is None:
            self.slot_origin = [None] * self.num_host_blocks

    def _stored(self, h: bytes, parent: bytes | None, group: int = 0) -> None:
        eh = self._event_hash
        # NOTE: as vLLM's offloading connector publishes CPU stores: no token ids
        # (the request is gone); the parent hash is known here.
        self.pool.events.append(BlockStored(
            block_hashes=[eh(h)], parent_block_hash=eh(parent) if parent is not None else None,
            token_ids=[], block_size=self.block_size, lora_id=None, medium=MEDIUM_CPU,
            lora_name=None, group_idx=group))

    def pin(self, slot_id: int) -> None:
        """Keep the entry in ``slot_id`` from being evicted (a promotion is under way):
        out of the eviction order until ``load``."""
        slot = self.slots[slot_id]
        h = slot.block_hash
        del self.hash_to_slot[h]
        self._pinned[h] = slot
        if self.policy is not None:
            self.policy.discard(slot)

    def load(self, slot_id: int, block_id: int) -> None:
        """Promote the pinned entry in ``slot_id`` into device block ``block_id``
        (record the load; the slot becomes free)."""
        slot = self.slots[slot_id]
        h = slot.block_hash
        del self._pinned[h]
        slot.block_hash = None
        if self.policy is not None:
            self.policy.on_evicted(slot)
        self.free_slots.append(slot_id)
        self.transfers += (-1 - block_id, slot_id)
        self.num_loaded += 1
        if self.enable_events:
            self._removed(h)

    def discard(self, h: bytes) -> None:
        """The device cached ``h`` again (computed, not loaded): drop the host copy."""
        slot = self.hash_to_slot.pop(h)
        if self.policy is not None:
            self.policy.discard(slot)
            self.policy.on_evicted(slot)
        slot.block_hash = None
        self.free_slots.append(slot.block_id)
        self.num_discarded += 1
        if self.enable_events:
            self._removed(h)

    def clear(self) -> None:
        """Forget every entry (the pool's reset emitted ``AllBlocksCleared``). Pending
        transfers stay: stores already recorded still describe copies to make."""
        for slot in self.hash_to_slot.values():
            slot.block_hash = None
        self.hash_to_slot = OrderedDict()
        self.free_slots = collections.deque(range(self.num_host_blocks))
        if self.policy is not None:
            self.policy.clear()
        if self.lower is not None:
            self.lower.clear()

    def take_transfers(self) -> list[HostTransfer]:
        out = self.pending_transfers()
        self.transfers = []
        return out

    def pending_transfers(self) -> list:
        """The recorded transfers, decoded, without taking them (``HostTransfer``s, and
        the lower tiers' ``TierTransfer``s in their places)."""
        it = iter(self.transfers)
        if self.lower is None:
            return [HostTransfer(HOST_STORE, b, s) if b >= 0
                    else HostTransfer(HOST_LOAD, -1 - b, s) for b, s in zip(it, it)]
        return [b if type(b) is not int else HostTransfer(HOST_STORE, b, s) if b >= 0
                else HostTransfer(HOST_LOAD, -1 - b, s) for b, s in zip(it, it)]

    def record_tier_transfer(self, t) -> None:
        """Record a lower tier's ``TierTransfer`` in order with the host's copies."""
        self.transfers += (t, 0)

    def drop_transfers(self) -> None:
        """Forget the recorded transfers (a replay has no pages to copy)."""
        self.transfers.clear()

    # --------------------------------------------------------------- checking
    def check_invariants(self, device_cached: Mapping[bytes, Any]) -> None:
        """Raise ``InvariantError`` naming the slot / hash on any inconsistency."""
        n = self.num_host_blocks
        if self._pinned:
            raise InvariantError(f"host slots {[s.block_id for s in self._pinned.values()]} "
                                 "are still pinned outside allocate_slots")
        if len(self.hash_to_slot) > n:
            raise InvariantError(f"{len(self.hash_to_slot)} host entries > {n} host slots")
        occupied = []
        for i, slot in enumerate(self.slots):
            if slot.block_id != i:
                raise InvariantError(f"host slots[{i}] has slot id {slot.block_id}")
            h = slot.block_hash
            if h is not None:
                if self.hash_to_slot.get(h) is not slot:
                    raise InvariantError(f"host slot {i} holds {h.hex()} but the map does not "
                                         "point back to it")
                occupied.append(i)
        for h, slot in self.hash_to_slot.items():
            if slot.block_hash != h:
                raise InvariantError(f"host map: {h.hex()} -> slot {slot.block_id} which holds "
                                     f"{slot.block_hash!r}")
            if h in device_cached:
                raise InvariantError(f"hash {h.hex()} is cached on the device and on the host "
                                     f"(slot {slot.block_id})")
        free = list(self.free_slots)
        if len(set(free)) != len(free):
            raise InvariantError(f"a host slot is free twice: {sorted(free)}")
        if set(free) & set(occupied):
            raise InvariantError(f"host slots both free and occupied: "
                                 f"{sorted(set(free) & set(occupied))}")
        if len(free) + len(occupied) != n:
            raise InvariantError(f"{len(occupied)} occupied + {len(free)} free host slots != "
                                 f"{n}")
        if self.policy is not None:
            self.policy.check_invariants(occupied)
        if self.lower is not None:
            self.lower.check_invariants(device_cached, self.hash_to_slot)

    def eviction_order(self) -> list[int]:
        """The occupied host slots, the next one the host policy evicts first."""
        if self.policy is None:
            return [slot.block_id for slot in self.hash_to_slot.values()]
        return self.policy.candidate_ids()


def _group_of(key: bytes) -> int:
    return int.from_bytes(key[-_KEY_BYTES:], "big")


class GroupHostTier(HostTier):
    """The host tier of a multi-group manager (``core/hybrid.py``): entries are keyed
    by the pool's ``(block hash, group id)`` keys, so one host slot holds one block of
    one group (a page of that group's arrays; vLLM's hybrid layouts have one page
    size), and the exclusive contract (a key on the device or on the host, never both)
    holds per group. Events carry the plain digest and ``group_idx``; transfers are
    ``GroupHostTransfer``s naming their group. The tiers below it (``attach_lower``)
    hold the same keys (``TierChain(group_bytes=4)``); their ``TierTransfer``s join the
    list in order, each naming its group.
    """

    group_bytes = _KEY_BYTES

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The group of each recorded transfer (``transfers`` holds two ints per copy).
        self.transfer_groups: list[int] = []

    def _stored(self, h: bytes, parent: bytes | None, group: int = 0) -> None:
        super()._stored(h[:-_KEY_BYTES], parent[:-_KEY_BYTES] if parent is not None else None,
                        _group_of(h))

    def _removed(self, h: bytes, group: int = 0) -> None:
        super()._removed(h[:-_KEY_BYTES], _group_of(h))

    def store(self, block_id: int, h: bytes, parent: bytes | None) -> None:
        n = self.num_stored
        super().store(block_id, h, parent)
        if self.num_stored != n:  # (not dropped)
            self.transfer_groups.append(_group_of(h))

    def load(self, slot_id: int, block_id: int) -> None:
        g = _group_of(self.slots[slot_id].block_hash)
        super().load(slot_id, block_id)
        self.transfer_groups.append(g)

    def record_tier_transfer(self, t) -> None:
        super().record_tier_transfer(t)
        self.transfer_groups.append(t.group)

    def take_transfers(self) -> list[HostTransfer]:
        out = self.pending_transfers()
        self.transfers = []
        self.transfer_groups = []
        return out

    def pending_transfers(self) -> list[HostTransfer]:
        it = iter(self.transfers)
        return [b if type(b) is not int else GroupHostTransfer(HOST_STORE, b, s, g) if b >= 0
                else GroupHostTransfer(HOST_LOAD, -1 - b, s, g)
                for (b, s), g in zip(zip(it, it), self.transfer_groups)]

    def drop_transfers(self) -> None:
        self.transfers.clear()
        self.transfer_groups.clear()


class HostTierAPI:
    """The managers' host-tier calls, read from ``self.host_tier`` (a ``HostTier`` or
    ``None``): shared by the hash index, the radix index and the hybrid manager (a
    ``GroupHostTier``; the radix layout manager has none: ``host_tier = None``)."""

    def take_host_transfers(self) -> list[HostTransfer]:
        """Return and clear the page copies between the tiers recorded since the last
        call, in order (``[]`` without a host tier). Apply them in list order before
        the step computes: a ``HostTransfer`` ``store`` copies device page
        ``block_id`` to host slot ``host_slot``, ``load`` the other way; a
        ``TierTransfer`` (``prefixcache.core.tiers``) copies between ``src`` and
        ``dst`` when a tier below the host is on."""
        if self.host_tier is None:
            return []
        return self.host_tier.take_transfers()

    def take_tier_transfers(self) -> list:
        """``take_host_transfers`` (the same list: every tier's copies, in order)."""
        return self.take_host_transfers()

    @property
    def tier_chain(self):
        """The tiers below the host (``tiers.TierChain``), or ``None``."""
        return self.host_tier.lower if self.host_tier is not None else None

    @property
    def hit_tokens_by_tier(self) -> dict[str, int]:
        """Prefix-hit tokens adopted at admission by the tier they came from
        (``"device"``, ``"host"``, and each tier below the host by name), cumulative."""
        out = {"device": self.device_hit_tokens, "host": self.host_hit_tokens}
        lower = getattr(self, "_lower_hit_tokens", None)
        if lower:
            out.update(lower)
        return out

    @property
    def num_host_cached_blocks(self) -> int:
        """Hashes held in the host tier now (0 without one)."""
        return len(self.host_tier) if self.host_tier is not None else 0

    @property
    def host_blocks_loaded(self) -> int:
        """Host entries promoted into device blocks (load transfers), cumulative."""
        return self.host_tier.num_loaded if self.host_tier is not None else 0

    @property
    def host_blocks_stored(self) -> int:
        """Device blocks demoted into host slots (store transfers), cumulative."""
        return self.host_tier.num_stored if self.host_tier is not None else 0
