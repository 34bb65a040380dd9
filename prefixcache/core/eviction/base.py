"""The eviction-policy seam: which evictable cached block goes first.

Two parties share the work (see ``prefixcache/core/eviction/__init__.py`` for the
registry):

* The **index** (the hash-chain ``BlockPool``, or the radix tree) owns the blocks and
  decides which ones are *candidates*: cached (they hold a hash / a tree node), not in
  use (``ref_cnt == 0``) and, for the radix tree, leaves. It tells the policy when a block
  becomes a candidate (``add``) and when it stops being one (``discard``), and asks for a
  victim with ``pop`` only after it has used up every free block that holds no hash
  (those can never be hit, so they always go first).
* The **policy** keeps per-block metadata from the notifications below and orders the
  candidates. It never changes a block.

Notifications, in the order the index makes them for one block's life::

    on_cached(block, block_hash, request, position)   # the block entered the cache
    on_hit(block, request)                            # a lookup adopted it (any ref_cnt)
    on_release(block, request, position)              # its ref_cnt dropped to 0
    add(block) / discard(block)                       # candidate set membership
    pop() -> block                                    # the victim; no longer a candidate
    on_evicted(block)                                 # it left the cache: forget it
    clear()                                           # every block left the cache

``position`` is the block's index in its request's block table (its depth in the hash
chain / the tree, 0 = first block). A driver that knows the trace calls
``on_arrival(request, index)`` once per request, before its first lookup (only the
offline ``belady`` bound needs it). A driver with a waiting queue (the engine's
scheduler, the replay's look-ahead) reports it to policies with ``needs_waiting``
through the manager: ``on_waiting(request_id, block_hashes)`` when a request joins the
queue, ``drop_waiting(request_id)`` when it leaves (the manager itself drops it at
admission); only ``queue_aware`` reads it.

A pool with several KV cache groups (the hash index's hybrid coordinator,
``core/hybrid.py``) tells a policy with ``needs_groups`` which group each cached block
belongs to: ``set_groups(groups)`` once, before any block is cached (the checked
``kv_groups.KVCacheGroup`` tuple: each group's spec -- its ``kind``, window -- and
layers), then ``on_cached_group(block, block_hash, request, position, group_id)`` in
place of ``on_cached`` for every block it caches. A policy without the property is
told nothing of groups (``on_cached`` as above, no cost); one with it that never hears
``set_groups`` (a one-group manager) sees one full-attention group, id 0.

Every policy here is a *keyed* policy: ``key(block)`` is computed when the block becomes
a candidate, and ``pop`` returns the candidate with the smallest key (a lazy-deletion
binary heap, O(log n) per operation). Keys end with the block's release stamp, so equal
keys fall back to LRU order -- the order of vLLM's free queue.

A *time-varying* policy (``needs_time``; ``TimedPolicy``: ``ttl_lru``) ranks a block by
``priority(block, now)`` -- SGLang's ``get_priority(node)`` with the driver's clock --
asked when the block becomes a candidate and again, when the pool pops, for every
candidate whose rank may have changed since (``priority`` says until when its answer
holds). The driver tells such a policy the time with ``set_time(now_s, step)``
(``policy_clock(manager)`` finds the device's and the host tier's); other policies are
never told (no cost).
"""

from __future__ import annotations

import heapq
import math
import numbers
from typing import Any, Callable, Sequence

from prefixcache._validate import check_positive_int


class PolicyError(AssertionError):
    """A policy's bookkeeping is inconsistent (a bug, never a caller error)."""


