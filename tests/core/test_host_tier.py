"""The host-memory tier (``KVCacheManager(num_host_blocks=N)``, core/host_tier.py) under
every index (``index="hash"`` and ``"radix"``), each case written once and parametrised
over the indexes where both run it.

Exact transfers and events on a hand-sized pool (the expected block ids per index: the
chain evicts in free-queue order, the tree its leaves deepest first), bad input,
failure atomicity, stale and misplaced hits, reset, a stateful property test per index
(random tiny capacities and policies, invariants and a numpy page model checked after
every step), and the replay: off = byte-identical to the vLLM goldens; a host tier
holding every evicted block = the infinite cache's hits; radix+host hits = hash+host
hits where both indexes evict the same blocks.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import pathlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from prefixcache.core import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    HostHit,
    HostTransfer,
    KVCacheManager,
    Request,
)
from prefixcache.core.block_pool import BlockPool
from prefixcache.core.eviction import online_policy_names
from prefixcache.core.radix import RadixKVCacheManager
from prefixcache.sim import workloads
from prefixcache.sim.replay import replay
from prefixcache.sim.trace import read_trace

ONLINE = list(online_policy_names())  # the policies that run without the trace's future
INDEXES = ["hash", "radix"]
GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "data" / "replay_golden"


def _admit(m, req):
    blocks, hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    return blocks, hit, new


def _device_blocks(m):
    """The device pool's blocks (the chain's pool, the tree's own list)."""
    return m.block_pool.blocks if m.index == "hash" else m.blocks


# ----------------------------------------------------------------- exact behaviour
@pytest.mark.parametrize("index", INDEXES)
def test_off_is_the_plain_manager(index):
    m = KVCacheManager(8, 4, index=index)
    assert m.host_tier is None
    if index == "hash":
        assert type(m.block_pool) is BlockPool
        swapped = ("_hit_blocks", "_allocate_checked")
    else:
        assert type(m.implementation) is RadixKVCacheManager
        swapped = ("get_computed_blocks", "peek_computed_tokens", "_allocate_checked", "_cache")
    assert not any(name in vars(m.implementation) for name in swapped)
    assert m.take_host_transfers() == [] and m.num_host_cached_blocks == 0
    assert (m.host_hit_tokens, m.host_blocks_loaded, m.host_blocks_stored) == (0, 0, 0)
    r = Request("a", list(range(9)))
    _admit(m, r)
    m.free(r)
    r2 = Request("b", list(range(9)))
    _, hit, _ = _admit(m, r2)
    assert hit == 8 and m.device_hit_tokens == 8


# The chain: free queue (append) after a's free: [4, 3, 2, 1, 0] -- the request's blocks
# reversed; b takes 5 first (never used), then 4, 3, 2, 1. The tree: b takes the
# unhashed 4, then 5 (never used), then evicts the leaves 3, 2, 1 (a's deepest first).
# Either way blocks 3, 2, 1 held a's hashes 3, 2, 1 -> three demotions into host slots
# 0, 1, 2; block 0 (a's first) stays. Then c's partial block takes the chain's next
# free block 4 / the tree's next leaf 5 (b's), whose hash goes to the slot the first
# load freed.
_DEMOTION = {"hash": ([5, 4, 3, 2, 1], 4), "radix": ([4, 5, 3, 2, 1], 5)}


