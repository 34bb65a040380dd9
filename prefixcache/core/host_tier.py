"""The host-memory tier: cached blocks the device evicted, kept in host slots.

``KVCacheManager(..., num_host_blocks=N)`` (issue 16 item 1; the contract is in the
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

The transfers are sequential copies, to apply in list order before the step computes
(``KVCacheManager.take_host_transfers``). Their order is safe by construction: a host
entry being promoted is pinned (out of the host policy's candidates) while the device
blocks for it are taken, so the demotions those evictions cause never store into a
slot that is about to be loaded; its slot is freed only after its load is recorded.

Host policy notifications (``prefixcache/core/eviction/base.py``): a demotion is
``on_cached`` + ``on_release`` + ``add`` of the slot (so ``lru`` / ``fifo`` evict the
least recently demoted entry first); ``length`` and ``cost`` see the block's chain
position and ``priority`` the priority of the request that cached it on the device
(recorded by the tiered pool when it caches a block); a host hit is not a policy
hit (the entry leaves the host at once). ``belady`` is not offered for the host.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any, NamedTuple

from prefixcache._validate import ArgumentTypeError, check_count
from prefixcache.core.block_pool import BlockPool, InvariantError, KVCacheBlock
from prefixcache.core.eviction import DEFAULT_POLICY, get_policy_class, make_policy
from prefixcache.core.eviction.base import EvictionPolicy
from prefixcache.core.events import MEDIUM_CPU, BlockRemoved, BlockStored
from prefixcache.core.policy_pool import PolicyBlockPool

HOST_STORE = "store"  # device page block_id -> host slot (at demotion)
HOST_LOAD = "load"  # host slot -> device page block_id (at promotion)
UNSUPPORTED_HOST_POLICIES = ("belady",)  # needs the trace's future: device only


class HostTransfer(NamedTuple):
    """One page copy between the tiers, in the order recorded.

    Attributes:
        kind: ``"store"`` (device page ``block_id`` -> host slot ``host_slot``) or
            ``"load"`` (host slot ``host_slot`` -> device page ``block_id``).
        block_id: the device block (page) id.
        host_slot: the host slot id, ``0 .. num_host_blocks - 1``.
    """

    kind: str
    block_id: int
    host_slot: int


class HostBlock:
    """One host slot (the host policy sees it as a block: ``block_id`` is the slot).

    Attributes:
        block_id: the slot id, ``0 .. num_host_blocks - 1``.
        block_hash: the hash it holds, ``None`` while the slot is free.
        parent_hash: the hash of the block before it in its chain (``None``: a first
            block); stale while free.
    """

    __slots__ = ("block_id", "block_hash", "parent_hash")

    def __init__(self, slot: int):
        self.block_id = slot
        self.block_hash: bytes | None = None
        self.parent_hash: bytes | None = None

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

    def __init__(self, block_hash: bytes, host_slot: int):
        self.block_hash = block_hash
        self.host_slot = host_slot
        self.block_id = -1

    def __repr__(self) -> str:
        return (f"HostHit(host_slot={self.host_slot}, block_id={self.block_id}, "
                f"block_hash={self.block_hash.hex()[:12]})")


class _Origin:
    """What the host policy's ``on_cached`` / ``on_release`` read of a request
    (``priority``) for a block demoted long after its request left."""

    __slots__ = ("priority",)

    def __init__(self, priority: int):
        self.priority = priority


def check_host_args(num_host_blocks, host_eviction, host_eviction_options) -> tuple[int, dict]:
    """Validate the manager's host-tier arguments (before anything is built).

    Returns:
        ``(num_host_blocks as int, the host policy's options as a dict)``.

    Raises:
        ArgumentTypeError / ValueError naming the argument.
    """
    num_host_blocks = check_count("num_host_blocks", num_host_blocks)
    if not isinstance(host_eviction, str):
        raise ArgumentTypeError(
            f"host_eviction must be a policy name (str), got {host_eviction!r}")
    get_policy_class(host_eviction)  # unknown -> ValueError naming the choices
    if host_eviction in UNSUPPORTED_HOST_POLICIES:
        raise ValueError(
            f"host_eviction={host_eviction!r} is not supported for the host tier (it needs "
            "the trace's future); use one of "
            f"{tuple(p for p in _policy_names() if p not in UNSUPPORTED_HOST_POLICIES)}")
    if host_eviction_options is None:
        options: dict = {}
    elif isinstance(host_eviction_options, Mapping):
        options = dict(host_eviction_options)
    else:
        raise ArgumentTypeError(
            "host_eviction_options must be a mapping or None, got "
            f"{type(host_eviction_options).__name__}")
    return num_host_blocks, options


def _policy_names() -> tuple[str, ...]:
    from prefixcache.core.eviction import policy_names  # noqa: PLC0415

    return policy_names()


class HostTier:
    """The host index: hash -> host slot, the free slots, the host policy.

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

    def __init__(self, num_host_blocks: int, *, block_size: int, num_device_blocks: int,
                 eviction: str = DEFAULT_POLICY, eviction_options: Mapping[str, Any] | None = None,
                 enable_events: bool = False, event_hash=None):
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.eviction = eviction
        self.policy: EvictionPolicy = make_policy(
            eviction, num_blocks=num_host_blocks, block_size=block_size,
            **dict(eviction_options or {}))
        self.slots = [HostBlock(i) for i in range(num_host_blocks)]
        self.hash_to_slot: dict[bytes, HostBlock] = {}
        # NOTE: free slots are reused in FIFO order (deterministic; slot 0 first).
        self.free_slots: collections.deque[int] = collections.deque(range(num_host_blocks))
        self.transfers: list[HostTransfer] = []
        self.enable_events = enable_events
        self._event_hash = event_hash
        self.pool: BlockPool | None = None  # set by the tiered pool that owns this tier
        # Per device block: chain position and request priority when it was cached
        # (what the host policy is told at demotion).
        self.device_position = [0] * num_device_blocks
        self.device_priority = [0] * num_device_blocks
        # Cumulative counters (never reset).
        self.num_stored = 0  # demotions (store transfers)
        self.num_loaded = 0  # promotions (load transfers)
        self.num_evicted = 0  # host entries dropped by the host policy
        self.num_dropped = 0  # demotions refused: host full, every entry pinned
        self.num_discarded = 0  # host entries dropped because the device cached the hash

    def __len__(self) -> int:
        return len(self.hash_to_slot)

    # ----------------------------------------------------------------- events
    def _removed(self, h: bytes) -> None:
        self.pool.events.append(
            BlockRemoved(block_hashes=[self._event_hash(h)], medium=MEDIUM_CPU, group_idx=0))

    # ------------------------------------------------------------ transitions
    def store(self, block_id: int, h: bytes, parent: bytes | None) -> None:
        """Demote: the device block ``block_id`` lost hash ``h`` (no device block
        holds it any more); keep it in a host slot (record the store)."""
        if h in self.hash_to_slot:
            raise InvariantError(f"hash {h.hex()} demoted from block {block_id} is already "
                                 "on the host")
        policy = self.policy
        free = self.free_slots
        if free:
            slot = self.slots[free.popleft()]
        elif len(policy):
            slot = policy.pop()
            old = slot.block_hash
            del self.hash_to_slot[old]
            policy.on_evicted(slot)
            self.num_evicted += 1
            if self.enable_events:
                self._removed(old)
        else:  # every host entry is pinned by the promotion in progress
            self.num_dropped += 1
            return
        slot.block_hash = h
        slot.parent_hash = parent
        self.hash_to_slot[h] = slot
        origin = _Origin(self.device_priority[block_id])
        pos = self.device_position[block_id]
        policy.on_cached(slot, h, origin, pos)
        policy.on_release(slot, origin, pos)
        policy.add(slot)
        self.transfers.append(HostTransfer(HOST_STORE, block_id, slot.block_id))
        self.num_stored += 1
        if self.enable_events:
            eh = self._event_hash
            # NOTE: as vLLM's offloading connector publishes CPU stores: no token ids
            # (the request is gone); the parent hash is known here.
            self.pool.events.append(BlockStored(
                block_hashes=[eh(h)], parent_block_hash=eh(parent) if parent is not None else None,
                token_ids=[], block_size=self.block_size, lora_id=None, medium=MEDIUM_CPU,
                lora_name=None, group_idx=0))

    def pin(self, slot_id: int) -> None:
        """Keep the entry in ``slot_id`` from being evicted (a promotion is under way)."""
        self.policy.discard(self.slots[slot_id])

    def load(self, slot_id: int, block_id: int) -> None:
        """Promote the pinned entry in ``slot_id`` into device block ``block_id``
        (record the load; the slot becomes free)."""
        slot = self.slots[slot_id]
        h = slot.block_hash
        del self.hash_to_slot[h]
        slot.block_hash = None
        self.policy.on_evicted(slot)
        self.free_slots.append(slot_id)
        self.transfers.append(HostTransfer(HOST_LOAD, block_id, slot_id))
        self.num_loaded += 1
        if self.enable_events:
            self._removed(h)

    def discard(self, h: bytes) -> None:
        """The device cached ``h`` again (computed, not loaded): drop the host copy."""
        slot = self.hash_to_slot.pop(h)
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
        self.hash_to_slot = {}
        self.free_slots = collections.deque(range(self.num_host_blocks))
        self.policy.clear()

    def take_transfers(self) -> list[HostTransfer]:
        out = self.transfers
        self.transfers = []
        return out

    # --------------------------------------------------------------- checking
    def check_invariants(self, device_cached: Mapping[bytes, Any]) -> None:
        """Raise ``InvariantError`` naming the slot / hash on any inconsistency."""
        n = self.num_host_blocks
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
        self.policy.check_invariants(occupied)


class _TieredPool:
    """Mixin over a block pool: demotes evicted hashes to ``host_tier`` and keeps the
    tiers exclusive when the device caches a hash the host holds."""

    host_tier: HostTier

    def _evict(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        parent = block.parent_hash
        super()._evict(block)
        # NOTE: a duplicate device block may still hold h: then it stays on the device.
        if h not in self.cached_block_hash_to_block:
            self.host_tier.store(block.block_id, h, parent)

    def cache_full_blocks(self, request, blocks, block_hashes, num_cached_blocks,
                          num_full_blocks, block_size) -> None:
        super().cache_full_blocks(request, blocks, block_hashes, num_cached_blocks,
                                  num_full_blocks, block_size)
        tier = self.host_tier
        on_host = tier.hash_to_slot
        pos_of = tier.device_position
        prio_of = tier.device_priority
        prio = request.priority
        for pos in range(num_cached_blocks, num_full_blocks):
            blk = blocks[pos]
            bid = blk.block_id
            pos_of[bid] = pos
            prio_of[bid] = prio
            if on_host and blk.block_hash in on_host:
                tier.discard(blk.block_hash)

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        self.host_tier.clear()
        return True


class TieredBlockPool(_TieredPool, BlockPool):
    """``BlockPool`` (device lru) with a host tier under it."""


class TieredPolicyBlockPool(_TieredPool, PolicyBlockPool):
    """``PolicyBlockPool`` (any other device policy) with a host tier under it."""
