"""The host tier under multi-group layouts (``KVCacheManager(kv_cache_groups=...,
num_host_blocks=N)``: ``core/hybrid.py`` drives a ``GroupHostTier`` keyed by the pool's
``(block hash, group id)`` keys, one host slot per block of one group).

Exact promotion on a hand-sized pool (which group's blocks load, a sliding window's
slots before its window never loaded, transfers and CPU events naming their group),
stale / misplaced host hits refused before any change, the refusals of the one rule
(radix layout index; state-space groups are served on the hash index only), a host tier
holding every evicted block = an unbounded device pool's hits (direct and through the
replay; sliding-window and state-space layouts), and random-operation property tests
(sliding-window and state-space layouts) with the invariants and a page-content model
checked after every call.
"""

from __future__ import annotations

import random
from types import MappingProxyType

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.core import (
    BlockRemoved,
    BlockStored,
    HostHit,
    HostTransfer,
    KVCacheManager,
    Request,
    kv_groups,
)
from prefixcache.core.groups.base import _KEY_BYTES
from prefixcache.core.groups.full_attention import FullAttentionManager
from prefixcache.core.host_tier import GroupHostTier, GroupHostTransfer
from prefixcache.core.indexes import COMBINATION_RULES, refusal
from prefixcache.core.kv_groups import KVCacheGroup, parse_kv_groups
from prefixcache.core.radix import RadixKVCacheManager
from prefixcache.core.radix_hybrid import RadixHybridKVCacheManager
from prefixcache.sim.replay import replay
from prefixcache.sim.trace import TraceRequest

BS = 4


def _admit(m, req):
    blocks, hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    return blocks, hit, new


def _admit_chunked(m, req, after=None):
    """Admit ``req`` as the replay does: the lookup, then the prefill in the chunks
    ``prefill_chunks`` gives (one chunk unless a state group stops it; the first one
    is the admission), ``after()`` (default: the invariants) after each call.
    ``(blocks, hit, new)``; ``new`` None (nothing admitted) or False (a later chunk
    found no blocks: the request holds what it got) on failure."""
    after = after or m.check_invariants
    blocks, hit = m.get_computed_blocks(req)
    chunks = m.prefill_chunks(req, hit)
    new = m.allocate_slots(req, chunks[0], hit, blocks)
    after()
    if new is None:
        return blocks, hit, None
    req.num_computed_tokens = hit + chunks[0]
    for c in chunks[1:]:
        got = m.allocate_slots(req, c)
        after()
        if got is None:
            return blocks, hit, False
        req.num_computed_tokens += c
    return blocks, hit, new


def _group(key: bytes) -> int:
    return int.from_bytes(key[-_KEY_BYTES:], "big")


def _snapshot(m):
    tier = m.host_tier
    return (m.free_block_ids(), sorted(m.cached_block_ids()), dict(tier.hash_to_slot),
            list(tier.free_slots), list(tier.transfers), list(tier.transfer_groups),
            tier.num_loaded, tier.num_stored, m.host_hit_tokens, m.device_hit_tokens)


# ----------------------------------------------------------------- the transfer type
def test_host_transfer_group_is_an_attribute_with_a_default():
    t = HostTransfer("store", 3, 1)
    assert t.group == 0 and tuple(t) == ("store", 3, 1)
    kind, b, s = t  # (every one-group caller unpacks three)
    g = GroupHostTransfer("load", 3, 1, 2)
    assert g.group == 2 and tuple(g) == ("load", 3, 1) and isinstance(g, HostTransfer)
    assert g == GroupHostTransfer("load", 3, 1, 2) != GroupHostTransfer("load", 3, 1, 1)
    assert GroupHostTransfer("store", 3, 1, 0) == t and g != HostTransfer("load", 3, 1)
    assert len({g, GroupHostTransfer("load", 3, 1, 2)}) == 1 and "group=2" in repr(g)


# ----------------------------------------------------------------- exact behaviour
def _two_prompts():
    a = [1 + i for i in range(3 * BS + 1)]  # 3 full blocks + 1 token
    b = [50 + i for i in range(3 * BS + 1)]
    return a, b