@pytest.mark.parametrize("index", INDEXES)
def test_demotion_lookup_promotion_exact_transfers_and_events(index):
    b_new, c_new = _DEMOTION[index]
    m = KVCacheManager(6, 4, num_host_blocks=3, enable_events=True, index=index)
    a = Request("a", list(range(17)))  # 4 full blocks + 1 token
    _admit(m, a)
    m.free(a)
    m.take_events()
    b = Request("b", list(range(100, 117)))
    _, _, new = _admit(m, b)
    assert [x.block_id for x in new] == b_new
    assert m.take_host_transfers() == [
        HostTransfer("store", 3, 0), HostTransfer("store", 2, 1), HostTransfer("store", 1, 2)]
    ev = m.take_events()
    # Each demotion: the GPU removal, then the CPU store with its parent's hash.
    assert [(type(e).__name__, e.medium) for e in ev[:6]] == [
        ("BlockRemoved", "GPU"), ("BlockStored", "CPU")] * 3
    eh = m.host_tier._event_hash
    assert [e.parent_block_hash for e in ev[1:6:2]] == [
        eh(h) for h in (a.block_hashes[2], a.block_hashes[1], a.block_hashes[0])]
    assert all(e.token_ids == [] for e in ev[1:6:2])
    assert m.num_host_cached_blocks == 3 and m.num_cached_blocks == 5
    m.check_invariants()
    m.free(b)
    c = Request("c", list(range(17)))
    assert m.peek_computed_tokens(c) == 16
    blocks, hit, new = _admit(m, c)
    # Lookup: block 0 on the device, then a's blocks 1, 2, 3 on the host (by hash).
    assert hit == 16 and type(blocks[0]).__name__ == "KVCacheBlock"
    assert [type(x) for x in blocks[1:]] == [HostHit] * 3
    assert [x.host_slot for x in blocks[1:]] == [2, 1, 0]
    # Promotion: the host hits got device blocks 1, 2, 3 (their block_id is set, so a
    # block table built from the hit list is right); those blocks held b's hashes, but
    # the host was full of pinned entries -> dropped, not stored.
    assert [x.block_id for x in blocks] == [0, 1, 2, 3] and [x.block_id for x in new] == [c_new]
    assert m.get_block_ids("c") == [0, 1, 2, 3, c_new]
    assert m.take_host_transfers() == [
        HostTransfer("load", 1, 2), HostTransfer("load", 2, 1), HostTransfer("load", 3, 0),
        HostTransfer("store", c_new, 2)]
    ev = m.take_events()
    gpu_stored = [e for e in ev if type(e) is BlockStored and e.medium == "GPU"]
    # The loaded run: one event, with its tokens and its parent (device block 0).
    assert [len(e.block_hashes) for e in gpu_stored] == [3]
    assert gpu_stored[0].parent_block_hash == m.host_tier._event_hash(a.block_hashes[0])
    assert gpu_stored[0].token_ids == list(range(4, 16))
    assert sum(type(e) is BlockRemoved and e.medium == "CPU" for e in ev) == 3
    assert (m.device_hit_tokens, m.host_hit_tokens) == (4, 12)
    assert (m.host_blocks_loaded, m.host_blocks_stored) == (3, 4)
    assert m.host_tier.num_dropped == 2
    if index == "radix":  # the promoted blocks are ordinary nodes on c's path, locked by it
        state_c = m.implementation._states["c"]
        assert [n.block.block_id for n in state_c.path] == [0, 1, 2, 3]
        assert all(n.lock == 1 for n in state_c.path)
    m.check_invariants()
    m.free(c)
    d = Request("d", list(range(17)))
    assert _admit(m, d)[1] == 16 and m.host_hit_tokens == 12  # all on the device now
    m.check_invariants()


def test_host_hit_after_device_miss_then_device_hit_again():
    # The chain goes on block by block: a host hit, then a device hit behind it.
    m = KVCacheManager(4, 2, num_host_blocks=4)
    a = Request("a", [1, 2, 3, 4, 5])  # blocks (1,2) (3,4) cached
    _admit(m, a)
    m.free(a)
    pool = m.block_pool
    first = pool.get_cached_block(a.block_hashes[0])
    pool.free_block_queue.remove(first)
    pool.free_block_queue.prepend_n([first])  # a's first block is the next victim
    b = Request("b", [9, 9, 9])  # takes it: a's first block goes to the host
    _admit(m, b)
    m.free(b)
    assert m.num_host_cached_blocks == 1
    c = Request("c", [1, 2, 3, 4, 5])
    blocks, hit = m.get_computed_blocks(c)
    assert hit == 4 and type(blocks[0]) is HostHit and blocks[1].block_hash == a.block_hashes[1]
    assert m.allocate_slots(c, 1, hit, blocks) is not None
    assert m.get_block_ids("c")[:2] == [blocks[0].block_id, blocks[1].block_id]
    assert blocks[0].block_id >= 0 and m.host_hit_tokens == 2 and m.device_hit_tokens == 2
    m.check_invariants()


