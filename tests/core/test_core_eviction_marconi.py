"""``marconi`` (Marconi's FLOP-aware eviction, MLSys'25) and the ``needs_groups`` seam:
hand-computed FLOP efficiencies per group kind and victim orders on the protocol, the
hybrid pool telling each cached block's group (and telling policies without the
property nothing), options checked at the boundary, random operations through every
layout with invariants checked after each call."""

from __future__ import annotations

import random

import numpy as np
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


def _chunks(m, req, hit):
    """The prefill chunks (state layouts split prefill at checkpoint positions; other
    managers take the prompt at once)."""
    split = getattr(m, "prefill_chunks", None)
    return split(req, hit) if split is not None else [req.num_tokens - hit]


def _fill(m, prompt):
    req = Request("a", prompt)
    blocks, hit = m.get_computed_blocks(req)
    for c in _chunks(m, req, hit):
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


def _random_operations(m, rng) -> None:
    """150 random admissions (prefill split where the layout splits it) and frees, with
    ``check_invariants`` after each; the pool must have evicted."""
    prefixes = [[rng.randrange(20) for _ in range(rng.randrange(2, 9))] for _ in range(5)]
    live = []
    for i in range(150):
        if live and (rng.random() < 0.45 or len(live) > 3):
            m.free(live.pop(rng.randrange(len(live))))
        else:
            req = Request(f"r{i}", rng.choice(prefixes)
                          + [rng.randrange(20) for _ in range(rng.randrange(1, 5))])
            blocks, hit = m.get_computed_blocks(req)
            chunks = _chunks(m, req, hit)
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


@pytest.mark.parametrize("layout", [None, "full,sw3", "full,mamba", "full,sw5,mamba_r0"])
def test_random_operations_keep_invariants(layout):
    rng = random.Random(f"marconi-{layout}")
    groups = parse_kv_groups(layout) if layout else None
    m = KVCacheManager(24, 2, eviction="marconi", kv_cache_groups=groups,
                       free_order="unhashed_first")
    _random_operations(m, rng)
    p = m.policy
    # A key changed behind the heap's back is caught.
    if len(p):
        bid = p.candidate_ids()[0]
        p.score[bid] += 1.0
        with pytest.raises(PolicyError, match="rekey"):
            m.check_invariants()


# -- normalization="minmax": Marconi's min-max over the candidates at each eviction --


def _brute_utilities(cands, alpha):
    """Marconi's rule in plain Python: ``cands`` = {bid: (stamp, efficiency, order)}
    of the live candidates -> {bid: (utility, stamp, order)} (the victim: the min)."""
    st = [c[0] for c in cands.values()]
    ef = [c[1] for c in cands.values()]
    s0, s1, e0, e1 = min(st), max(st), min(ef), max(ef)
    out = {}
    for bid, (stamp, eff, order) in cands.items():
        u = (stamp - s0) / (s1 - s0) if s1 > s0 else 0.0
        if alpha and e1 > e0:
            u += alpha * ((eff - e0) / (e1 - e0))
        out[bid] = (u, stamp, order)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_minmax_pops_the_brute_force_argmin(seed):
    rng = random.Random(f"minmax-{seed}")
    alpha = rng.choice([0.0, 0.5, 1.0, 3.0])
    n = 12
    p = make_policy("marconi", num_blocks=n, block_size=2, model=TINY, alpha=alpha,
                    normalization="minmax")
    p.set_groups(parse_kv_groups("full,sw2,mamba"))
    blocks = [KVCacheBlock(i) for i in range(n)]
    meta = {}  # live candidates: bid -> (stamp, efficiency, order)
    order = 0
    pops = 0
    for _ in range(400):
        free = [b for b in blocks if b.block_id not in meta]
        r = rng.random()
        if free and (r < 0.5 or not meta):
            b = rng.choice(free)
            # positions repeat, so equal efficiencies (ties) happen
            pos, g = rng.randrange(4), rng.randrange(3)
            p.on_cached_group(b, bytes([b.block_id]) * 32, None, pos, g)
            if rng.random() < 0.3:
                p.on_hit(b, None)
            p.on_release(b, None, pos)
            p.add(b)
            order += 1
            meta[b.block_id] = (p.released_at[b.block_id], p.efficiency[b.block_id], order)
        elif r < 0.65:
            bid = rng.choice(sorted(meta))
            p.discard(blocks[bid])
            del meta[bid]
        else:
            brute = _brute_utilities(meta, alpha)
            want = sorted(brute, key=brute.__getitem__)
            assert p.candidate_ids() == want
            ids = sorted(meta)
            assert p.utilities(ids).tolist() == pytest.approx([brute[b][0] for b in ids])
            assert p.pop().block_id == want[0]
            del meta[want[0]]
            pops += 1
        assert len(p) == len(meta)
        p.check_invariants(sorted(meta))
    assert pops > 50
    outside = [b.block_id for b in blocks if b.block_id not in meta]
    if outside:
        with pytest.raises(ValueError, match="not candidates"):
            p.utilities(outside[:1])
    with pytest.raises(PolicyError, match="not a candidate"):
        p.discard(blocks[outside[0]]) if outside else p.discard(p.pop())


