"""The ``layout`` variant of the shared-prefix generators: same tokens, stable part first or last."""

import pytest

from prefixcache.sim import workloads as wl
from prefixcache.sim.replay import replay

B = 16


@pytest.mark.parametrize("name, kwargs, stable_len", [
    ("shared_system_prompt", dict(num_requests=6, system_len=40, unique_len=(4, 20)), 40),
    ("few_shot", dict(num_headers=2, num_questions=3, header_len=50), 50),
])
def test_layouts_reorder_the_same_tokens(name, kwargs, stable_len):
    default = wl.generate(name, seed=2, **kwargs)
    first = wl.generate(name, seed=2, layout="stable_first", **kwargs)
    last = wl.generate(name, seed=2, layout="stable_last", **kwargs)
    assert first == default  # the default layout is unchanged
    assert [r.id for r in last] == [r.id for r in first]
    for f, l in zip(first, last):
        n = len(f.prompt) - stable_len
        assert l.prompt == f.prompt[stable_len:] + f.prompt[:stable_len]
        assert n > 0 and l.output_len == f.output_len
    hits = {}
    for layout, reqs in (("first", first), ("last", last)):
        hits[layout] = replay(reqs, num_blocks=1000, block_size=B)["hit_tokens"]
    assert hits["first"] > 0 and hits["last"] == 0


def test_unknown_layout():
    with pytest.raises(ValueError, match="unknown layout 'middle'"):
        wl.shared_system_prompt(num_requests=2, layout="middle")
    with pytest.raises(ValueError, match="unknown layout"):
        wl.few_shot(num_headers=1, num_questions=1, layout="")