@pytest.mark.parametrize("index", INDEXES)
def test_failed_allocation_changes_nothing_host_entries_included(index):
    m = KVCacheManager(5, 4, num_host_blocks=4, index=index)
    a = Request("a", list(range(13)))  # 3 full blocks 0, 1, 2 + partial 3
    _admit(m, a)
    m.free(a)
    b = Request("b", list(range(50, 63)))
    # The chain: b takes blocks 4, 3, 2, 1 (free queue [4, 3, 2, 1, 0]); the tree: 3, 4
    # (unhashed), then the leaves 2, 1. Either way a's cached blocks 2 and 1 go to the
    # host and block 0 stays cached on the device (free / unlocked).
    _admit(m, b)
    assert m.num_host_cached_blocks == 2
    tier = m.host_tier

    def state():
        return (m.free_block_ids(), dict(tier.hash_to_slot), list(tier.free_slots),
                tier.eviction_order(), tier.pending_transfers(), m.num_cached_blocks,
                m.num_free_blocks, m.counters()["evictions"],
                m.num_available_blocks if index == "radix" else None)

    before = state()
    c = Request("c", list(range(13)))
    blocks, hit = m.get_computed_blocks(c)
    assert hit == 12 and [type(x) for x in blocks[1:]] == [HostHit, HostHit]
    # Needs block 0 (free: leaves the free blocks), 2 loads and 1 new block: 1 is free.
    assert m.allocate_slots(c, 1, hit, blocks) is None
    assert state() == before and all(x.block_id == -1 for x in blocks[1:])
    m.check_invariants()
    m.free(b)
    assert m.allocate_slots(c, 1, hit, blocks) is not None  # the same hit list, now fits
    assert [x.block_id for x in blocks] == m.get_block_ids("c")[:3]
    assert m.host_blocks_loaded == 2  # (b's evicted blocks took the freed slots)
    m.check_invariants()


@pytest.mark.parametrize("index", INDEXES)
def test_stale_and_misplaced_host_hits_are_rejected_before_any_change(index):
    m = KVCacheManager(5, 4, num_host_blocks=4, index=index)
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
    # A device block behind the host hits: the tree refuses the order, the chain the
    # block (block 0 is not cached: a's blocks went to the host).
    misplaced = ("follows a host-tier hit" if index == "radix"
                 else "block 0 is not a cached block of this manager")
    with pytest.raises(ValueError, match=misplaced):
        m.allocate_slots(other, 1, 12, blocks + [_device_blocks(m)[0]])
    with pytest.raises(TypeError, match="follows a host-tier hit" if index == "radix"
                       else "must hold KVCacheBlock / HostHit objects, got 'x'"):
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


@pytest.mark.parametrize("index", INDEXES)
def test_reset_clears_both_tiers_one_event(index):
    m = KVCacheManager(4, 2, num_host_blocks=8, enable_events=True, index=index)
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
    r = Request("x", [0, 1, 2, 3, 4])
    assert m.get_computed_blocks(r) == ([], 0)


@pytest.mark.parametrize("index", INDEXES)
def test_invariants_catch_a_hash_in_both_tiers(index):
    m = KVCacheManager(3, 2, num_host_blocks=4, index=index)
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


