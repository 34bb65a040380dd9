"""Multi-replica simulation and routing policies (prefixcache.sim.cluster / routing)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.core.kv_cache_manager import KVCacheManager
from prefixcache.core.request import Request
from prefixcache.sim import des, workloads
from prefixcache.sim.cluster import simulate_cluster
from prefixcache.sim.cost_model import CostModel
from prefixcache.sim.routing import ROUTERS, ReplicaLoad, make_router, router_names
from prefixcache.sim.routing.cache_aware import ApproxTree
from prefixcache.sim.routing.kv_events import GlobalBlockIndex, event_hash
from prefixcache.sim.trace import TraceRequest

COST = CostModel.create("llama_3_1_8b", "h100")
SCHED = des.SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32)


def _rag():
    return workloads.generate("rag", num_requests=120, arrival_rate=20.0)


@pytest.mark.parametrize("policy", router_names())
def test_one_replica_is_exactly_the_single_server_simulation(policy):
    reqs = _rag()
    want: list[dict] = []
    base = des.simulate(reqs, cost_model=COST, num_blocks=300, block_size=16, scheduler=SCHED,
                        on_record=want.append)
    assert base["preemptions"] > 0 and base["hit_tokens"] > 0  # a case with pressure
    got: list[dict] = []
    s = simulate_cluster(reqs, num_replicas=1, router=policy, cost_model=COST, num_blocks=300,
                         block_size=16, scheduler=SCHED, on_record=got.append, check_every=9)
    assert [{k: v for k, v in r.items() if k != "replica"} for r in got] == want
    assert {r["replica"] for r in got} == {0}
    for key in ("hit_tokens", "prompt_tokens", "preemptions", "steps", "makespan_s"):
        assert s[key] == base[key], key
    assert s["load_imbalance"] == 1.0


def _tenants(n_tenants=32, n=600, rate=8.0):
    return workloads.generate("tenant_prefixes", num_requests=n, num_tenants=n_tenants,
                              prefix_len=1024, question_len=(64, 256), output_len=(16, 64),
                              arrival_rate=rate)


def test_kv_events_beats_random_and_round_robin_at_8_replicas():
    # A small llm-d-like workload: 32 tenants x 1k-token prefixes, each replica caches
    # 8k tokens (a quarter of the prefixes): routing decides what hits.
    reqs = _tenants()
    out = {p: simulate_cluster(reqs, num_replicas=8, router=p, cost_model=COST,
                               num_blocks=512, block_size=16, scheduler=SCHED)
           for p in ("random", "round_robin", "kv_events")}
    kv = out["kv_events"]
    for p in ("random", "round_robin"):
        assert out[p]["hit_rate_tokens"] < kv["hit_rate_tokens"] - 0.2, (p, out[p], kv)
        assert out[p]["ttft_p90_s"] > kv["ttft_p90_s"], p
    assert kv["requests"] == len(reqs) and kv["failed"] == 0
    assert kv["route_us"]["count"] == len(reqs) and kv["route_hash_us"]["count"] == len(reqs)
    # Every replica takes the eviction policy too.
    lfu = simulate_cluster(reqs, num_replicas=8, router="kv_events", cost_model=COST,
                           num_blocks=512, block_size=16, scheduler=SCHED, eviction="lfu",
                           check_every=50)
    assert lfu["requests"] == len(reqs) and lfu["evictions"] > 0
    assert sum(r["requests"] for r in kv["per_replica"]) == len(reqs)


def _cached_hashes(manager) -> set[int]:
    return {event_hash(b.block_hash) for b in manager.block_pool.blocks
            if b.block_hash is not None}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(1, 70),
                          st.sampled_from(["run", "free", "reset"])), min_size=1, max_size=40))
def test_kv_events_index_is_the_union_of_the_replicas_cached_blocks(ops):
    managers = [KVCacheManager(12, 4, enable_events=True, free_order="unhashed_first")
                for _ in range(3)]
    index = GlobalBlockIndex(3)
    running: list[list[Request]] = [[], [], []]
    prefixes = [[(p * 7 + i) % 50 + 1 for i in range(40)] for p in range(6)]
    for k, (r, p, n, op) in enumerate(ops):
        m = managers[r]
        if op == "run":
            req = Request(f"r{k}", prefixes[p][: min(n, 40)] + [1000 + k] * max(0, n - 40))
            blocks, hit = m.get_computed_blocks(req)
            if m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None:
                req.num_computed_tokens = req.num_tokens
                running[r].append(req)
        elif op == "free" and running[r]:
            m.free(running[r].pop(0))
        elif op == "reset":
            while running[r]:
                m.free(running[r].pop())
            assert m.reset_prefix_cache()
        index.apply(r, m.take_events())
        index.check()
        assert index.union() == set().union(*map(_cached_hashes, managers))
        for i, mm in enumerate(managers):
            assert set(index.counts[i]) == _cached_hashes(mm)
            # Per-replica counts include duplicates (same hash in several blocks).
            assert sum(index.counts[i].values()) == sum(
                b.block_hash is not None for b in mm.block_pool.blocks)


def test_overlaps_count_leading_blocks_per_replica():
    idx = GlobalBlockIndex(3)
    from prefixcache.core.events import BlockRemoved, BlockStored

    def stored(hs):
        return BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=[], block_size=1,
                           lora_id=None, medium="GPU", lora_name=None)

    idx.apply(0, [stored([1, 2, 3])])
    idx.apply(1, [stored([1, 2]), stored([9])])
    idx.apply(2, [stored([2, 3])])  # no block 1: nothing leading
    assert idx.overlaps([1, 2, 3, 4]) == [3, 2, 0]
    idx.apply(0, [BlockRemoved(block_hashes=[2], medium="GPU")])
    assert idx.overlaps([1, 2, 3]) == [1, 2, 0]
    with pytest.raises(ValueError, match="never stored"):
        idx.apply(2, [BlockRemoved(block_hashes=[7], medium="GPU")])


def _load(i, outstanding, active=0, num_blocks=100):
    return ReplicaLoad(index=i, outstanding=outstanding, waiting=0, active_blocks=active,
                       queued_blocks=0, num_blocks=num_blocks)


def test_simple_routers():
    req = Request("a", list(range(1, 40)))
    rr = make_router("round_robin", num_replicas=3, block_size=16)
    assert [rr.route(req, [], 0.0) for _ in range(5)] == [0, 1, 2, 0, 1]
    ll = make_router("least_loaded", num_replicas=3, block_size=16)
    assert ll.route(req, [_load(0, 4), _load(1, 2), _load(2, 2)], 0.0) == 1
    r1 = make_router("random", num_replicas=4, block_size=16, seed=3)
    r2 = make_router("random", num_replicas=4, block_size=16, seed=3)
    seq = [r1.route(req, [], 0.0) for _ in range(50)]
    assert seq == [r2.route(req, [], 0.0) for _ in range(50)] and set(seq) == {0, 1, 2, 3}


def test_power_of_two_picks_the_less_loaded_of_two_draws():
    req = Request("a", list(range(1, 40)))
    loads = [_load(0, 5), _load(1, 0), _load(2, 3), _load(3, 3)]
    p2 = make_router("power_of_two", num_replicas=4, block_size=16, seed=1)
    rng = __import__("random").Random(1)  # the same draws, by hand
    for _ in range(200):
        a, b = rng.sample(range(4), 2)
        want = b if loads[b].outstanding < loads[a].outstanding else a
        assert p2.route(req, loads, 0.0) == want
    # Never the most loaded replica while another draw is possible; with one replica, 0.
    picks = {make_router("power_of_two", num_replicas=4, block_size=16, seed=s)
             .route(req, loads, 0.0) for s in range(40)}
    assert 0 not in picks and picks == {1, 2, 3}
    assert make_router("power_of_two", num_replicas=1, block_size=16).route(req, loads[:1], 0) == 0


def test_session_routing_is_sticky_and_consistent():
    reqs = [Request(f"s{i}", [i % 97 + 1] * 40 + [5, 6]) for i in range(400)]
    four = make_router("session", num_replicas=4, block_size=16)
    five = make_router("session", num_replicas=5, block_size=16)
    a = [four.route(r, [], 0.0) for r in reqs]
    b = [five.route(r, [], 0.0) for r in reqs]
    # The same key (first 2 blocks) always lands on the same replica...
    again = [four.route(Request(f"t{i}", [i % 97 + 1] * 40 + [7]), [], 0.0) for i in range(400)]
    assert again == a
    assert len(set(a)) == 4
    # ... and adding a fifth replica moves only the keys the new one takes.
    moved = [i for i in range(400) if a[i] != b[i]]
    assert all(b[i] == 4 for i in moved)
    assert 0 < len(moved) < 200


def test_cache_aware_follows_the_tree_then_balances():
    ca = make_router("cache_aware", num_replicas=3, block_size=16, balance_abs_threshold=4)
    idle = [_load(0, 0), _load(1, 0), _load(2, 0)]
    p = list(range(1, 200))
    first = ca.route(Request("a", p), idle, 0.0)
    assert first == 0  # empty tree: the smallest tenant
    # A different prompt goes to another (smaller) replica; a matching one follows.
    second = ca.route(Request("b", list(range(500, 700))), idle, 0.0)
    assert second != first
    assert ca.route(Request("c", p[:150] + [9999] * 20), idle, 0.0) == first
    # Imbalance beyond the thresholds: shortest queue, whatever the tree says.
    busy = [_load(0, 10), _load(1, 1), _load(2, 3)]
    assert ca.route(Request("d", p), busy, 0.0) == 1
    ca.check_invariants()


def test_approx_tree_split_and_eviction():
    import numpy as np

    t = ApproxTree(2)
    t.insert(np.array([1, 2, 3, 4]), 0)
    t.insert(np.array([1, 2, 9]), 1)  # splits the edge after [1, 2]
    t.check()
    assert t.match(np.array([1, 2, 3, 4, 5])) == (4, 0)
    assert t.match(np.array([1, 2, 9])) == (3, 1)
    assert t.size == [4, 3]
    t.insert(np.array([7, 7, 7]), 0)
    t.evict(0, 3)  # drops tenant 0's least recently used leaf ([3, 4]) and then [1, 2]
    t.check()
    assert t.size[0] == 3 and t.match(np.array([7, 7, 7])) == (3, 0)
    assert t.match(np.array([1, 2, 3])) == (2, 1)


def test_bad_input_is_rejected_before_anything_runs():
    reqs = _rag()[:5]
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        simulate_cluster(reqs, num_replicas=2, router="nope", cost_model=COST,
                         num_blocks=100, block_size=16)
    with pytest.raises(ValueError, match="num_replicas must be a positive int"):
        simulate_cluster(reqs, num_replicas=0, router="random", cost_model=COST,
                         num_blocks=100, block_size=16)
    with pytest.raises(ValueError, match="time_scale"):
        simulate_cluster(reqs, num_replicas=1, router="random", cost_model=COST,
                         num_blocks=100, block_size=16, time_scale=0)
    untimed = [TraceRequest(id="u", prompt=[1, 2, 3], output_len=2)]
    with pytest.raises(ValueError, match="has no timestamp"):
        simulate_cluster(untimed, num_replicas=2, router="random", cost_model=COST,
                         num_blocks=100, block_size=16)
    with pytest.raises(ValueError, match="belady needs the trace's future"):
        simulate_cluster(reqs, num_replicas=2, router="random", cost_model=COST,
                         num_blocks=100, block_size=16, eviction="belady")
    with pytest.raises(TypeError, match="routing policy 'session'"):
        make_router("session", num_replicas=2, block_size=16, bogus=1)
    with pytest.raises(ValueError, match="key_blocks"):
        make_router("session", num_replicas=2, block_size=16, key_blocks=0)
    assert set(ROUTERS) == {"random", "round_robin", "least_loaded", "power_of_two", "session",
                            "cache_aware", "kv_events"}


def test_route_experiment_end_to_end(tmp_path, capsys):
    import json

    from configs import route as route_config
    from experiments import route

    c = route_config.get_config()
    c.workload.kwargs.num_requests = 120
    c.workload.kwargs.num_tenants = 8
    c.workload.kwargs.prefix_len = 512
    c.replicas = "1,2"
    c.policies = "round_robin,kv_events"
    c.num_blocks = 256
    c.workdir = str(tmp_path)
    out = route.run(c)
    rows = [json.loads(line) for line in open(out["rows_file"])]
    assert [(r["policy"], r["replicas"]) for r in rows] == [
        ("round_robin", 1), ("kv_events", 1), ("round_robin", 2), ("kv_events", 2)]
    for r in rows:
        for k in ("requests", "prompt_tokens", "hit_tokens", "hit_rate_tokens", "ttft_p50_s",
                  "ttft_p90_s", "ttft_p99_s", "throughput_tok_s", "load_imbalance", "provenance"):
            assert k in r, k
    assert rows[0]["hit_tokens"] == rows[1]["hit_tokens"]  # 1 replica: routing is moot
    assert (tmp_path / "route_ttft.png").stat().st_size > 0
    c.policies = "round_robin,nope"
    with pytest.raises(ValueError, match="unknown routing policy"):
        route.run(c)
    c.policies = "random"
    c.replicas = "2,0"
    with pytest.raises(ValueError, match="replica count must be >= 1"):
        route.run(c)
