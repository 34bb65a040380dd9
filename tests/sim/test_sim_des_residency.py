"""Block residency in the DES (``simulate(..., residency=RATE)``): nothing changes in the
simulation, the histograms' counts are the run's own totals, sampling is a fixed subset,
off costs nothing (no key, no events)."""

import pytest

from prefixcache.sim import workloads
from prefixcache.sim.cost_model import CostModel
from prefixcache.sim.des import simulate

TRACE = workloads.generate("multi_turn", seed=1, num_conversations=16, num_turns=4)
CM = CostModel.create("tiny", "h100")


def _run(**kw):
    recs = []
    s = simulate(TRACE, cost_model=CM, num_blocks=160, block_size=16, on_record=recs.append,
                 **kw)
    return s, recs


def test_residency_changes_nothing_and_counts_the_run():
    off, recs_off = _run()
    on, recs_on = _run(residency=1.0)
    res = on.pop("residency")
    assert "residency" not in off
    assert on == off and recs_on == recs_off
    gpu = res["tiers"]["GPU"]
    assert on["evictions"] > 0
    # every ended residency is an eviction (no clears), and every hit block a reuse gap
    assert gpu["lifetime"]["count"] == gpu["hits_per_residency"]["count"] == on["evictions"]
    hit_blocks = sum(r["num_cached_tokens"] // 16 for r in recs_on)
    assert sum(r.get("num_preemptions", 0) for r in recs_on) == 0
    assert gpu["reuse_gap"]["count"] == hit_blocks > 0
    assert res["resident_at_end"]["GPU"] > 0
    for name in ("lifetime", "idle_before_evict", "reuse_gap"):  # simulated seconds
        assert gpu[name]["sum"] >= 0 and gpu[name]["p50"] is not None


def test_sampling_is_a_fixed_subset_and_checked():
    full = _run(residency=1.0)[0]["residency"]["tiers"]["GPU"]
    half = _run(residency=0.5)[0]["residency"]["tiers"]["GPU"]
    again = _run(residency=0.5)[0]["residency"]["tiers"]["GPU"]
    assert half == again
    assert 0 < half["lifetime"]["count"] < full["lifetime"]["count"]
    for bad in (0, 2.0, "1", True):
        with pytest.raises(ValueError, match="sample_rate"):
            simulate(TRACE[:2], cost_model=CM, num_blocks=160, block_size=16, residency=bad)


def test_with_miss_reasons_one_drain_feeds_both():
    on, _ = _run(residency=1.0, miss_reasons=True)
    off, _ = _run(miss_reasons=True)
    on.pop("residency")
    assert on == off