# ------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("bad, exc, match", [
    (-1, ValueError, "num_host_blocks must be >= 0"),
    (2.0, TypeError, "num_host_blocks must be an int"),
    (np.float64(4.0), TypeError, "num_host_blocks must be an int"),
    (True, TypeError, "num_host_blocks must be an int"),
    ("8", TypeError, "num_host_blocks must be an int"),
    (None, TypeError, "num_host_blocks must be an int"),
    (10**15, ValueError, "host tier of num_host_blocks=1000000000000000"),
])
def test_bad_host_size(bad, exc, match):
    with pytest.raises(exc, match=match):
        KVCacheManager(8, 4, num_host_blocks=bad)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_host_blocks=4, host_eviction="mru"), "unknown eviction policy 'mru'"),
    (dict(num_host_blocks=4, host_eviction="belady"), "not supported for the host tier"),
    (dict(num_host_blocks=0, host_eviction="nope"), "unknown eviction policy 'nope'"),
    (dict(num_host_blocks=4, host_eviction=3), "host_eviction must be a policy name"),
    (dict(num_host_blocks=4, host_eviction_options=[1]), "host_eviction_options must be"),
    (dict(num_host_blocks=4, host_eviction_options={"bogus": 1}), "bogus"),
    (dict(num_host_blocks=4, enable_caching=False), "needs prefix caching"),
    (dict(num_host_blocks=4, index="radix", enable_caching=False), "needs prefix caching"),
    (dict(num_host_blocks=4, index="radix", host_eviction="belady"), "not supported for the host"),
])
def test_bad_host_config(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        KVCacheManager(8, 4, **kwargs)


@pytest.mark.parametrize("index", INDEXES)
def test_numpy_int_host_size_and_every_online_policy(index):
    for p in ONLINE:
        m = KVCacheManager(6, 2, num_host_blocks=np.int64(3), host_eviction=p, index=index)
        assert m.num_host_blocks == 3 and type(m.num_host_blocks) is int
        for i in range(8):
            r = Request(str(i), [i % 3, 7, 8, 9, i, 1], priority=i % 2)
            assert _admit(m, r)[2] is not None
            m.free(r)
            m.check_invariants()
        assert m.host_blocks_stored > 0, p


def test_replay_rejects_bad_host_input_before_reading():
    def stream():
        raise AssertionError("read")
        yield  # pragma: no cover

    for bad in (-1, 1.5, True, "4"):
        with pytest.raises((ValueError, TypeError), match="num_host_blocks"):
            replay(stream(), num_blocks=8, block_size=4, num_host_blocks=bad)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        replay(stream(), num_blocks=8, block_size=4, num_host_blocks=4, host_eviction="x")


# --------------------------------------------------------------- stateful property
def _page(h: bytes, width: int) -> np.ndarray:
    """The KV data of the block with hash ``h``: random, NaN-free, fixed per hash."""
    seed = int.from_bytes(hashlib.blake2b(h, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).standard_normal(width).astype(np.float32)


# Short shared stems: prefixes collide, hit, duplicate, demote and promote in tiny pools.
_STEMS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 20, 21], [30] * 5, [40, 41, 42, 43]]
WIDTH = 8


