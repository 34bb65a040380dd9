"""``belady``: the offline bound -- evict the block whose next use is farthest away.

Among the candidates, the victim is the block whose next use (the next request in
trace order whose prompt contains the block's hash) lies farthest in the future;
blocks never used again go first; among equals, the one LRU would evict first.
It needs the future, so it exists only where the trace is known: the replay reads
the trace once to build a ``TraceFuture`` (per block hash, the sorted indices of the
requests whose prompt holds it), then replays it, calling ``on_arrival(request,
index)`` before each request's lookup. ``on_arrival`` moves the next-use pointers of
that request's prompt hashes past it and re-keys the candidates holding them.

What it is optimal for, and what not (NOTE):
  Belady's MIN minimises misses for a cache of equal-size objects whose hits are
  independent. A prefix cache is not that:
  * a hit needs the whole chain before a block: a cached block whose parent was
    evicted is useless (stranded). In a hash chain every request holding a block also
    holds its parent, so a parent's next use is never later than its child's: this
    policy never evicts a parent before its child except on ties, and ties fall to
    LRU order, which evicts a request's deeper blocks first -- stranding is rare but
    possible (a block re-cached under a new parent-less run, duplicates);
  * hits are counted in tokens of a prefix, lookups stop at the first miss, at most
    ``num_tokens - 1`` tokens hit, and blocks held by running requests cannot be
    evicted -- so the order of next uses is not the order of value;
  * blocks produced by decoding are in the future index only if a later prompt holds
    them (their content hashes to a prompt block of a later request).
  It is therefore a strong offline reference, not a proven upper bound on hit tokens:
  an online policy may beat it. A documented case
  (``tests/sim/test_sim_replay_eviction.py::test_documented_case_where_online_policies_beat_belady``):
  a later prompt that is exactly a cached block "uses" it but cannot hit it (its last
  token is always computed), so belady keeps that block and evicts one that a later
  request would have hit. On the generated workloads and the Mooncake traces it beat
  or tied every online policy at every capacity measured (WORKSPACE_NOTES).
"""

from __future__ import annotations

import array
from typing import Iterable, Sequence

import numpy as np

from prefixcache.core.eviction.base import KeyedPolicy, PolicyError

NEVER = 1 << 62  # next use of a block no later request holds


