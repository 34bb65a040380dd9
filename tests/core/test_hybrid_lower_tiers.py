"""The tiers below the host under multi-group layouts (the hash index's hybrid manager):
per ``(hash, group)`` key demotion to the disk and a remote store, lookups and loads
through the chain, per-tier attribution of every hit (manager counters, replay summary
and records, KV events' ``medium``, transfers' ``group``), miss reasons, a corrupted
page, a store shared by two managers, and the refusals."""

from __future__ import annotations

import random

import pytest

from prefixcache import CacheConfig
from prefixcache.core import KVCacheManager, Request
from prefixcache.core.kv_groups import parse_kv_groups
from prefixcache.core.tiers import RemoteStore, TierHit, TierTransfer, key_of
from prefixcache.sim.replay import replay
from prefixcache.sim.trace import TraceRequest

BS = 4
SW = parse_kv_groups("full,sw4")


def _run(m, rid, tokens):
    r = Request(rid, tokens)
    blocks, hit = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
    m.check_invariants()
    m.free(r)
    m.check_invariants()
    return r, blocks, hit


def test_exact_demotions_loads_events_and_attribution():
    # 6 device blocks (3 per group for a 9-token prompt), 2 host slots, 4 disk pages.
    m = KVCacheManager(6, BS, kv_cache_groups=SW, num_host_blocks=2, disk_bytes=400,
                       page_bytes=100, enable_events=True, int_event_hashes=False)
    a, _, _ = _run(m, "a", list(range(9)))  # full: blocks 0, 1 cached; sw: 3, 4
    m.take_host_transfers()
    m.take_events()
    a0, a1 = a.block_hashes[:2]
    # b takes every block: free queue [2, 1, 0, 5, 4, 3] (each group's table reversed).
    # Full a1 (block 1), then full a0 (block 0) go to the host; then sw a1 (block 4)
    # and sw a0 (block 3) push them on to the disk, least recently demoted first.
    _run(m, "b", list(range(100, 109)))
    got = m.take_host_transfers()
    assert [(type(t).__name__, t.kind, t.group) for t in got] == [
        ("GroupHostTransfer", "store", 0), ("GroupHostTransfer", "store", 0),
        ("TierTransfer", "store", 0), ("GroupHostTransfer", "store", 1),
        ("TierTransfer", "store", 0), ("GroupHostTransfer", "store", 1)]
    # A disk page is named by the plain digest and the group (the engine's page files).
    assert got[2] == TierTransfer("store", "host", 0, "disk", key_of(a1), key_of(a1), 0)
    assert got[4] == TierTransfer("store", "host", 1, "disk", key_of(a0), key_of(a0), 0)
    assert tuple(got[3]) == ("store", 4, 0) and got[3].group == 1
    disk = m.tier_chain.get("disk")
    assert list(disk.entries) == [a1 + bytes(4), a0 + bytes(4)]
    assert [disk.page_key(h) for h in disk.entries] == [(key_of(a1), 0), (key_of(a0), 0)]
    events = [(type(e).__name__, e.medium, e.group_idx, e.block_hashes)
              for e in m.take_events() if e.medium in ("CPU", "DISK")]
    assert ("BlockStored", "DISK", 0, [a1]) in events
    assert ("BlockRemoved", "CPU", 0, [a1]) in events
    assert ("BlockStored", "CPU", 1, [a1]) in events
    # a again: full a0, a1 from the disk; sw a1 from the host (sw a0 lies before the
    # window of the 9th token: a null slot, not loaded). Both positions count as disk
    # hits: a position is attributed to the slowest tier any group loaded it from.
    r, blocks, hit = _run(m, "a2", list(range(9)))
    assert hit == 8
    assert [type(b).__name__ for b in blocks.blocks[0]] == ["TierHit", "TierHit"]
    assert type(blocks.blocks[1][1]).__name__ == "HostHit"
    assert m.hit_tokens_by_tier == {"device": 0, "host": 0, "disk": 8}
    loads = [t for t in m.take_host_transfers() if t.kind == "load"]
    assert [(type(t).__name__, t.group) for t in loads] == [
        ("TierTransfer", 0), ("TierTransfer", 0), ("GroupHostTransfer", 1)]
    assert [t.key for t in loads[:2]] == [key_of(a0), key_of(a1)]
    assert a1 + bytes(4) not in disk and a0 + bytes(4) not in disk  # (exclusive)


def _trace(n=80, seed=0):
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 50) for _ in range(4 * BS + 1)] for _ in range(8)]
    return [TraceRequest(f"r{i}", list(rng.choice(systems))
                         + [rng.randrange(50, 90) for _ in range(rng.randrange(1, 7))], 3)
            for i in range(n)]