def test_promotion_loads_each_groups_kept_blocks_and_names_the_group():
    # full + sliding window 5 (the window needs the hit's last block only); 8 device
    # blocks = one 4-block request in both groups; the host holds all of its 6.
    m = KVCacheManager(8, BS, kv_cache_groups=parse_kv_groups("full,sw5"), num_host_blocks=8,
                       free_order="unhashed_first", enable_events=True)
    assert type(m.host_tier) is GroupHostTier
    pa, pb = _two_prompts()
    a = Request("a", pa)
    _admit(m, a)
    m.free(a)
    b = Request("b", pb)
    _, hit, new = _admit(m, b)  # evicts a's 6 cached blocks: 3 per group demoted
    assert hit == 0 and new is not None
    m.check_invariants()
    stores = m.take_host_transfers()
    assert [t.kind for t in stores] == ["store"] * 6
    assert sorted(t.group for t in stores) == [0, 0, 0, 1, 1, 1]
    ev = m.take_events()
    cpu = [e for e in ev if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert sorted(e.group_idx for e in cpu) == [0, 0, 0, 1, 1, 1]
    m.free(b)
    m.check_invariants()
    a2 = Request("a2", pa)
    blocks, hit = m.get_computed_blocks(a2)
    assert hit == 3 * BS
    full, sw = blocks.blocks
    assert all(type(x) is HostHit for x in full)
    assert sw[:2] == [m.null_block, m.null_block] and type(sw[2]) is HostHit
    assert m.allocate_slots(a2, a2.num_tokens - hit, hit, blocks) is not None
    m.check_invariants()
    t = m.take_host_transfers()
    # b's 2 uncached blocks go first (unhashed_first), then 2 of its cached ones are
    # demoted for the loads' blocks (the pinned entries untouched), 2 more for the
    # new token's block per group.
    assert [x.kind for x in t] == ["store"] * 2 + ["load"] * 4 + ["store"] * 2
    loads = [x for x in t if x.kind == "load"]
    # the sliding window's slots before its window are never loaded
    assert [x.group for x in loads] == [0, 0, 0, 1]
    assert all(x.block_id == h.block_id for x, h in zip(loads, full + [sw[2]]))
    ids = m.get_block_ids("a2")
    assert ids[0][:3] == [h.block_id for h in full] and ids[1][2] == sw[2].block_id
    assert ids[1][:2] == [m.null_block_id] * 2
    assert m.host_hit_tokens == 3 * BS and m.device_hit_tokens == 0
    assert m.host_blocks_loaded == 4 and m.num_host_cached_blocks == 6 - 4 + 4
    ev = m.take_events()
    removed = [e for e in ev if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert [e.group_idx for e in removed] == [x.group for x in loads]  # (freed slots)
    gpu = [e for e in ev if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert {e.group_idx for e in gpu} == {0, 1}
    m.free(a2)
    m.check_invariants()


def test_stale_or_misplaced_host_hits_change_nothing():
    m = KVCacheManager(8, BS, kv_cache_groups=parse_kv_groups("full,sw5"), num_host_blocks=8,
                       free_order="unhashed_first")
    pa, pb = _two_prompts()
    for rid, p in (("a", pa), ("b", pb)):
        r = Request(rid, p)
        _admit(m, r)
        m.free(r)
    a2 = Request("a2", pa)
    blocks, hit = m.get_computed_blocks(a2)
    full, sw = blocks.blocks
    before = _snapshot(m)
    with pytest.raises(ValueError, match="host-tier hit of group 1"):
        m.allocate_slots(a2, 1, hit, (full, [m.null_block, m.null_block, full[2]]))
    with pytest.raises(ValueError, match="not the cached block #0"):
        m.allocate_slots(a2, 1, hit, (full[1:] + full[:1], sw))
    assert _snapshot(m) == before
    m.check_invariants()
    assert m.allocate_slots(a2, a2.num_tokens - hit, hit, blocks) is not None
    m.free(a2)
    c = Request("c", pa)
    before = _snapshot(m)
    with pytest.raises(ValueError, match="host-tier hit"):  # already promoted
        m.allocate_slots(c, 1, hit, blocks)
    assert _snapshot(m) == before
    m.check_invariants()


def test_reset_clears_the_host_and_keeps_pending_transfers():
    m = KVCacheManager(8, BS, kv_cache_groups=parse_kv_groups("full,sw5"), num_host_blocks=8)
    pa, pb = _two_prompts()
    for rid, p in (("a", pa), ("b", pb)):
        r = Request(rid, p)
        _admit(m, r)
        m.free(r)
    assert m.num_host_cached_blocks == 6
    assert m.reset_prefix_cache()
    m.check_invariants()
    assert m.num_host_cached_blocks == 0 and len(m.take_host_transfers()) == 6
    assert m.get_computed_blocks(Request("a2", pa))[1] == 0


# ------------------------------------------------------------ the one rule's refusals
def test_radix_layouts_keep_the_rules_refusal_and_state_groups_are_served():
    sw = parse_kv_groups("full,sw8")
    assert refusal("hash", sw, "lru", 4) is None
    why = refusal("radix", sw, "lru", 4)
    assert why.endswith(COMBINATION_RULES[("layout index", "tier")])
    with pytest.raises(ValueError) as e:
        KVCacheManager(8, BS, index="radix", kv_cache_groups=sw, num_host_blocks=4)
    assert str(e.value) == why
    with pytest.raises(ValueError, match="radix layout index"):  # (a numpy int too)
        KVCacheManager(8, BS, index="radix", kv_cache_groups=sw, num_host_blocks=np.int64(4))
    # The hash index serves state groups with a tier; radix refuses state groups
    # whatever the tier; an index class that declares them gets the state rule.
    for layout in ("full,mamba", "mamba", "full,sw8,mamba_r0"):
        groups = parse_kv_groups(layout)
        assert refusal("hash", groups, "lru", np.int64(4)) is None
        m = KVCacheManager(8, BS, kv_cache_groups=groups, num_host_blocks=4)
        assert type(m.host_tier) is GroupHostTier
    mamba = parse_kv_groups("full,mamba")
    assert refusal("radix", mamba, "lru", 4).endswith(COMBINATION_RULES[("state", "index")])

    class StateLayoutIndex(RadixKVCacheManager):
        INDEX_NAME = "state_layout_toy"
        LAYOUT_CLASS = RadixHybridKVCacheManager
        LAYOUT_KINDS = ("full_attention", "mamba")

    assert refusal(StateLayoutIndex, mamba, "lru", 0) is None
    why = refusal(StateLayoutIndex, mamba, "lru", 4)
    assert why.endswith(COMBINATION_RULES[("state", "tier")])
    with pytest.raises(ValueError) as e:
        KVCacheManager(8, BS, index=StateLayoutIndex, kv_cache_groups=mamba, num_host_blocks=4)
    assert str(e.value) == why


class _ToySpec:
    """A kind registered without being listed in ``TIER_GROUP_KINDS``."""

    kind = "toy_full_tier"

    @property
    def sliding_window(self) -> None:
        return None


class _ToyManager(FullAttentionManager):
    spec_class = _ToySpec


def test_a_kind_not_listed_for_the_tier_is_refused_by_its_rule(monkeypatch):
    monkeypatch.setattr(kv_groups, "GROUP_KINDS", MappingProxyType(
        {**kv_groups.GROUP_KINDS, "toy_full_tier": f"{__name__}:_ToyManager"}))
    layout = [KVCacheGroup(kv_groups.FullAttentionSpec(), ["a"]), KVCacheGroup(_ToySpec(), ["b"])]
    assert refusal("hash", layout, "lru", 0) is None
    why = refusal("hash", layout, "lru", 4)
    assert why.endswith(COMBINATION_RULES[("kind", "tier")]) and "'toy_full_tier'" in why
    with pytest.raises(ValueError) as e:
        KVCacheManager(8, BS, kv_cache_groups=layout, num_host_blocks=4)
    assert str(e.value) == why


# ------------------------------------- a host tier that never evicts = no eviction
def _multi_turn(m, seed=0, turns=4, convs=3, loaded=None):
    """A small multi-turn trace (each turn re-sends the history plus new tokens, 3
    decode steps; a state group's prefill in its chunks); invariants after every
    call. The hit tokens per request (the groups of the host loads added to the set
    ``loaded``)."""
    rng = random.Random(seed)
    hist = [[rng.randrange(50) for _ in range(9)] for _ in range(convs)]
    hits = []
    for t in range(turns):
        for c in range(convs):
            hist[c] = hist[c] + [rng.randrange(50, 90) for _ in range(rng.randrange(2, 7))]
            r = Request(f"r{t}_{c}", hist[c])
            _, n, new = _admit_chunked(m, r)
            assert new is not None
            hits.append(n)
            for k in range(3):
                r.append_output_token_ids(100 + k)
                assert m.allocate_slots(r, 1) is not None
                r.num_computed_tokens += 1
                m.check_invariants()
            hist[c] = list(r.all_token_ids)
            m.free(r)
            m.check_invariants()
            if loaded is not None:
                loaded.update(t.group for t in m.take_host_transfers() if t.kind == "load")
    return hits


@pytest.mark.parametrize("layout", ["full,sw6", "full,sw9", "full,mamba", "full,mamba_r0",
                                    "sw6,full,mamba"])
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_big_host_tier_gives_the_unbounded_device_hits(layout, eviction):
    groups = parse_kv_groups(layout)

    def make(nb, nh):
        return KVCacheManager(nb, BS, kv_cache_groups=groups, num_host_blocks=nh,
                              eviction=eviction, free_order="unhashed_first")

    dev = 24 if "mamba" in layout else 30  # (a state group's snapshots get evicted too)
    alone = _multi_turn(make(dev, 0))
    m = make(dev, 300)
    loaded = set()
    tiered = _multi_turn(m, loaded=loaded)
    ideal = _multi_turn(make(2000, 0))
    assert tiered == ideal
    assert sum(tiered) > sum(alone)  # (the device alone evicts what the turns re-use)
    assert m.host_hit_tokens > 0 and m.host_hit_tokens + m.device_hit_tokens == sum(tiered)
    assert m.host_tier.num_evicted == m.host_tier.num_dropped == 0
    # a state group's hits came from the host too (a snapshot demoted and promoted whole)
    assert {g for g, k in enumerate(groups) if k.spec.kind == "mamba"} <= loaded


@pytest.mark.parametrize("layout", ["full,sw8", "full,mamba", "full,mamba_r0"])
def test_replay_summary_counts_host_hits_of_groups(layout):
    rng = random.Random(1)
    systems = [[rng.randrange(1, 50) for _ in range(40)] for _ in range(4)]
    reqs = [TraceRequest(str(i), systems[i % 4] + [rng.randrange(50, 99) for _ in range(6)], 4)
            for i in range(40)]
    kw = dict(block_size=BS, kv_cache_groups=layout, concurrency=2, hash_seed=0)
    ideal = replay(reqs, num_blocks=5000, **kw)
    dev = replay(reqs, num_blocks=40, **kw)
    s = replay(reqs, num_blocks=40, num_host_blocks=5000, **kw)
    assert s["failed"] == 0 and ideal["evictions"] == 0
    assert s["hit_tokens"] == ideal["hit_tokens"] > dev["hit_tokens"]
    assert s["device_hit_tokens"] + s["host_hit_tokens"] == s["hit_tokens"]
    assert s["host_hit_tokens"] > 0 and s["host_blocks_loaded"] >= s["host_hit_tokens"] // BS
    assert s["host_blocks_stored"] >= s["host_blocks_loaded"] and s["peak_host_cached_blocks"] > 0
    assert "host_hit_tokens" not in dev  # the tier off: the summary unchanged


# ------------------------------------------- random operations, a page-content model
class _Pages:
    """What each device page and host slot holds, by the key it was computed for,
    moved only by the transfers (in order): a load must bring the key its device
    block is then cached under, a host entry must hold its key's page, and each
    transfer names the group of the page it moves."""

    def __init__(self, m):
        self.m = m
        self.dev: dict[int, bytes] = {}
        self.host: dict[int, bytes] = {}

    def after_call(self):
        m = self.m
        m.check_invariants()
        loaded = []
        for t in m.take_host_transfers():
            if t.kind == "store":
                c = self.dev.get(t.block_id)
                assert c is not None and _group(c) == t.group, (t, c)
                self.host[t.host_slot] = c
            else:
                c = self.host.get(t.host_slot)
                assert c is not None and _group(c) == t.group, (t, c)
                self.dev[t.block_id] = c
                loaded.append(t.block_id)
        blocks = m.block_pool.blocks
        for b in loaded:
            assert blocks[b].block_hash == self.dev[b]  # it loaded the right page
        for b in blocks:  # computed (not loaded) this call: its page is its key's
            if b.block_hash is not None and self.dev.get(b.block_id) != b.block_hash:
                self.dev[b.block_id] = b.block_hash
        for key, slot in m.host_tier.hash_to_slot.items():
            assert self.host.get(slot.block_id) == key, (slot, key)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), num_blocks=st.integers(8, 16),
       num_host=st.integers(1, 24), layout=st.sampled_from(["full,sw5", "full,sw9", "sw6,full"]),
       eviction=st.sampled_from(["lru", "lfu", "fifo"]),
       host_eviction=st.sampled_from(["lru", "lfu"]),
       free_order=st.sampled_from(["unhashed_first", "append"]))
def test_random_demote_promote_keeps_invariants_and_pages(seed, num_blocks, num_host, layout,
                                                          eviction, host_eviction, free_order):
    _random_ops(seed, num_blocks, num_host, layout, eviction, host_eviction, free_order)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), num_blocks=st.integers(10, 18),
       num_host=st.integers(1, 24),
       layout=st.sampled_from(["full,mamba", "full,mamba_r0", "mamba", "sw6,full,mamba"]),
       eviction=st.sampled_from(["lru", "lfu", "marconi"]),
       host_eviction=st.sampled_from(["lru", "lfu"]),
       free_order=st.sampled_from(["unhashed_first", "append"]))
