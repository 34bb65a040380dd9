"""Discrete-event simulation of a prefix-caching server: simulated TTFT at scale.

The real ``KVCacheManager`` decides hits, allocation, eviction and preemption;
a roofline ``CostModel`` says how long each batched step takes on a named
accelerator; arrival times come from the trace (``timestamp``) or a Poisson
process. Result: per-request queueing delay, time to first token (TTFT) and
end-to-end latency, so latency by cached-prefix length can be studied for
models and chips no machine here can run.

Scheduling policy (the one ``prefixcache.engine.Scheduler`` and vLLM's v1
scheduler use; FCFS, chunked prefill, a per-step token budget):

1. Running requests first, in admission order: each gets
   ``min(num_tokens - num_computed_tokens, budget)`` tokens (a prefill chunk, or
   one decode token). If ``allocate_slots`` returns None, the newest running
   request is preempted by recompute (blocks freed, ``num_computed_tokens = 0``,
   put at the front of the waiting queue) and the allocation retried, until it
   fits or the request preempted itself.
2. If nothing was preempted this step: waiting requests in the scheduling
   policy's order (``prefixcache.scheduling``; FCFS by default) while
   the budget and ``max_num_seqs`` allow: ``get_computed_blocks`` then
   ``allocate_slots(req, n, hit, blocks)``; the first that does not fit stops
   admission for the step.
3. The step takes ``cost_model.step_time(chunks)``; every request whose
   computed tokens reach its token count samples a token at the step's end
   (the first one defines TTFT); a request with ``output_len`` tokens finishes
   and frees its blocks.

The decode tokens are ``output_token(id, k)``, as in the replay, so multi-turn
workloads hit their earlier turns' outputs here too.

Host memory tier (``num_host_blocks > 0``; the manager's host-tier contract): the
manager demotes the cached blocks the device pool evicts into a host pool and
promotes host hits back when ``allocate_slots`` admits a request. The blocks a
step promotes are copied host -> device before it computes: the step takes
``cost_model.step_time(chunks) + cost_model.load_time(loaded * block_bytes)``
(one batched transfer per step; latency + bytes over the chips' effective host
link bandwidth, ``cost_model.HostLink``). NOTE: by default loads overlap nothing
(the step waits for them): simulated TTFT with the tier is then a pessimistic
bound. ``host_load_overlap=True`` gives the optimistic one: the step takes
``max(compute, load)``, as if the copies were hidden behind the step's compute
layer by layer (SGLang HiCache's load-back overlaps per layer).
Demotions (device -> host stores) are not charged: they are off the critical
path (written back asynchronously after the step). Summaries split hits into
``device_hit_tokens`` and ``host_hit_tokens``; with the tier off the manager,
the records and the summaries are exactly those of a simulator without one.

Waiting queue: with a policy that reads it (``queue_aware`` as the device's or the
host tier's policy: ``eviction.reads_waiting_queue``), the manager hears of each request
joining the queue (``on_waiting`` with the prompt blocks a lookup can adopt: at arrival
and at a preemption, as the engine's scheduler reports it) and of one that leaves it
unadmitted (``drop_waiting``, a failure); admission drops it in the manager. Every other
policy: no queue work.

A time-varying eviction policy (``needs_time``: ``ttl_lru``) is told the simulated time
(seconds) and the steps run so far before each step schedules; other policies: no clock.

Not modelled: network/tokenizer time, speculative decoding, KV transfer
between prefill and decode instances, communication between chips.

Host only: never imports jax.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from prefixcache._validate import ArgumentTypeError, check_count
from prefixcache.core.cache_config import UNSET, CacheConfig, resolve
from prefixcache.core.eviction import policy_clock, policy_name, reads_waiting_queue
from prefixcache.core.kv_cache_manager import KVCacheManager
from prefixcache.core.request import LoRARequest, MultiModalFeature, Request
from prefixcache.core.tiers import TierTransfer
from prefixcache.cost_model import CostModel
from prefixcache.scheduling import WaitingPolicy, make_scheduling_policy
from prefixcache.sim.trace import TraceRequest, output_token


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits of the simulated server.

    Attributes:
      max_num_batched_tokens: token budget of one step (vLLM's
        ``max_num_batched_tokens``).
      max_num_seqs: most requests running at once.
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256

    def __post_init__(self):
        for f in ("max_num_batched_tokens", "max_num_seqs"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SchedulerConfig.{f} must be a positive int, got {v!r}")


def to_core_request(tr: TraceRequest) -> Request:
    """The core ``Request`` for a trace entry (prompt, mm items, adapter, salt)."""
    mm = tuple(MultiModalFeature(str(i), int(o), int(n))
               for i, o, n in sorted(tr.mm or (), key=lambda m: m[1]))
    lora = None if tr.lora is None else LoRARequest(*tr.lora)
    return Request(tr.id, tr.prompt, mm_features=mm, lora=lora, cache_salt=tr.cache_salt,
                   priority=tr.priority, retention=tr.retention)


@dataclasses.dataclass(eq=False)
class _SimRequest:
    """Simulator-side state of one request."""

    trace: TraceRequest
    req: Request
    arrival_s: float
    max_output: int
    first_scheduled_s: float | None = None
    ttft_s: float | None = None
    num_cached_tokens: int | None = None  # hit at first admission
    num_host_tokens: int | None = None  # of which loaded from the host tier
    num_preemptions: int = 0
    finished: bool = False
    queued_blocks: int = 0  # blocks it needed when it was last queued
    miss_reasons: dict | None = None  # summed over its admissions (miss accounting)


def check_arrival_rate(arrival_rate) -> float | None:
    """None, or ``arrival_rate`` as a finite float > 0 (req/s).

    Raises:
      TypeError: not a real number (a str, a bool, ...).
      ValueError: not finite or not > 0.
    """
    if arrival_rate is None:
        return None
    if isinstance(arrival_rate, (bool, np.bool_)) or not isinstance(
            arrival_rate, (int, float, np.integer, np.floating)):
        raise TypeError(f"arrival_rate must be a number (req/s) or None, got "
                        f"{type(arrival_rate).__name__} {arrival_rate!r}")
    if not (math.isfinite(arrival_rate) and arrival_rate > 0):
        raise ValueError(f"arrival_rate must be a finite number > 0 (req/s), got "
                         f"{arrival_rate!r}")
    return float(arrival_rate)


def _arrivals(requests: Iterable[TraceRequest], arrival_rate: float | None,
              seed: int) -> Iterator[tuple[float, TraceRequest]]:
    """(arrival time in s, request) in order; validates timestamps are sorted."""
    if arrival_rate is not None:
        arrival_rate = check_arrival_rate(arrival_rate)
        rng = np.random.default_rng([int(seed), 7])
        t = 0.0
        for tr in requests:
            t += float(rng.exponential(1.0 / arrival_rate))
            yield t, tr
        return
    last = -math.inf
    for i, tr in enumerate(requests):
        if tr.timestamp is None:
            raise ValueError(
                f"request {i} ({tr.id!r}) has no timestamp; pass arrival_rate for Poisson arrivals")
        t = float(tr.timestamp)
        if t < last:
            raise ValueError(f"request {i} ({tr.id!r}) arrives at {t} s, before the previous one "
                             f"({last} s): trace timestamps must be non-decreasing")
        last = t
        yield t, tr


def warm_up(manager: KVCacheManager, requests: Iterable[TraceRequest]) -> int:
    """Fills the prefix cache by prefilling each prompt alone, then freeing it.

    Requests that do not fit are skipped.

    Returns:
      The number of prompts that were prefilled.
    """
    done = 0
    for tr in requests:
        req = to_core_request(tr)
        blocks, hit = manager.get_computed_blocks(req)
        if manager.allocate_slots(req, req.num_tokens - hit, hit, blocks) is None:
            continue
        req.num_computed_tokens = req.num_tokens
        manager.free(req)
        done += 1
    return done


class Server:
    """One simulated server (a replica): its ``KVCacheManager``, queues and clock.

    ``simulate`` drives one; ``prefixcache.sim.cluster`` drives several behind a
    router. The scheduling policy is the module docstring's.

    Args:
      manager: the server's prefix cache.
      cost_model: step times.
      scheduler: batching limits.
      on_finish: called with ``(sim_request, record)`` when a request finishes.
      on_fail: called with ``(sim_request, record)`` when a request fails.
      scheduling: the waiting queue's admission order (``prefixcache.scheduling``
        name or policy; default FCFS).
      host_load_overlap: with a host tier, hide a step's loads behind its compute
        (``max``) instead of adding them (the default; see the module docstring).

    Attributes:
      now: the server's clock (s): when its next step may start.
      waiting / running: queued and admitted requests.
      counts: ``steps``, ``preemptions``, ``hit_tokens``, ``prefill_tokens``
        (prompt tokens computed, i.e. not hit), ``finished``, ``failed``; with a
        host tier also ``device_hit_tokens``, ``host_hit_tokens`` (of the hits at
        first admission), ``host_blocks_loaded``, ``host_load_steps`` (steps that
        loaded any) and ``host_load_s`` (seconds the steps took beyond their compute
        because of loads).
      host_block_bytes: KV bytes of one block when the manager has a host tier
        (the cost model then needs a ``host_link``), else ``None``.
      queued_blocks: blocks the waiting requests still need, counted when each was
        queued (a router's load signal, kept in O(1) per queue change).
    """

    def __init__(self, manager: KVCacheManager, cost_model: CostModel,
                 scheduler: SchedulerConfig, *,
                 on_finish: Callable[[_SimRequest, dict[str, Any]], None],
                 on_fail: Callable[[_SimRequest, dict[str, Any]], None],
                 scheduling: "str | WaitingPolicy" = "fcfs",
                 host_load_overlap: bool = False):
        self.host_load_overlap = bool(host_load_overlap)
        self.policy = (scheduling if isinstance(scheduling, WaitingPolicy)
                       else make_scheduling_policy(scheduling))
        self.manager = manager
        self.cost_model = cost_model
        self.scheduler = scheduler
        self.on_finish = on_finish
        self.on_fail = on_fail
        self.now = 0.0
        self.waiting: collections.deque[_SimRequest] = collections.deque()
        self.running: list[_SimRequest] = []
        self.counts = collections.Counter()
        self.queued_blocks = 0  # blocks the queued requests still need (at enqueue time)
        self.host_block_bytes: int | None = None
        # Miss accounting (``prefixcache.core.misses``; None: off, no cost) and, when it
        # follows events, the manager's ``take_events``.
        self.miss_accountant = None
        self.miss_events = None
        # Block residency (``prefixcache.core.residency.ManagerResidency``; None: off).
        self.residency = None
        # An eviction policy that reads the waiting queue (queue_aware, the device's or
        # the host tier's): the manager hears of each request joining the queue (arrival,
        # preemption: ``on_waiting``) and of one leaving it unadmitted (a failure:
        # ``drop_waiting``); admission drops it in the manager. None: no queue work.
        self._queue_watch = manager if reads_waiting_queue(manager) else None
        # A time-varying eviction policy (ttl_lru): told the simulated time and the
        # steps so far before each step schedules. None: no clock.
        self._set_time = policy_clock(manager)
        self.tier_links = None  # the tiers below the host: name -> TierLink
        if host_tier_on(manager):
            cost_model.load_time(0)  # no host_link -> ValueError before anything runs
            self.host_block_bytes = cost_model.block_bytes(manager.block_size)
            chain = getattr(manager, "tier_chain", None)
            if chain is not None:
                self.tier_links = {t.name: t.link for t in chain.tiers}
            manager.take_host_transfers()  # copies before this server (a warm-up) are done

    def _enqueue(self, s: _SimRequest, *, front: bool = False) -> None:
        r = s.req
        s.queued_blocks = -(-(r.num_tokens - r.num_computed_tokens) // self.manager.block_size)
        self.queued_blocks += s.queued_blocks
        if front:
            self.waiting.appendleft(s)
        else:
            self.waiting.append(s)
        m = self._queue_watch
        if m is not None:  # the blocks a lookup can adopt (at most num_tokens - 1 tokens)
            r.bind_hasher(m.hasher, m.block_size)
            m.on_waiting(r.request_id, r.block_hashes[: (r.num_tokens - 1) // m.block_size])

    def _dequeue(self, s: _SimRequest) -> None:
        self.waiting.remove(s)
        self.queued_blocks -= s.queued_blocks

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_outstanding(self) -> int:
        """Requests queued or running."""
        return len(self.running) + len(self.waiting)

    def fail(self, s: _SimRequest, reason: str) -> None:
        self.counts["failed"] += 1
        self.on_fail(s, {"id": s.trace.id, "arrival_s": s.arrival_s,
                         "prompt_tokens": s.req.num_prompt_tokens, "failed": reason})

    def arrive(self, s: _SimRequest) -> None:
        """Queue an arrived request (or fail it at once if the pool cannot hold it)."""
        m = self.manager
        needed = -(-(s.req.num_prompt_tokens + s.max_output - 1) // m.block_size)
        if needed > m.num_blocks:
            self.fail(s, f"needs {needed} blocks > num_blocks={m.num_blocks}")
        else:
            self._enqueue(s)

    def _admit(self, s: _SimRequest, budget: int, scheduled: list) -> int | None:
        """Tries to admit the waiting ``s``; the budget left, or ``None`` if it does not
        fit now (admission stops for the step). One that can never fit fails."""
        manager = self.manager
        req = s.req
        acct = self.miss_accountant
        if acct is not None and self.miss_events is not None:
            acct.observe(self.miss_events())  # the cache as this lookup sees it
        blocks, hit = manager.get_computed_blocks(req)
        if acct is not None:  # (before the allocation changes the cache)
            reasons = acct.lookup(req, hit)
        n = min(req.num_tokens - hit, budget)
        host = self.host_block_bytes is not None
        if host:
            loaded0 = manager.host_blocks_loaded
            lower0 = self._lower_hits()
        res = self.residency
        if res is not None:
            host_before = res.host_hit_tokens()
        if manager.allocate_slots(req, n, hit, blocks) is None:
            if not self.running:  # the whole pool is free and it still does not fit
                self._dequeue(s)
                self.policy.forget(req)
                if self._queue_watch is not None:
                    self._queue_watch.drop_waiting(req.request_id)
                self.fail(s, "does not fit in the pool")
                return budget
            return None
        self._dequeue(s)
        if res is not None:
            res.admitted(req, hit, self.now, host_before, blocks)
        req.num_computed_tokens = hit
        if acct is not None:
            acct.admit(req, hit, reasons)
            mr = s.miss_reasons
            if mr is None:
                mr = s.miss_reasons = {}
            for r, v in reasons.items():
                mr[r] = mr.get(r, 0) + v
        if s.first_scheduled_s is None:
            s.first_scheduled_s = self.now
            s.num_cached_tokens = hit
            self.counts["hit_tokens"] += hit
            if host:
                # Promoted host hits are whole blocks of the hit prefix.
                h = (manager.host_blocks_loaded - loaded0) * manager.block_size
                s.num_host_tokens = h
                self.counts["host_hit_tokens"] += h
                lower = 0
                if lower0 is not None:  # hits loaded from the tiers below the host
                    for name, v in self._lower_hits().items():
                        self.counts["hit_tokens_" + name] += v - lower0[name]
                        lower += v - lower0[name]
                self.counts["device_hit_tokens"] += hit - h - lower
        self.running.append(s)
        scheduled.append((s, n, hit))
        return budget - n

    def step(self) -> bool:
        """Schedule and run one step at ``self.now``; advance the clock past it.

        Returns:
          ``False`` when nothing could be scheduled (no work left, or everything
          that was waiting failed); ``True`` after a step ran.
        """
        manager = self.manager
        counts = self.counts
        host = self.host_block_bytes is not None
        if host:
            loaded0 = manager.host_blocks_loaded
        if self._set_time is not None and (self.running or self.waiting):
            self._set_time(self.now, counts["steps"])
        while True:
            running = self.running
            waiting = self.waiting
            if not running and not waiting:
                return False
            budget = self.scheduler.max_num_batched_tokens
            scheduled: list[tuple[_SimRequest, int, int]] = []  # (req, new, cached before)
            preempted = False
            i = 0
            while i < len(running) and budget > 0:
                s = running[i]
                req = s.req
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                victim = None
                while manager.allocate_slots(req, n) is None:
                    victim = running.pop()
                    if self.miss_accountant is not None:  # its computed blocks, first
                        self.miss_accountant.preempted(victim.req)
                    manager.free(victim.req)
                    victim.req.num_computed_tokens = 0
                    victim.num_preemptions += 1
                    # The core request too: the manager files its re-admission lookup
                    # under the preempted prefix-cache stats.
                    victim.req.num_preemptions += 1
                    counts["preemptions"] += 1
                    self._enqueue(victim, front=True)
                    preempted = True
                    if victim is s:
                        break
                if victim is s:
                    break
                scheduled.append((s, n, req.num_computed_tokens))
                budget -= n
                i += 1
            if not preempted and waiting:
                policy = self.policy
                if policy.is_fcfs:
                    while waiting and budget > 0 and len(running) < self.scheduler.max_num_seqs:
                        left = self._admit(waiting[0], budget, scheduled)
                        if left is None:
                            break
                        budget = left
                else:
                    fcfs = list(waiting)
                    admitted = []
                    for s in policy.order(fcfs, _core_of, manager):
                        if budget <= 0 or len(running) >= self.scheduler.max_num_seqs:
                            break
                        n_running = len(running)
                        left = self._admit(s, budget, scheduled)
                        if left is None:
                            break
                        if len(running) > n_running:
                            admitted.append(s)
                        budget = left
                    policy.after_admission(fcfs, admitted, _core_of)
            if scheduled:
                break
            if not running and not waiting:
                return False  # everything left failed
            # Running requests exist but all were preempted this step: retry now.
            if preempted:
                continue
            raise AssertionError(
                f"simulator stalled at t={self.now}: {len(running)} running, "
                f"{len(waiting)} waiting")

        counts["steps"] += 1
        step_s = self.cost_model.step_time([(n, c) for _, n, c in scheduled])
        if host:
            step_s = self._with_loads(step_s, loaded0)
        self.now += step_s
        now = self.now
        finished = False
        for s, n, _ in scheduled:
            req = s.req
            if req.num_computed_tokens < req.num_prompt_tokens:
                counts["prefill_tokens"] += min(n, req.num_prompt_tokens - req.num_computed_tokens)
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk that samples nothing
            k = len(req.output_token_ids)
            req.append_output_token_ids(output_token(s.trace.id, k))
            if s.ttft_s is None:
                s.ttft_s = now - s.arrival_s
            if k + 1 >= s.max_output:
                if self.residency is not None:
                    keys = self.residency.release_keys(req)
                    manager.free(req)
                    self.residency.released(keys, now)
                else:
                    manager.free(req)
                finished = True
                queue = s.first_scheduled_s - s.arrival_s
                counts["finished"] += 1
                s.finished = True
                rec = {
                    "id": s.trace.id, "arrival_s": s.arrival_s, "queue_s": queue,
                    "ttft_s": s.ttft_s, "e2e_s": now - s.arrival_s,
                    "prompt_tokens": req.num_prompt_tokens,
                    "num_cached_tokens": s.num_cached_tokens,
                    "output_tokens": k + 1, "num_preemptions": s.num_preemptions}
                if host:
                    rec["num_host_tokens"] = s.num_host_tokens
                if self.miss_accountant is not None:
                    self.miss_accountant.forget(req)
                    rec["miss_reasons"] = s.miss_reasons or {}
                self.on_finish(s, rec)
        if finished:
            self.running = [s for s in self.running if not s.finished]
        return True

    def _lower_hits(self) -> dict | None:
        """The manager's hit tokens from each tier below the host (None: no such tier)."""
        if self.tier_links is None:
            return None
        by = self.manager.hit_tokens_by_tier
        return {name: by[name] for name in self.tier_links}

    def _with_loads(self, compute_s: float, loaded0: int) -> float:
        """The step's time with its host -> device copies (``compute_s`` if none);
        drains the manager's transfer list (checked against its counter: a mismatch is
        a bug)."""
        manager = self.manager
        transfers = manager.take_host_transfers()
        lower_s = 0.0
        if self.tier_links is not None:  # each lower tier's loads at its own link
            per_tier = collections.Counter(t.src for t in transfers
                                           if type(t) is TierTransfer and t.kind == "load")
            for name, n in per_tier.items():
                lower_s += self.tier_links[name].load_time(n, self.host_block_bytes)
                self.counts[name + "_blocks_loaded"] += n
            transfers = [t for t in transfers if type(t) is not TierTransfer]
        loads = sum(1 for t in transfers if t.kind == "load")
        if lower_s:
            # NOTE: the tiers' copies run one after the other, then the host's.
            load_s = lower_s + (self.cost_model.load_time(loads * self.host_block_bytes)
                                if loads else 0.0)
            step_s = max(compute_s, load_s) if self.host_load_overlap else compute_s + load_s
            self.counts["host_load_s"] += step_s - compute_s
            self.counts["host_blocks_loaded"] += loads
            self.counts["host_load_steps"] += 1
            return step_s
        if loads != manager.host_blocks_loaded - loaded0:  # pragma: no cover - a bug
            raise AssertionError(f"the step recorded {loads} host loads but the manager's "
                                 f"host_blocks_loaded grew by "
                                 f"{manager.host_blocks_loaded - loaded0}")
        if not loads:
            return compute_s
        load_s = self.cost_model.load_time(loads * self.host_block_bytes)
        step_s = max(compute_s, load_s) if self.host_load_overlap else compute_s + load_s
        counts = self.counts
        counts["host_blocks_loaded"] += loads
        counts["host_load_steps"] += 1
        counts["host_load_s"] += step_s - compute_s
        return step_s


def _core_of(s: _SimRequest) -> Request:
    return s.req


def host_tier_on(manager: KVCacheManager) -> bool:
    """Whether ``manager`` has a host memory tier (``num_host_blocks > 0``)."""
    return getattr(manager, "num_host_blocks", 0) > 0


def check_host_tier(num_host_blocks: Any, cost_model: CostModel) -> int:
    """Validates a simulator's ``num_host_blocks`` (an int >= 0) before anything runs;
    a host tier needs ``cost_model.host_link``. Returns it as an int."""
    n = check_count("num_host_blocks", num_host_blocks)
    if n:
        cost_model.load_time(0)  # no host_link -> ValueError naming HOST_LINKS
    return n


def sim_cache_config(cache_config: CacheConfig | None, cost_model: CostModel,
                     **keywords) -> CacheConfig:
    """The one ``CacheConfig`` of a simulated server: ``cache_config`` with the driver's
    given keywords (`prefixcache.core.cache_config.resolve`), its byte budget sized by
    ``cost_model.shape``, checked for what a simulated server can run.

    Raises:
      ValueError: a bad field (named), a policy that needs the trace's future, KV cache
        groups, a host tier without ``cost_model.host_link``.
    """
    if not isinstance(cost_model, CostModel):  # (else an AttributeError mid-run)
        raise ArgumentTypeError(
            "cost_model must be a prefixcache.cost_model.CostModel (CostModel.create(model, "
            f"accelerator)), got {type(cost_model).__name__} {cost_model!r}")
    cfg = resolve(cache_config, **keywords)
    if cfg.kv_cache_bytes is not None:
        cfg = cfg.with_pool_blocks(
            cost_model.shape.kv_bytes_per_block(cfg.block_size, cfg.kv_dtype))
    if cfg.needs_future:
        name = policy_name(cfg.eviction)
        raise ValueError(f"{name} needs the trace's future (an offline bound): run "
                         f"it through prefixcache.sim.replay (eviction={name!r}), not "
                         "an online simulation")
    if cfg.kv_cache_groups is not None:
        raise ValueError("kv_cache_groups: the simulated server reads one block list per "
                         "request (one full-attention group); replay the trace instead "
                         "(prefixcache.sim.replay takes kv_cache_groups)")
    check_host_tier(cfg.num_host_blocks, cost_model)
    if (cfg.disk_bytes or cfg.remote_bytes or cfg.tiers) and cfg.page_bytes is None:
        # The tiers below the host hold pages of the cost model's block size.
        cfg = cfg.replace(page_bytes=cost_model.block_bytes(cfg.block_size))
    return cfg


def host_summary(counts: collections.Counter, block_bytes: int) -> dict[str, Any]:
    """The host-tier fields of a summary (``counts``: one or several servers' counts);
    with tiers below the host also ``hit_tokens_by_tier`` and each tier's
    ``<name>_blocks_loaded``."""
    lower = {k[len("hit_tokens_"):]: v for k, v in counts.items() if k.startswith("hit_tokens_")}
    prompt_hits = counts["device_hit_tokens"] + counts["host_hit_tokens"] + sum(lower.values())
    extra: dict[str, Any] = {}
    if lower:
        extra["hit_tokens_by_tier"] = {"device": counts["device_hit_tokens"],
                                       "host": counts["host_hit_tokens"], **lower}
        for name in lower:
            extra[name + "_blocks_loaded"] = counts[name + "_blocks_loaded"]
    return {**extra,
        "device_hit_tokens": counts["device_hit_tokens"],
        "host_hit_tokens": counts["host_hit_tokens"],
        "host_hit_share": counts["host_hit_tokens"] / prompt_hits if prompt_hits else 0.0,
        "host_blocks_loaded": counts["host_blocks_loaded"],
        "host_bytes_loaded": counts["host_blocks_loaded"] * block_bytes,
        "host_load_steps": counts["host_load_steps"],
        "host_load_s": float(counts["host_load_s"]),
    }


def make_sim_request(tr: TraceRequest, arrival_s: float) -> _SimRequest:
    """The simulator's state for trace entry ``tr`` arriving at ``arrival_s``."""
    return _SimRequest(tr, to_core_request(tr), arrival_s, max(1, int(tr.output_len)))


class _Totals:
    """Latency lists and token counts over finished / failed requests."""

    def __init__(self, emit: Callable[[dict[str, Any]], None]):
        self.emit = emit
        self.ttfts: list[float] = []
        self.queues: list[float] = []
        self.e2es: list[float] = []
        self.counts = collections.Counter()

    def finish(self, s: _SimRequest, rec: dict[str, Any]) -> None:
        self.ttfts.append(rec["ttft_s"])
        self.queues.append(rec["queue_s"])
        self.e2es.append(rec["e2e_s"])
        self.counts["prompt_tokens"] += rec["prompt_tokens"]
        self.counts["output_tokens"] += s.max_output
        self.emit(rec)

    def fail(self, s: _SimRequest, rec: dict[str, Any]) -> None:
        self.counts["prompt_tokens"] += rec["prompt_tokens"]
        self.emit(rec)


def simulate(
    requests: Iterable[TraceRequest],
    *,
    cost_model: CostModel,
    cache_config: CacheConfig | None = None,
    num_blocks: int = UNSET,
    block_size: int = UNSET,
    scheduler: SchedulerConfig = SchedulerConfig(),
    hash_algo: str = UNSET,
    hash_seed: int | str | None = UNSET,
    free_order: str = UNSET,
    enable_caching: bool = UNSET,
    scheduling: str = "fcfs",
    eviction: str = UNSET,
    eviction_options: dict | None = UNSET,
    warmup: Iterable[TraceRequest] | None = None,
    arrival_rate: float | None = None,
    seed: int = 0,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    progress: bool = False,
    total: int | None = None,
    num_host_blocks: int = UNSET,
    host_eviction: str = UNSET,
    host_eviction_options: dict | None = UNSET,
    host_load_overlap: bool = False,
    index: str = UNSET,
    max_model_len: int | None = UNSET,
    miss_reasons: bool = False,
    residency: float | None = None,
) -> dict[str, Any]:
    """Runs the discrete-event simulation.

    Args:
      requests: trace entries in arrival order (streamed: only arrived,
        unfinished requests are held in memory).
      cost_model: step times.
      cache_config: the simulated server's cache (``prefixcache.CacheConfig``; a
        ``kv_cache_bytes`` budget is sized by ``cost_model.shape``); the cache
        keywords (``num_blocks``, ``block_size``, ``hash_algo``, ``hash_seed``,
        ``free_order``, ``enable_caching``, ``eviction``, ``eviction_options``,
        ``index``, ``max_model_len``, the host ones) override its fields when given,
        or build it alone. A policy that needs the trace's future is refused (use
        ``prefixcache.sim.replay``), as are ``kv_cache_groups`` (the server reads
        one block list per request).
      scheduler: batching limits.
      scheduling: the waiting queue's admission order (``fcfs``, ``lpm``,
        ``dfs_weight``; ``prefixcache.scheduling``).
      warmup: if given, these prompts are prefilled one by one (and freed)
        before the first arrival: the run starts with a warm cache.
      arrival_rate: if set, Poisson arrivals at this rate (req/s) replace the
        trace's timestamps; otherwise every request needs a ``timestamp``.
      seed: seed of the Poisson arrivals.
      on_record: called with each request's record when it finishes or fails
        (in completion order): ``id``, ``arrival_s``, ``queue_s`` (first
        scheduled - arrival), ``ttft_s``, ``e2e_s``, ``prompt_tokens``,
        ``num_cached_tokens`` (hit at first admission), ``output_tokens``,
        ``num_preemptions``; failed requests have ``failed: reason`` and no
        latencies.
      progress: show a tqdm bar of finished requests.
      total: the number of requests, for the progress bar.
      num_host_blocks, host_eviction, host_eviction_options: the manager's host
        memory tier (0: none, the default; see the module docstring). A tier
        needs ``cost_model.host_link``; records then carry ``num_host_tokens``
        (of ``num_cached_tokens``, loaded from the host).
      host_load_overlap: loads hidden behind the step's compute (``max``) instead
        of added to it (default False: the pessimistic bound).

    Returns:
      A summary: ``cache_state`` (cold/warm at the start), request and token
      counts, token hit rate, latency percentiles (s), simulated makespan and
      throughput, steps, preemptions and evictions. With a host tier also
      ``num_host_blocks``, ``host_eviction``, ``host_link``, ``device_hit_tokens``
      / ``host_hit_tokens`` (``hit_tokens`` is their sum), ``host_hit_share``,
      ``host_blocks_loaded``, ``host_bytes_loaded``, ``host_load_steps``,
      ``host_load_s`` (time the steps took beyond their compute because of loads),
      ``host_load_overlap``, ``host_blocks_stored`` (demotions). With
      ``miss_reasons=True`` (``prefixcache.core.misses``: why each missed prompt block
      missed, ``preempted`` included) records get ``miss_reasons`` (summed over the
      request's admissions) and the summary ``miss_reasons`` (as the replay's).
      With ``residency=RATE`` (block residency, ``prefixcache.core.residency``, on the
      simulated clock in seconds; RATE the share of block hashes tracked, in (0, 1]:
      1.0 is exact, vLLM samples 0.01) the summary gets ``residency``: per tier,
      histograms of ``lifetime``, ``idle_before_evict``, ``reuse_gap`` and
      ``hits_per_residency``; ``None`` (the default) tracks nothing, at no cost.

    Raises:
      ValueError: missing/unsorted timestamps, a bad arrival rate, a bad
        ``num_host_blocks`` or host policy, a host tier without a host link.
      TypeError: an arrival rate that is not a number.
    """
    arrival_rate = check_arrival_rate(arrival_rate)
    cfg = sim_cache_config(
        cache_config, cost_model, num_blocks=num_blocks, block_size=block_size,
        hash_algo=hash_algo, hash_seed=hash_seed, free_order=free_order,
        enable_caching=enable_caching, eviction=eviction, eviction_options=eviction_options,
        num_host_blocks=num_host_blocks, host_eviction=host_eviction,
        host_eviction_options=host_eviction_options, index=index,
        max_model_len=max_model_len)
    block_size, num_host_blocks, host_eviction = (
        cfg.block_size, cfg.num_host_blocks, cfg.host_eviction)
    make_scheduling_policy(scheduling)  # an unknown name fails before anything runs
    if not isinstance(host_load_overlap, bool):
        raise ValueError(f"host_load_overlap must be a bool, got {host_load_overlap!r}")
    manager_kw = cfg.manager_kwargs()
    acct = None
    if miss_reasons:
        from prefixcache.core.misses import MissAccountant, uses_probes  # noqa: PLC0415

        if not uses_probes(cfg.index, cfg.kv_cache_groups):
            manager_kw.update(enable_events=True, int_event_hashes=False)
    if residency is not None:
        from prefixcache.core.residency import ResidencyTracker  # noqa: PLC0415

        ResidencyTracker(residency)  # (the sample rate's check, before anything runs)
        if cfg.kv_cache_groups is not None and len(cfg.kv_cache_groups) > 1:
            raise ValueError("residency statistics need one full-attention group")
        manager_kw["enable_events"] = True
    manager = KVCacheManager(**manager_kw, log_stats=False)
    if miss_reasons:  # (before the warm-up: its evictions are remembered)
        acct = MissAccountant.for_manager(manager)
    warmed = 0 if warmup is None else warm_up(manager, warmup)
    evictions0 = manager.num_evictions
    stored0 = manager.host_blocks_stored if num_host_blocks else 0
    arrivals = _arrivals(requests, arrival_rate, seed)
    pending = next(arrivals, None)
    bar = None
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        bar = tqdm(total=total, unit="req", desc="des", mininterval=1.0)

    def emit(rec: dict[str, Any]) -> None:
        if on_record is not None:
            on_record(rec)
        if bar is not None:
            bar.update(1)

    totals = _Totals(emit)
    server = Server(manager, cost_model, scheduler, on_finish=totals.finish, on_fail=totals.fail,
                    scheduling=scheduling, host_load_overlap=host_load_overlap)
    if acct is not None:
        server.miss_accountant = acct
        if acct.uses_events:
            server.miss_events = manager.take_events
    res = None
    if residency is not None:
        from prefixcache.core.residency import ManagerResidency  # noqa: PLC0415

        res = ManagerResidency(manager, residency)
        if server.miss_events is not None:  # one drain feeds both
            pre = manager.take_events()  # (the warm-up's, before the measured run)
            acct.observe(pre)
            server.miss_events = lambda: res.drain(server.now)
        else:
            manager.take_events()  # (the warm-up's: before the measured run)
        server.residency = res
    server.now = 0.0 if pending is None else pending[0]
    while True:
        # 1. Arrivals up to now.
        while pending is not None and pending[0] <= server.now:
            t, tr = pending
            server.arrive(make_sim_request(tr, t))
            pending = next(arrivals, None)
        # 2-3. One step; when idle, jump to the next arrival.
        if not server.step():
            if pending is None:
                break
            server.now = max(server.now, pending[0])

    if bar is not None:
        bar.close()
    summary = {
        "cache_state": "cold" if warmup is None else "warm",
        "warmup_prompts": warmed,
        **summarize(totals, server.counts, server.now),
        "evictions": manager.num_evictions - evictions0,
    }
    if res is not None:
        summary["residency"] = res.summary(server.now)
    if num_host_blocks:
        summary.update({
            "num_host_blocks": num_host_blocks, "host_eviction": policy_name(host_eviction),
            "host_link": cost_model.host_link.name, "host_load_overlap": host_load_overlap,
            **host_summary(server.counts, server.host_block_bytes),
            "host_blocks_stored": manager.host_blocks_stored - stored0,
        })
    if acct is not None:
        summary["miss_reasons"] = acct.summary()
    return summary


def summarize(totals: _Totals, counts: collections.Counter, makespan_s: float) -> dict[str, Any]:
    """The summary fields shared by ``simulate`` and the cluster simulator."""
    prompt_tokens = totals.counts["prompt_tokens"]
    output_tokens = totals.counts["output_tokens"]
    return {
        "requests": counts["finished"] + counts["failed"],
        "finished": counts["finished"],
        "failed": counts["failed"],
        "prompt_tokens": prompt_tokens,
        "hit_tokens": counts["hit_tokens"],
        "hit_rate_tokens": counts["hit_tokens"] / prompt_tokens if prompt_tokens else 0.0,
        "output_tokens": output_tokens,
        "steps": counts["steps"],
        "preemptions": counts["preemptions"],
        "makespan_s": makespan_s,
        "ttft_s": percentiles(totals.ttfts),
        "queue_s": percentiles(totals.queues),
        "e2e_s": percentiles(totals.e2es),
        "output_tokens_per_s": output_tokens / makespan_s if makespan_s > 0 else 0.0,
    }


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """``{"mean", "p50", "p90", "p99", "count"}`` of ``values`` (NaN when empty)."""
    if not len(values):
        return {"count": 0, "mean": math.nan, **{f"p{q:g}": math.nan for q in qs}}
    arr = np.asarray(values, dtype=np.float64)
    out = {"count": int(arr.size), "mean": float(arr.mean())}
    out.update({f"p{q:g}": float(np.percentile(arr, q)) for q in qs})
    return out


def bucket_by(records: Iterable[dict[str, Any]], key: str, value: str,
              edges: Sequence[float]) -> list[dict[str, Any]]:
    """Groups ``record[value]`` by ``record[key]`` into ``[edges[i], edges[i+1])`` bins.

    Records without ``value`` (failed requests) are skipped. The last bin is
    closed on the right.

    Returns:
      One dict per bin: ``lo``, ``hi``, and the ``percentiles`` of the values.
    """
    edges = list(edges)
    if len(edges) < 2 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"edges must be strictly increasing with >= 2 entries, got {edges}")
    groups: list[list[float]] = [[] for _ in range(len(edges) - 1)]
    for r in records:
        if r.get(value) is None:
            continue
        x = r[key]
        if x == edges[-1]:
            groups[-1].append(r[value])
            continue
        j = bisect.bisect_right(edges, x) - 1
        if 0 <= j < len(groups):
            groups[j].append(r[value])
    return [{"lo": lo, "hi": hi, **percentiles(g)} for lo, hi, g in zip(edges, edges[1:], groups)]
