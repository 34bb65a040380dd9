"""The tier-aware ``kv_events`` router: its index follows the replicas' device and host
tiers from their events alone, host blocks score at ``host_weight``, and a cluster with a
host tier routes by them."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixcache.core.kv_cache_manager import KVCacheManager
from prefixcache.core.request import Request
from prefixcache.sim import des, workloads
from prefixcache.sim.cluster import simulate_cluster
from prefixcache.sim.cost_model import CostModel
from prefixcache.sim.routing import ReplicaLoad, make_router
from prefixcache.sim.routing.kv_events import DEFAULT_HOST_WEIGHT, GlobalBlockIndex, \
    event_hash, host_hit_weight

COST = CostModel.create("llama_3_1_8b", "h200", host_link="h200_pcie5")
SCHED = des.SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32)


def _device_hashes(m) -> collections.Counter:
    """The manager's device-cached hashes (as events carry them), with multiplicity."""
    if hasattr(m, "block_pool"):
        blocks = [b for b in m.block_pool.blocks if b.block_hash is not None]
    else:  # the radix index: the tree's blocks
        blocks = [m.blocks[i] for i in m.cached_block_ids()]
    return collections.Counter(event_hash(b.block_hash) for b in blocks)


def _host_hashes(m) -> set[int]:
    return {event_hash(h) for h in m.host_tier.hash_to_slot}


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(["hash", "radix"]), st.sampled_from(["lru", "lfu"]),
       st.integers(1, 10),
       st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(1, 70),
                          st.sampled_from(["run", "run", "free", "reset"])),
                min_size=1, max_size=40))
def test_index_follows_each_tier_of_the_managers_exactly(index, host_eviction, num_host, ops):
    managers = [KVCacheManager(12, 4, enable_events=True, free_order="unhashed_first",
                               index=index, num_host_blocks=num_host,
                               host_eviction=host_eviction)
                for _ in range(3)]
    gbi = GlobalBlockIndex(3)
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
        m.take_host_transfers()
        gbi.apply(r, m.take_events())
        gbi.check()
        for i, mm in enumerate(managers):
            assert collections.Counter(gbi.counts[i]) == _device_hashes(mm), i
            host = _host_hashes(mm)
            assert set(gbi.host_counts[i]) == host, i
            assert set(gbi.host_counts[i].values()) <= {1}
        assert gbi.host_union() == set().union(*map(_host_hashes, managers))
    # The leading match of every prefix, per tier, is what the manager would hit.
    for p in prefixes:
        probe = Request("probe", p + [999])
        hits = [m.get_computed_blocks(probe)[0] for m in managers]  # (binds the hasher)
        device, host = gbi.tier_overlaps([event_hash(h) for h in probe.block_hashes])
        for i, blocks in enumerate(hits):
            n_host = sum(1 for b in blocks if getattr(b, "block_id", 0) == -1)
            assert (device[i], host[i]) == (len(blocks) - n_host, n_host), (i, p[:3])


def _stored(hs, medium="GPU"):
    return BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=[], block_size=1,
                       lora_id=None, medium=medium, lora_name=None)


def test_tier_overlaps_walk_device_then_host_and_errors():
    idx = GlobalBlockIndex(3)
    idx.apply(0, [_stored([1, 2]), _stored([3, 4], "CPU")])  # 2 device then 2 host
    idx.apply(1, [_stored([1], "CPU"), _stored([2, 3])])  # host, device, device
    idx.apply(2, [_stored([2, 3, 4], "CPU")])  # no block 1: nothing leading
    assert idx.tier_overlaps([1, 2, 3, 4, 5]) == ([2, 2, 0], [2, 1, 0])
    assert idx.overlaps([1, 2, 3, 4]) == [2, 0, 0]  # the device-only walk
    # A demotion (device -> host) and a promotion (host -> device).
    idx.apply(0, [BlockRemoved(block_hashes=[2], medium="GPU"), _stored([2], "CPU")])
    idx.apply(1, [_stored([1]), BlockRemoved(block_hashes=[1], medium="CPU")])
    assert idx.tier_overlaps([1, 2, 3, 4]) == ([1, 3, 0], [3, 0, 0])
    idx.check()
    with pytest.raises(ValueError, match="never stored"):
        idx.apply(2, [BlockRemoved(block_hashes=[1], medium="CPU")])
    with pytest.raises(ValueError, match="unknown medium 'DISK'"):
        idx.apply(2, [_stored([9], "DISK")])
    idx.apply(0, [AllBlocksCleared()])  # both tiers of replica 0
    assert idx.tier_overlaps([1, 2, 3, 4]) == ([0, 3, 0], [0, 0, 0])
    idx.check()


def _load(i, active=0):
    return ReplicaLoad(index=i, outstanding=0, waiting=0, active_blocks=active,
                       queued_blocks=0, num_blocks=100)


class _Req:
    def __init__(self, hashes):
        self.block_hashes = hashes


