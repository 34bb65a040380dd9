"""experiments.hybrid_state's policy variants (a label -> a policy with options): the
options reach the manager (marconi min-max at alpha 0 replays exactly as LRU; at a
large alpha it does not), rows name what ran, and bad variants are refused before any
cell runs."""

from __future__ import annotations

import pytest

from configs import hybrid_state as hs_config
from experiments import hybrid_state


def _small(**over):
    c = hs_config.get_config("quick")
    c.workload_kwargs.multi_turn.num_conversations = 12
    c.capacities = "96"
    c.layouts = "full;mamba|full;sw32"
    for k, v in over.items():
        setattr(c, k, v)
    return c


def test_variants_reach_the_manager_and_name_their_rows():
    c = _small(policies="lru,mm0,mm8")
    c.policy_variants = {
        "mm0": {"eviction": "marconi", "options": {"normalization": "minmax", "alpha": 0}},
        "mm8": {"eviction": "marconi", "options": {"normalization": "minmax", "alpha": 8.0}},
    }
    rows = hybrid_state.run(c)["rows"]
    by = {(r["layout"], r["policy"]): r for r in rows}
    assert len(by) == 6
    for layout in ("full,mamba", "full,sw32"):
        lru, mm0, mm8 = (by[(layout, p)] for p in ("lru", "mm0", "mm8"))
        assert lru["evictions"] > 0
        assert (mm0["hit_tokens"], mm0["evictions"]) == (lru["hit_tokens"], lru["evictions"])
        assert mm0["eviction"] == "marconi"
        assert mm0["eviction_options"] == {"normalization": "minmax", "alpha": 0}
        assert lru["eviction"] == "lru" and lru["eviction_options"] == {}
    # a heavy FLOP weight keeps deep states over recent attention blocks: other hits
    assert by[("full,mamba", "mm8")]["hit_tokens"] != by[("full,mamba", "lru")]["hit_tokens"]


@pytest.mark.parametrize("variants,match", [
    ({"v": {"eviction": "nope"}}, "nope"),
    ({"v": {"eviction": "marconi", "options": {"normalization": "zscore"}}}, "normalization"),
    ({"v": {"eviction": "marconi", "options": {"gamma": 1}}}, r"policy_variants\['v'\].*gamma"),
    ({"v": {"options": {}}}, r"policy_variants\['v'\] must be"),
    ({"v": {"eviction": "belady"}}, "future"),
])
def test_bad_variants_are_refused_before_any_cell(variants, match):
    c = _small(policies="lru,v")
    c.policy_variants = variants
    with pytest.raises(ValueError, match=match):
        hybrid_state.cells(c)


def test_an_unknown_label_is_an_unknown_policy():
    with pytest.raises(ValueError, match="mm9"):
        hybrid_state.cells(_small(policies="lru,mm9"))


def test_a_tuned_variant_picks_the_best_value_on_the_prefix_and_reports_held_out():
    from prefixcache.core.kv_groups import parse_kv_groups
    from prefixcache.sim import workloads
    from prefixcache.sim.replay import replay

    c = _small(policies="lru,mmt", layouts="full;mamba", tune_fraction=0.5)
    grid = [8.0, 0, 0.2]
    c.policy_variants = {"mmt": {"eviction": "marconi", "options": {"normalization": "minmax"},
                                 "tune": {"option": "alpha", "grid": grid}}}
    rows = {r["policy"]: r for r in hybrid_state.run(c)["rows"]}
    trace = workloads.generate("multi_turn", seed=c.seed, **{
        k: tuple(v) if isinstance(v, list) else v
        for k, v in dict(c.workload_kwargs["multi_turn"]).items()})
    n = len(trace) // 2
    kw = dict(num_blocks=96, block_size=16, hash_algo=c.hash_algo, hash_seed=0,
              free_order=c.free_order, concurrency=c.concurrency,
              kv_cache_groups=parse_kv_groups("full,mamba"))
    by_value = {x: replay(trace[:n], eviction="marconi", eviction_options={
        "normalization": "minmax", "alpha": x}, **kw)["hit_tokens"] for x in grid}
    assert len(set(by_value.values())) > 1  # (the grid matters on this prefix)
    best = max(grid, key=lambda x: (by_value[x], -grid.index(x)))
    t = rows["mmt"]["tuned"]
    assert t["option"] == "alpha" and t["value"] == best and t["requests"] == n
    assert t["hit_tokens_by_value"] == {str(x): by_value[x] for x in grid}
    assert rows["mmt"]["eviction_options"] == {"normalization": "minmax", "alpha": best}
    assert rows["lru"]["tuned"] is None
    # held out: the requests after the prefix, from the replay's per-request records
    recs = []
    replay(trace, eviction="lru", on_record=recs.append, **kw)
    tail = recs[n:]
    want = sum(r["num_computed_tokens"] for r in tail) / sum(r["prompt_tokens"] for r in tail)
    assert rows["lru"]["heldout_hit_rate_tokens"] == pytest.approx(want)
    assert 0 < want < 1


@pytest.mark.parametrize("tune,match", [
    ({"option": "alpha"}, r"\['tune'\] must be"),
    ({"option": "alpha", "grid": []}, r"\['tune'\] must be"),
    ({"option": "alpha", "grid": [1, -1]}, "alpha"),
    ({"option": "gamma", "grid": [1]}, "gamma"),
])
def test_bad_tuning_is_refused_before_any_cell(tune, match):
    c = _small(policies="lru,v")
    c.policy_variants = {"v": {"eviction": "marconi", "tune": tune}}
    with pytest.raises(ValueError, match=match):
        hybrid_state.cells(c)


@pytest.mark.parametrize("fraction", [0.0, 1.0, 1.5, -0.25])
def test_bad_tune_fraction_is_refused(fraction):
    with pytest.raises(ValueError, match="tune_fraction"):
        hybrid_state.cells(_small(tune_fraction=fraction))