def test_random_state_group_demote_promote_keeps_invariants_and_pages(
        seed, num_blocks, num_host, layout, eviction, host_eviction, free_order):
    # A state snapshot is one page of the state group: the page model checks that a
    # promoted state block holds the state its key names (the hit's end).
    _random_ops(seed, num_blocks, num_host, layout, eviction, host_eviction, free_order)


def _random_ops(seed, num_blocks, num_host, layout, eviction, host_eviction, free_order):
    m = KVCacheManager(num_blocks, BS, kv_cache_groups=parse_kv_groups(layout),
                       num_host_blocks=num_host, eviction=eviction,
                       host_eviction=host_eviction, free_order=free_order,
                       enable_events=bool(seed % 2))
    pages = _Pages(m)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 40) for _ in range(rng.randrange(2, 13))] for _ in range(3)]
    running: list[Request] = []
    hits = resets = 0
    for step in range(40):
        op = rng.random()
        if op < 0.45 or not running:
            p = rng.choice(prefixes) + [rng.randrange(40, 60) for _ in range(rng.randrange(1, 6))]
            r = Request(f"q{step}", p)
            _, n, new = _admit_chunked(m, r, pages.after_call)  # (one chunk: no state group)
            if new is None:
                if running:
                    m.free(running.pop(0))
                    pages.after_call()
                continue
            hits += n
            if new is False:  # a later chunk found no blocks: preempted
                m.free(r)
                pages.after_call()
                continue
            running.append(r)
            if rng.random() < 0.3:
                prefixes.append(list(p))
        elif op < 0.8:
            r = rng.choice(running)
            r.append_output_token_ids(rng.randrange(60, 70))
            if m.allocate_slots(r, 1) is None:
                running.remove(r)
                m.free(r)
            else:
                r.num_computed_tokens += 1
            pages.after_call()
        elif op < 0.97:
            m.free(running.pop(rng.randrange(len(running))))
            pages.after_call()
        else:
            for r in running:
                m.free(r)
            running.clear()
            assert m.reset_prefix_cache()
            resets += 1
            pages.after_call()
            pages.host.clear()  # (the host forgot every entry)
        assert m.device_hit_tokens + m.host_hit_tokens == hits
    for r in running:
        m.free(r)
    pages.after_call()
    tier = m.host_tier
    if not resets:  # every demoted entry left the host one way, or is there
        assert tier.num_stored == (tier.num_loaded + tier.num_evicted + tier.num_discarded
                                   + len(tier))
    assert m.num_free_blocks == num_blocks


