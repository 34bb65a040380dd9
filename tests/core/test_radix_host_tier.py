"""The radix index with a host tier (``KVCacheManager(index="radix", num_host_blocks=N)``).

Exact transfers and events on a hand-sized pool, failure atomicity, stale and misplaced
hits, reset, the hash index's stateful property test run over the tree (invariants and
the numpy page model rebuilt from the transfer log), and the replay: a host tier holding
every evicted block = the infinite cache's hits, and radix+host hits = hash+host hits
where both indexes evict the same blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant
from test_host_tier import ONLINE, WIDTH, HostTierMachine, _page

from prefixcache.core import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    HostHit,
    HostTransfer,
    KVCacheManager,
    Request,
)
from prefixcache.core.radix import RadixKVCacheManager
from prefixcache.sim import workloads
from prefixcache.sim.replay import replay


def _admit(m, req):
    blocks, hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    return blocks, hit, new


# ----------------------------------------------------------------- exact behaviour
def test_off_is_the_plain_tree():
    m = KVCacheManager(8, 4, index="radix")
    assert type(m.implementation) is RadixKVCacheManager and m.host_tier is None
    for name in ("get_computed_blocks", "peek_computed_tokens", "_allocate_slow", "_cache"):
        assert name not in vars(m.implementation)
    assert m.take_host_transfers() == [] and m.num_host_cached_blocks == 0
    assert (m.host_hit_tokens, m.host_blocks_loaded, m.host_blocks_stored) == (0, 0, 0)


def test_demotion_lookup_promotion_exact_transfers_and_events():
    m = KVCacheManager(6, 4, num_host_blocks=3, enable_events=True, index="radix")
    a = Request("a", list(range(17)))  # 4 full blocks (nodes 0-3) + block 4 partial
    _admit(m, a)
    m.free(a)  # the unhashed block 4, then blocks 5 (never used); leaves first: 3, 2, 1, 0
    m.take_events()
    b = Request("b", list(range(100, 117)))
    _, _, new = _admit(m, b)
    # b takes the unhashed 4, 5, then evicts the leaves 3, 2, 1 (a's deepest first):
    # demoted into host slots 0, 1, 2; block 0 (a's first) stays a node.
    assert [x.block_id for x in new] == [4, 5, 3, 2, 1]
    assert m.take_host_transfers() == [
        HostTransfer("store", 3, 0), HostTransfer("store", 2, 1), HostTransfer("store", 1, 2)]
    ev = m.take_events()
    # Each demotion: the GPU removal, then the CPU store with its parent's hash.
    assert [(type(e).__name__, e.medium) for e in ev[:6]] == [
        ("BlockRemoved", "GPU"), ("BlockStored", "CPU")] * 3
    assert [e.parent_block_hash for e in ev[1:6:2]] == [
        m._event_hash(h) for h in (a.block_hashes[2], a.block_hashes[1], a.block_hashes[0])]
    assert all(e.token_ids == [] for e in ev[1:6:2])
    assert m.num_host_cached_blocks == 3 and m.num_cached_blocks == 5
    m.check_invariants()
    m.free(b)
    c = Request("c", list(range(17)))
    assert m.peek_computed_tokens(c) == 16
    blocks, hit, new = _admit(m, c)
    # Lookup: node 0 on the device, then a's blocks 1, 2, 3 on the host (by hash).
    assert hit == 16 and type(blocks[0]).__name__ == "KVCacheBlock"
    assert [type(x) for x in blocks[1:]] == [HostHit] * 3
    assert [x.host_slot for x in blocks[1:]] == [2, 1, 0]
    # Promotion: the three fresh blocks are b's unhashed partial block 1, then b's
    # leaves 2, 3 (deepest first); the host is full of pinned entries -> those two are
    # dropped. Then c's partial block evicts b's next leaf, block 5, stored into the
    # slot the first load freed.
    assert [x.block_id for x in blocks] == [0, 1, 2, 3] and [x.block_id for x in new] == [5]
    assert m.get_block_ids("c") == [0, 1, 2, 3, 5]
    assert m.take_host_transfers() == [
        HostTransfer("load", 1, 2), HostTransfer("load", 2, 1), HostTransfer("load", 3, 0),
        HostTransfer("store", 5, 2)]
    ev = m.take_events()
    gpu_stored = [e for e in ev if type(e) is BlockStored and e.medium == "GPU"]
    # The loaded run: one event, with its tokens and its parent (device node 0).
    assert [len(e.block_hashes) for e in gpu_stored] == [3]
    assert gpu_stored[0].parent_block_hash == m._event_hash(a.block_hashes[0])
    assert gpu_stored[0].token_ids == list(range(4, 16))
    assert sum(type(e) is BlockRemoved and e.medium == "CPU" for e in ev) == 3
    assert (m.device_hit_tokens, m.host_hit_tokens) == (4, 12)
    assert (m.host_blocks_loaded, m.host_blocks_stored) == (3, 4)
    assert m.host_tier.num_dropped == 2
    # The promoted blocks are ordinary nodes on c's path, locked by it.
    state_c = m._states["c"]
    assert [n.block.block_id for n in state_c.path] == [0, 1, 2, 3]
    assert all(n.lock == 1 for n in state_c.path)
    m.check_invariants()
    m.free(c)
    d = Request("d", list(range(17)))
    assert _admit(m, d)[1] == 16 and m.host_hit_tokens == 12  # all on the device now
    m.check_invariants()


def test_failed_allocation_changes_nothing_host_entries_included():
    m = KVCacheManager(5, 4, num_host_blocks=4, index="radix")
    a = Request("a", list(range(13)))  # nodes 0, 1, 2 + partial 3
    _admit(m, a)
    m.free(a)
    b = Request("b", list(range(50, 63)))
    # b takes 3, 4 (unhashed), then the leaves 2, 1: they go to the host, 0 stays.
    _admit(m, b)
    assert m.num_host_cached_blocks == 2
    tier = m.host_tier

    def state():
        return (m.free_block_ids(), dict(tier.hash_to_slot), list(tier.free_slots),
                tier.eviction_order(), tier.pending_transfers(), m.num_cached_blocks,
                m.num_available_blocks, m.counters()["evictions"])

    before = state()
    c = Request("c", list(range(13)))
    blocks, hit = m.get_computed_blocks(c)
    assert hit == 12 and [type(x) for x in blocks[1:]] == [HostHit, HostHit]
    # Needs node 0 (unlocked: leaves the available blocks), 2 loads and 1 new block.
    assert m.allocate_slots(c, 1, hit, blocks) is None
    assert state() == before and all(x.block_id == -1 for x in blocks[1:])
    m.check_invariants()
    m.free(b)
    assert m.allocate_slots(c, 1, hit, blocks) is not None  # the same hit list, now fits
    assert [x.block_id for x in blocks] == m.get_block_ids("c")[:3]
    assert m.host_blocks_loaded == 2
    m.check_invariants()


def test_stale_and_misplaced_host_hits_are_rejected_before_any_change():
    m = KVCacheManager(5, 4, num_host_blocks=4, index="radix")
    a = Request("a", list(range(9)))
    _admit(m, a)
    m.free(a)
    b = Request("b", list(range(50, 67)))
    _admit(m, b)
    m.free(b)
    c = Request("c", list(range(9)))
    blocks, hit = m.get_computed_blocks(c)
    assert hit == 8 and [type(x) for x in blocks] == [HostHit, HostHit]

    def state():
        return (m.free_block_ids(), dict(m.host_tier.hash_to_slot), m.num_cached_blocks,
                m.host_tier.pending_transfers())

    before = state()
    other = Request("o", list(range(9)) + [5])
    with pytest.raises(ValueError, match="not a current host-tier hit .* block #0"):
        m.allocate_slots(other, 10 - 4, 4, blocks[1:])  # a's block 1 as block 0
    with pytest.raises(ValueError, match="follows a host-tier hit"):
        m.allocate_slots(other, 1, 12, blocks + [m.blocks[0]])
    with pytest.raises(TypeError, match="follows a host-tier hit"):
        m.allocate_slots(other, 2, 12, blocks + ["x"])
    assert state() == before
    d = Request("d", list(range(9)))
    blocks_d, hit_d = m.get_computed_blocks(d)
    assert m.allocate_slots(d, 1, hit_d, blocks_d) is not None  # promotes the same entries
    m.take_host_transfers()
    before = state()
    with pytest.raises(ValueError, match="not a current host-tier hit"):
        m.allocate_slots(c, c.num_tokens - hit, hit, blocks)
    assert state() == before
    m.check_invariants()


def test_device_recomputing_a_host_hash_drops_the_host_copy():
    m = KVCacheManager(3, 2, num_host_blocks=4, enable_events=True, index="radix")
    a = Request("a", [1, 2, 3])
    _admit(m, a)
    m.free(a)
    b = Request("b", [7, 7, 7, 7, 7])  # 3 blocks: evicts a's node (1, 2)
    _admit(m, b)
    m.free(b)
    assert a.block_hashes[0] in m.host_tier.hash_to_slot
    m.take_events()
    c = Request("c", [1, 2])  # one block: cannot hit it, computes and caches it
    blocks, hit, new = _admit(m, c)
    assert hit == 0 and new is not None
    assert a.block_hashes[0] not in m.host_tier.hash_to_slot
    assert m.host_tier.num_discarded == 1
    ev = m.take_events()
    assert [(type(e).__name__, e.medium) for e in ev][-2:] == [
        ("BlockStored", "GPU"), ("BlockRemoved", "CPU")]
    m.check_invariants()


def test_reset_clears_both_tiers_one_event():
    m = KVCacheManager(4, 2, num_host_blocks=8, enable_events=True, index="radix")
    for i in range(4):
        r = Request(str(i), [i * 10 + k for k in range(5)])
        _admit(m, r)
        m.free(r)
    assert m.num_host_cached_blocks > 0
    m.take_events()
    assert m.reset_prefix_cache()
    assert m.take_events() == [AllBlocksCleared()]
    assert m.num_host_cached_blocks == 0 and m.num_cached_blocks == 0
    assert len(m.host_tier.free_slots) == 8
    m.check_invariants()
    assert m.get_computed_blocks(Request("x", [0, 1, 2, 3, 4])) == ([], 0)


def test_invariants_catch_a_hash_in_both_tiers():
    m = KVCacheManager(3, 2, num_host_blocks=4, index="radix")
    a = Request("a", [1, 2, 3])
    _admit(m, a)
    m.free(a)
    tier = m.host_tier
    h = a.block_hashes[0]
    slot = tier.slots[tier.free_slots.popleft()]
    slot.block_hash = h
    tier.hash_to_slot[h] = slot
    with pytest.raises(Exception, match="cached on the device and on the host"):
        m.check_invariants()


def test_every_online_host_policy_and_numpy_size():
    for p in ONLINE:
        m = KVCacheManager(6, 2, num_host_blocks=np.int64(3), host_eviction=p, index="radix")
        assert m.num_host_blocks == 3 and type(m.num_host_blocks) is int
        for i in range(8):
            r = Request(str(i), [i % 3, 7, 8, 9, i, 1], priority=i % 2)
            assert _admit(m, r)[2] is not None
            m.free(r)
            m.check_invariants()
        assert m.host_blocks_stored > 0, p


# --------------------------------------------------------------- stateful property
class RadixHostTierMachine(HostTierMachine):
    """``HostTierMachine`` (tests/core/test_host_tier.py) over the radix index: the same
    rules; the page model reads the tree (a request's computed blocks are its path's
    new nodes, a promoted block is a node again)."""

    @initialize(num_blocks=st.integers(1, 10), num_host=st.integers(1, 6),
                block_size=st.sampled_from([1, 2, 2, 4]),
                free_order=st.sampled_from(["append", "unhashed_first"]),
                eviction=st.sampled_from(ONLINE),
                host_eviction=st.sampled_from(ONLINE + ["keyed lru"]),
                events=st.booleans())
    def setup(self, num_blocks, num_host, block_size, free_order, eviction, host_eviction,
              events=True):
        options = None
        if host_eviction == "keyed lru":
            host_eviction, options = "lru", {"fast_path": False}
        self.m = KVCacheManager(num_blocks, block_size, free_order=free_order,
                                eviction=eviction, index="radix", num_host_blocks=num_host,
                                host_eviction=host_eviction, host_eviction_options=options,
                                enable_events=events)
        self.nb, self.nh, self.bs = num_blocks, num_host, block_size
        self.dev = np.zeros((num_blocks, WIDTH), np.float32)
        self.host = np.zeros((num_host, WIDTH), np.float32)
        self.running: list[Request] = []
        self.written: dict[str, int] = {}
        self.n = 0
        self.loads_checked = 0

    def _sync(self):
        m = self.m
        for t in m.take_host_transfers():
            if t.kind == "store":
                self.host[t.host_slot] = self.dev[t.block_id]
            else:
                assert t.kind == "load"
                self.dev[t.block_id] = self.host[t.host_slot]
                h = m.blocks[t.block_id].block_hash
                if h is not None and m._nodes[t.block_id] is not None:
                    # Promotion: byte-identical to the data the block was computed with.
                    assert self.dev[t.block_id].tobytes() == _page(h, WIDTH).tobytes()
                    self.loads_checked += 1
        for r in self.running:
            st_ = m._states[r.request_id]
            for pos in range(self.written[r.request_id], len(st_.path)):
                b = st_.blocks[pos]
                if st_.path[pos].block is b:  # a new node (a duplicate stays uncached)
                    self.dev[b.block_id] = _page(b.block_hash, WIDTH)
            self.written[r.request_id] = max(self.written[r.request_id], len(st_.path))

    @invariant()
    def consistent(self):
        m = self.m
        m.check_invariants()  # the tree, exclusivity, host map <-> slots, policies
        tier = m.host_tier
        held = {b for r in self.running for b in m.get_block_ids(r.request_id)}
        assert m.num_free_blocks + len(held) == self.nb
        assert len(tier.hash_to_slot) + len(tier.free_slots) == self.nh
        assert m.num_stranded_blocks() == 0
        device = {b.block_hash for b in m.blocks if b.block_hash is not None}
        assert not (tier.hash_to_slot.keys() & device)
        for b in m.blocks:
            if b.block_hash is not None:
                assert self.dev[b.block_id].tobytes() == _page(b.block_hash, WIDTH).tobytes()
        for h, slot in tier.hash_to_slot.items():
            assert self.host[slot.block_id].tobytes() == _page(h, WIDTH).tobytes()


TestRadixHostTierMachine = RadixHostTierMachine.TestCase
TestRadixHostTierMachine.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


def test_the_radix_page_model_sees_promotions():
    mach = RadixHostTierMachine()
    mach.setup(num_blocks=8, num_host=4, block_size=2, free_order="append",
               eviction="lru", host_eviction="lru")
    assert isinstance(mach.m.implementation, RadixKVCacheManager) and mach.m.host_tier is not None
    mach.new(0, [1, 2, 3, 4, 5, 6], None)
    mach.free(0)
    mach.new(2, [0, 0, 0], None)
    mach.free(0)
    mach.new(0, [1, 2, 3, 4, 5, 6], None)
    mach.consistent()
    assert mach.loads_checked > 0
    mach.teardown()


# ------------------------------------------------------------------------- replay
_WORKLOADS = {
    "multi_turn": dict(num_conversations=40, num_turns=4),
    "rag": dict(num_requests=120),
    "mm_salt": dict(num_requests=100),
    "few_shot": dict(num_headers=4, num_questions=40, header_len=600),
}


@pytest.mark.parametrize("workload", sorted(_WORKLOADS))
def test_big_host_tier_gives_the_infinite_cache_hits_radix(workload):
    reqs = workloads.generate(workload, seed=3, **_WORKLOADS[workload])
    ideal = replay(reqs, num_blocks=50_000, block_size=16, hash_seed=0, concurrency=4,
                   index="radix")
    assert ideal["evictions"] == 0
    longest = max(-(-(len(r.prompt) + r.output_len) // 16) for r in reqs)
    host_hits = 0
    for nb in (4 * longest, 1000):
        dev = replay(reqs, num_blocks=nb, block_size=16, hash_seed=0, concurrency=4,
                     index="radix")
        s = replay(reqs, num_blocks=nb, block_size=16, hash_seed=0, concurrency=4,
                   index="radix", num_host_blocks=50_000, host_eviction="fifo",
                   model="llama_3_1_8b")
        assert s["failed"] == s["decode_truncated"] == 0
        assert s["hit_tokens"] == ideal["hit_tokens"] >= dev["hit_tokens"]
        assert s["device_hit_tokens"] + s["host_hit_tokens"] == s["hit_tokens"]
        assert s["host_hit_tokens"] == 16 * s["host_blocks_loaded"]
        assert s["host_bytes_loaded"] == s["host_blocks_loaded"] * s["bytes_per_block"]
        host_hits += s["host_hit_tokens"]
    assert host_hits > 0


@pytest.mark.parametrize("workload", sorted(_WORKLOADS))
def test_radix_host_hits_equal_hash_host_hits_where_they_evict_alike(workload):
    # Under device lru, with free blocks without a hash reused first (the tree always
    # does; the chain with free_order="unhashed_first") and a request's blocks released
    # deepest first, the chain's lru victim is always a leaf: both indexes evict the
    # same blocks in the same order, demote them alike, and hit alike -- device and host
    # counts, with a host small enough to evict (lru) or holding everything.
    reqs = workloads.generate(workload, seed=3, **_WORKLOADS[workload])
    longest = max(-(-(len(r.prompt) + r.output_len) // 16) for r in reqs)
    keys = ("hit_tokens", "device_hit_tokens", "host_hit_tokens", "host_blocks_loaded",
            "host_blocks_stored", "evictions", "peak_host_cached_blocks")
    for conc, nb, nh in ((1, 2 * longest, longest), (4, 2 * longest, 3 * longest),
                         (4, 4 * longest + 37, 50_000)):
        kw = dict(num_blocks=nb, block_size=16, hash_seed=0, concurrency=conc,
                  free_order="unhashed_first", num_host_blocks=nh)
        h_recs, r_recs = [], []
        h = replay(reqs, index="hash", on_record=h_recs.append, **kw)
        r = replay(reqs, index="radix", on_record=r_recs.append, **kw)
        assert {k: h[k] for k in keys} == {k: r[k] for k in keys}
        assert ([x["num_computed_tokens"] for x in h_recs]
                == [x["num_computed_tokens"] for x in r_recs])
        assert r["host_hit_tokens"] > 0 and r["host_blocks_stored"] > 0
    # Where they differ: the chain's default free_order ("append") queues a request's
    # freed blocks without a hash behind older cached blocks and reuses a cached one
    # first; the tree never does. That is a device difference (not the tier's), and on
    # this workload it shows.
    if workload == "multi_turn":
        kw = dict(num_blocks=2 * longest, block_size=16, hash_seed=0, concurrency=1,
                  num_host_blocks=longest)
        assert replay(reqs, index="hash", **kw)["hit_tokens"] != replay(
            reqs, index="radix", **kw)["hit_tokens"]


def test_big_host_tier_gives_the_infinite_cache_hits_radix_mooncake(local_datasets):
    import itertools

    from prefixcache.sim import datasets
    from prefixcache.sim.trace import read_trace

    # NOTE: expanded token ids: the tree keys blocks by tokens, and the replay's
    # hash-id path (mooncake_tokens="lazy") gives it zero tokens.
    path = datasets.path_of("mooncake_conversation", download=False)
    reqs = list(itertools.islice(read_trace(path), 300))
    ideal = replay(reqs, num_blocks=100_000, block_size=512, concurrency=1)
    assert ideal["evictions"] == 0
    longest = max(-(-(len(r.prompt) + r.output_len) // 512) for r in reqs)
    for nb in (longest, 2 * longest + 5):
        kw = dict(num_blocks=nb, block_size=512, concurrency=1, num_host_blocks=100_000,
                  free_order="unhashed_first")
        s = replay(reqs, index="radix", **kw)
        h = replay(reqs, index="hash", **kw)
        assert s["failed"] == 0 and s["hit_tokens"] == ideal["hit_tokens"]
        assert s["host_hit_tokens"] == h["host_hit_tokens"] > 0
        assert s["device_hit_tokens"] == h["device_hit_tokens"]
