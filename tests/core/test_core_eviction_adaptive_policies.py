"""The policies users asked vLLM for (issue 26): ``arc`` (vllm#40268), ``s3fifo`` and
RAGCache's ``pgdsf``: hand-computed victim orders through the manager on the shared
trace of ``test_core_eviction.py``, each policy's own mechanism (ARC's adaptive target
and ghost lists, S3-FIFO's quick demotion and lazy promotion, PGDSF's frequency
multiplier) on the protocol directly, and every index/tier running them under random
pressure with invariants checked after each call."""

from __future__ import annotations

import random

import pytest

from prefixcache import KVCacheManager, Request
from prefixcache.core.eviction import PolicyError, make_policy

from tests.core.test_core_eviction import BS, TRACE, A, B, C, D, _admit, _run

# Blocks after TRACE: hits A 2, B 1, C 0, D 0; released C < A < B < D; cached A < B < C < D.
EXPECTED = {
    # ARC: A and B were hit (T2), C and D not (T1). No ghost hit yet, so p = 0 and
    # |T1| = 2 > p: T1's candidates go first (LRU: C, D), then T2's (A before B: A's
    # last release came first).
    "arc": [C, D, A, B],
    # S3-FIFO (S = max(1, 10% of 6) = 1 block): every block starts in S. Evicting:
    # A (2 hits) and B (1 hit) move to M; C, D (no hit) are the victims; then M:
    # A 2 -> 1 (back), B 1 -> 0 (back), A 1 -> 0 (back), B evicted, A evicted.
    "s3fifo": [C, D, B, A],
    # PGDSF: every block sits at position 0 (equal cost/size v0): H = (1 + hits) * v0:
    # C v0, D v0 (C released first), B 2 v0, A 3 v0.
    "pgdsf": [C, D, B, A],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("index", ["hash", "radix"])
def test_victim_order_hand_computed(name, index):
    m = KVCacheManager(6, BS, eviction=name, index=index)
    _run(m, TRACE)
    assert m.policy.candidate_ids() == EXPECTED[name]
    req, hit = _admit(m, "big", list(range(100, 111)))  # needs all 6 blocks
    assert hit == 0
    assert m.get_block_ids("big")[2:] == EXPECTED[name]
    assert m.num_evictions == 4
    m.check_invariants()


class _Block:
    def __init__(self, block_id):
        self.block_id = block_id


def _cache(p, block, h):
    p.on_cached(block, h, None, 0)
    p.on_release(block, None, 0)
    p.add(block)


def _evict(p):
    victim = p.pop()
    p.on_evicted(victim)
    return victim


def test_arc_ghost_hits_move_the_target():
    p = make_policy("arc", num_blocks=4)
    b = [_Block(i) for i in range(4)]
    for i, h in enumerate((b"a", b"b", b"c", b"d")):
        _cache(p, b[i], h)
    # a is hit: T2 = {a}; T1 = {b, c, d}. |T1| = 3 > p = 0: evict T1's LRU, b.
    p.discard(b[0]); p.on_hit(b[0], None); p.on_release(b[0], None, 0); p.add(b[0])
    assert _evict(p) is b[1] and list(p._b1) == [b"b"]
    # b comes back into block 1: a B1 ghost hit -> p += max(1, |B2|/|B1|) = 1, in T2.
    _cache(p, b[1], b"b")
    assert p.p == 1.0 and p.ghost_hits == {"b1": 1, "b2": 0} and not p._b1
    assert p._count == {1: 2, 2: 2}
    # |T1| = 2 > p = 1: T1's LRU (c) goes, then |T1| = 1 = p: T2's LRU (a) goes.
    assert _evict(p) is b[2]
    assert _evict(p) is b[0] and list(p._b2) == [b"a"]
    # a comes back: a B2 ghost hit -> p -= max(1, |B1|/|B2|) = max(1, 1/1): p = 0.
    _cache(p, b[0], b"a")
    assert p.p == 0.0 and p.ghost_hits == {"b1": 1, "b2": 1}
    p.check_invariants(p.candidate_ids())
    # Ghost lists stay bounded by 2c whatever the stream.
    for i in range(200):
        victim = _evict(p)
        _cache(p, victim, b"x%d" % i)
    p.check_invariants(p.candidate_ids())
    assert len(p._b1) + len(p._b2) + len(p) <= 2 * 4


def test_s3fifo_ghost_sends_a_returning_block_to_main():
    p = make_policy("s3fifo", num_blocks=10)  # S holds 1 block
    b = [_Block(i) for i in range(10)]
    for i in range(10):
        _cache(p, b[i], b"h%d" % i)
    assert _evict(p) is b[0] and b"h0" in p._ghost  # one-hit wonder, oldest in S
    _cache(p, b[0], b"h0")  # back: straight into M
    assert p._queue[0] == 2 and b"h0" not in p._ghost
    # M's blocks are evicted FIFO when nobody hit them; a hit buys one more round.
    p.on_hit(b[1], None)
    order = p.candidate_ids()
    assert order[0] == 2 and order.index(1) > order.index(9)
    with pytest.raises(ValueError, match="small_fraction"):
        make_policy("s3fifo", num_blocks=4, small_fraction=1.0)
    with pytest.raises(ValueError, match="move_threshold"):
        make_policy("s3fifo", num_blocks=4, move_threshold=True)


def test_pgdsf_frequency_multiplies_the_saved_cost():
    p = make_policy("pgdsf", num_blocks=3, block_size=16)
    b = [_Block(i) for i in range(3)]
    p.on_cached(b[0], b"deep", None, 5)  # deep block: saves more per hit
    p.on_cached(b[1], b"shallow", None, 0)
    p.on_cached(b[2], b"hot", None, 0)
    for _ in range(3):
        p.on_hit(b[2], None)
    for blk in b:
        p.on_release(blk, None, 0)
        p.add(blk)
    assert p.value(5) > p.value(0)
    expected = sorted(range(3), key=lambda i: (p.h[i], p.released_at[i]))
    assert p.candidate_ids() == expected and expected[0] == 1  # shallow, never hit
    assert p.h[2] == pytest.approx(4 * p.value(0))
    assert _evict(p) is b[1] and p.inflation == pytest.approx(p.value(0))
    capped = make_policy("pgdsf", num_blocks=3, block_size=16, frequency_cap=2)
    capped.hits[0] = 9
    assert capped.frequency(0) == 2
    with pytest.raises(ValueError, match="frequency_cap"):
        make_policy("pgdsf", num_blocks=3, block_size=16, frequency_cap=0)
    with pytest.raises(PolicyError):
        make_policy("arc", num_blocks=3).pop()


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("index,num_host_blocks", [("hash", 0), ("radix", 0), ("hash", 6),
                                                   ("radix", 6)])
def test_random_pressure_keeps_invariants(name, index, num_host_blocks):
    rng = random.Random(f"{name}-{index}-{num_host_blocks}")
    m = KVCacheManager(12, BS, eviction=name, index=index, num_host_blocks=num_host_blocks,
                       host_eviction=name)
    prefixes = [[rng.randrange(20) for _ in range(rng.randrange(2, 9))] for _ in range(6)]
    live = []
    for i in range(150):
        if live and (len(live) > 3 or rng.random() < 0.4):
            m.free(live.pop(rng.randrange(len(live))))
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(20) for _ in range(rng.randrange(1, 5))]
            req = Request(f"r{i}", prompt)
            blocks, hit = m.get_computed_blocks(req)
            if m.allocate_slots(req, len(prompt) - hit, hit, blocks) is not None:
                req.num_computed_tokens = len(prompt)
                live.append(req)
        m.take_host_transfers() if num_host_blocks else None
        m.check_invariants()
    assert m.num_evictions > 0
    for req in live:
        m.free(req)
    m.check_invariants()
    assert m.reset_prefix_cache() and m.num_cached_blocks == 0
    m.check_invariants()