class EvictionPolicy:
    """Base class of eviction policies; see the module docstring for the protocol.

    Args:
        num_blocks: blocks in the pool (ids ``0 .. num_blocks - 1``).

    Attributes:
        name: the registry name (set by subclasses).
        needs_future: the policy needs ``on_arrival`` calls from a driver that knows
            the trace (``belady``); a manager built without one raises.
        needs_block_size: the constructor takes ``block_size=`` (tokens per block);
            ``make_policy`` passes the index's own (``cost``).
        needs_waiting: the policy reads the waiting queue (``on_waiting`` /
            ``drop_waiting``, forwarded by the manager; ``queue_aware``); drivers and
            managers make those calls only for such a policy (no cost otherwise).
        needs_groups: the policy reads each cached block's KV cache group
            (``set_groups`` / ``on_cached_group``, from a multi-group pool; ``marconi``,
            ``queue_aware``); other policies are never told (no cost).
        needs_time: the policy reads the driver's clock (``set_time``, called by the
            drivers through ``policy_clock``; ``TimedPolicy``); other policies are
            never told (no cost).
    """

    name = "base"
    needs_future = False
    needs_block_size = False
    needs_waiting = False
    needs_groups = False
    needs_time = False

    def __init__(self, num_blocks: int):
        self.num_blocks = check_positive_int("num_blocks", num_blocks)  # (the one int rule)

    # -- metadata notifications (defaults: nothing to remember) ---------------------
    def on_cached(self, block, block_hash: bytes, request, position: int) -> None:
        """``block`` got ``block_hash`` (position ``position`` of ``request``)."""

    def on_hit(self, block, request) -> None:
        """A prefix lookup of ``request`` adopted the cached ``block``."""

    def on_release(self, block, request, position: int) -> None:
        """``request`` dropped the last reference to the cached ``block``."""

    def on_evicted(self, block) -> None:
        """``block`` left the cache (its hash was dropped to reuse it)."""

    def on_arrival(self, request, index: int) -> None:
        """Trace request number ``index`` arrives (called before its first lookup)."""

    def on_waiting(self, request_id, block_hashes) -> None:
        """``request_id`` joined the waiting queue holding ``block_hashes``
        (``needs_waiting`` policies only)."""

    def drop_waiting(self, request_id) -> None:
        """``request_id`` left the waiting queue (``needs_waiting`` policies only)."""

    def set_groups(self, groups) -> None:
        """The pool's KV cache groups (a ``kv_groups.KVCacheGroup`` tuple; block ``b``
        of group ``g`` is then announced by ``on_cached_group``), once, before any block
        is cached (``needs_groups`` policies only)."""

    def on_cached_group(self, block, block_hash: bytes, request, position: int,
                        group_id: int) -> None:
        """``on_cached`` from a multi-group pool: ``block`` of group ``group_id`` got
        ``block_hash`` (its plain digest) at table position ``position``
        (``needs_groups`` policies only; the default forgets the group)."""
        self.on_cached(block, block_hash, request, position)

    def waiting_ids(self) -> list:
        """Requests the policy holds as waiting (none unless ``needs_waiting``)."""
        return []

    def set_time(self, now_s: float | None, step: int) -> None:
        """The driver's clock: ``now_s`` seconds (``None`` where the driver has no
        clock in seconds) and ``step`` (see ``policy_clock``); ``needs_time`` policies
        only."""

    # -- candidate set -----------------------------------------------------------
    def add(self, block) -> None:
        raise NotImplementedError

    def discard(self, block) -> None:
        raise NotImplementedError

    def pop(self):
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def candidate_ids(self) -> list[int]:
        """Ids of the current candidates, the next victim first."""
        raise NotImplementedError

    def check_invariants(self, candidate_ids: Sequence[int]) -> None:
        """Raise ``PolicyError`` unless the candidates are exactly ``candidate_ids``."""
        got = sorted(self.candidate_ids())
        want = sorted(candidate_ids)
        if got != want:
            extra = sorted(set(got) - set(want))
            missing = sorted(set(want) - set(got))
            raise PolicyError(
                f"{self.name}: candidates differ from the index's evictable blocks: "
                f"extra {extra[:10]}, missing {missing[:10]}"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_blocks={self.num_blocks}, candidates={len(self)})"


