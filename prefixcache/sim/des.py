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
2. If nothing was preempted this step: waiting requests in FCFS order while
   the budget and ``max_num_seqs`` allow: ``get_computed_blocks`` then
   ``allocate_slots(req, n, hit, blocks)``; the first that does not fit stops
   admission for the step.
3. The step takes ``cost_model.step_time(chunks)``; every request whose
   computed tokens reach its token count samples a token at the step's end
   (the first one defines TTFT); a request with ``output_len`` tokens finishes
   and frees its blocks.

The decode tokens are ``output_token(id, k)``, as in the replay, so multi-turn
workloads hit their earlier turns' outputs here too.

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

from prefixcache.core.kv_cache_manager import KVCacheManager
from prefixcache.core.request import LoRARequest, MultiModalFeature, Request
from prefixcache.sim.cost_model import CostModel
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
    return Request(tr.id, tr.prompt, mm_features=mm, lora=lora, cache_salt=tr.cache_salt)


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
    num_preemptions: int = 0
    finished: bool = False


def _arrivals(requests: Iterable[TraceRequest], arrival_rate: float | None,
              seed: int) -> Iterator[tuple[float, TraceRequest]]:
    """(arrival time in s, request) in order; validates timestamps are sorted."""
    if arrival_rate is not None:
        if not arrival_rate > 0:
            raise ValueError(f"arrival_rate must be > 0, got {arrival_rate!r}")
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


