"""Waiting-queue policies (prefixcache.scheduling) in the simulator and in isolation."""

from __future__ import annotations

import pytest

from prefixcache.core.kv_cache_manager import KVCacheManager
from prefixcache.core.request import Request
from prefixcache.scheduling import make_scheduling_policy, scheduling_policy_names
from prefixcache.sim import des, workloads
from prefixcache.sim.cost_model import CostModel
from prefixcache.sim.trace import TraceRequest

COST = CostModel.create("llama_3_1_8b", "h100")


def _interleaved_tenants(n=240, tenants=12, burst=True):
    # Tenants' requests interleave in arrival order (FCFS alternates between them);
    # arrivals come in bursts so the waiting queue is long.
    reqs = workloads.generate("tenant_prefixes", num_requests=n, num_tenants=tenants,
                              prefix_len=1024, question_len=(32, 128), output_len=(8, 32),
                              arrival_rate=None)
    times = [(i // 40) * 2.0 for i in range(n)] if burst else [i * 0.01 for i in range(n)]
    return workloads.with_timestamps(reqs, times)


def _run(reqs, policy, **kw):
    recs = []
    s = des.simulate(reqs, cost_model=COST, num_blocks=200, block_size=16,
                     scheduler=des.SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=8),
                     scheduling=policy, on_record=recs.append, **kw)
    return s, recs


def test_lpm_and_dfs_weight_raise_the_hit_rate_where_fcfs_interleaves_tenants():
    reqs = _interleaved_tenants()
    fcfs, _ = _run(reqs, "fcfs")
    lpm, _ = _run(reqs, "lpm")
    dfs, _ = _run(reqs, "dfs_weight")
    assert fcfs["finished"] == lpm["finished"] == dfs["finished"] == len(reqs)
    assert lpm["hit_rate_tokens"] > fcfs["hit_rate_tokens"] + 0.1, (lpm, fcfs)
    assert dfs["hit_rate_tokens"] > fcfs["hit_rate_tokens"] + 0.1, (dfs, fcfs)


def test_starvation_bound_holds():
    # With a tiny bound, no request is passed over more than `bound` steps in a row:
    # check the policy's own bookkeeping never exceeds it, and the bound changes order.
    reqs = _interleaved_tenants()
    bound = 2
    pol = make_scheduling_policy("lpm", starvation_bound=bound)
    manager = KVCacheManager(200, 16, log_stats=False)
    seen_max = 0
    server = des.Server(manager, COST, des.SchedulerConfig(1024, 8),
                        on_finish=lambda s, r: None, on_fail=lambda s, r: None, scheduling=pol)
    pending = [des.make_sim_request(tr, tr.timestamp) for tr in reqs]
    i = 0
    while i < len(pending) or server.has_work:
        while i < len(pending) and pending[i].arrival_s <= server.now:
            server.arrive(pending[i])
            i += 1
        if not server.step():
            server.now = max(server.now, pending[i].arrival_s)
        if pol.passed_over:
            seen_max = max(seen_max, max(pol.passed_over.values()))
        assert all(v <= bound for v in pol.passed_over.values()), pol.passed_over
    assert seen_max == bound  # the bound was reached (and then honoured)
    assert server.counts["finished"] == len(reqs) and not pol.passed_over
    manager.check_invariants()


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_policies_order_by_cached_prefix(index):
    m = KVCacheManager(64, 4, log_stats=False, index=index)
    warm = Request("warm", list(range(1, 18)))
    blocks, hit = m.get_computed_blocks(warm)
    m.allocate_slots(warm, warm.num_tokens - hit, hit, blocks)
    m.free(warm)
    a = Request("a", [99] * 12)                       # nothing cached
    b = Request("b", list(range(1, 9)) + [7, 7, 7])   # 2 blocks cached
    c = Request("c", list(range(1, 17)) + [5])        # 4 blocks cached
    d = Request("d", list(range(1, 5)) + [8] * 8)     # 1 block cached
    counters = m.counters()
    assert [m.peek_computed_tokens(r) for r in (a, b, c, d)] == [0, 8, 16, 4]
    assert m.counters() == counters  # peeking counts no lookup
    ident = lambda r: r  # noqa: E731
    assert make_scheduling_policy("fcfs").order([a, b, c, d], ident, m) == [a, b, c, d]
    assert make_scheduling_policy("lpm").order([a, b, c, d], ident, m) == [c, b, d, a]
    # dfs_weight: the tree of cached paths. b, c, d share block 0 (weight 3); under it
    # b and c share block 1 (weight 2: visited first, c's deeper node before b's own),
    # then d's node (block 0 itself); a (nothing cached) comes last (post-order).
    assert make_scheduling_policy("dfs_weight").order([a, b, c, d], ident, m) == [c, b, d, a]
    # Longer queues than max_reorder are served FCFS.
    assert make_scheduling_policy("lpm", max_reorder=3).order([a, b, c, d], ident, m) == [
        a, b, c, d]


def test_in_batch_prefix_sharing_comes_from_caching_at_allocation():
    # Two waiting requests share a prefix nobody holds: the first one admitted caches
    # its blocks at allocation, the second one (same step) hits them.
    shared = list(range(1, 65))
    reqs = [TraceRequest(id=f"r{i}", prompt=shared + [100 + i] * 8, output_len=2, timestamp=0.0)
            for i in range(3)]
    for policy in scheduling_policy_names():
        s, recs = _run(reqs, policy)
        hits = sorted(r["num_cached_tokens"] for r in recs)
        assert hits == [0, 64, 64], (policy, hits)


def test_bad_policy_names_and_options():
    with pytest.raises(ValueError, match="unknown scheduling policy 'sjf'"):
        make_scheduling_policy("sjf")
    with pytest.raises(ValueError, match="starvation_bound must be an int >= 1"):
        make_scheduling_policy("lpm", starvation_bound=0)
    with pytest.raises(TypeError, match="scheduling policy 'lpm'"):
        make_scheduling_policy("lpm", bogus=1)
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        des.simulate([], cost_model=COST, num_blocks=10, block_size=16, scheduling="nope")
