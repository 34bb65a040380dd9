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
