"""A priority changed after construction is validated where it enters (issue 25): None,
NaN, a bool or a float is refused by the setter and nothing changes, so `free()` under the
`priority` policy cannot fail halfway and `check_invariants()` holds."""

from __future__ import annotations

import math

import pytest

from prefixcache import KVCacheManager, Request


@pytest.mark.parametrize("index", ["hash", "radix"])
@pytest.mark.parametrize("bad", [None, math.nan, True, 1.5, "2"])
def test_bad_priority_is_refused_by_the_setter(index, bad):
    m = KVCacheManager(8, 2, eviction="priority", index=index)
    req = Request("r", [1, 1, 2, 2, 3], priority=2)
    blocks, hit = m.get_computed_blocks(req)
    assert m.allocate_slots(req, 5 - hit, hit, blocks) is not None
    req.num_computed_tokens = 5
    with pytest.raises(ValueError, match="priority must be an int"):
        req.priority = bad
    assert req.priority == 2
    m.free(req)  # unchanged: free works and the pool is consistent
    m.check_invariants()
    req2 = Request("r2", [1, 1, 2, 2, 4])
    req2.priority = 5
    blocks, hit = m.get_computed_blocks(req2)
    assert hit == 4 and m.allocate_slots(req2, 1, hit, blocks) is not None
    m.check_invariants()