class KeyedPolicy(EvictionPolicy):
    """A policy that evicts the candidate with the smallest ``key(block)``.

    Keeps a release stamp per block (a logical clock ticked by every ``on_cached`` and
    ``on_release``), which subclasses end their keys with so that ties are broken in
    LRU order. Subclasses implement ``key`` and may extend the notifications (call
    ``super()``).

    NOTE: lazy deletion: ``discard`` only forgets the heap entry's token; stale entries
    are skipped by ``pop`` and dropped when the heap grows past twice the candidates.
    """

    name = "keyed"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.clock = 0
        self.released_at = [0] * num_blocks  # clock at the last release to ref_cnt 0
        self.cached_at = [0] * num_blocks  # clock when the block entered the cache
        self._token = [0] * num_blocks  # heap token of the live entry; 0: not a candidate
        self._next_token = 0
        self._heap: list[tuple[Any, int, Any]] = []
        self._n = 0

    def key(self, block) -> Any:
        """The block's eviction key (smaller = evicted first); computed at ``add``."""
        raise NotImplementedError

    # -- notifications -----------------------------------------------------------
    def on_cached(self, block, block_hash, request, position) -> None:
        self.clock += 1
        self.cached_at[block.block_id] = self.clock

    def on_release(self, block, request, position) -> None:
        self.clock += 1
        self.released_at[block.block_id] = self.clock

    # -- candidates --------------------------------------------------------------
    def add(self, block) -> None:
        self._push(block, self.key(block))

    def _push(self, block, key) -> int:
        """Make ``block`` a candidate keyed ``key``; its heap token."""
        bid = block.block_id
        if self._token[bid]:
            raise PolicyError(f"{self.name}: block {bid} is already a candidate")
        self._next_token += 1
        tok = self._next_token
        self._token[bid] = tok
        heapq.heappush(self._heap, (key, tok, block))
        self._n += 1
        return tok

    def discard(self, block) -> None:
        bid = block.block_id
        if not self._token[bid]:
            raise PolicyError(f"{self.name}: block {bid} is not a candidate")
        self._token[bid] = 0
        self._n -= 1
        if len(self._heap) > 2 * self._n + 64:
            self._compact()

    def pop(self):
        heap = self._heap
        token = self._token
        while heap:
            _, tok, block = heapq.heappop(heap)
            if token[block.block_id] == tok:
                token[block.block_id] = 0
                self._n -= 1
                return block
        raise PolicyError(f"{self.name}: pop() with no candidates")

    def rekey(self, block) -> None:
        """Recompute a candidate's key (its metadata changed while it waits)."""
        self.discard(block)
        self.add(block)

    def _compact(self) -> None:
        token = self._token
        self._heap = [e for e in self._heap if token[e[2].block_id] == e[1]]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return self._n

    def clear(self) -> None:
        self._heap = []
        self._token = [0] * self.num_blocks
        self._n = 0

    def candidate_ids(self) -> list[int]:
        token = self._token
        live = sorted(e for e in self._heap if token[e[2].block_id] == e[1])
        return [e[2].block_id for e in live]

    def current_key(self, block) -> Any:
        """What ``key(block)`` is now, without side effects (``check_invariants``
        compares it with each live heap entry's key: metadata that changed while the
        block waited, without a ``rekey``, is a bug)."""
        return self.key(block)

    def check_invariants(self, candidate_ids: Sequence[int]) -> None:
        n_live = sum(1 for t in self._token if t)
        if n_live != self._n:
            raise PolicyError(f"{self.name}: {n_live} live tokens but {self._n} candidates")
        super().check_invariants(candidate_ids)
        token = self._token
        for k, tok, block in self._heap:
            if token[block.block_id] == tok:
                now = self.current_key(block)
                if k != now:
                    raise PolicyError(
                        f"{self.name}: candidate block {block.block_id} is keyed {k!r} "
                        f"but its key is now {now!r} (metadata changed without a rekey)"
                    )


class HitCounts:
    """Mixin of a ``KeyedPolicy`` (list it first among the bases): ``hits[block_id]``,
    the block's hits (``on_hit``: a prefix lookup adopting it, whatever its ``ref_cnt``)
    since it was cached (``on_cached`` resets it to 0). Used by ``lfu``, ``slru`` and
    ``pgdsf``."""

    def __init__(self, num_blocks: int, **kwargs):
        super().__init__(num_blocks, **kwargs)
        self.hits = [0] * num_blocks

    def on_cached(self, block, block_hash, request, position) -> None:
        super().on_cached(block, block_hash, request, position)
        self.hits[block.block_id] = 0

    def on_hit(self, block, request) -> None:
        self.hits[block.block_id] += 1


TIME_UNITS = ("s", "steps")  # what a time-varying policy's clock counts


