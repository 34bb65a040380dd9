"""des with a host memory tier: the load time is charged to the step that promotes, hits
are split device / host, bad input fails before anything runs."""

import math

import pytest

from prefixcache.sim import cluster
from prefixcache.sim import cost_model as cm
from prefixcache.sim import des
from prefixcache.sim import workloads as wl
from prefixcache.sim.trace import TraceRequest

BS = 4  # tokens per block
A = list(range(1, 18))  # 17 tokens: 4 full blocks


def _link(bandwidth, latency_s=0.0):
    return cm.HostLink("test", bandwidth, 1.0, latency_s)


def _cost(link=None):
    return cm.CostModel.create("llama_3_1_8b", "h200", host_link=link)


def _sequential():
    """A, four unrelated fillers that push A's blocks out of an 8-block device pool,
    then A' = A's 16 cached tokens + 9 new ones. 100 s apart: each runs alone."""
    reqs = [TraceRequest(id="a", prompt=A, output_len=1, timestamp=0.0)]
    for i in range(4):
        reqs.append(TraceRequest(id=f"f{i}", prompt=[100 * (i + 1) + j for j in range(17)],
                                 output_len=1, timestamp=100.0 * (i + 1)))
    reqs.append(TraceRequest(id="a2", prompt=A[:16] + [900 + j for j in range(9)],
                             output_len=1, timestamp=1000.0))
    return reqs


def _run(reqs, cost, **kw):
    recs = []
    kw.setdefault("num_blocks", 8)
    kw.setdefault("block_size", BS)
    summary = des.simulate(reqs, cost_model=cost, on_record=recs.append, **kw)
    return summary, {r["id"]: r for r in recs}


def test_host_hit_is_charged_its_load_time_to_the_promoting_step():
    off, off_recs = _run(_sequential(), _cost())
    assert off_recs["a2"]["num_cached_tokens"] == 0  # A's blocks were evicted for good
    assert "host_hit_tokens" not in off and "num_host_tokens" not in off_recs["a2"]

    block_bytes = _cost().block_bytes(BS)
    by_bw = {}
    for bw in (math.inf, 1e12, 1e9, 1e6):
        cost = _cost(_link(bw, latency_s=5e-6 if bw != math.inf else 0.0))
        summary, recs = _run(_sequential(), cost, num_host_blocks=32)
        a2 = recs["a2"]
        # The chain goes on in the host tier: all 4 blocks of the prefix, none on device.
        assert (a2["num_cached_tokens"], a2["num_host_tokens"]) == (16, 16)
        assert summary["host_hit_tokens"] == 16
        assert summary["device_hit_tokens"] == summary["hit_tokens"] - 16
        assert summary["host_blocks_loaded"] == 4
        assert summary["host_bytes_loaded"] == 4 * block_bytes
        assert summary["host_load_steps"] == 1
        assert summary["host_blocks_stored"] >= 4
        load = cost.load_time(4 * block_bytes)
        assert summary["host_load_s"] == pytest.approx(load)
        # TTFT = the prefill of the 9 new tokens over 16 cached ones + the load.
        assert a2["ttft_s"] == pytest.approx(cost.prefill_time(9, 16) + load, rel=1e-9)
        by_bw[bw] = a2["ttft_s"]
        for rid in ("a", "f0", "f1", "f2", "f3"):  # cold requests: no load, as off
            assert recs[rid]["ttft_s"] == pytest.approx(off_recs[rid]["ttft_s"], rel=1e-12)
            assert recs[rid]["num_host_tokens"] == 0
    # Infinite bandwidth (no latency) = no charge at all: exactly the compute.
    assert by_bw[math.inf] == pytest.approx(_cost().prefill_time(9, 16), rel=1e-9)
    ttfts = [by_bw[bw] for bw in (math.inf, 1e12, 1e9, 1e6)]
    assert all(a < b for a, b in zip(ttfts, ttfts[1:])), ttfts  # slower link, later token
    # A free load is never worse than recomputing the prefix; a very slow one is (a
    # 25-token prefill of an 8B model is bound by reading the weights: ~3 ms either way).
    assert by_bw[math.inf] <= off_recs["a2"]["ttft_s"] < by_bw[1e6]