def test_minmax_hand_computed_order():
    # The blocks of test_victim_order_hand_computed, min-max normalised over the four:
    # stamps 2, 4, 6, 8 -> 0, 1/3, 2/3, 1; efficiencies 768, 385.5, 385.5, 192 ->
    # 1, 0.3359, 0.3359, 0. alpha 2: 2, 1.005, 1.338, 1 -> the shallow state (1) first,
    # then the two attention blocks, the deep state last.
    p = _policy("full,mamba", state_bytes_per_layer=4096, alpha=2, normalization="minmax")
    for bid, pos, g in [(0, 3, 1), (1, 0, 0), (2, 0, 0), (3, 0, 1)]:
        _cache_release_add(p, bid, pos, g)
    assert p.candidate_ids() == [3, 1, 2, 0]
    assert p.utilities([0, 3]).tolist() == pytest.approx([2.0, 1.0])
    # Unlike the running scale, a victim changes the others' utilities: with the
    # shallow state gone, the attention blocks' 385.5 is the minimum efficiency (0) and
    # the stamps 2, 4, 6 span 0 .. 1: 0.5, 1.0 and 0 + 2 x 1.
    assert p.pop().block_id == 3
    assert p.candidate_ids() == [1, 2, 0]
    assert p.utilities([1, 2, 0]).tolist() == pytest.approx([0.5, 1.0, 2.0])
    p.check_invariants([0, 1, 2])
    p.clear()
    assert len(p) == 0 and p.candidate_ids() == []
    with pytest.raises(PolicyError, match="no candidates"):
        p.pop()


def _drive(m, ops):
    """Apply one random op sequence to manager ``m``; the hits and the candidates'
    order after every op."""
    live, seen = [], []
    for op, req_id, prompt in ops:
        if op == "free":
            match = [r for r in live if r.request_id == req_id]
            if match:
                live.remove(match[0])
                m.free(match[0])
        else:
            req = Request(req_id, prompt)
            blocks, hit = m.get_computed_blocks(req)
            if m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None:
                req.num_computed_tokens = req.num_tokens
                live.append(req)
            seen.append(hit)
        m.check_invariants()
        seen.append(tuple(m.policy.candidate_ids()))
    return seen