class HostTierMachine(RuleBasedStateMachine):
    """Random lookups/admissions, decode steps, frees and resets over tiny pools.

    A numpy model of the device pages and host slots: transfers are applied in list
    order after every manager call, computed blocks are written with their hash's data;
    every cached block (device or host) must then hold exactly its hash's bytes -- so a
    promoted block's bytes came through the transfer log. Over the hash index here;
    `RadixHostTierMachine` runs the same rules over the tree.
    """

    index = "hash"

    @initialize(num_blocks=st.integers(1, 10), num_host=st.integers(1, 6),
                block_size=st.sampled_from([1, 2, 2, 4]),
                free_order=st.sampled_from(["append", "unhashed_first"]),
                eviction=st.sampled_from(ONLINE),
                host_eviction=st.sampled_from(ONLINE + ["keyed lru"]),
                events=st.booleans())
    def setup(self, num_blocks, num_host, block_size, free_order, eviction, host_eviction,
              events=True):
        # (events off + both lru: the pool's inlined demotion loop; else per block)
        options = None
        if host_eviction == "keyed lru":
            host_eviction, options = "lru", {"fast_path": False}
        self.m = KVCacheManager(num_blocks, block_size, free_order=free_order,
                                eviction=eviction, index=self.index, num_host_blocks=num_host,
                                host_eviction=host_eviction, host_eviction_options=options,
                                enable_events=events)
        self.nb, self.nh, self.bs = num_blocks, num_host, block_size
        self.dev = np.zeros((num_blocks, WIDTH), np.float32)
        self.host = np.zeros((num_host, WIDTH), np.float32)
        self.running: list[Request] = []
        self.written: dict[str, int] = {}  # request id -> table positions written/adopted
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
                h = m.block_pool.blocks[t.block_id].block_hash
                if h is not None and h in m.block_pool.cached_block_hash_to_block:
                    # Promotion: byte-identical to the data the block was computed with.
                    assert self.dev[t.block_id].tobytes() == _page(h, WIDTH).tobytes()
                    self.loads_checked += 1
        # Compute: blocks the requests cached beyond what they adopted get their data.
        for r in self.running:
            st_ = m.implementation._states[r.request_id]
            for pos in range(self.written[r.request_id], st_.num_cached_blocks):
                b = st_.blocks[pos]
                self.dev[b.block_id] = _page(b.block_hash, WIDTH)
            self.written[r.request_id] = max(self.written[r.request_id], st_.num_cached_blocks)

    @rule(stem=st.integers(0, 3), tail=st.lists(st.integers(0, 3), max_size=4),
          salt=st.sampled_from([None, None, "s"]))
    def new(self, stem, tail, salt):
        m = self.m
        req = Request(f"r{self.n}", _STEMS[stem] + tail, cache_salt=salt, priority=self.n % 3)
        self.n += 1
        while True:  # as the replay: does not fit -> free the oldest and look up again
            blocks, hit = m.get_computed_blocks(req)
            assert hit == len(blocks) * self.bs and hit <= req.num_tokens - 1
            snapshot = (m.free_block_ids(), dict(m.host_tier.hash_to_slot))
            new = m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
            if new is not None:
                break
            assert (m.free_block_ids(), dict(m.host_tier.hash_to_slot)) == snapshot
            assert all(b.block_id == -1 for b in blocks if type(b) is HostHit)
            if not self.running:
                return
            self.free(0)
        assert m.get_block_ids(req.request_id)[: len(blocks)] == [b.block_id for b in blocks]
        req.num_computed_tokens = req.num_tokens
        req.append_output_token_ids(7)
        self.running.append(req)
        self.written[req.request_id] = len(blocks)  # adopted: written by hits or loads
        self._sync()

    @rule(i=st.integers(0, 7), k=st.integers(1, 3))
    def decode(self, i, k):
        if not self.running:
            return
        req = self.running[i % len(self.running)]
        for t in range(k):
            if self.m.allocate_slots(req, 1) is None:
                break
            req.num_computed_tokens += 1
            req.append_output_token_ids(t + 3)
            self._sync()

    @rule(i=st.integers(0, 7))
    def free(self, i):
        if self.running:
            req = self.running.pop(i % len(self.running))
            self.m.free(req)
            del self.written[req.request_id]

    @rule()
    def reset(self):
        ok = self.m.reset_prefix_cache()
        assert ok == (not self.running)
        self._sync()

    @invariant()
    def consistent(self):
        m = self.m
        m.check_invariants()  # exclusivity, host map <-> slots, policies, pool
        tier = m.host_tier
        held = {b for r in self.running for b in m.get_block_ids(r.request_id)}
        assert m.num_free_blocks + len(held) == self.nb  # no device block leaked
        assert len(tier.hash_to_slot) + len(tier.free_slots) == self.nh  # no slot leaked
        assert m.num_host_cached_blocks <= self.nh
        assert not (tier.hash_to_slot.keys() & m.block_pool.cached_block_hash_to_block.keys())
        for b in m.block_pool.blocks:
            if b.block_hash is not None:
                assert self.dev[b.block_id].tobytes() == _page(b.block_hash, WIDTH).tobytes()
        for h, slot in tier.hash_to_slot.items():
            assert self.host[slot.block_id].tobytes() == _page(h, WIDTH).tobytes()


TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


class RadixHostTierMachine(HostTierMachine):
    """``HostTierMachine`` over the radix index: the same rules and setup; the page
    model reads the tree (a request's computed blocks are its path's
    new nodes, a promoted block is a node again)."""

    index = "radix"

    def _sync(self):
        m = self.m
        for t in m.take_host_transfers():
            if t.kind == "store":
                self.host[t.host_slot] = self.dev[t.block_id]
            else:
                assert t.kind == "load"
                self.dev[t.block_id] = self.host[t.host_slot]
                h = m.blocks[t.block_id].block_hash
                if h is not None and m.implementation._nodes[t.block_id] is not None:
                    # Promotion: byte-identical to the data the block was computed with.
                    assert self.dev[t.block_id].tobytes() == _page(h, WIDTH).tobytes()
                    self.loads_checked += 1
        for r in self.running:
            st_ = m.implementation._states[r.request_id]
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


