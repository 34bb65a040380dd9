"""The tier chain below the host (``prefixcache.core.tiers``): disk and a remote store
shared by replicas, on hand-sized pools (exact transfers), a random-ops page model
(every copy applied to a model of pages: a loaded block holds its hash), the disk
validator, preload and the refusals."""

from __future__ import annotations

import random

import pytest

from prefixcache.core import HostTransfer, KVCacheManager, Request
from prefixcache.core.tiers import (
    DiskTier,
    KeyTier,
    RemoteStore,
    TierHit,
    TierLink,
    TierTransfer,
    get_tier_class,
    key_of,
)

BS = 4


def _admit(m, req):
    blocks, hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    assert new is not None
    return blocks, hit


def _run(m, rid, tokens):
    r = Request(rid, tokens)
    _, hit = _admit(m, r)
    m.free(r)
    m.check_invariants()
    return r, hit


def test_disk_exact_transfers_and_hit():
    # device 3 blocks, host 1 slot, disk 2 pages (200 bytes / 100 per page).
    m = KVCacheManager(3, BS, num_host_blocks=1, disk_bytes=200, page_bytes=100)
    a, _ = _run(m, "a", list(range(9)))  # caches a0 (block 0), a1 (block 1)
    assert m.take_host_transfers() == []
    # free queue [2, 1, 0] (a's blocks in reverse): b evicts a1 -> host slot 0, then
    # a0 -> host slot 0 after a1 moves on to the disk.
    _run(m, "b", list(range(100, 109)))
    a0, a1 = a.block_hashes[:2]
    k1 = key_of(a1)
    assert m.take_host_transfers() == [
        HostTransfer("store", 1, 0),
        TierTransfer("store", "host", 0, "disk", k1, k1, 0),
        HostTransfer("store", 0, 0),
    ]
    assert list(m.tier_chain.tiers[0].entries) == [a1]
    # a again: a0 from the host, a1 from the disk.
    r, hit = _run(m, "a2", list(range(9)))
    assert hit == 8
    ts = m.take_host_transfers()
    loads = [t for t in ts if t.kind == "load"]
    assert type(loads[0]) is HostTransfer
    assert loads[1] == TierTransfer("load", "disk", k1, "device", loads[1].dst_id, k1, 0)
    assert m.hit_tokens_by_tier == {"device": 0, "host": 4, "disk": 4}
    assert a1 not in m.tier_chain.tiers[0]  # exclusive: the load moved it up


def test_disk_budget_evicts_by_its_policy():
    # disk of 2 pages: three demotions past the host drop the oldest (lru) for good.
    m = KVCacheManager(2, BS, num_host_blocks=1, disk_bytes=250, page_bytes=100)
    disk = m.tier_chain.tiers[0]
    assert disk.num_blocks == 2
    reqs = [_run(m, f"r{i}", list(range(100 * i, 100 * i + 5)))[0] for i in range(5)]
    # r0..r4 each cache one block; device holds r4's, host r3's, disk r1's, r2's.
    assert disk.eviction_order() == [reqs[1].block_hashes[0], reqs[2].block_hashes[0]]
    assert disk.num_evicted == 1 and disk.num_stored == 3
    fifo = KVCacheManager(2, BS, num_host_blocks=1, disk_bytes=200, page_bytes=100,
                          disk_eviction="lfu")
    assert fifo.tier_chain.tiers[0].policy is not None


def test_corrupt_disk_page_is_a_miss_never_served():
    m = KVCacheManager(2, BS, num_host_blocks=1, disk_bytes=400, page_bytes=100)
    a, _ = _run(m, "a", list(range(5)))
    for i in range(3):
        _run(m, f"x{i}", list(range(100 * (i + 1), 100 * (i + 1) + 5)))
    disk = m.tier_chain.tiers[0]
    assert a.block_hashes[0] in disk
    bad = {key_of(a.block_hashes[0])}
    disk.validator = lambda key: key not in bad
    _, hit = _run(m, "a2", list(range(5)))
    assert hit == 0 and disk.num_corrupt == 1
    assert a.block_hashes[0] not in disk  # dropped, never found again


