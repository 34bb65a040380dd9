"""A ``Request`` re-used after ``free()`` (its ``num_computed_tokens`` still claiming KV
it no longer holds) is refused at admission, for every index, tier and group layout,
before any state changes; after the documented reset (``num_computed_tokens = 0``) it
is admitted again, and no fresh block is ever cached under its prompt's hashes."""

from __future__ import annotations

import pytest

from prefixcache.core import HostHit, KVCacheManager, Request
from prefixcache.core.kv_groups import parse_kv_groups

BS = 4
CONFIGS = {
    "hash": {},
    "radix": {"index": "radix"},
    "hash+host": {"num_host_blocks": 4},
    "radix+host": {"index": "radix", "num_host_blocks": 4},
    "hybrid": {"kv_cache_groups": parse_kv_groups("full,sw6")},
    "hybrid+lfu": {"kv_cache_groups": parse_kv_groups("full,sw6"), "eviction": "lfu"},
}


def _snap(m):
    return (m.free_block_ids(), m.cached_block_ids(), m.counters(), m.running_request_ids,
            m.num_free_blocks)


def _admit(m, r):
    blocks, n = m.get_computed_blocks(r)
    new = m.allocate_slots(r, r.num_tokens - n, n, blocks)
    assert new is not None
    r.num_computed_tokens = r.num_tokens
    return n


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_freed_request_is_refused_until_reset(name):
    m = KVCacheManager(16, BS, free_order="unhashed_first", **CONFIGS[name])
    other = Request("o", list(range(100, 111)))
    _admit(m, other)
    r = Request("r", list(range(11)))
    _admit(m, r)
    m.free(r)  # r.num_computed_tokens == 11: KV it no longer holds
    m.check_invariants()
    before = _snap(m)
    # The whole prompt as computed, no hit, one new token: today's main would take
    # fresh blocks and cache them under r's hashes.
    r.append_output_token_ids(7)
    with pytest.raises(ValueError, match=r"num_computed_tokens=11 but holds no blocks"):
        m.allocate_slots(r, 1)
    with pytest.raises(ValueError, match=r"num_computed_tokens=11 but holds no blocks"):
        blocks, n = m.get_computed_blocks(r)
        m.allocate_slots(r, r.num_tokens - n, n, blocks)
    assert _snap(m)[:2] == before[:2] and _snap(m)[3:] == before[3:]
    m.check_invariants()
    # The documented reset: recompute from the cached prefix.
    r.num_computed_tokens = 0
    hit = _admit(m, r)
    assert hit == 8  # its two full blocks are still cached (the pool kept them)
    m.check_invariants()
    assert sorted(m.running_request_ids) == ["o", "r"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fresh_blocks_are_never_cached_under_a_stale_claim(name):
    # Pool pressure evicts r's blocks after free; the stale claim must not get fresh
    # (uncomputed) blocks cached under r's prompt hashes for a later request to hit.
    groups = len(CONFIGS[name].get("kv_cache_groups") or [None])
    m = KVCacheManager(6 * groups, BS, free_order="unhashed_first", **CONFIGS[name])
    r = Request("r", list(range(9)))
    _admit(m, r)
    m.free(r)
    filler = Request("f", list(range(200, 221)))  # 6 blocks: evicts every cached block
    _admit(m, filler)
    m.free(filler)
    with pytest.raises(ValueError, match="holds no blocks"):
        m.allocate_slots(r, 1)
    m.check_invariants()
    probe = Request("p", list(range(9)))
    blocks, n = m.get_computed_blocks(probe)
    if m.num_host_blocks:  # the real KV went to the host tier when evicted
        assert n == 8 and all(type(b) is HostHit for b in blocks.blocks[0])
    else:  # nothing holds r's prefix on the device
        assert n == 0
