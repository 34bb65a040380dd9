"""Prefix-cache statistics (vLLM's ``PrefixCacheStats``) and cumulative counters.

``PrefixCacheStats`` is the per-interval record vLLM's ``make_prefix_cache_stats()``
returns and resets: admitted requests (``requests``; one record per admission, at the
allocation that gives a request its first blocks, as vLLM 0.33's scheduler records),
their tokens (``queries``) and prefix-hit tokens (``hits``), with previously preempted
requests counted apart. All counts are in
tokens except ``requests``; the token hit rate is ``hits / queries``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache hit statistics since the last ``make_prefix_cache_stats()``.

    Attributes:
        reset: whether ``reset_prefix_cache()`` succeeded in this interval.
        requests: admissions of requests that were never preempted.
        queries: tokens those requests had at admission (``request.num_tokens``).
        hits: their prefix-hit tokens (adopted cached blocks x block size).
        preempted_requests / preempted_queries / preempted_hits: the same for
            requests with ``num_preemptions > 0`` (recomputation after preemption).
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Add one admission of ``num_tokens`` tokens that hit ``num_hits``."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """Token hit rate of the non-preempted admissions (0.0 when there were none)."""
        return self.hits / self.queries if self.queries else 0.0
