"""``hinted``: honours the clients' retention hints (``Request(..., retention=
RetentionHints(...))``); LRU where there are none.

Agent frameworks know what a cache cannot: the next call of a tool loop comes in
seconds (keep its context), a sub-agent just finished (its private blocks are dead),
the system prompt and tools outlive any one session. Dynamo ships such agent hints
(retention priority, a TTL, a token range to keep); this policy ranks the candidates
by them:

1. **dead** blocks first: released by a request with ``session_end=True`` and not
   covered by its ``keep_range`` (the session is over; nothing will ask for them);
2. then blocks **without a hint in force** (no hint, or its TTL ran out), least
   recently released first -- vLLM's free-queue order;
3. last, blocks **with a hint in force**: the lowest ``priority`` first, then LRU.

A hint is in force on a block from a request's use of it (cached, hit, released) until
the hint's TTL in the policy's clock (``ttl_s`` when ``unit="s"``, ``ttl_steps`` when
``unit="steps"``; the other TTL is ignored) has passed since that use, for ever when
the hint has no TTL in that unit; it covers the block when ``keep_range`` is ``None``
or holds all of the block's tokens (positions ``[p * block_size, (p + 1) *
block_size)`` of a block at depth ``p``). Several requests' hints on one block merge:
the larger priority and the later expiry. A later use revives a dead block. Hints never
pin a block: a protected block is still evicted when nothing else is left.

Without any hint, every candidate is in the second class and the order is exactly ``lru``'s
(a test replays both and compares the records byte for byte). The host tier and the
tiers below it hand their policy the priority and the hints of the request that cached
the block on the device (``core/tiers/base.py``'s ``_Origin``): there a hint's TTL
counts from the block's arrival in the tier.

Options: ``unit``: the clock a hint's TTL is read in -- ``"steps"`` (the default, as
``ttl_lru``'s: the clock every driver has; a hint's ``ttl_steps``) or ``"s"`` (the
driver's seconds: a trace's timestamps, the DES's simulated time, the engine's clock; a
hint's ``ttl_s``).
"""

from __future__ import annotations

import math

from prefixcache.core.eviction.base import TimedPolicy

_DEAD, _PLAIN, _KEPT = 0, 1, 2


class HintedPolicy(TimedPolicy):
    """Dead blocks first, then unhinted / expired ones (LRU), then the hinted ones by
    priority (LRU among equals).

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block (the index's; for ``keep_range``).
        unit: ``"steps"`` or ``"s"``: the clock a hint's TTL is read in.
    """

    name = "hinted"
    needs_block_size = True

    def __init__(self, num_blocks: int, *, block_size: int, unit: str = "steps"):
        super().__init__(num_blocks, unit=unit)
        self.block_size = int(block_size)
        self.position = [0] * num_blocks
        self.dead = [False] * num_blocks
        self.hint_priority = [0] * num_blocks
        self.hint_until = [-math.inf] * num_blocks  # in force while now <= until
        # The last request's hint as read at ``now`` (a request's blocks are told in
        # runs: one request, one clock reading; a request's hints are fixed for its
        # life): (request, now, hint, priority, until, first covered depth, last
        # covered depth, session_end).
        self._read = (None, None, None, 0, 0.0, 0, -1, False)

    def _read_hint(self, request) -> tuple:
        """``request``'s hint read at ``self.now``: its priority, the expiry of a use
        now, the depths ``[lo, hi]`` of the blocks ``keep_range`` covers (block ``p``
        holds positions ``[p * block_size, (p + 1) * block_size)``), ``session_end``."""
        now = self.now
        hint = getattr(request, "retention", None) if request is not None else None
        if hint is None:
            self._read = (request, now, None, 0, 0.0, 0, -1, False)
            return self._read
        ttl = hint.ttl_s if self.unit == "s" else hint.ttl_steps
        kr = hint.keep_range
        bs = self.block_size
        if kr is None:
            lo, hi = 0, math.inf
        else:
            lo, hi = -(-kr[0] // bs), kr[1] // bs - 1
        self._read = (request, now, hint, hint.priority,
                      math.inf if ttl is None else now + ttl, lo, hi, hint.session_end)
        return self._read

    def _use(self, bid: int, request, release: bool) -> None:
        read = self._read
        if read[0] is not request or read[1] != self.now:
            read = self._read_hint(request)
        _, now, hint, prio, until, lo, hi, session_end = read
        if hint is None:
            return
        if lo <= self.position[bid] <= hi:  # the hint covers the block
            if self.hint_until[bid] >= now:  # a hint in force: merge
                if prio > self.hint_priority[bid]:
                    self.hint_priority[bid] = prio
                if until > self.hint_until[bid]:
                    self.hint_until[bid] = until
            else:
                self.hint_priority[bid] = prio
                self.hint_until[bid] = until
            self.dead[bid] = False
        elif release and session_end:
            self.dead[bid] = True

    def on_cached(self, block, block_hash, request, position) -> None:
        super().on_cached(block, block_hash, request, position)
        bid = block.block_id
        self.position[bid] = position
        self.dead[bid] = False
        self.hint_until[bid] = -math.inf
        self._use(bid, request, False)

    def on_hit(self, block, request) -> None:
        bid = block.block_id
        self.dead[bid] = False
        self._use(bid, request, False)

    def on_release(self, block, request, position) -> None:
        super().on_release(block, request, position)
        self._use(block.block_id, request, True)

    def priority(self, block, now: float):
        bid = block.block_id
        if self.dead[bid]:
            return (_DEAD, 0, self.released_at[bid]), math.inf
        until = self.hint_until[bid]
        if now <= until:
            return (_KEPT, self.hint_priority[bid], self.released_at[bid]), until
        return (_PLAIN, 0, self.released_at[bid]), math.inf
