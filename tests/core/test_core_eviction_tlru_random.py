"""``tlru`` (tail-optimized LRU) and ``random`` (seeded uniform victims; RLT under the
radix index): hand-computed orders, random operations against plain-Python
references, determinism for a seed, and bad options refused before anything is built.
(The compose matrix runs both under every index, tier and group layout.)"""

from __future__ import annotations

import collections
import random

import pytest

from prefixcache.core import KVCacheManager, Request
from prefixcache.core.block_pool import KVCacheBlock
from prefixcache.core.eviction import make_policy


def _admit(m, rid, prompt):
    r = Request(rid, prompt)
    blocks, hit = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
    r.num_computed_tokens = r.num_tokens
    m.check_invariants()
    return r, hit


def _two_requests(eviction, options, index="hash"):
    # Eight blocks of 2 tokens.
    #   a [1..7]    caches blocks 0, 1, 2 (positions 0, 1, 2; block 3 partial): L = 3
    #   b [11..13]  caches block 4 (position 0; block 5 partial):                L = 1
    # a freed, then b: a's blocks are released tail first, so the release order
    # (the lru queue) is 2, 1, 0, 4.
    m = KVCacheManager(8, 2, eviction=eviction, index=index, eviction_options=options,
                       free_order="unhashed_first")
    a, _ = _admit(m, "a", [1, 2, 3, 4, 5, 6, 7])
    b, _ = _admit(m, "b", [11, 12, 13])
    assert m.get_block_ids("a") == [0, 1, 2, 3] and m.get_block_ids("b") == [4, 5]
    m.free(a)
    m.free(b)
    m.check_invariants()
    return m


def test_tlru_hand_computed_order():
    # threshold 2, next_prompt 0: budget = max(L + 0 - 2, 0): a's is 1 (blocks at
    # positions >= 1 are TEL-safe: 1, 2), b's is 0 (block 4 is TEL-safe).
    # TEL-safe in LRU order 2, 1, 4; then the rest: 0.   (lru: 2, 1, 0, 4)
    m = _two_requests("tlru", {"threshold": 2})
    assert m.policy.candidate_ids() == [2, 1, 4, 0]
    # One request needing every block: unhashed blocks (3, 5, 6, 7) first, then the
    # victims in that order.
    r, hit = _admit(m, "big", list(range(100, 115)))
    assert hit == 0 and m.get_block_ids("big")[4:] == [2, 1, 4, 0]
    # next_prompt 1 raises a's budget to 2 (only block 2 safe) and b's to 0 (block 4).
    m = _two_requests("tlru", {"threshold": 2, "next_prompt": 1})
    assert m.policy.candidate_ids() == [2, 4, 1, 0]
    # Defaults (threshold 0): nothing is TEL-safe: lru's order.
    assert _two_requests("tlru", None).policy.candidate_ids() == [2, 1, 0, 4]
    assert _two_requests("lru", {"fast_path": False}).policy.candidate_ids() == [2, 1, 0, 4]
    # The radix index offers only leaves (2 and 4): both TEL-safe, LRU between them.
    assert _two_requests("tlru", {"threshold": 2}, "radix").policy.candidate_ids() == [2, 4]


