"""``ttl_lru``: a block idle longer than ``ttl`` is evicted before any younger one; LRU
among each class.

A block's idle time is the driver's clock minus the last time a request used it: cached
it, or adopted it in a prefix hit (SGLang's ``last_access_time``, set at insert and at
match; hosted prompt caches refresh their TTL on each hit the same way). Releasing the
block does not refresh it: a block held by a long request ages while it is held. Once
``now > last use + ttl`` the block is *expired*: every expired candidate goes before every
fresh one; within each class, the least recently released first (vLLM's free-queue
order, the ``lru`` policy's key).

With the driver's requests freed in the order they were admitted (the replay's window)
the last use follows the release order, so the expired blocks are the least recently
released ones and ``ttl_lru`` evicts exactly as ``lru`` does; it differs where requests
finish out of order (the DES, the engine: a long generation's prompt blocks expire while
it runs and go first once it finishes).

Options: ``ttl`` (a number > 0; default 1000) and ``unit``: ``"steps"`` (the default:
the driver's step counter -- the replay's request index, the DES's and the engine's
scheduler steps) or ``"s"`` (the driver's seconds: a replayed trace's timestamps, the
DES's simulated time, the engine's wall clock). See ``TimedPolicy`` for how the time reaches the pool.
"""

from __future__ import annotations

import math
import numbers

from prefixcache.core.eviction.base import TimedPolicy

# NOTE: the defaults count steps, the clock every driver has (a trace without timestamps
# has no seconds): 1000 requests in the replay, 1000 scheduler steps in the DES and the
# engine. A study of a TTL in seconds names both (``{"ttl": 300, "unit": "s"}``: hosted
# prompt caches' five minutes).
DEFAULT_TTL = 1000
DEFAULT_UNIT = "steps"


class TTLLRUPolicy(TimedPolicy):
    """Expired blocks (idle longer than ``ttl``) first, LRU among each class.

    Args:
        num_blocks: blocks in the pool.
        ttl: the idle time after which a block expires (a finite number > 0, in
            ``unit``).
        unit: ``"steps"`` or ``"s"`` (``base.TIME_UNITS``).
    """

    name = "ttl_lru"

    def __init__(self, num_blocks: int, *, ttl: float = DEFAULT_TTL,
                 unit: str = DEFAULT_UNIT):
        if (isinstance(ttl, bool) or not isinstance(ttl, numbers.Real)
                or not math.isfinite(ttl) or ttl <= 0):
            raise ValueError(f"ttl_lru: ttl must be a finite number > 0, got {ttl!r}")
        super().__init__(num_blocks, unit=unit)
        self.ttl = float(ttl)
        self.last_use = [0.0] * num_blocks  # the clock at the block's last cache / hit

    def on_cached(self, block, block_hash, request, position) -> None:
        super().on_cached(block, block_hash, request, position)
        self.last_use[block.block_id] = self.now

    def on_hit(self, block, request) -> None:
        self.last_use[block.block_id] = self.now

    def priority(self, block, now: float) -> tuple[tuple[int, int], float]:
        bid = block.block_id
        expires = self.last_use[bid] + self.ttl
        if now > expires:  # expired: stays so until a request uses it again
            return (0, self.released_at[bid]), math.inf
        return (1, self.released_at[bid]), expires
