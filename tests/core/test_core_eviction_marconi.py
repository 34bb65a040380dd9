"""``marconi`` (Marconi's FLOP-aware eviction, MLSys'25) and the ``needs_groups`` seam:
hand-computed FLOP efficiencies per group kind and victim orders on the protocol, the
hybrid pool telling each cached block's group (and telling policies without the
property nothing), options checked at the boundary, random operations through every
layout with invariants checked after each call."""

from __future__ import annotations

import random

import pytest

from prefixcache import KVCacheManager, Request
from prefixcache.core.block_pool import KVCacheBlock
from prefixcache.core.eviction import LRUPolicy, PolicyError, make_policy
from prefixcache.core.kv_groups import parse_kv_groups
from prefixcache.cost_model import ModelShape

from tests.core.test_core_eviction import BS, TRACE, A, B, C, D, _run

TINY = ModelShape.tiny()  # params_per_layer 196608; 4 q heads x 64; 2 kv heads; f32


def _policy(layout=None, **kw):
    p = make_policy("marconi", num_blocks=4, block_size=2, model=TINY, **kw)
    if layout is not None:
        p.set_groups(parse_kv_groups(layout))
    return p


def test_flop_efficiency_per_group_kind():
    p = _policy("full,sw2,mamba", state_bytes_per_layer=4096)
    # Per token 2 x 196608 = 393216 FLOPs; a key 4 x 4 x 64 = 1024; a block's K/V
    # 2 tokens x 2 x 2 heads x 64 x 4 bytes = 2048 bytes.
    # full, position 1 (tokens 2, 3 see 3 + 4 keys): (2 x 393216 + 7 x 1024) / 2048
    assert p.efficiency_of(0, 1) == 387.5
    # sliding window W=2: tokens 2, 3 see 2 + 2 keys
    assert p.efficiency_of(1, 1) == 386.0
    assert p.efficiency_of(1, 7) == 386.0  # flat past the window
    assert p.efficiency_of(0, 7) > p.efficiency_of(0, 1)  # full attention grows
    # state at position 1: the prefix's 4 tokens x 393216 / 4096 bytes, linear in p
    assert p.efficiency_of(2, 1) == 384.0
    assert p.efficiency_of(2, 3) == 2 * p.efficiency_of(2, 1)
    # Mamba2's default state size (expand 2, d_state 128, d_conv 4), f32
    q = _policy("full,mamba")
    assert q.state_bytes_per_layer == (256 * 128 + 4 * (256 + 256)) * 4


def _cache_release_add(p, bid, pos, group):
    b = KVCacheBlock(bid)
    p.on_cached_group(b, bytes([bid]) * 32, None, pos, group)
    p.on_release(b, None, pos)
    p.add(b)
    return b


@pytest.mark.parametrize("alpha,order", [(0, [0, 1, 2, 3]), (2, [1, 0, 3, 2])])
def test_victim_order_hand_computed(alpha, order):
    p = _policy("full,mamba", state_bytes_per_layer=4096, recency_window=4, alpha=alpha)
    # Released at ticks 2, 4, 6, 8: a deep state (efficiency 768, the scale), two
    # attention blocks at position 0 (385.5 = 0.501953125 x 768) and a shallow state
    # (192 = 0.25 x 768). alpha 2: scores 0.5 + 2, 1 + 1.0039, 1.5 + 1.0039, 2 + 0.5:
    # the new attention block goes first, the deep state ties the shallow one (its
    # older stamp first).
    for bid, pos, g in [(0, 3, 1), (1, 0, 0), (2, 0, 0), (3, 0, 1)]:
        _cache_release_add(p, bid, pos, g)
    assert p.efficiency_scale == 768.0
    assert p.candidate_ids() == order
    p.check_invariants([0, 1, 2, 3])
    assert [p.pop().block_id for _ in range(4)] == order


def test_one_full_group_degrades_to_recency_and_position():
    # Through the manager on the shared trace (every block at position 0: equal
    # efficiency): exactly LRU's order.
    m = KVCacheManager(6, BS, eviction="marconi")
    _run(m, TRACE)
    assert m.policy.candidate_ids() == [C, A, B, D]
    # No set_groups: a block is full attention at its position.
    p = _policy()
    assert p.efficiency_of(0, 3) > p.efficiency_of(0, 0)


class _Spy(LRUPolicy):
    name = "spy"
    calls: list

    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.calls = []

    def set_groups(self, groups):
        self.calls.append(("set_groups", len(groups)))

    def on_cached(self, block, block_hash, request, position):
        self.calls.append(("on_cached", block.block_id))
        super().on_cached(block, block_hash, request, position)

    def on_cached_group(self, block, block_hash, request, position, group_id):
        self.calls.append(("on_cached_group", block.block_id, group_id))
        super().on_cached(block, block_hash, request, position)