def test_busy_workload_ttft_grows_with_load_time():
    reqs = wl.generate("multi_turn", seed=5, num_conversations=10, num_turns=4,
                       new_tokens=(20, 60), output_len=(2, 8), start_window_s=2.0,
                       turn_gap_s=(0.2, 1.0), vocab=500)
    kw = dict(num_blocks=24, block_size=16, num_host_blocks=200)
    free, _ = _run(reqs, _cost(_link(math.inf)), **kw)
    slow, _ = _run(reqs, _cost(_link(1e7, 1e-4)), **kw)
    assert free["host_hit_tokens"] > 0 and free["host_load_s"] == 0.0
    assert slow["host_load_s"] > 0
    assert slow["ttft_s"]["mean"] > free["ttft_s"]["mean"]
    off, _ = _run(reqs, _cost(), num_blocks=24, block_size=16)
    assert free["hit_tokens"] > off["hit_tokens"]  # the tier recovers evicted prefixes


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(num_host_blocks=-1), ValueError, "num_host_blocks must be >= 0"),
    (dict(num_host_blocks=True), TypeError, "num_host_blocks must be an int"),
    (dict(num_host_blocks=2.0), TypeError, "num_host_blocks must be an int"),
    (dict(num_host_blocks=8, host_eviction="mru"), ValueError, "mru"),
])
def test_bad_host_tier_input_fails_before_anything_runs(kwargs, err, match):
    recs = []
    with pytest.raises(err, match=match):
        des.simulate(_sequential(), cost_model=_cost("h200_pcie5"), num_blocks=8,
                     block_size=BS, on_record=recs.append, **kwargs)
    assert recs == []


def test_a_host_tier_needs_a_host_link():
    with pytest.raises(ValueError, match="no host_link"):
        des.simulate(_sequential(), cost_model=_cost(), num_blocks=8, block_size=BS,
                     num_host_blocks=8)
    with pytest.raises(ValueError, match="no host_link"):
        cluster.simulate_cluster(_sequential(), num_replicas=2, router="round_robin",
                                 cost_model=_cost(), num_blocks=8, block_size=BS,
                                 num_host_blocks=8)


def test_cluster_of_one_equals_des_with_a_host_tier():
    cost = _cost("h200_pcie5")
    alone, _ = _run(_sequential(), cost, num_host_blocks=32)
    # kv_events reads the tiers from the events (tests/sim/test_sim_tier_router.py).
    for router in ("round_robin", "kv_events"):
        one = cluster.simulate_cluster(_sequential(), num_replicas=1, router=router,
                                       cost_model=cost, num_blocks=8, block_size=BS,
                                       num_host_blocks=32, check_every=1)
        for key in ("hit_tokens", "device_hit_tokens", "host_hit_tokens", "host_blocks_loaded",
                    "host_bytes_loaded", "host_load_s", "host_blocks_stored", "ttft_s",
                    "makespan_s", "steps"):
            assert one[key] == alone[key], (router, key)


def test_overlapped_loads_cost_only_what_compute_does_not_hide():
    block_bytes = _cost().block_bytes(BS)
    for bw in (1e12, 1e6):
        cost = _cost(_link(bw, latency_s=5e-6))
        summary, recs = _run(_sequential(), cost, num_host_blocks=32, host_load_overlap=True)
        load, compute = cost.load_time(4 * block_bytes), cost.prefill_time(9, 16)
        assert summary["host_load_overlap"] is True
        assert recs["a2"]["ttft_s"] == pytest.approx(max(compute, load), rel=1e-9)
        assert summary["host_load_s"] == pytest.approx(max(compute, load) - compute, abs=1e-12)
        serial, serial_recs = _run(_sequential(), cost, num_host_blocks=32)
        assert serial["host_load_overlap"] is False
        assert recs["a2"]["ttft_s"] < serial_recs["a2"]["ttft_s"]
    # 1e12 B/s: 2 MiB load in ~7 us, hidden behind a ~3 ms step -> nothing charged.
    fast, _ = _run(_sequential(), _cost(_link(1e12, 5e-6)), num_host_blocks=32,
                   host_load_overlap=True)
    assert fast["host_load_s"] == 0.0
    with pytest.raises(ValueError, match="host_load_overlap must be a bool"):
        _run(_sequential(), _cost(_link(1e9)), num_host_blocks=32, host_load_overlap="yes")