def test_queue_aware_host_policy_hears_the_waiting_queue_with_groups():
    # The host tier's queue_aware policy is fed by the coordinator's waiting hooks (one
    # fan-out with the device policy), keyed by (block hash, group id); a replay with a
    # look-ahead runs clean (no waiting interest left, invariants hold).
    rng = random.Random(3)
    systems = [[rng.randrange(1, 50) for _ in range(40)] for _ in range(4)]
    reqs = [TraceRequest(str(i), systems[i % 4] + [rng.randrange(50, 99) for _ in range(6)], 4)
            for i in range(40)]
    kw = dict(block_size=BS, kv_cache_groups="full,sw8", concurrency=2, hash_seed=0,
              num_blocks=40, num_host_blocks=12)
    s = replay(reqs, host_eviction="queue_aware", eviction="queue_aware", queue_depth=4, **kw)
    assert s["failed"] == 0 and s["host_blocks_stored"] > 0
    m = KVCacheManager(40, BS, kv_cache_groups=parse_kv_groups("full,sw8"), num_host_blocks=12,
                       host_eviction="queue_aware", eviction="queue_aware")
    assert m.host_tier.policy.needs_waiting
    r = Request("w", systems[0] + [60, 61])
    r.bind_hasher(m.hasher, BS)
    m.on_waiting("w", r.block_hashes[: (r.num_tokens - 1) // BS])
    assert m.host_tier.policy.waiting_ids() == ["w"] and m.policy.waiting_ids() == ["w"]
    m.drop_waiting("w")
    assert m.host_tier.policy.waiting_ids() == [] and m.policy.waiting_ids() == []