@pytest.mark.parametrize("layout", ["full,sw6", "full,mamba"])
def test_replay_host_and_disk_equal_a_larger_host_and_attribution_adds_up(layout):
    groups = parse_kv_groups(layout)
    base = dict(num_blocks=16, block_size=BS, kv_cache_groups=groups)
    runs = {}
    for name, tiers in (("host", dict(num_host_blocks=14)),
                        ("host+disk", dict(num_host_blocks=6, disk_bytes=800, page_bytes=100)),
                        ("small", dict(num_host_blocks=6))):
        recs = []
        s = replay(_trace(), cache_config=CacheConfig(**base, **tiers),
                   on_record=recs.append, concurrency=2)
        runs[name] = (s, recs)
    s, recs = runs["host+disk"]
    # Exclusive lru tiers: host (6) + disk (8 pages) hit as one lru host of 14 slots.
    assert ([r["num_computed_tokens"] for r in recs]
            == [r["num_computed_tokens"] for r in runs["host"][1]])
    assert s["hit_tokens"] == runs["host"][0]["hit_tokens"] > runs["small"][0]["hit_tokens"]
    by = s["hit_tokens_by_tier"]
    assert by["disk"] > 0 and by["host"] > 0 and sum(by.values()) == s["hit_tokens"]
    for r in recs:  # every record's hit split by tier adds up to its hit
        assert sum(r["hit_tokens_" + t] for t in by) == r["num_computed_tokens"], r
    assert s["tiers"]["disk"]["blocks_loaded"] * BS >= by["disk"]


def test_miss_reasons_name_the_tier_that_dropped_the_block():
    cfg = CacheConfig(num_blocks=16, block_size=BS, kv_cache_groups=parse_kv_groups("full,sw6"),
                      num_host_blocks=6, disk_bytes=400, page_bytes=100)
    s = replay(_trace(), cache_config=cfg, miss_reasons=True, concurrency=2)
    reasons = s["miss_reasons"]["reasons"]
    assert reasons["evicted_disk"] == reasons["evicted"] > 0  # (the disk is the last tier)
    assert reasons["evicted_device"] == reasons["evicted_host"] == 0


def test_a_corrupted_page_is_a_miss_per_group_key():
    m = KVCacheManager(6, BS, kv_cache_groups=SW, num_host_blocks=2, disk_bytes=400,
                       page_bytes=100)
    a, _, _ = _run(m, "a", list(range(9)))
    _run(m, "b", list(range(100, 109)))
    disk = m.tier_chain.get("disk")
    checked = []
    # The validator is asked per page: the plain digest and the group.
    disk.validator = lambda key, group: checked.append((key, group)) or key != key_of(
        a.block_hashes[0])
    _, blocks, hit = _run(m, "a2", list(range(9)))
    assert hit == 0 and (key_of(a.block_hashes[0]), 0) in checked
    assert disk.num_corrupt == 1 and m.tier_chain.num_corrupt == 1


def test_a_remote_store_shared_by_two_hybrid_managers():
    store = RemoteStore(800, page_bytes=100, block_size=BS)
    ms = [KVCacheManager(6, BS, kv_cache_groups=SW, num_host_blocks=2, remote=store)
          for _ in range(2)]
    _run(ms[0], "a", list(range(9)))
    _run(ms[0], "b", list(range(100, 109)))
    _run(ms[0], "c", list(range(200, 209)))  # a's keys reach the store
    _, blocks, hit = _run(ms[1], "a", list(range(9)))
    assert hit == 8 and ms[1].hit_tokens_by_tier["remote"] == 8
    assert all(type(b) is TierHit for b in blocks.blocks[0])
    # A one-group manager keys its blocks by the digest alone, another layout's group 1
    # is another kind of group: neither can share it.
    with pytest.raises(ValueError, match="another group layout"):
        KVCacheManager(6, BS, num_host_blocks=2, remote=store)
    with pytest.raises(ValueError, match="another group layout"):
        KVCacheManager(6, BS, kv_cache_groups=parse_kv_groups("full,sw8"),
                       num_host_blocks=2, remote=store)


def test_a_foreign_tier_hit_is_refused_and_changes_nothing():
    ms = [KVCacheManager(6, BS, kv_cache_groups=SW, num_host_blocks=2, disk_bytes=400,
                         page_bytes=100) for _ in range(2)]
    for m in ms:
        _run(m, "a", list(range(9)))
        _run(m, "b", list(range(100, 109)))
    r = Request("a2", list(range(9)))
    blocks, hit = ms[0].get_computed_blocks(r)
    other, _ = ms[1].get_computed_blocks(Request("a2", list(range(9))))
    with pytest.raises(ValueError, match="not a current lower-tier hit of group 0"):
        ms[0].allocate_slots(r, r.num_tokens - hit, hit, other)
    ms[0].check_invariants()
    assert ms[0].allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None


def test_the_radix_layout_index_refuses_the_tiers_by_the_rule():
    from prefixcache.core.indexes import refusal

    why = refusal("radix", SW, "lru", 2)
    assert why is not None and "radix layout index" in why
    with pytest.raises(ValueError) as e:
        KVCacheManager(6, BS, index="radix", kv_cache_groups=SW, num_host_blocks=2,
                       disk_bytes=400, page_bytes=100)
    assert str(e.value) == why


def test_a_tier_of_ones_own_under_a_hybrid_host():
    from prefixcache.core.tiers import KeyTier, TierLink

    class Slow(KeyTier):
        name = "slow"
        medium = "SLOW"
        link = TierLink(1e9, 1e-4)

    m = KVCacheManager(6, BS, kv_cache_groups=SW, num_host_blocks=2, enable_events=True,
                       tiers=({"tier": Slow, "num_blocks": 8},))
    _run(m, "a", list(range(9)))
    _run(m, "b", list(range(100, 109)))
    m.take_events()
    _, blocks, hit = _run(m, "a2", list(range(9)))
    assert hit == 8 and m.hit_tokens_by_tier == {"device": 0, "host": 0, "slow": 8}
    removed = [e for e in m.take_events() if e.medium == "SLOW"]
    assert {e.group_idx for e in removed} == {0, 1}  # (both groups' keys loaded from it)
