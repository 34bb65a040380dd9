"""Several simulated replicas behind a router: prefix-aware routing at scale.

Each replica is a ``prefixcache.sim.des.Server`` -- its own ``KVCacheManager`` (with KV
cache events on when the router consumes them), FCFS scheduling with chunked prefill
and preemption, and roofline step times from the cost model. Requests arrive at their
trace timestamps (times ``time_scale``) or by a Poisson process; the router
(``prefixcache.sim.routing``) picks a replica for each at its arrival time, seeing
only the replicas' loads and -- for ``kv_events`` -- the events they published.

Time advances event by event: the next arrival is routed before any replica starts a
step at the same or a later time; otherwise the replica whose clock is earliest runs
its next step. With one replica this is exactly ``des.simulate`` (a test pins it).

Host only: never imports jax.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from prefixcache._validate import check_positive_int
from prefixcache.core.cache_config import UNSET, CacheConfig
from prefixcache.core.eviction import policy_name
from prefixcache.core.kv_cache_manager import KVCacheManager
from prefixcache.core.tiers import RemoteStore
from prefixcache.cost_model import CostModel
from prefixcache.sim.des import SchedulerConfig, Server, _arrivals, _Totals, check_arrival_rate, \
    host_summary, make_sim_request, percentiles, sim_cache_config, summarize
from prefixcache.sim.routing import ReplicaLoad, Router, make_router
from prefixcache.sim.trace import TraceRequest


def _scaled(arrivals, time_scale: float):
    for t, tr in arrivals:
        yield t * time_scale, tr


def _check(servers: list[Server], router: Router) -> None:
    for i, srv in enumerate(servers):
        srv.manager.check_invariants()
        q = sum(s.queued_blocks for s in srv.waiting)
        if q != srv.queued_blocks:
            raise AssertionError(f"replica {i}: queued_blocks {srv.queued_blocks} != {q}")
    router.check_invariants()


def _us(seconds: list[float]) -> dict[str, float]:
    return {k: (v * 1e6 if k != "count" else v)
            for k, v in percentiles(np.asarray(seconds)).items()}


def _load(i: int, srv: Server) -> ReplicaLoad:
    m = srv.manager
    # NOTE: positional: (index, outstanding, waiting, active_blocks, queued_blocks,
    # num_blocks); this runs for every replica on every routing decision.
    w = len(srv.waiting)
    return ReplicaLoad(i, len(srv.running) + w, w, m.num_blocks - m.num_free_blocks,
                       srv.queued_blocks, m.num_blocks)


def simulate_cluster(
    requests: Iterable[TraceRequest],
    *,
    num_replicas: int,
    router: str | Router,
    cost_model: CostModel,
    cache_config: CacheConfig | None = None,
    num_blocks: int = UNSET,
    block_size: int = UNSET,
    scheduler: SchedulerConfig = SchedulerConfig(),
    hash_algo: str = UNSET,
    hash_seed: int | str | None = UNSET,
    free_order: str = UNSET,
    scheduling: str = "fcfs",
    eviction: str = UNSET,
    router_options: dict[str, Any] | None = None,
    arrival_rate: float | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    check_every: int = 0,
    progress: bool = False,
    total: int | None = None,
    num_host_blocks: int = UNSET,
    host_eviction: str = UNSET,
    eviction_options: dict | None = UNSET,
    index: str = UNSET,
    enable_caching: bool = UNSET,
    max_model_len: int | None = UNSET,
    host_eviction_options: dict | None = UNSET,
    miss_reasons: bool = False,
    remote: RemoteStore | None = None,
) -> dict[str, Any]:
    """Simulates ``num_replicas`` replicas behind ``router``.

    Args:
      requests: trace entries in arrival order (streamed).
      cache_config: every replica's cache (``prefixcache.CacheConfig``), as in
        ``des.simulate``; the cache keywords (``num_blocks``, ``block_size``,
        ``hash_algo``, ``hash_seed``, ``free_order``, ``eviction``,
        ``eviction_options``, ``index``, ``enable_caching``, ``max_model_len``, the
        host ones) override its fields when given, or build it alone. A router that
        needs events turns ``enable_events`` on.
      num_replicas: replicas (>= 1); each has ``num_blocks`` KV blocks.
      router: a registered routing policy name or a ``Router`` built for
        ``num_replicas`` replicas.
      cost_model, num_blocks, block_size, scheduler, hash_algo, hash_seed,
        free_order, scheduling, eviction: every replica's server, as in
        ``des.simulate`` (``belady`` needs the trace's future: not here).
      router_options: keyword options of the named router.
      arrival_rate: Poisson arrivals (req/s) instead of the trace timestamps.
      time_scale: multiplies every arrival time (> 0; < 1 compresses the trace,
        i.e. raises the load).
      seed: seed of the router and of Poisson arrivals.
      on_record: called with each request's record (``des.simulate``'s fields plus
        ``replica``), in completion order.
      check_every: if > 0, check every replica's manager and the router's own state
        (e.g. the ``kv_events`` index against the replicas' cached blocks) after
        every ``check_every`` routed requests (tests).
      progress: tqdm bar of finished requests; ``total`` its length.
      num_host_blocks, host_eviction: every replica's host memory tier, as in
        ``des.simulate`` (0: none; needs ``cost_model.host_link``). The replicas'
        events then carry the tier (``medium`` GPU / CPU) and ``kv_events`` scores
        host blocks at its ``host_weight`` (``prefixcache/sim/routing/kv_events.py``).
      remote: a ``prefixcache.core.tiers.RemoteStore`` every replica's chain ends in
        (shared: a block one replica demoted is a hit for another, loaded at the
        store's link); without it, ``cache_config.remote_bytes > 0`` builds one store
        of that size shared by the replicas. Needs a host tier.
      miss_reasons: classify every missed prompt block (``prefixcache.core.misses``),
        one accountant per replica: records get ``miss_reasons`` (as
        ``des.simulate``'s), ``per_replica`` rows their replica's summary and the
        summary ``miss_reasons`` the replicas' summed. Off: no cost.

    Returns:
      ``des.simulate``'s summary fields over all replicas plus ``policy``,
      ``replicas``, ``ttft_p50_s``/``ttft_p90_s``/``ttft_p99_s``,
      ``throughput_tok_s`` (prompt + output tokens per simulated second),
      ``load_imbalance`` (max / mean of the replicas' prefill work: prompt tokens
      computed), ``route_us`` (wall-clock percentiles of one routing decision:
      reading the loads and choosing), ``route_hash_us`` (hashing the prompt's
      blocks for a router that needs them, which the chosen replica's manager then
      reuses; empty otherwise) and
      ``per_replica`` (requests, hit and prefill tokens, evictions). With a host
      tier also ``des.simulate``'s host fields (over all replicas).

    Raises:
      ValueError: bad counts, an unknown router, a router built for another replica
        count or block size, a bad arrival rate, missing/unsorted timestamps.
      TypeError: a router that is neither a name nor a Router, a non-numeric
        arrival rate.
    """
    num_replicas = check_positive_int("num_replicas", num_replicas)  # (numpy ints too)
    if not (isinstance(time_scale, (int, float)) and math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale must be a finite number > 0, got {time_scale!r}")
    arrival_rate = check_arrival_rate(arrival_rate)
    cfg = sim_cache_config(
        cache_config, cost_model, num_blocks=num_blocks, block_size=block_size,
        hash_algo=hash_algo, hash_seed=hash_seed, free_order=free_order, eviction=eviction,
        num_host_blocks=num_host_blocks, host_eviction=host_eviction,
        eviction_options=eviction_options, index=index, enable_caching=enable_caching,
        max_model_len=max_model_len, host_eviction_options=host_eviction_options)
    block_size, num_host_blocks, host_eviction = (
        cfg.block_size, cfg.num_host_blocks, cfg.host_eviction)
    if isinstance(router, str) or (isinstance(router, type) and issubclass(router, Router)):
        router = make_router(router, num_replicas=num_replicas, block_size=block_size,
                             seed=seed, **(router_options or {}))
    elif not isinstance(router, Router):
        raise TypeError(f"router must be a registered routing policy name or a Router, "
                        f"got {type(router).__name__} {router!r}")
    elif router_options:
        raise ValueError("router_options are only for a router given by name")
    if router.num_replicas != num_replicas:
        raise ValueError(f"router {router!r} was built for {router.num_replicas} replicas, "
                         f"not {num_replicas}")
    if router.block_size != block_size:
        # NOTE: a block-keyed router (cache_aware, kv_events) would hash prompts at its
        # own block size and never match the replicas' blocks.
        raise ValueError(f"router {router!r} was built for block_size={router.block_size}, "
                         f"not block_size={block_size}")
    bar = None
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        bar = tqdm(total=total, unit="req", desc=f"{router.name} x{num_replicas}",
                   mininterval=1.0)
    replica_of: dict[int, int] = {}

    def emit(rec: dict[str, Any]) -> None:
        if on_record is not None:
            on_record(rec)
        if bar is not None:
            bar.update(1)

    totals = _Totals(emit)
    servers: list[Server] = []
    accts: list = []
    if miss_reasons:
        # NOTE: every layout the simulated server runs (one full-attention group, hash
        # or radix) is probed: no events taken from the router.
        from prefixcache.core.misses import MissAccountant  # noqa: PLC0415
    shared: dict[str, Any] = {}
    if remote is not None or cfg.remote_bytes:
        # One remote store shared by every replica: a block one replica demoted is a
        # hit for another.
        if remote is None:
            remote = RemoteStore(cfg.remote_bytes, page_bytes=cfg.page_bytes,
                                 block_size=cfg.block_size, eviction=cfg.remote_eviction)
        if not cfg.num_host_blocks:
            raise ValueError("remote needs a host tier (num_host_blocks > 0) on every replica")
        shared = {"remote": remote, "remote_bytes": 0}
    for i in range(num_replicas):
        # NOTE: events carry the raw digests (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0):
        # the router then keys its index on the request's own block hashes directly.
        manager = KVCacheManager(**{**cfg.manager_kwargs(), **shared,
                                    "enable_events": cfg.enable_events or router.needs_events},
                                 log_stats=False, int_event_hashes=False)

        def finish(s, rec, i=i):
            totals.finish(s, {**rec, "replica": i})

        def fail(s, rec, i=i):
            totals.fail(s, {**rec, "replica": i})

        servers.append(Server(manager, cost_model, scheduler, on_finish=finish, on_fail=fail,
                              scheduling=scheduling))
        if miss_reasons:
            acct = MissAccountant.for_manager(manager)
            accts.append(acct)
            servers[-1].miss_accountant = acct

    hasher = servers[0].manager.hasher
    arrivals = _scaled(_arrivals(requests, arrival_rate, seed), float(time_scale))
    pending = next(arrivals, None)
    route_s: list[float] = []
    hash_s: list[float] = []
    per_req = [0] * num_replicas
    needs_events = router.needs_events
    perf = time.perf_counter
    routed = 0
    try:
        while True:
            t_srv = math.inf
            nxt = None
            for srv in servers:
                if (srv.running or srv.waiting) and srv.now < t_srv:
                    t_srv = srv.now
                    nxt = srv
            if pending is not None and pending[0] <= t_srv:
                t, tr = pending
                sreq = make_sim_request(tr, t)
                # NOTE: every replica hashes alike; the router (kv_events) reads the
                # request's block hashes with the same hasher (lazily, on its clock).
                sreq.req.bind_hasher(hasher, block_size)
                if needs_events:
                    t0 = perf()
                    sreq.req.block_hashes  # the replica's manager reuses them
                    hash_s.append(perf() - t0)
                t0 = perf()
                loads = [_load(i, srv) for i, srv in enumerate(servers)]
                r = router.route(sreq.req, loads, t)
                route_s.append(perf() - t0)
                if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < num_replicas:
                    raise AssertionError(f"router {router.name} returned replica {r!r}")
                srv = servers[r]
                if not (srv.running or srv.waiting):
                    srv.now = max(srv.now, t)
                srv.arrive(sreq)
                per_req[r] += 1
                routed += 1
                if check_every and routed % check_every == 0:
                    _check(servers, router)
                pending = next(arrivals, None)
                continue
            if nxt is None:
                break
            nxt.step()
            if needs_events:
                router.on_events(servers.index(nxt), nxt.manager.take_events())
    finally:
        if bar is not None:
            bar.close()
    if check_every:
        _check(servers, router)

    counts = sum((s.counts for s in servers), start=type(servers[0].counts)())
    makespan = max(s.now for s in servers)
    summary = summarize(totals, counts, makespan)
    prefill = [s.counts["prefill_tokens"] for s in servers]
    mean_prefill = sum(prefill) / num_replicas
    if num_host_blocks:
        summary.update({"num_host_blocks": num_host_blocks,
                        "host_eviction": policy_name(host_eviction),
                        "host_link": cost_model.host_link.name,
                        **host_summary(counts, servers[0].host_block_bytes),
                        "host_blocks_stored": sum(s.manager.host_blocks_stored
                                                  for s in servers)})
    ttft = summary["ttft_s"]
    tokens = summary["prompt_tokens"] + summary["output_tokens"]
    rows = [
        {"replica": i, "requests": per_req[i], "hit_tokens": s.counts["hit_tokens"],
         "prefill_tokens": s.counts["prefill_tokens"], "finished": s.counts["finished"],
         "failed": s.counts["failed"], "evictions": s.manager.num_evictions}
        for i, s in enumerate(servers)
    ]
    if miss_reasons:
        from prefixcache.core.misses import sum_summaries  # noqa: PLC0415

        for row, acct in zip(rows, accts):
            row["miss_reasons"] = acct.summary()
        summary["miss_reasons"] = sum_summaries(row["miss_reasons"] for row in rows)
    return {
        "policy": router.name,
        "replicas": num_replicas,
        **summary,
        "evictions": sum(s.manager.num_evictions for s in servers),
        "ttft_p50_s": ttft["p50"],
        "ttft_p90_s": ttft["p90"],
        "ttft_p99_s": ttft["p99"],
        "throughput_tok_s": tokens / makespan if makespan > 0 else 0.0,
        "load_imbalance": max(prefill) / mean_prefill if mean_prefill > 0 else 1.0,
        "route_us": _us(route_s),
        "route_hash_us": _us(hash_s),
        "per_replica": rows,
    }