@pytest.mark.parametrize("machine", [HostTierMachine, RadixHostTierMachine],
                         ids=INDEXES)
def test_the_page_model_sees_promotions(machine):
    # The machine's load check is not vacuous: a deterministic run promotes blocks.
    mach = machine()
    mach.setup(num_blocks=8, num_host=4, block_size=2, free_order="append",
               eviction="lru", host_eviction="lru")
    assert mach.m.index == machine.index and mach.m.host_tier is not None
    mach.new(0, [1, 2, 3, 4, 5, 6], None)
    mach.free(0)
    mach.new(2, [0, 0, 0], None)  # 4 blocks: 2 unused, then the first's last 2 (to the host)
    mach.free(0)
    mach.new(0, [1, 2, 3, 4, 5, 6], None)
    mach.consistent()
    assert mach.loads_checked > 0
    mach.teardown()


# ------------------------------------------------------------------------- replay
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())


@pytest.mark.parametrize("run", MANIFEST["runs"], ids=lambda r: r["vllm_out"][: -len(".vllm.jsonl")])
def test_host_off_replay_records_equal_the_goldens(run):
    vllm = [json.loads(line) for line in (GOLDEN / run["vllm_out"]).read_text().splitlines()]
    ours = []
    summary = replay(
        read_trace(GOLDEN / run["trace"]), num_blocks=run["num_blocks_vllm"] - 1,
        block_size=MANIFEST["block_size"], hash_algo=run["hash_algo"], hash_seed=0,
        free_order="unhashed_first", concurrency=run["concurrency"], on_record=ours.append,
        record_evictions=True, num_host_blocks=0, host_eviction="lru")
    for theirs in vllm:
        theirs["block_ids"] = [b - 1 for b in theirs["block_ids"]]
    assert ours == vllm
    assert summary["hit_tokens"] == run["hit_tokens"]
    assert not any(k.startswith("host_") or k == "device_hit_tokens" for k in summary)


_WORKLOADS = {
    "multi_turn": dict(num_conversations=40, num_turns=4),
    "rag": dict(num_requests=120),
    "mm_salt": dict(num_requests=100),
    "few_shot": dict(num_headers=4, num_questions=40, header_len=600),
}