def check_time(policy: str, unit: str, now_s, step) -> float:
    """The driver's clock reading in ``unit`` (``TIME_UNITS``) for ``policy``: ``now_s``
    for ``"s"``, ``step`` for ``"steps"``; ``ValueError`` when it is missing, not a
    finite number >= 0 (bools refused)."""
    now = now_s if unit == "s" else step
    if now is None:
        raise ValueError(
            f"{policy}: unit={unit!r} reads the driver's clock in seconds, which this "
            "driver does not have (a replayed trace request without a timestamp); give "
            "the trace timestamps or use unit='steps'")
    if (isinstance(now, bool) or not isinstance(now, numbers.Real)
            or not math.isfinite(now) or now < 0):
        raise ValueError(f"{policy}: the clock ({unit}) must be a finite number >= 0, "
                         f"got {now!r}")
    return float(now)


class TimedPolicy(KeyedPolicy):
    """A keyed policy whose ranks depend on the driver's clock (``needs_time``).

    Subclasses implement one method, ``priority(block, now) -> (key, until)``: the
    block's key at time ``now`` (smaller = evicted first; end it with the release
    stamp for LRU ties) and the last time at which that key still holds if nothing
    happens to the block (``math.inf``: until a notification rekeys it; ``now``: it may
    change at any later time). It is asked when the block becomes a candidate and
    again, before ``pop`` chooses, for every candidate whose ``until`` is past:
    piecewise-constant priorities (a TTL: one change per block) cost O(log n) per
    change; a priority that changes continuously is recomputed at every later pop.

    Args:
        num_blocks: blocks in the pool.
        unit: what ``now`` counts (``TIME_UNITS``): ``"s"``, the driver's seconds, or
            ``"steps"``, its step counter (see ``policy_clock``).

    NOTE: time. The policy's ``now`` is the driver's clock, told by ``set_time(now_s,
    step)`` and never read from a global: the replay calls it once per request before
    the request's lookup (``now_s``: the request's arrival ``timestamp``, ``None`` in a
    trace without one; ``step``: its index in the trace); the DES once per scheduler
    step (simulated seconds; steps so far); the engine's scheduler once per step
    (seconds of ``time.monotonic()`` since the scheduler started; steps so far). It
    reaches the pool through the policy: the pool pops as for any keyed policy, and
    ``pop`` re-ranks the candidates whose key expired at ``now`` first. Until a driver
    tells it, ``now`` is 0. The clock never goes back (``ValueError``).
    """

    name = "timed"
    needs_time = True

    def __init__(self, num_blocks: int, *, unit: str = "s"):
        super().__init__(num_blocks)
        if unit not in TIME_UNITS:
            raise ValueError(f"{self.name}: unit must be one of {TIME_UNITS}, got {unit!r}")
        self.unit = unit
        self.now = 0.0
        self._until = [math.inf] * num_blocks  # until when each candidate's key holds
        self._timers: list[tuple[float, int, Any]] = []  # heap of (until, token, block)

    def priority(self, block, now: float) -> tuple[Any, float]:
        """``(key, until)``: ``block``'s key at ``now`` and the last time it holds."""
        raise NotImplementedError

    def key(self, block) -> Any:
        return self.priority(block, self.now)[0]

    def time_of(self, now_s, step) -> float:
        """The clock reading ``set_time`` would take, checked (no change)."""
        now = check_time(self.name, self.unit, now_s, step)
        if now < self.now:
            raise ValueError(f"{self.name}: the clock went back from {self.now} to {now} "
                             f"({self.unit}); a driver's clock never decreases")
        return now

    def set_time(self, now_s, step) -> None:
        self.now = self.time_of(now_s, step)

    def add(self, block) -> None:
        key, until = self.priority(block, self.now)
        tok = self._push(block, key)
        self._until[block.block_id] = until
        if until != math.inf:
            heapq.heappush(self._timers, (until, tok, block))

    def _refresh(self) -> None:
        """Re-rank every candidate whose key expired before ``now`` (lazy: stale timer
        entries of discarded candidates are skipped)."""
        token = self._token
        now = self.now
        while self._timers and self._timers[0][0] < now:
            # (self._timers is read again each time: a discard may compact it)
            _, tok, block = heapq.heappop(self._timers)
            if token[block.block_id] == tok:
                self.discard(block)
                self.add(block)  # (until >= now: it does not come back in this loop)

    def pop(self):
        self._refresh()
        return super().pop()

    def _compact(self) -> None:
        super()._compact()
        token = self._token
        self._timers = [e for e in self._timers if token[e[2].block_id] == e[1]]
        heapq.heapify(self._timers)

    def clear(self) -> None:
        super().clear()
        self._timers = []

    def candidate_ids(self) -> list[int]:
        # NOTE: re-ranks the expired keys first (as pop does): the order at ``now``.
        # Nothing observable changes: the same candidates, the ranks pop would use.
        self._refresh()
        return super().candidate_ids()

    def check_invariants(self, candidate_ids: Sequence[int]) -> None:
        self._refresh()
        super().check_invariants(candidate_ids)
        token = self._token
        timed = {tok for _, tok, block in self._timers if token[block.block_id] == tok}
        for bid, tok in enumerate(token):
            if tok and (self._until[bid] != math.inf) != (tok in timed):
                raise PolicyError(f"{self.name}: candidate block {bid} keyed until "
                                  f"{self._until[bid]} has {'no' if tok not in timed else 'a'}"
                                  " timer")


