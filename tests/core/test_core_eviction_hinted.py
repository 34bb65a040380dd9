"""Retention hints: ``RetentionHints`` at the boundary, the ``hinted`` policy's order
(hand-computed and against a plain-Python reference under random operations), and
"absent hints change nothing" (replays byte-identical to lru)."""

from __future__ import annotations

import math
import random

import pytest

from prefixcache.core import KVCacheManager, Request
from prefixcache.core.block_pool import KVCacheBlock
from prefixcache.core.eviction import make_policy, policy_clock
from prefixcache.core.request import RetentionHints
from prefixcache.sim import workloads
from prefixcache.sim.replay import replay
from prefixcache.sim.trace import TraceRequest


@pytest.mark.parametrize("kwargs,match", [
    (dict(priority=1.5), "RetentionHints.priority must be an int"),
    (dict(priority=True), "RetentionHints.priority must be an int"),
    (dict(ttl_s=0), "RetentionHints.ttl_s must be a finite number > 0"),
    (dict(ttl_steps=float("nan")), "RetentionHints.ttl_steps"),
    (dict(ttl_s="5"), "RetentionHints.ttl_s must be a number"),
    (dict(keep_range=(5, 5)), "RetentionHints.keep_range must satisfy"),
    (dict(keep_range=(-1, 5)), "keep_range start must be >= 0"),
    (dict(keep_range="ab"), "RetentionHints.keep_range must be a"),
    (dict(session_end="yes"), "RetentionHints.session_end must be True or False"),
])
def test_hints_are_checked_at_the_boundary(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RetentionHints(**kwargs)


def test_request_takes_hints_or_their_dict():
    h = RetentionHints(priority=2, ttl_s=30, keep_range=[0, 64], session_end=True)
    assert h.keep_range == (0, 64) and h.ttl_s == 30.0
    assert RetentionHints.from_dict(h.to_dict()) == h
    assert Request("a", [1, 2], retention=h.to_dict()).retention == h
    assert Request("a", [1, 2]).retention is None
    with pytest.raises(ValueError, match="unknown field"):
        Request("a", [1, 2], retention={"ttl": 3})
    with pytest.raises(ValueError, match="request 'a': retention must be"):
        Request("a", [1, 2], retention=[1])


def _admit(m, rid, prompt, hints=None):
    r = Request(rid, prompt, retention=hints)
    blocks, hit = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
    m.check_invariants()
    return r, hit


def test_hand_computed_order():
    # block size 2; a: blocks 0,1 (+2 partial), kept 10 steps; b: 3,4 (+5), no hint;
    # c: 6,7 (+8) ends its session keeping its first block only.
    m = KVCacheManager(9, 2, eviction="hinted", free_order="unhashed_first")
    tick = policy_clock(m)
    tick(None, 0)
    a, _ = _admit(m, "a", [1, 2, 3, 4, 5], RetentionHints(priority=1, ttl_steps=10))
    b, _ = _admit(m, "b", [6, 7, 8, 9, 10])
    c, _ = _admit(m, "c", [11, 12, 13, 14, 15],
                  RetentionHints(ttl_steps=10, keep_range=(0, 2), session_end=True))
    for r in (a, b, c):
        m.free(r)
    m.check_invariants()
    p = m.policy
    # dead (c's block 7) < plain (b's 3, 4) < kept by priority: c's 6 (0) < a's 0, 1 (1)
    order = [bid for bid in p.candidate_ids()]
    assert order == [7, 4, 3, 6, 1, 0]  # (a request frees its last block first)
    tick(None, 11)  # the TTLs ran out: everything plain, LRU (release order) ...
    assert p.candidate_ids() == [7, 1, 0, 4, 3, 6]  # ... but the dead block first
    # a hit revives and re-protects
    tick(None, 12)
    _, hit = _admit(m, "c2", [11, 12, 13, 14, 99], RetentionHints(priority=5, ttl_steps=2))
    assert hit == 4


class _Req:
    def __init__(self, retention):
        self.retention = retention
        self.priority = 0


def _reference_rank(meta, now, bid):
    dead, prio, until, rel = meta[bid]
    if dead:
        return (0, 0, rel)
    if now <= until:
        return (2, prio, rel)
    return (1, 0, rel)


@pytest.mark.parametrize("unit", ["steps", "s"])
def test_random_operations_against_a_reference(unit):
    rng = random.Random(5)
    n, bs = 24, 4
    p = make_policy("hinted", num_blocks=n, block_size=bs, unit=unit)
    blocks = [KVCacheBlock(i) for i in range(n)]
    meta = {}  # bid -> [dead, prio, until, released stamp]
    pos = {}
    cand: set[int] = set()
    held: set[int] = set()
    now, clock = 0.0, 0
    for _ in range(3000):
        op = rng.random()
        hint = None
        if rng.random() < 0.7:
            ttl = rng.choice([None, 1.0, 3.0, 7.5])
            hint = RetentionHints(priority=rng.randrange(3),
                                  **({"ttl_s": ttl} if unit == "s" else {"ttl_steps": ttl}),
                                  keep_range=rng.choice([None, (0, 8), (4, 16)]),
                                  session_end=rng.random() < 0.3)
        req = _Req(hint)

        def use(bid, release):
            m = meta[bid]
            if hint is None:
                return
            lo = pos[bid] * bs
            kr = hint.keep_range
            if kr is None or (kr[0] <= lo and lo + bs <= kr[1]):
                ttl = hint.ttl_s if unit == "s" else hint.ttl_steps
                until = math.inf if ttl is None else now + ttl
                if m[2] >= now:
                    m[1], m[2] = max(m[1], hint.priority), max(m[2], until)
                else:
                    m[1], m[2] = hint.priority, until
                m[0] = False
            elif release and hint.session_end:
                m[0] = True

        if op < 0.05:
            now += rng.choice([0.5, 1.0, 2.0])
            p.set_time(now, now)
        elif op < 0.35:  # a free block enters the cache, held
            free = [b for b in range(n) if b not in held and b not in cand and b not in meta]
            if not free:
                continue
            bid = rng.choice(free)
            pos[bid] = rng.randrange(5)
            clock += 1
            meta[bid] = [False, 0, -math.inf, 0]
            p.on_cached(blocks[bid], b"h", req, pos[bid])
            use(bid, False)
            held.add(bid)
        elif op < 0.6 and held:  # release -> candidate
            bid = rng.choice(sorted(held))
            held.discard(bid)
            p.on_release(blocks[bid], req, pos[bid])
            clock += 1
            meta[bid][3] = clock
            use(bid, True)
            p.add(blocks[bid])
            cand.add(bid)
        elif op < 0.75 and cand:  # a hit adopts a candidate
            bid = rng.choice(sorted(cand))
            p.discard(blocks[bid])
            cand.discard(bid)
            p.on_hit(blocks[bid], req)
            meta[bid][0] = False
            use(bid, False)
            held.add(bid)
        elif cand:  # evict
            want = min(cand, key=lambda b: _reference_rank(meta, now, b))
            got = p.pop().block_id
            assert got == want, (got, want)
            cand.discard(got)
            p.on_evicted(blocks[got])
            del meta[got]
        p.check_invariants(sorted(cand))


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_absent_hints_change_nothing(index):
    trace = workloads.generate("multi_turn", seed=0, num_conversations=12, num_turns=4)
    out = []
    for name, opts in (("lru", None), ("hinted", None), ("hinted", {"unit": "s"})):
        recs = []
        s = replay(trace, num_blocks=60, block_size=16, concurrency=4, index=index,
                   free_order="unhashed_first", eviction=name, eviction_options=opts,
                   on_record=recs.append)
        assert s["evictions"] > 0
        out.append((recs, {k: v for k, v in s.items() if k not in ("eviction", "timing",
                                                                    "config", "wall_s")}))
    assert out[1][0] == out[0][0] and out[2][0] == out[0][0]


def test_hints_change_the_agentic_replay_and_help():
    kw = dict(num_sessions=3, mean_steps=10, system_tokens=300, tool_tokens=900,
              compact_at=8000, summary_tokens=600, subagent_prob=0.3,
              subagent_mean_steps=3, seed=0)
    plain = workloads.generate("agentic", **kw)
    hinted = workloads.generate("agentic", hints=True, ttl_s=60.0, **kw)
    assert all(r.retention is None for r in plain)
    assert all(r.retention is not None for r in hinted)
    res = {}
    for name, trace in (("lru", plain), ("hinted", hinted)):
        s = replay(trace, num_blocks=180, block_size=64, concurrency=4,
                   free_order="unhashed_first", eviction="hinted",
                   eviction_options={"unit": "s"})
        res[name] = s["hit_tokens"]
    base = replay(plain, num_blocks=180, block_size=64, concurrency=4,
                  free_order="unhashed_first")["hit_tokens"]
    assert res["lru"] == base  # hinted without hints is lru
    assert res["hinted"] > base