class TraceFuture:
    """Next uses of block hashes in a trace: per hash, the sorted request indices whose
    prompt holds it (compact: one int32 array of all occurrences, CSR by hash).

    Build it with ``TraceFuture.from_hashes`` (the replay's first pass). The object
    holds the read pointers of one replay: a policy advances them (build one future per
    replay).

    Attributes:
        num_requests: requests in the trace.
        num_hashes: distinct block hashes.
        num_occurrences: (hash, request) pairs.
    """

    def __init__(self, slots: dict[bytes, int], occ: np.ndarray, starts: np.ndarray,
                 num_requests: int):
        self._slots = slots
        # NOTE: array.array indexes to a Python int at C speed (numpy scalars are slower).
        self.occ = array.array("i", occ.astype(np.int32).tobytes())
        self.ptr = array.array("i", starts[:-1].astype(np.int32).tobytes())
        self.end = array.array("i", starts[1:].astype(np.int32).tobytes())
        self.num_requests = num_requests
        self.num_hashes = len(slots)
        self.num_occurrences = len(self.occ)
        self.index = -1  # the last request index passed to ``advance``

    @classmethod
    def from_hashes(cls, hashes_per_request: Iterable[Sequence[bytes]]) -> "TraceFuture":
        """Index a trace given each request's prompt block hashes, in trace order.

        Memory: one dict entry per distinct hash plus 8 bytes per (hash, request) pair
        while building, 4 after (a Mooncake trace of 12k requests: ~290k pairs).
        """
        slots: dict[bytes, int] = {}
        slot_of = slots.setdefault
        s_col = array.array("i")
        r_col = array.array("i")
        n = 0
        for i, hashes in enumerate(hashes_per_request):
            n = i + 1
            for h in hashes:
                s = slot_of(h, len(slots))
                s_col.append(s)
                r_col.append(i)
        s_np = np.frombuffer(s_col, dtype=np.int32) if len(s_col) else np.zeros(0, np.int32)
        r_np = np.frombuffer(r_col, dtype=np.int32) if len(r_col) else np.zeros(0, np.int32)
        order = np.argsort(s_np, kind="stable")  # request order kept within a hash
        occ = r_np[order]
        counts = np.bincount(s_np, minlength=len(slots))
        starts = np.zeros(len(slots) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        return cls(slots, occ, starts, n)

    def slot(self, block_hash: bytes) -> int:
        """The hash's slot, or -1 when no prompt of the trace holds it."""
        return self._slots.get(block_hash, -1)

    def next_use(self, slot: int) -> int:
        """Index of the next request (after the last ``advance``) holding the slot's
        hash; ``NEVER`` if none."""
        if slot < 0:
            return NEVER
        p = self.ptr[slot]
        return self.occ[p] if p < self.end[slot] else NEVER

    def advance(self, hashes: Iterable[bytes], index: int) -> list[int]:
        """Request ``index`` arrives holding ``hashes``: move their pointers past it.

        Returns the slots whose next use changed. Indices must not go backwards.
        """
        if index < self.index:
            raise ValueError(
                f"belady: request index {index} arrives after index {self.index}; "
                "on_arrival must follow trace order"
            )
        if index >= self.num_requests:
            raise ValueError(
                f"belady: request index {index} is beyond the {self.num_requests} requests "
                "the future was built from"
            )
        self.index = index
        get = self._slots.get
        occ, ptr, end = self.occ, self.ptr, self.end
        moved = []
        for h in hashes:
            s = get(h)
            if s is None:
                continue
            p = ptr[s]
            e = end[s]
            if p < e and occ[p] <= index:
                p += 1
                while p < e and occ[p] <= index:
                    p += 1
                ptr[s] = p
                moved.append(s)
        return moved


class BeladyPolicy(KeyedPolicy):
    """Evict the candidate used again farthest in the future (never-used first;
    ties: LRU). See the module docstring.

    Args:
        num_blocks: blocks in the pool.
        future: the ``TraceFuture`` of the trace being replayed.
    """

    name = "belady"
    needs_future = True

    def __init__(self, num_blocks: int, *, future: TraceFuture | None = None):
        super().__init__(num_blocks)
        if future is None:
            raise ValueError(
                "belady needs the trace's future: run it through the replay "
                "(prefixcache.sim.replay.replay(..., eviction='belady')), which reads the "
                "trace once to index next uses, or pass eviction_options={'future': "
                "TraceFuture.from_hashes(...)}"
            )
        if not isinstance(future, TraceFuture):
            raise TypeError(f"belady: future must be a TraceFuture, got {type(future).__name__}")
        self.future = future
        self.slot = [-1] * num_blocks  # future slot of each cached block's hash
        self._holders: dict[int, list[int]] = {}  # slot -> ids of cached blocks under it
        self._block_objs: list = [None] * num_blocks  # block objects, as add() saw them

    def on_cached(self, block, block_hash, request, position) -> None:
        super().on_cached(block, block_hash, request, position)
        s = self.future.slot(block_hash)
        bid = block.block_id
        self.slot[bid] = s
        if s >= 0:
            held = self._holders.get(s)
            if held is None:
                self._holders[s] = [bid]
            else:
                held.append(bid)

    def on_evicted(self, block) -> None:
        bid = block.block_id
        s = self.slot[bid]
        if s >= 0:
            held = self._holders[s]
            held.remove(bid)
            if not held:
                del self._holders[s]
        self.slot[bid] = -1

    def on_arrival(self, request, index: int) -> None:
        moved = self.future.advance(request.block_hashes, index)
        holders = self._holders
        token = self._token
        blocks = self._block_objs
        for s in moved:
            held = holders.get(s)
            if held:
                for bid in held:
                    if token[bid]:
                        self.rekey(blocks[bid])

    def add(self, block) -> None:
        self._block_objs[block.block_id] = block
        super().add(block)

    def key(self, block) -> tuple[int, int]:
        bid = block.block_id
        return (-self.future.next_use(self.slot[bid]), self.released_at[bid])

    def clear(self) -> None:
        super().clear()
        self._holders = {}
        self.slot = [-1] * self.num_blocks

    def check_invariants(self, candidate_ids: Sequence[int]) -> None:
        super().check_invariants(candidate_ids)
        for s, held in self._holders.items():
            for bid in held:
                if self.slot[bid] != s:
                    raise PolicyError(f"belady: block {bid} listed under slot {s} but has {self.slot[bid]}")