class _GroupSpy(_Spy):
    name = "group_spy"
    needs_groups = True


def _fill(m, prompt):
    req = Request("a", prompt)
    blocks, hit = m.get_computed_blocks(req)
    for c in m.prefill_chunks(req, hit):
        assert m.allocate_slots(req, c, hit, blocks) is not None
        req.num_computed_tokens += c + hit
        hit, blocks = 0, None
    m.check_invariants()
    return req


def test_the_pool_tells_groups_only_to_policies_that_ask():
    groups = parse_kv_groups("full,mamba")
    m = KVCacheManager(30, 2, eviction=_Spy, kv_cache_groups=groups)
    _fill(m, list(range(1, 10)))
    assert m.policy.calls and {c[0] for c in m.policy.calls} == {"on_cached"}
    m = KVCacheManager(30, 2, eviction=_GroupSpy, kv_cache_groups=groups)
    req = _fill(m, list(range(1, 10)))
    calls = m.policy.calls
    assert calls[0] == ("set_groups", 2)
    assert {c[0] for c in calls[1:]} == {"on_cached_group"}
    for _, bid, g in calls[1:]:
        assert m.block_pool.blocks[bid].block_hash[-4:] == g.to_bytes(4, "big")
    assert {g for _, _, g in calls[1:]} == {0, 1}
    m.free(req)


def test_hybrid_manager_gives_marconi_each_blocks_group():
    m = KVCacheManager(40, 2, eviction="marconi", kv_cache_groups=parse_kv_groups("full,mamba"),
                       eviction_options={"model": TINY})
    req = _fill(m, list(range(1, 16)))
    p = m.policy
    cached = [b for b in m.block_pool.blocks if b.block_hash is not None]
    assert cached
    for b in cached:
        g = int.from_bytes(b.block_hash[-4:], "big")
        assert p.group[b.block_id] == g
    states = [b for b in cached if p.group[b.block_id] == 1]
    assert states and all(p.efficiency[b.block_id] < p.efficiency_scale or
                          p.efficiency[b.block_id] == p.efficiency_scale for b in states)
    m.free(req)
    m.check_invariants()


@pytest.mark.parametrize("bad,match", [
    ({"alpha": -1}, "alpha"), ({"alpha": float("nan")}, "alpha"), ({"alpha": True}, "alpha"),
    ({"state_bytes_per_layer": 0}, "state_bytes_per_layer"),
    ({"recency_window": 0}, "recency_window"), ({"model": "nope"}, "nope"),
])
def test_bad_options_are_refused_before_anything_is_built(bad, match):
    with pytest.raises(ValueError, match=match):
        KVCacheManager(8, 2, eviction="marconi", eviction_options=bad)
    with pytest.raises(TypeError, match="model"):
        make_policy("marconi", num_blocks=4, block_size=2, model=3)
    with pytest.raises(TypeError, match="gamma"):
        make_policy("marconi", num_blocks=4, block_size=2, gamma=1)


def test_unknown_group_kind_is_refused():
    class _Spec:
        kind = "linear_attention"

    class _Group:
        spec = _Spec()

    with pytest.raises(ValueError, match="no FLOP model.*linear_attention"):
        _policy().set_groups((_Group(),))


@pytest.mark.parametrize("layout", [None, "full,sw3", "full,mamba", "full,sw5,mamba_r0"])
def test_random_operations_keep_invariants(layout):
    rng = random.Random(f"marconi-{layout}")
    groups = parse_kv_groups(layout) if layout else None
    m = KVCacheManager(24, 2, eviction="marconi", kv_cache_groups=groups,
                       free_order="unhashed_first")
    prefixes = [[rng.randrange(20) for _ in range(rng.randrange(2, 9))] for _ in range(5)]
    live = []
    for i in range(150):
        if live and (rng.random() < 0.45 or len(live) > 3):
            m.free(live.pop(rng.randrange(len(live))))
        else:
            req = Request(f"r{i}", rng.choice(prefixes)
                          + [rng.randrange(20) for _ in range(rng.randrange(1, 5))])
            blocks, hit = m.get_computed_blocks(req)
            chunks = m.prefill_chunks(req, hit) if groups else [req.num_tokens - hit]
            if m.allocate_slots(req, chunks[0], hit, blocks) is not None:
                req.num_computed_tokens = hit + chunks[0]
                live.append(req)
                for c in chunks[1:]:
                    if m.allocate_slots(req, c) is None:  # (a later chunk may not fit)
                        m.free(live.pop())
                        break
                    req.num_computed_tokens += c
        m.check_invariants()
    assert m.num_evictions > 0
    p = m.policy
    # A key changed behind the heap's back is caught.
    if len(p):
        bid = p.candidate_ids()[0]
        p.score[bid] += 1.0
        with pytest.raises(PolicyError, match="rekey"):
            m.check_invariants()