def test_preload_keys_are_hits():
    m = KVCacheManager(4, BS, num_host_blocks=1, disk_bytes=400, page_bytes=100)
    probe = Request("p", list(range(9)))
    probe.bind_hasher(m.implementation.hasher, BS)
    keys = [key_of(h) for h in probe.block_hashes[:2]]
    assert m.tier_chain.tiers[0].preload(keys) == 2
    _, hit = _run(m, "a", list(range(9)))
    assert hit == 8 and m.hit_tokens_by_tier["disk"] == 8


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_remote_store_shared_by_replicas(index):
    store = RemoteStore(1000, page_bytes=100, block_size=BS)
    a = KVCacheManager(2, BS, index=index, num_host_blocks=1, remote=store)
    b = KVCacheManager(2, BS, index=index, num_host_blocks=1, remote=store)
    r, _ = _run(a, "a", list(range(5)))
    for i in range(2):  # push a's block past its host into the store
        _run(a, f"x{i}", list(range(100 * (i + 1), 100 * (i + 1) + 5)))
    assert r.block_hashes[0] in store
    _, hit = _run(b, "b", list(range(5)))  # another replica hits it
    assert hit == 4 and b.hit_tokens_by_tier == {"device": 0, "host": 0, "remote": 4}
    assert r.block_hashes[0] in store  # inclusive: the store keeps it
    k = key_of(r.block_hashes[0])
    assert [t for t in b.take_host_transfers() if type(t) is TierTransfer] == [
        TierTransfer("load", "remote", k, "device", 0, k, 0)]


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_events_carry_each_tiers_medium(index):
    m = KVCacheManager(2, BS, index=index, num_host_blocks=1, disk_bytes=200, page_bytes=100,
                       remote_bytes=500, enable_events=True)
    media = set()
    for i in range(6):  # (events taken every step: the list is swapped each time)
        _run(m, f"r{i}", list(range(100 * i, 100 * i + 5)))
        media |= {e.medium for e in m.take_events()}
    assert media == {"GPU", "CPU", "DISK", "REMOTE"}


def test_user_tier_class_and_registry():
    class Slow(KeyTier):
        name = "slow"
        medium = "SLOW"
        link = TierLink(1e9, 1e-3)

    m = KVCacheManager(2, BS, num_host_blocks=1, tiers=({"tier": Slow, "num_blocks": 4},))
    r, _ = _run(m, "a", list(range(5)))
    for i in range(2):
        _run(m, f"x{i}", list(range(100 * (i + 1), 100 * (i + 1) + 5)))
    _, hit = _run(m, "a2", list(range(5)))
    assert hit == 4 and m.hit_tokens_by_tier["slow"] == 4
    assert get_tier_class("disk") is DiskTier and get_tier_class("remote") is RemoteStore


@pytest.mark.parametrize("kwargs, match", [
    ({"disk_bytes": 100, "page_bytes": 100}, "need a host tier"),
    ({"num_host_blocks": 1, "disk_bytes": 100}, "page_bytes"),
    ({"num_host_blocks": 1, "disk_bytes": 50, "page_bytes": 100}, "holds no page"),
    ({"num_host_blocks": 1, "disk_bytes": -1, "page_bytes": 100}, "disk_bytes"),
    ({"num_host_blocks": 1, "disk_bytes": 100, "page_bytes": 100, "disk_eviction": "belady"},
     "disk_eviction"),
    ({"num_host_blocks": 1, "remote": "shared"}, "remote must be a shared RemoteStore"),
    ({"num_host_blocks": 1, "tiers": ({"tier": "nope", "num_blocks": 2},)}, "unknown tier"),
    ({"num_host_blocks": 1, "kv_cache_groups": "full,sw8", "disk_bytes": 100}, "page_bytes"),
    ({"kv_cache_groups": "full,sw8", "disk_bytes": 100, "page_bytes": 100},
     "need a host tier"),
    ({"num_host_blocks": 1, "index": "radix", "kv_cache_groups": "full,sw8",
      "disk_bytes": 100, "page_bytes": 100}, "not supported with KV cache groups"),
])
def test_refusals_name_the_argument(kwargs, match):
    from prefixcache.core.kv_groups import parse_kv_groups

    kwargs = dict(kwargs)
    if "kv_cache_groups" in kwargs:
        kwargs["kv_cache_groups"] = parse_kv_groups(kwargs["kv_cache_groups"])
    with pytest.raises(ValueError, match=match):
        KVCacheManager(4, BS, **kwargs)