def test_minmax_alpha_zero_is_lru():
    rng = random.Random("minmax-lru")
    prefixes = [[rng.randrange(20) for _ in range(rng.randrange(2, 9))] for _ in range(5)]
    ops = []
    for i in range(200):
        if rng.random() < 0.45:
            ops.append(("free", f"r{rng.randrange(i + 1)}", None))
        else:
            ops.append(("add", f"r{i}", rng.choice(prefixes)
                        + [rng.randrange(20) for _ in range(rng.randrange(1, 5))]))
    kw = dict(free_order="unhashed_first")
    got = _drive(KVCacheManager(16, 2, eviction="marconi", eviction_options={
        "alpha": 0, "normalization": "minmax"}, **kw), ops)
    want = _drive(KVCacheManager(16, 2, eviction=LRUPolicy, **kw), ops)  # (a policy object)
    assert got == want
    assert sum(1 for x in want if type(x) is int and x) > 10  # (hits happened)
    m = KVCacheManager(16, 2, eviction="marconi", eviction_options={"alpha": 0}, **kw)
    assert _drive(m, ops) == want  # (the running normalisation's alpha 0 too)
    assert m.num_evictions > 10


@pytest.mark.parametrize("bad,match", [
    ({"normalization": "zscore"}, "normalization"), ({"normalization": 1}, "normalization"),
    ({"normalization": "minmax", "recency_window": 8}, "recency_window"),
])
def test_bad_normalization_is_refused_before_anything_is_built(bad, match):
    with pytest.raises(ValueError, match=match):
        KVCacheManager(8, 2, eviction="marconi", eviction_options=bad)
    with pytest.raises(ValueError, match=match):
        KVCacheManager(8, 2, eviction="marconi", eviction_options=bad, index="radix",
                       kv_cache_groups=parse_kv_groups("full,sw3"))


# (the radix index refuses state groups: COMBINATION_RULES)
@pytest.mark.parametrize("layout,index", [
    (None, "hash"), ("full,sw3", "hash"), ("full,mamba", "hash"), (None, "radix"),
    ("full,sw3", "radix")])
def test_minmax_random_operations_keep_invariants(layout, index):
    rng = random.Random(f"minmax-{layout}-{index}")
    groups = parse_kv_groups(layout) if layout else None
    m = KVCacheManager(24, 2, eviction="marconi", kv_cache_groups=groups, index=index,
                       free_order="unhashed_first",
                       eviction_options={"normalization": "minmax", "alpha": 2.0})
    _random_operations(m, rng)
    p = m.policy
    if len(p):  # a candidate's metadata changed behind its back is caught
        bid = p.candidate_ids()[0]
        p._mm_stamp[bid] += 1.0
        with pytest.raises(PolicyError, match="rekey"):
            m.check_invariants()


# -- the radix index's multi-group manager tells marconi each block's group ----------


def test_radix_multi_group_manager_gives_marconi_each_blocks_group():
    groups = parse_kv_groups("full,sw4")
    m = KVCacheManager(40, 2, eviction="marconi", kv_cache_groups=groups, index="radix",
                       eviction_options={"model": TINY})
    p = m.policy
    assert [k for k, _ in p._models] == ["attention", "attention"]
    assert p._models[1][1] == 4  # (the window reached the FLOP model)
    req = _fill(m, list(range(1, 16)))
    impl = m.implementation
    cached = [(bid, impl._owner_group[bid]) for bid, node in enumerate(impl._owner)
              if node is not None]
    assert {g for _, g in cached} == {0, 1}
    for bid, g in cached:
        assert p.group[bid] == g
    # a sliding-window block past the window saves less than the full block there
    deep = [bid for bid, g in cached if g == 1 and p.efficiency[bid] < p.efficiency_scale]
    assert deep
    m.free(req)
    m.check_invariants()


def test_radix_multi_group_manager_tells_groups_only_to_policies_that_ask():
    groups = parse_kv_groups("full,sw4")
    m = KVCacheManager(30, 2, eviction=_Spy, kv_cache_groups=groups, index="radix")
    _fill(m, list(range(1, 10)))
    assert m.policy.calls and {c[0] for c in m.policy.calls} == {"on_cached"}
    m = KVCacheManager(30, 2, eviction=_GroupSpy, kv_cache_groups=groups, index="radix")
    _fill(m, list(range(1, 10)))
    calls = m.policy.calls
    assert calls[0] == ("set_groups", 2)
    assert {c[0] for c in calls[1:]} == {"on_cached_group"}
    assert {g for _, _, g in calls[1:]} == {0, 1}