def test_tlru_history_is_the_high_water_depth():
    # A later, longer turn of a's conversation hits blocks 0..2 and caches 3..5: L = 6
    # for every block it released. threshold 3: budget 3, blocks at positions >= 3 safe.
    m = KVCacheManager(10, 2, eviction="tlru", eviction_options={"threshold": 3},
                       free_order="unhashed_first")
    a, _ = _admit(m, "a", [1, 2, 3, 4, 5, 6, 7])
    m.free(a)
    a2, hit = _admit(m, "a2", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert hit == 6
    ids = m.get_block_ids("a2")
    m.free(a2)
    # released tail first: positions 5, 4, 3 (safe), then 2, 1, 0
    assert m.policy.candidate_ids()[:3] == [ids[5], ids[4], ids[3]]
    assert m.policy.candidate_ids()[3:] == [ids[2], ids[1], ids[0]]


class _Req:
    def __init__(self, num_tokens):
        self.num_tokens = num_tokens


@pytest.mark.parametrize("seed", range(4))
def test_tlru_random_operations_match_the_reference(seed):
    rng = random.Random(seed)
    n, bs = 12, 4
    xi, q = rng.randrange(0, 6), rng.randrange(0, 3)
    p = make_policy("tlru", num_blocks=n, block_size=bs, threshold=xi, next_prompt=q)
    blocks = [KVCacheBlock(i) for i in range(n)]
    depth, hist, released = [0] * n, [0] * n, [0] * n
    cands: set[int] = set()
    held: set[int] = set()
    seq = 0

    def order():
        def key(b):
            safe = depth[b] >= max(hist[b] + q - xi, 0)
            return (0 if safe else 1, released[b])
        return sorted(cands, key=key)

    for _ in range(500):
        op = rng.random()
        free_ids = [b for b in range(n) if b not in held and b not in cands]
        if op < 0.3 and free_ids:  # cached at some position by a request of some length
            b, pos, toks = rng.choice(free_ids), rng.randrange(6), rng.randrange(0, 40)
            p.on_cached(blocks[b], b"h", _Req(toks), pos)
            seq += 1
            depth[b], hist[b] = pos, max(pos + 1, toks // bs)
            held.add(b)
        elif op < 0.45 and cands:  # a lookup adopts a candidate
            b = rng.choice(sorted(cands))
            p.discard(blocks[b])
            cands.discard(b)
            p.on_hit(blocks[b], _Req(rng.randrange(60)))
            held.add(b)
        elif op < 0.75 and held:  # released (by a request of some length; None: host)
            b = rng.choice(sorted(held))
            held.discard(b)
            toks = rng.randrange(0, 60)
            p.on_release(blocks[b], _Req(toks) if toks < 50 else None, depth[b])
            p.add(blocks[b])
            seq += 1
            released[b] = seq
            hist[b] = max(hist[b], toks // bs if toks < 50 else 0)
            cands.add(b)
        elif cands:
            want = order()[0]
            got = p.pop()
            assert got.block_id == want
            p.on_evicted(got)
            cands.discard(want)
        if rng.random() < 0.2:
            assert p.candidate_ids() == order()
            p.check_invariants(sorted(cands))


def _victims(seed, ops_seed=0, n=10, steps=400):
    rng = random.Random(ops_seed)
    p = make_policy("random", num_blocks=n, seed=seed)
    blocks = [KVCacheBlock(i) for i in range(n)]
    cands: set[int] = set()
    out = []
    for _ in range(steps):
        op = rng.random()
        outside = [b for b in range(n) if b not in cands]
        if op < 0.45 and outside:
            b = rng.choice(outside)
            p.add(blocks[b])
            cands.add(b)
        elif op < 0.6 and cands:
            b = rng.choice(sorted(cands))
            p.discard(blocks[b])
            cands.discard(b)
        elif cands:
            got = p.pop().block_id
            assert got in cands  # a candidate, never anything else
            cands.discard(got)
            out.append(got)
        if rng.random() < 0.2:
            p.check_invariants(sorted(cands))
            assert len(p) == len(cands)
    return out


def test_random_is_deterministic_for_a_seed_and_draws_candidates_only():
    assert _victims(3) == _victims(3)
    assert _victims(3) != _victims(4)
    for s in range(3):
        _victims(s, ops_seed=s + 10)


def test_random_draws_uniformly_among_the_present_candidates():
    # Four candidates; pop one and put it back, 4000 times: each is drawn ~1000 times.
    # Block 0 survives many draws before the others join: a key fixed at add() would
    # bias against newcomers; a draw at pop() does not.
    p = make_policy("random", num_blocks=4, seed=0)
    blocks = [KVCacheBlock(i) for i in range(4)]
    counts = collections.Counter()
    for b in blocks:
        p.add(b)
    for _ in range(4000):
        b = p.pop()
        counts[b.block_id] += 1
        p.add(b)
    assert sorted(counts) == [0, 1, 2, 3]
    assert all(850 < c < 1150 for c in counts.values()), counts


def test_random_in_the_manager_is_deterministic_and_rlt_under_radix():
    def run(index, seed):
        m = KVCacheManager(6, 2, index=index, eviction="random",
                           eviction_options={"seed": seed}, free_order="unhashed_first")
        hits = []
        rng = random.Random(0)
        for i in range(40):
            r, hit = _admit(m, f"r{i}", [rng.randrange(3)] * 2 + [rng.randrange(3)] * 3)
            hits.append(hit)
            m.free(r)
            m.check_invariants()
        return hits, m.num_evictions

    for index in ("hash", "radix"):
        assert run(index, 7) == run(index, 7)
        assert run(index, 7)[1] > 0
    # radix: the candidates are leaves (RLT); a parent becomes one once its child left
    m = _two_requests("random", {"seed": 1}, "radix")
    assert sorted(m.policy.candidate_ids()) == [2, 4]


@pytest.mark.parametrize("eviction,options,err", [
    ("tlru", {"threshold": -1}, ValueError), ("tlru", {"threshold": 1.5}, TypeError),
    ("tlru", {"threshold": True}, TypeError), ("tlru", {"next_prompt": "2"}, TypeError),
    ("tlru", {"xi": 2}, TypeError),
    ("random", {"seed": 1.5}, TypeError), ("random", {"seed": "7"}, TypeError),
    ("random", {"seed": None}, TypeError), ("random", {"sed": 1}, TypeError),
])
def test_bad_options_are_refused_before_anything_is_built(eviction, options, err):
    from prefixcache.sim.replay import replay

    with pytest.raises(err, match=eviction):
        KVCacheManager(8, 2, eviction=eviction, eviction_options=options)

    def untouched():
        raise AssertionError("the trace was read before the options were checked")
        yield  # noqa: unreachable (a generator)

    with pytest.raises(err, match=eviction):
        replay(untouched(), num_blocks=8, block_size=2, eviction=eviction,
               eviction_options=options)