@pytest.mark.parametrize("index", ["hash", "radix"])
@pytest.mark.parametrize("seed", range(3))
def test_random_ops_page_model(seed, index):
    """Every recorded copy applied to a model of pages: each block a request is given
    for a hit holds the hit's hash (no copy reads a page another copy overwrote)."""
    rng = random.Random(seed)
    store = RemoteStore(600, page_bytes=100, block_size=BS)
    ms = [KVCacheManager(5, BS, index=index, num_host_blocks=2, disk_bytes=300, page_bytes=100,
                         remote=store, disk_eviction=rng.choice(["lru", "fifo", "lfu"]))
          for _ in range(2)]
    device = [dict() for _ in ms]
    host = [dict() for _ in ms]
    disk = [dict() for _ in ms]
    remote: dict = {}
    prompts = [list(range(100 * p, 100 * p + 4 * rng.randint(1, 3) + 1)) for p in range(6)]
    for step in range(60):
        i = rng.randrange(2)
        m = ms[i]
        r = Request(f"{i}-{step}", prompts[rng.randrange(len(prompts))])
        blocks, hit = m.get_computed_blocks(r)
        if m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is None:
            continue
        for t in m.take_host_transfers():
            if type(t) is HostTransfer:
                if t.kind == "store":
                    host[i][t.host_slot] = device[i][t.block_id]
                else:
                    device[i][t.block_id] = host[i][t.host_slot]
                continue
            src = {"device": device[i], "host": host[i], "disk": disk[i], "remote": remote}
            page = src[t.src][t.src_id]
            src[t.dst][t.dst_id] = page
            assert page == t.key
        table = m.get_block_ids(r.request_id)
        for pos in range(hit // BS):
            assert device[i][table[pos]] == key_of(r.block_hashes[pos]), (step, pos)
        for pos in range(hit // BS, (r.num_tokens) // BS):  # computed: the model writes
            device[i][table[pos]] = key_of(r.block_hashes[pos])
        m.free(r)
        m.check_invariants()
    assert sum(m.hit_tokens_by_tier.get("remote", 0) for m in ms) > 0


def test_miss_reasons_name_each_tier():
    from prefixcache.core.misses import MissAccountant

    m = KVCacheManager(2, BS, num_host_blocks=1, disk_bytes=100, page_bytes=100)
    acct = MissAccountant.for_manager(m)
    reqs = [_run(m, f"r{i}", list(range(100 * i, 100 * i + 5)))[0] for i in range(5)]
    # r0's block went device -> host -> disk -> gone; r2's is on the disk now.
    r = Request("again0", list(range(5)))
    _, hit = m.get_computed_blocks(r)
    assert hit == 0 and acct.classify(r, 0) == {"evicted": 1, "evicted_disk": 1, "partial": 1}
    disk = m.tier_chain.tiers[0]
    assert reqs[2].block_hashes[0] in disk
    disk.validator = lambda key: False
    r = Request("again2", list(range(200, 205)))
    _, hit = m.get_computed_blocks(r)
    assert hit == 0 and acct.classify(r, 0) == {"evicted": 1, "corrupt_disk": 1, "partial": 1}


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_stale_tier_hit_is_refused_before_any_change(index):
    m = KVCacheManager(2, BS, index=index, num_host_blocks=1, disk_bytes=400, page_bytes=100)
    a, _ = _run(m, "a", list(range(5)))
    for i in range(2):
        _run(m, f"x{i}", list(range(100 * (i + 1), 100 * (i + 1) + 5)))
    r = Request("a2", list(range(5)))
    blocks, hit = m.get_computed_blocks(r)
    assert hit == 4 and type(blocks.blocks[0][0]) is TierHit
    disk = m.tier_chain.get("disk")
    disk.discard(a.block_hashes[0])  # the entry changed since the lookup
    m.take_host_transfers()
    before = (m.free_block_ids(), list(disk.entries), m.hit_tokens_by_tier)
    with pytest.raises(ValueError, match="not a current tier hit"):
        m.allocate_slots(r, r.num_tokens - hit, hit, blocks)
    assert m.take_host_transfers() == []  # no copy recorded
    assert (m.free_block_ids(), list(disk.entries), m.hit_tokens_by_tier) == before
    m.check_invariants()


def test_lower_tier_lru_map_equals_the_keyed_policy():
    # The disk's lru (its ordered map, no policy object) and the keyed LRUPolicy
    # (fast_path False), under the host's fast and keyed lru: the same hits, the same
    # transfers, the same disk contents in the same eviction order.
    from prefixcache.sim import workloads

    reqs = workloads.generate("multi_turn", seed=3, num_conversations=10, num_turns=4)
    runs = []
    for host_opts, disk_opts in ((None, None), (None, {"fast_path": False}),
                                 ({"fast_path": False}, {"fast_path": False})):
        m = KVCacheManager(40, 16, num_host_blocks=8, host_eviction_options=host_opts,
                           disk_bytes=20000, page_bytes=100, disk_eviction_options=disk_opts)
        disk = m.tier_chain.get("disk")
        assert (disk.policy is None) == (disk_opts is None)
        hits, transfers, running = [], [], []
        for i, tr in enumerate(reqs):
            req = Request(str(i), tr.prompt)
            while True:
                blocks, hit = m.get_computed_blocks(req)
                new = m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
                if new is not None or not running:
                    break
                m.free(running.pop(0))
            hits.append(hit)
            if new is not None:
                running.append(req)
            if len(running) > 3:
                m.free(running.pop(0))
            transfers += m.take_host_transfers()
            m.check_invariants()
        runs.append((hits, transfers, disk.eviction_order(), disk.num_evicted,
                     m.hit_tokens_by_tier))
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][3] > 0 and runs[0][4]["disk"] > 0  # disk evictions and hits happened
