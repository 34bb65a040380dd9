"""The waiting-queue seam: in which order a scheduler admits waiting requests.

The engine's ``Scheduler`` and the simulator's ``Server`` (``prefixcache.sim.des``)
share this code. Each step, after the running requests got their tokens, the
scheduler asks its policy to ``order`` the waiting queue (given in FCFS order, i.e.
arrival order with preempted requests back in front) and admits requests in that
order until the first one that does not fit, the token budget or ``max_num_seqs``
stops it; then it reports which requests it admitted (``after_admission``).

Starvation bound: a waiting request is *passed over* in a step when it was not
admitted but a request that arrived after it was. A request passed over
``starvation_bound`` times goes to the front (FCFS among such requests) until it is
admitted, so no request waits behind later ones more than ``starvation_bound`` steps.

In-batch prefix sharing comes from the cache itself: the manager caches every full
block at allocation time (vLLM's design), so when several waiting requests share a
prefix nobody holds yet, the first one admitted allocates and caches its blocks and
the others, looked up after it in the same step or the next, hit them instead of
computing them again (a test pins it under every policy). SGLang's radix cache only
inserts after the prefill, so it must deprioritise the others explicitly
(``IN_BATCH_PREFIX_CACHING``); here that would change nothing.

Policies are host code (no jax) and never change the manager: they look prefixes up
with ``manager.peek_computed_tokens`` (no stats, no state).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence


class WaitingPolicy:
    """Base class: orders the waiting queue; FCFS when ``prioritize`` is not overridden.

    Args:
      starvation_bound: steps a request may be passed over before it goes first (>= 1).
      max_reorder: a queue longer than this is served FCFS (the lookups cost grows
        with the queue; SGLang's bound for ``lpm`` is 128).

    Attributes:
      name: the registry name.
      passed_over: request object -> times passed over (only requests waiting now).
    """

    name = "base"

    def __init__(self, *, starvation_bound: int = 32, max_reorder: int = 128):
        for n, v in (("starvation_bound", starvation_bound), ("max_reorder", max_reorder)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"scheduling policy {self.name!r}: {n} must be an int >= 1, "
                                 f"got {v!r}")
        self.starvation_bound = starvation_bound
        self.max_reorder = max_reorder
        self.passed_over: dict[Any, int] = {}

    @property
    def is_fcfs(self) -> bool:
        """Whether this policy always keeps the FCFS order (the scheduler's fast path)."""
        return False

    def prioritize(self, items: list, request_of: Callable[[Any], Any], manager) -> list:
        """``items`` (FCFS order) in admission order; the policy's own rule."""
        return items

    def order(self, waiting: Sequence, request_of: Callable[[Any], Any], manager) -> list:
        """The waiting queue in admission order.

        Args:
          waiting: the queue, FCFS (index 0 = first come).
          request_of: item -> its core ``Request``.
          manager: the ``KVCacheManager`` (read with ``peek_computed_tokens``).
        """
        items = list(waiting)
        if len(items) <= 1 or len(items) > self.max_reorder:
            return items
        bound = self.starvation_bound
        passed = self.passed_over
        starved = [x for x in items if passed.get(request_of(x), 0) >= bound]
        if starved:
            rest = [x for x in items if passed.get(request_of(x), 0) < bound]
            return starved + self.prioritize(rest, request_of, manager)
        return self.prioritize(items, request_of, manager)

    def after_admission(self, waiting_fcfs: Sequence, admitted: Sequence,
                        request_of: Callable[[Any], Any]) -> None:
        """Counts pass-overs: ``waiting_fcfs`` was the queue before admission (FCFS),
        ``admitted`` the items admitted from it this step."""
        passed = self.passed_over
        adm = {id(x) for x in admitted}
        for x in admitted:
            passed.pop(request_of(x), None)
        if not adm:
            return
        # The last admitted position in FCFS order: everything before it that was not
        # admitted was passed over.
        last = max(i for i, x in enumerate(waiting_fcfs) if id(x) in adm)
        for x in waiting_fcfs[:last]:
            if id(x) not in adm:
                r = request_of(x)
                passed[r] = passed.get(r, 0) + 1

    def forget(self, request) -> None:
        """``request`` left the queue for good (finished or aborted while waiting)."""
        self.passed_over.pop(request, None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(starvation_bound={self.starvation_bound})"