def test_router_weighs_host_blocks_at_host_weight():
    prompt = _Req(list(range(1, 11)))  # 10 blocks

    def router(**kw):
        r = make_router("kv_events", num_replicas=2, block_size=1, **kw)
        return r

    # Equal-length matches: the device one wins.
    for first in (0, 1):
        r = router()
        r.on_events(first, [_stored(list(range(1, 5)), "CPU")])
        r.on_events(1 - first, [_stored(list(range(1, 5)))])
        assert r.route(prompt, [_load(0), _load(1)], 0.0) == 1 - first
    # 8 host blocks vs 3 device blocks: the host replica at 0.5 (4 > 3), not at 0.25 (2 < 3).
    for hw, want in ((0.5, 0), (0.25, 1), (DEFAULT_HOST_WEIGHT, 0)):
        r = router(host_weight=hw)
        r.on_events(0, [_stored(list(range(1, 9)), "CPU")])
        r.on_events(1, [_stored([1, 2, 3])])
        assert r.route(prompt, [_load(0), _load(1)], 0.0) == want, hw
    # A host match continues into device blocks (host block 1, then device 2..6).
    r = router(host_weight=0.5)
    r.on_events(0, [_stored([1], "CPU"), _stored([2, 3, 4, 5, 6])])
    r.on_events(1, [_stored([1, 2, 3, 4, 5])])
    assert r.route(prompt, [_load(0), _load(1)], 0.0) == 0  # 5.5 > 5


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.5", None, True, float("nan")])
def test_bad_host_weight_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="host_weight must be a number in \\[0, 1\\]"):
        make_router("kv_events", num_replicas=2, block_size=16, host_weight=bad)
    with pytest.raises(ValueError, match="host_weight"):
        simulate_cluster(workloads.generate("rag", num_requests=3, arrival_rate=1.0),
                         num_replicas=2, router="kv_events", cost_model=COST, num_blocks=64,
                         block_size=16, num_host_blocks=64,
                         router_options={"host_weight": bad})


def test_host_hit_weight_from_the_cost_model():
    w = host_hit_weight(COST, 16)
    assert 0.8 <= w < 0.85  # the default's derivation (kv_events docstring)
    assert host_hit_weight(COST, 512, 15000) > w  # longer context: prefill dearer
    slow = CostModel.create("llama_3_1_8b", "h200", host_link="tpu_v5e_host")
    assert host_hit_weight(slow, 16) < w
    with pytest.raises(ValueError, match="no host_link"):
        host_hit_weight(CostModel.create("llama_3_1_8b", "h200"), 16)
    with pytest.raises(ValueError, match="block_size"):
        host_hit_weight(COST, 0)


def test_cluster_with_a_host_tier_routes_by_kv_events():
    # 16 tenants x 1k-token prefixes, 4 replicas of 16k tokens each: a replica's device
    # holds ~4 prefixes, its host tier the rest it saw.
    reqs = workloads.generate("tenant_prefixes", num_requests=300, num_tenants=16,
                              prefix_len=1024, question_len=(64, 256), output_len=(16, 64),
                              arrival_rate=8.0)
    kw = dict(num_replicas=4, cost_model=COST, num_blocks=160, block_size=16, scheduler=SCHED)
    off = simulate_cluster(reqs, router="kv_events", **kw)
    recs: list[dict] = []
    on = simulate_cluster(reqs, router="kv_events", num_host_blocks=512, check_every=25,
                          on_record=recs.append, **kw)
    assert on["requests"] == len(reqs) and on["failed"] == 0
    assert on["host_hit_tokens"] > 0
    assert on["hit_tokens"] == on["device_hit_tokens"] + on["host_hit_tokens"]
    assert sum(r["num_host_tokens"] for r in recs) == on["host_hit_tokens"]
    assert on["hit_tokens"] > off["hit_tokens"]
    rr = simulate_cluster(reqs, router="round_robin", num_host_blocks=512, **kw)
    assert on["hit_rate_tokens"] > rr["hit_rate_tokens"]


def test_route_experiment_with_a_host_tier(tmp_path):
    import json

    from configs import route as route_config
    from experiments import route

    c = route_config.get_config()
    c.workload.kwargs.num_requests = 120
    c.workload.kwargs.num_tenants = 8
    c.workload.kwargs.prefix_len = 512
    c.replicas = "2"
    c.policies = "round_robin,kv_events"
    c.num_blocks = 64
    c.num_host_blocks = 256
    c.workdir = str(tmp_path)
    out = route.run(c)
    rows = [json.loads(line) for line in open(out["rows_file"])]
    assert [r["policy"] for r in rows] == ["round_robin", "kv_events"]
    for r in rows:
        assert r["num_host_blocks"] == 256 and r["host_link"] == "h200_pcie5"
        assert r["hit_tokens"] == r["device_hit_tokens"] + r["host_hit_tokens"]
    assert rows[1]["host_hit_tokens"] > 0
    assert rows[1]["host_weight"] == pytest.approx(
        host_hit_weight(CostModel.from_config(c), c.block_size))
    assert "host_weight" not in rows[0]
    c.host_weight = "0.5"
    c.workdir = str(tmp_path / "w05")  # another config: a workdir of its own (resume rule)
    out = route.run(c)
    assert out["rows"][1]["policy"] == "kv_events"
    assert json.loads(open(out["rows_file"]).read().splitlines()[-1])["host_weight"] == 0.5
    for bad in ("1.5", "x"):
        c.host_weight = bad
        with pytest.raises(ValueError, match="host_weight"):
            route.run(c)
    c.host_weight = "auto"
    c.num_host_blocks = -1
    with pytest.raises(ValueError, match="num_host_blocks"):
        route.run(c)