def simulate(
    requests: Iterable[TraceRequest],
    *,
    cost_model: CostModel,
    num_blocks: int,
    block_size: int,
    scheduler: SchedulerConfig = SchedulerConfig(),
    hash_algo: str = "sha256",
    hash_seed: int | str | None = None,
    free_order: str = "append",
    enable_caching: bool = True,
    eviction: str = "lru",
    eviction_options: dict | None = None,
    warmup: Iterable[TraceRequest] | None = None,
    arrival_rate: float | None = None,
    seed: int = 0,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    progress: bool = False,
    total: int | None = None,
) -> dict[str, Any]:
    """Runs the discrete-event simulation.

    Args:
      requests: trace entries in arrival order (streamed: only arrived,
        unfinished requests are held in memory).
      cost_model: step times.
      num_blocks, block_size, hash_algo, hash_seed, free_order, enable_caching,
        eviction, eviction_options: the ``KVCacheManager`` the simulated server uses
        (``belady`` needs the trace's future: use ``prefixcache.sim.replay``).
      scheduler: batching limits.
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

    Returns:
      A summary: ``cache_state`` (cold/warm at the start), request and token
      counts, token hit rate, latency percentiles (s), simulated makespan and
      throughput, steps, preemptions and evictions.

    Raises:
      ValueError: missing/unsorted timestamps, or a bad arrival rate.
    """
    manager = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching,
                             hash_algo=hash_algo, hash_seed=hash_seed, free_order=free_order,
                             log_stats=False, eviction=eviction,
                             eviction_options=eviction_options)
    warmed = 0 if warmup is None else warm_up(manager, warmup)
    evictions0 = manager.num_evictions
    arrivals = _arrivals(requests, arrival_rate, seed)
    pending = next(arrivals, None)
    waiting: collections.deque[_SimRequest] = collections.deque()
    running: list[_SimRequest] = []
    budget0 = scheduler.max_num_batched_tokens
    now = 0.0 if pending is None else pending[0]

    ttfts: list[float] = []
    queues: list[float] = []
    e2es: list[float] = []
    counts = collections.Counter()
    bar = None
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        bar = tqdm(total=total, unit="req", desc="des", mininterval=1.0)

    def emit(rec: dict[str, Any]) -> None:
        if on_record is not None:
            on_record(rec)
        if bar is not None:
            bar.update(1)

    def fail(s: _SimRequest, reason: str) -> None:
        counts["failed"] += 1
        counts["prompt_tokens"] += s.req.num_prompt_tokens
        emit({"id": s.trace.id, "arrival_s": s.arrival_s,
              "prompt_tokens": s.req.num_prompt_tokens, "failed": reason})

    while True:
        # 1. Arrivals up to now.
        while pending is not None and pending[0] <= now:
            t, tr = pending
            req = to_core_request(tr)
            s = _SimRequest(tr, req, t, max(1, int(tr.output_len)))
            needed = -(-(req.num_prompt_tokens + s.max_output - 1) // block_size)
            if needed > num_blocks:
                fail(s, f"needs {needed} blocks > num_blocks={num_blocks}")
            else:
                waiting.append(s)
            pending = next(arrivals, None)
        if not running and not waiting:
            if pending is None:
                break
            now = max(now, pending[0])
            continue

        # 2. Schedule one step.
        budget = budget0
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
                manager.free(victim.req)
                victim.req.num_computed_tokens = 0
                victim.num_preemptions += 1
                # The core request too: the manager files its re-admission lookup
                # under the preempted prefix-cache stats.
                victim.req.num_preemptions += 1
                counts["preemptions"] += 1
                waiting.appendleft(victim)
                preempted = True
                if victim is s:
                    break
            if victim is s:
                break
            scheduled.append((s, n, req.num_computed_tokens))
            budget -= n
            i += 1
        if not preempted:
            while waiting and budget > 0 and len(running) < scheduler.max_num_seqs:
                s = waiting[0]
                req = s.req
                blocks, hit = manager.get_computed_blocks(req)
                n = min(req.num_tokens - hit, budget)
                if manager.allocate_slots(req, n, hit, blocks) is None:
                    if not running:  # the whole pool is free and it still does not fit
                        waiting.popleft()
                        fail(s, "does not fit in the pool")
                        continue
                    break
                waiting.popleft()
                req.num_computed_tokens = hit
                if s.first_scheduled_s is None:
                    s.first_scheduled_s = now
                    s.num_cached_tokens = hit
                    counts["hit_tokens"] += hit
                running.append(s)
                scheduled.append((s, n, hit))
                budget -= n
        if not scheduled:
            if not running and not waiting:
                continue  # everything left failed; go to the next arrival
            # Running requests exist but all were preempted this step: retry now.
            if preempted:
                continue
            raise AssertionError(
                f"simulator stalled at t={now}: {len(running)} running, {len(waiting)} waiting")

        # 3. Run the step.
        counts["steps"] += 1
        now += cost_model.step_time([(n, c) for _, n, c in scheduled])
        finished = False
        for s, n, _ in scheduled:
            req = s.req
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk that samples nothing
            k = len(req.output_token_ids)
            req.append_output_token_ids(output_token(s.trace.id, k))
            if s.ttft_s is None:
                s.ttft_s = now - s.arrival_s
            if k + 1 >= s.max_output:
                manager.free(req)
                finished = True
                queue = s.first_scheduled_s - s.arrival_s
                e2e = now - s.arrival_s
                ttfts.append(s.ttft_s)
                queues.append(queue)
                e2es.append(e2e)
                counts["finished"] += 1
                counts["prompt_tokens"] += req.num_prompt_tokens
                counts["output_tokens"] += s.max_output
                s.finished = True
                emit({"id": s.trace.id, "arrival_s": s.arrival_s, "queue_s": queue,
                      "ttft_s": s.ttft_s, "e2e_s": e2e, "prompt_tokens": req.num_prompt_tokens,
                      "num_cached_tokens": s.num_cached_tokens,
                      "output_tokens": k + 1, "num_preemptions": s.num_preemptions})
        if finished:
            running = [s for s in running if not s.finished]

    if bar is not None:
        bar.close()
    prompt_tokens = counts["prompt_tokens"]
    return {
        "cache_state": "cold" if warmup is None else "warm",
        "warmup_prompts": warmed,
        "requests": counts["finished"] + counts["failed"],
        "finished": counts["finished"],
        "failed": counts["failed"],
        "prompt_tokens": prompt_tokens,
        "hit_tokens": counts["hit_tokens"],
        "hit_rate_tokens": counts["hit_tokens"] / prompt_tokens if prompt_tokens else 0.0,
        "output_tokens": counts["output_tokens"],
        "steps": counts["steps"],
        "preemptions": counts["preemptions"],
        "evictions": manager.num_evictions - evictions0,
        "makespan_s": now,
        "ttft_s": percentiles(ttfts),
        "queue_s": percentiles(queues),
        "e2e_s": percentiles(e2es),
        "output_tokens_per_s": counts["output_tokens"] / now if now > 0 else 0.0,
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
