"""``s3fifo``: S3-FIFO (Yang et al., SOSP'23), over cached blocks.

Three FIFO queues: a small one ``S`` (10% of the cache) where newly cached blocks start,
a main one ``M``, and a ghost queue ``G`` of hashes evicted from ``S``. Each block
counts its hits since it was cached (``freq``, capped at 3). When the cache must evict:

* while ``S`` holds at least its share of the cache (or ``M`` has no candidate), take
  the oldest candidate of ``S``: hit at least ``move_threshold`` times -> it moves to
  ``M`` (a quick demotion of one-hit wonders is what S3-FIFO is about), else it is the
  victim and its hash enters ``G``;
* otherwise take the oldest candidate of ``M``: hit since it entered (``freq > 0``) ->
  ``freq -= 1`` and it goes to the back of ``M`` (lazy promotion, CLOCK-like), else it
  is the victim.

A hash re-cached while in ``G`` starts in ``M``. ``G`` keeps at most ``num_blocks``
hashes (the paper sizes it as ``M``), oldest dropped first.

Mapping onto the index/policy protocol (``base.py``): queue sizes count every cached
block (in use or not); only candidates (cached, ``ref_cnt == 0``) can be examined, in
the order they entered their queue (FIFO: a hit does not move a block). Each examined
block moves at most once to ``M`` and is reinserted at most 3 times, so one ``pop`` is
O(candidates) at worst and O(1) amortised.

NOTE: not a keyed policy: a block's place in ``M`` changes while it waits.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from prefixcache.core.eviction.base import EvictionPolicy, PolicyError

_S, _M = 1, 2
MAX_FREQ = 3  # the paper's 2-bit counter
SMALL_FRACTION = 0.1  # the paper's default size of S


class _FifoCandidates:
    """Candidates of one queue, oldest entry first (lazy-deletion heap on entry stamps)."""

    def __init__(self):
        self.heap: list[tuple[int, int]] = []  # (entry stamp, block id)
        self.live: dict[int, int] = {}  # block id -> its live entry stamp

    def push(self, bid: int, stamp: int) -> None:
        self.live[bid] = stamp
        heapq.heappush(self.heap, (stamp, bid))

    def remove(self, bid: int) -> None:
        del self.live[bid]
        if len(self.heap) > 2 * len(self.live) + 64:
            live = self.live
            self.heap = [e for e in self.heap if live.get(e[1]) == e[0]]
            heapq.heapify(self.heap)

    def pop_oldest(self) -> int:
        heap, live = self.heap, self.live
        while heap:
            stamp, bid = heapq.heappop(heap)
            if live.get(bid) == stamp:
                del live[bid]
                return bid
        raise PolicyError("s3fifo: no candidate in this queue")

    def ordered(self) -> list[int]:
        return [bid for _, bid in sorted((s, b) for b, s in self.live.items())]

    def __len__(self) -> int:
        return len(self.live)


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (see the module docstring).

    Args:
        num_blocks: blocks in the pool.
        small_fraction: the share of the cache that ``S`` may hold, in (0, 1).
        move_threshold: hits since caching for a block leaving ``S`` to enter ``M``
            (>= 1).
    """

    name = "s3fifo"

    def __init__(self, num_blocks: int, *, small_fraction: float = SMALL_FRACTION,
                 move_threshold: int = 1):
        super().__init__(num_blocks)
        if (isinstance(small_fraction, bool) or not isinstance(small_fraction, (int, float))
                or not 0.0 < small_fraction < 1.0):
            raise ValueError(f"s3fifo: small_fraction must be in (0, 1), got {small_fraction!r}")
        if (isinstance(move_threshold, bool) or not isinstance(move_threshold, int)
                or move_threshold < 1):
            raise ValueError(f"s3fifo: move_threshold must be an int >= 1, got {move_threshold!r}")
        self.small_fraction = float(small_fraction)
        self.move_threshold = move_threshold
        self.small_size = max(1, int(num_blocks * small_fraction))
        self.clock = 0
        self._queue = [0] * num_blocks  # 0: not cached; _S / _M
        self._freq = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._blocks: list = [None] * num_blocks
        self._stamp = [0] * num_blocks  # when the block entered its queue
        self._count = {_S: 0, _M: 0}
        self._cand = {_S: _FifoCandidates(), _M: _FifoCandidates()}
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self.num_moved_to_main = 0
        self.num_reinserted = 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    # -- notifications -----------------------------------------------------------
    def on_cached(self, block, block_hash, request, position) -> None:
        bid = block.block_id
        if block_hash in self._ghost:
            del self._ghost[block_hash]
            q = _M
        else:
            q = _S
        self._queue[bid] = q
        self._count[q] += 1
        self._freq[bid] = 0
        self._hash[bid] = block_hash
        self._blocks[bid] = block
        self._stamp[bid] = self._tick()

    def on_hit(self, block, request) -> None:
        bid = block.block_id
        if self._freq[bid] < MAX_FREQ:
            self._freq[bid] += 1

    def on_evicted(self, block) -> None:
        bid = block.block_id
        q = self._queue[bid]
        if not q:
            return
        if q == _S:
            ghost = self._ghost
            h = self._hash[bid]
            ghost.pop(h, None)
            ghost[h] = None
            while len(ghost) > self.num_blocks:
                ghost.popitem(last=False)
        self._count[q] -= 1
        self._queue[bid] = 0
        self._freq[bid] = 0
        self._hash[bid] = None
        self._blocks[bid] = None

    # -- candidates --------------------------------------------------------------
    def add(self, block) -> None:
        bid = block.block_id
        q = self._queue[bid]
        if not q:
            raise PolicyError(f"s3fifo: block {bid} is a candidate but was never cached")
        if bid in self._cand[_S].live or bid in self._cand[_M].live:
            raise PolicyError(f"s3fifo: block {bid} is already a candidate")
        self._cand[q].push(bid, self._stamp[bid])

    def discard(self, block) -> None:
        bid = block.block_id
        for q in (_S, _M):
            if bid in self._cand[q].live:
                self._cand[q].remove(bid)
                return
        raise PolicyError(f"s3fifo: block {bid} is not a candidate")

    def _move(self, bid: int, q: int) -> None:
        """Re-enter queue ``q`` at its back (the block stays a candidate)."""
        self._count[self._queue[bid]] -= 1
        self._queue[bid] = q
        self._count[q] += 1
        self._stamp[bid] = self._tick()
        self._cand[q].push(bid, self._stamp[bid])

    def pop(self):
        cand_s, cand_m = self._cand[_S], self._cand[_M]
        if not (len(cand_s) or len(cand_m)):
            raise PolicyError("s3fifo: pop() with no candidates")
        while True:
            if len(cand_s) and (self._count[_S] >= self.small_size or not len(cand_m)):
                bid = cand_s.pop_oldest()
                if self._freq[bid] >= self.move_threshold:
                    self.num_moved_to_main += 1
                    self._move(bid, _M)
                    continue
                return self._blocks[bid]
            bid = cand_m.pop_oldest()
            if self._freq[bid] > 0:
                self._freq[bid] -= 1
                self.num_reinserted += 1
                self._move(bid, _M)
                continue
            return self._blocks[bid]

    def __len__(self) -> int:
        return len(self._cand[_S]) + len(self._cand[_M])

    def clear(self) -> None:
        n = self.num_blocks
        self._queue = [0] * n
        self._freq = [0] * n
        self._hash = [None] * n
        self._blocks = [None] * n
        self._stamp = [0] * n
        self._count = {_S: 0, _M: 0}
        self._cand = {_S: _FifoCandidates(), _M: _FifoCandidates()}
        self._ghost.clear()

    def candidate_ids(self) -> list[int]:
        """The victims in the order ``pop`` would give them (a dry run on copies)."""
        dry = object.__new__(S3FIFOPolicy)
        dry.small_size, dry.move_threshold = self.small_size, self.move_threshold
        dry.clock, dry.num_moved_to_main, dry.num_reinserted = self.clock, 0, 0
        dry._queue, dry._freq = list(self._queue), list(self._freq)
        dry._stamp, dry._blocks = list(self._stamp), list(range(self.num_blocks))
        dry._count = dict(self._count)
        dry._cand = {}
        for q, c in self._cand.items():
            copy = _FifoCandidates()
            copy.heap, copy.live = list(c.heap), dict(c.live)
            dry._cand[q] = copy
        order = []
        while len(dry):
            bid = dry.pop()
            dry._count[dry._queue[bid]] -= 1  # what on_evicted does to the order
            dry._queue[bid] = 0
            order.append(bid)
        return order

    def check_invariants(self, candidate_ids) -> None:
        super().check_invariants(candidate_ids)
        for q in (_S, _M):
            n = sum(1 for x in self._queue if x == q)
            if n != self._count[q]:
                raise PolicyError(f"s3fifo: queue {q} counts {self._count[q]}, {n} marked")
            for bid, stamp in self._cand[q].live.items():
                if self._queue[bid] != q or self._stamp[bid] != stamp:
                    raise PolicyError(f"s3fifo: candidate {bid} out of step with its queue")
        if len(self._ghost) > self.num_blocks:
            raise PolicyError(f"s3fifo: ghost queue holds {len(self._ghost)} > "
                              f"{self.num_blocks} hashes")
        if any(f < 0 or f > MAX_FREQ for f in self._freq):
            raise PolicyError("s3fifo: a frequency outside [0, 3]")