def policy_clock(manager) -> Callable[[float | None, int], None] | None:
    """The clock of ``manager``'s policies that read it (``needs_time``: the device's,
    the host tier's and those of the tiers below it but an inclusive one, a store shared
    by replicas whose clocks differ), as one ``set_time(now_s, step)`` callable; ``None``
    when no policy reads it (a driver then keeps no clock: no cost). Every policy checks
    the reading before any takes it (a bad one changes nothing)."""
    host = getattr(manager, "host_tier", None)
    lower = getattr(host, "lower", None)
    policies = [p for p in (getattr(manager, "policy", None), getattr(host, "policy", None),
                            *(t.policy for t in (lower.tiers if lower is not None else ())
                              if not t.inclusive))
                if p is not None and p.needs_time]
    if not policies:
        return None
    if len(policies) == 1:
        return policies[0].set_time

    checks = [p.time_of for p in policies if callable(getattr(p, "time_of", None))]

    def set_time(now_s, step) -> None:
        for check in checks:  # (TimedPolicy's: the reading, checked without a change)
            check(now_s, step)
        for p in policies:
            p.set_time(now_s, step)

    return set_time


class WaitingFanout:
    """The waiting-queue calls (``on_waiting`` / ``drop_waiting`` / ``waiting_ids``)
    forwarded to several ``needs_waiting`` policies, in order: a manager whose device
    policy and host-tier policy both read the queue holds one of these where it holds
    a waiting policy (a request already waiting raises ``ValueError`` in the first
    policy, before any change).

    Args:
        policies: the policies (``None`` entries are skipped).
    """

    def __init__(self, *policies):
        self.policies = tuple(p for p in policies if p is not None)
        for p in self.policies:
            if not p.needs_waiting:
                raise ValueError(f"{p.name} does not read the waiting queue (needs_waiting)")

    needs_waiting = True

    def on_waiting(self, request_id, block_hashes) -> None:
        # NOTE: the policies hear the same calls, so they hold the same requests: the
        # first one's "already waiting" check (before any change) answers for all.
        hashes = tuple(block_hashes)
        for p in self.policies:
            p.on_waiting(request_id, hashes)

    def drop_waiting(self, request_id) -> None:
        for p in self.policies:
            p.drop_waiting(request_id)

    def waiting_ids(self) -> list:
        out: dict = {}
        for p in self.policies:
            out.update(dict.fromkeys(p.waiting_ids()))
        return list(out)


def reads_waiting_queue(manager) -> bool:
    """Whether ``manager``'s eviction policy or its host tier's policy reads the waiting
    queue (``needs_waiting``: ``queue_aware``): a driver (the engine's scheduler, the
    replay, the DES) then reports its queue (``manager.on_waiting`` / ``drop_waiting``);
    no other manager is told anything."""
    policy = getattr(manager, "policy", None)
    if policy is not None and policy.needs_waiting:
        return True
    host = getattr(getattr(manager, "host_tier", None), "policy", None)
    return host is not None and host.needs_waiting