@pytest.mark.parametrize("index", INDEXES)
@pytest.mark.parametrize("workload", sorted(_WORKLOADS))
def test_big_host_tier_gives_the_infinite_cache_hits(workload, index):
    reqs = workloads.generate(workload, seed=3, **_WORKLOADS[workload])
    ideal = replay(reqs, num_blocks=50_000, block_size=16, hash_seed=0, concurrency=4,
                   index=index)
    assert ideal["evictions"] == 0
    longest = max(-(-(len(r.prompt) + r.output_len) // 16) for r in reqs)
    host_hits = 0
    # (the tree: two capacities, as its own suite had; the chain also an odd one)
    sizes = (4 * longest, 4 * longest + 37, 1000) if index == "hash" else (4 * longest, 1000)
    for nb in sizes:
        dev = replay(reqs, num_blocks=nb, block_size=16, hash_seed=0, concurrency=4,
                     index=index)
        s = replay(reqs, num_blocks=nb, block_size=16, hash_seed=0, concurrency=4,
                   index=index, num_host_blocks=50_000, host_eviction="fifo",
                   model="llama_3_1_8b")
        assert s["failed"] == s["decode_truncated"] == 0
        assert s["hit_tokens"] == ideal["hit_tokens"] >= dev["hit_tokens"]
        assert s["device_hit_tokens"] + s["host_hit_tokens"] == s["hit_tokens"]
        assert s["host_hit_tokens"] == 16 * s["host_blocks_loaded"]
        assert s["host_bytes_loaded"] == s["host_blocks_loaded"] * s["bytes_per_block"]
        assert s["peak_host_cached_blocks"] <= s["host_blocks_stored"]
        host_hits += s["host_hit_tokens"]
    assert host_hits > 0


def test_big_host_tier_gives_the_infinite_cache_hits_mooncake(local_datasets):
    from prefixcache.sim import datasets

    path = datasets.path_of("mooncake_conversation", download=False)
    reqs = list(itertools.islice(read_trace(path, mooncake_tokens="lazy"), 300))
    ideal = replay(reqs, num_blocks=100_000, block_size=512, concurrency=1)
    assert ideal["evictions"] == 0
    longest = max(-(-(len(r.prompt) + r.output_len) // 512) for r in reqs)
    for nb in (longest, 2 * longest + 5):
        tiered, alone = [], []
        s = replay(reqs, num_blocks=nb, block_size=512, concurrency=1, num_host_blocks=100_000,
                   on_record=tiered.append)
        d = replay(reqs, num_blocks=nb, block_size=512, concurrency=1, on_record=alone.append)
        assert s["failed"] == 0 and s["hit_tokens"] == ideal["hit_tokens"]
        assert s["host_hit_tokens"] > 0
        # The tier is invisible to the device here: a host hit takes the fresh block its
        # recomputation would have taken, in the same order (no device hit behind a host
        # hit in this slice), so block ids and device hits equal the device-only run's.
        assert [r["block_ids"] for r in tiered] == [r["block_ids"] for r in alone]
        assert s["device_hit_tokens"] == d["hit_tokens"] < s["hit_tokens"]
    small = replay(reqs, num_blocks=longest, block_size=512, concurrency=1,
                   num_host_blocks=longest, host_eviction="lru")
    assert small["hit_tokens"] < ideal["hit_tokens"]
    assert small["peak_host_cached_blocks"] <= longest


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
    from prefixcache.sim import datasets

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


@pytest.mark.parametrize("index", INDEXES)
def test_device_recomputing_a_host_hash_drops_the_host_copy(index):
    # A prompt that is exactly one block cannot hit it (its last token is computed),
    # so the device caches that block again while the host holds it: the host copy goes.
    m = KVCacheManager(3, 2, num_host_blocks=4, enable_events=True, index=index)
    a = Request("a", [1, 2, 3])
    _admit(m, a)
    m.free(a)
    b = Request("b", [7, 7, 7, 7, 7])  # 3 blocks: evicts a's cached block (1, 2)
    _admit(m, b)
    m.free(b)
    assert a.block_hashes[0] in m.host_tier.hash_to_slot
    m.take_events()
    c = Request("c", [1, 2])
    blocks, hit, new = _admit(m, c)
    assert hit == 0 and new is not None
    assert a.block_hashes[0] not in m.host_tier.hash_to_slot
    assert m.host_tier.num_discarded == 1
    ev = m.take_events()
    assert [(type(e).__name__, e.medium) for e in ev][-2:] == [
        ("BlockStored", "GPU"), ("BlockRemoved", "CPU")]
    m.check_invariants()


def test_host_lru_fast_path_equals_the_keyed_policy_and_the_event_path():
    # Three ways to run the host's lru: the inlined demotion loop (no events), the
    # per-block path (events on), the keyed LRUPolicy (fast_path False): same hits,
    # same transfers, same host contents.
    reqs = workloads.generate("multi_turn", seed=5, num_conversations=12, num_turns=4)
    runs = []
    for kw in ({}, {"enable_events": True},
               {"host_eviction_options": {"fast_path": False}}):
        m = KVCacheManager(40, 16, num_host_blocks=25, hash_seed=0, **kw)
        assert (m.host_tier.policy is None) == ("host_eviction_options" not in kw)
        hits, transfers, running = [], [], []
        for i, tr in enumerate(reqs):
            req = Request(str(i), tr.prompt)
            while True:
                blocks, hit, new = _admit(m, req)
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
        runs.append((hits, transfers, m.host_tier.eviction_order(),
                     m.host_tier.num_evicted, m.host_blocks_loaded))
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][3] > 0 and runs[0][4] > 0  # host evictions and promotions happened
