"""Retention hints on the tiers below the device: the host tier and the tiers below it
hand their ``hinted`` policy the hints of the request that cached each block (as they
hand on its priority); without hints, nothing changes."""

from __future__ import annotations

import pytest

from prefixcache.core import CacheConfig, KVCacheManager, Request
from prefixcache.core.eviction import policy_clock
from prefixcache.core.request import RetentionHints
from prefixcache.sim import workloads
from prefixcache.sim.replay import replay

BS = 2
KEEP = RetentionHints(priority=5)


def _run(index, hints_on, names="abcde", hint=KEEP, **kw):
    """One-block requests through a 2-block device, one step each: ``a`` (hinted) is
    demoted first, then the others push blocks down. Returns (manager, {name: block
    hash})."""
    m = KVCacheManager(3, BS, index=index, **kw)
    tick = policy_clock(m)
    hashes = {}
    for i, name in enumerate(names):
        if tick is not None:
            tick(None, i)
        r = Request(name, [10 * i + 1, 10 * i + 2, 10 * i + 3],
                    retention=hint if (name == "a" and hints_on) else None)
        blocks, hit = m.get_computed_blocks(r)
        assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
        m.free(r)
        m.check_invariants()
        hashes[name] = r.block_hashes[0]
    return m, hashes


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_hints_keep_a_block_on_the_host(index):
    kw = dict(num_host_blocks=2, host_eviction="hinted")
    lru, h = _run(index, True, num_host_blocks=2)
    plain, _ = _run(index, False, **kw)
    hinted, _ = _run(index, True, **kw)
    # lru and hinted-without-hints drop the oldest demotion (a's block) from the host
    assert h["a"] not in lru.host_tier.hash_to_slot
    assert list(plain.host_tier.hash_to_slot) == list(lru.host_tier.hash_to_slot)
    # with a's hint the host keeps it and drops the unhinted ones instead
    assert h["a"] in hinted.host_tier.hash_to_slot
    assert hinted.host_tier.num_evicted == lru.host_tier.num_evicted > 0


@pytest.mark.parametrize("index", ["hash", "radix"])
@pytest.mark.parametrize("host_eviction", ["lru", "hinted"])
def test_hints_reach_the_disk(index, host_eviction):
    kw = dict(num_host_blocks=1, host_eviction=host_eviction, disk_bytes=200,
              page_bytes=100)
    lru, h = _run(index, True, "abcdefg", **kw)
    hinted, _ = _run(index, True, "abcdefg", disk_eviction="hinted", **kw)
    disk_lru, disk = lru.tier_chain.get("disk"), hinted.tier_chain.get("disk")
    assert disk_lru.num_evicted == disk.num_evicted > 0
    assert h["a"] not in disk_lru.entries
    assert h["a"] in disk.entries
    # the hint came with the block's request: a's entry carries it
    assert disk.entries[h["a"]].origin.retention == KEEP
    # the disk's policy keeps the driver's clock: a hint whose TTL ran out protects nothing
    short = RetentionHints(priority=5, ttl_steps=2)
    expired, _ = _run(index, True, "abcdefg", short, disk_eviction="hinted", **kw)
    assert expired.tier_chain.get("disk").policy.now == 6
    assert h["a"] not in expired.tier_chain.get("disk").entries


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_absent_hints_change_nothing_on_the_tiers(index):
    trace = workloads.generate("multi_turn", seed=0, num_conversations=10, num_turns=4)
    out = []
    for ev in ("lru", "hinted"):
        cfg = CacheConfig(num_blocks=40, block_size=16, free_order="unhashed_first",
                          index=index, num_host_blocks=20, host_eviction=ev,
                          disk_bytes=20 * 100, disk_eviction=ev, page_bytes=100)
        recs = []
        s = replay(trace, cache_config=cfg, concurrency=4, on_record=recs.append)
        counts = {k: v for k, v in s.items() if not k.endswith("_per_s")
                  and k not in ("timing", "config", "wall_s", "eviction", "host_eviction")}
        counts["tiers"] = {n: {k: v for k, v in t.items() if k != "eviction"}
                           for n, t in s["tiers"].items()}
        out.append((recs, counts))
    (recs_lru, s_lru), (recs_h, s_h) = out
    assert s_lru["tiers"]["disk"]["blocks_stored"] > s_lru["tiers"]["disk"]["num_blocks"]
    assert s_lru["hit_tokens"] > 0 and recs_lru
    assert recs_h == recs_lru
    assert s_h == s_lru
