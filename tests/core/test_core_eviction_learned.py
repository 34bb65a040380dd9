"""``LearnedPolicy`` (numpy inference of a small MLP over block features; trained by
``experiments/learned_policy.py``): hand-computed orders from hand-set weights, random
operations against a plain-Python reference (features and MLP), the parameters
checked before anything is built, one batched ranking per run of pops, and every
index x tier x layout of the compose matrix."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from prefixcache.core import KVCacheManager, Request
from prefixcache.core.block_pool import KVCacheBlock
from prefixcache.core.eviction.learned import FEATURES, LearnedPolicy, load_params

NF = len(FEATURES)


def _linear(weights) -> dict:
    """A one-layer 'MLP': score = sum(weights[f] * feature f) (no standardization)."""
    w = np.zeros((NF, 1))
    for f, v in weights.items():
        w[FEATURES.index(f), 0] = v
    return {"mean": np.zeros(NF), "std": np.ones(NF), "w0": w, "b0": np.zeros(1)}


def _admit(m, rid, prompt):
    r = Request(rid, prompt)
    blocks, hit = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
    r.num_computed_tokens = r.num_tokens
    m.check_invariants()
    return r, hit


def _manager(params, index="hash"):
    # Eight blocks of 2 tokens.
    #   a [1..7]   caches blocks 0, 1, 2 (depths 0, 1, 2; block 3 partial)
    #   b [11..13] caches block 4 (depth 0; block 5 partial)
    #   c [1, 2, 3] hits block 0 (a hit on it), caches nothing new (block 6 partial)
    # Freed a, b, c: release order 2, 1, 0, 4, then 0 again (c).
    m = KVCacheManager(8, 2, index=index, eviction=LearnedPolicy,
                       eviction_options={"params": params}, free_order="unhashed_first")
    a, _ = _admit(m, "a", [1, 2, 3, 4, 5, 6, 7])
    b, _ = _admit(m, "b", [11, 12, 13])
    m.free(a)
    m.free(b)
    c, hit = _admit(m, "c", [1, 2, 3])
    assert hit == 2
    m.free(c)
    m.check_invariants()
    return m


def test_hand_computed_orders():
    # score = recency (log1p of ticks since release / 8 blocks): least recently
    # released first -- lru's order: 2, 1, 4, 0 (0 was released again by c).
    assert _manager(_linear({"recency": 1.0})).policy.candidate_ids() == [2, 1, 4, 0]
    # score = depth: the deepest first (2, then 1), depth-0 ties in LRU order (4, 0).
    assert _manager(_linear({"depth": 1.0})).policy.candidate_ids() == [2, 1, 4, 0]
    # score = -depth: depth 0 first (4 before 0: LRU among ties), then 1, 2.
    assert _manager(_linear({"depth": -1.0})).policy.candidate_ids() == [4, 0, 1, 2]
    # score = -frequency: the blocks never hit (2, 1, 4 in LRU order), then 0 (1 hit).
    assert _manager(_linear({"frequency": -1.0})).policy.candidate_ids() == [2, 1, 4, 0]
    # score = frequency: the hit block 0 first.
    m = _manager(_linear({"frequency": 1.0}))
    assert m.policy.candidate_ids() == [0, 2, 1, 4]
    # One request needing every block: unhashed ones (3, 5, 6, 7) first, then victims.
    r, hit = _admit(m, "big", list(range(100, 115)))
    assert hit == 0 and m.get_block_ids("big")[4:] == [0, 2, 1, 4]
    # The radix index offers leaves only (2 and 4; 0 and 1 have children).
    assert _manager(_linear({"depth": -1.0}), "radix").policy.candidate_ids() == [4, 2]


def test_pops_without_a_change_between_them_share_one_ranking():
    rng = np.random.default_rng(0)
    params = {"mean": np.zeros(NF), "std": np.ones(NF), "w0": rng.normal(size=(NF, 4)),
              "b0": np.zeros(4), "w1": rng.normal(size=(4, 1)), "b1": np.zeros(1)}
    p = LearnedPolicy(16, block_size=4, params=params)
    blocks = [KVCacheBlock(i) for i in range(16)]
    for b in blocks:
        p.on_cached(b, b"h", None, b.block_id % 5)
        p.on_release(b, None, b.block_id % 5)
        p.add(b)
    want = p.candidate_ids()
    n0 = p.num_rankings
    p.discard(blocks[want[1]])  # (a discard changes no other score)
    got = [p.pop().block_id for _ in range(5)]
    assert got == [want[0], *want[2:6]] and p.num_rankings == n0 + 1
    p.add(blocks[want[1]])  # a new candidate: the next pop ranks again
    p.pop()
    assert p.num_rankings == n0 + 2


class _Ref:
    """Plain-Python features and MLP."""

    def __init__(self, params, n, bs):
        self.p = {k: np.asarray(v).tolist() for k, v in params.items()}
        self.n, self.bs = n, bs
        self.clock = 0
        self.rel, self.cached, self.last, self.hits, self.depth = ([0] * n for _ in range(5))

    def features(self, b):
        now, n = self.clock, self.n
        raw = [(now - self.rel[b]) / n, self.hits[b], self.depth[b],
               (self.depth[b] + 1) * self.bs, (now - self.last[b]) / n,
               (now - self.cached[b]) / n]
        return [math.log1p(v) for v in raw]

    def score(self, b):
        h = [(x - m) / s for x, m, s in zip(self.features(b), self.p["mean"], self.p["std"])]
        i = 0
        while f"w{i}" in self.p:
            w, bias = self.p[f"w{i}"], self.p[f"b{i}"]
            h = [sum(h[r] * w[r][c] for r in range(len(h))) + bias[c] for c in range(len(bias))]
            if f"w{i + 1}" in self.p:
                h = [max(v, 0.0) for v in h]
            i += 1
        return h[0]


@pytest.mark.parametrize("seed", range(3))
def test_random_operations_match_the_reference(seed):
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    n, bs = 10, 4
    params = {"mean": nrng.normal(size=NF), "std": nrng.uniform(0.5, 2, size=NF),
              "w0": nrng.normal(size=(NF, 5)), "b0": nrng.normal(size=5),
              "w1": nrng.normal(size=(5, 1)), "b1": nrng.normal(size=1)}
    p = LearnedPolicy(n, block_size=bs, params=params)
    ref = _Ref(params, n, bs)
    blocks = [KVCacheBlock(i) for i in range(n)]
    cands: set[int] = set()
    held: set[int] = set()
    for _ in range(400):
        op = rng.random()
        free_ids = [b for b in range(n) if b not in held and b not in cands]
        if op < 0.3 and free_ids:
            b, pos = rng.choice(free_ids), rng.randrange(8)
            p.on_cached(blocks[b], b"h", None, pos)
            ref.clock += 1
            ref.cached[b] = ref.last[b] = ref.clock
            ref.hits[b], ref.depth[b] = 0, pos
            held.add(b)
        elif op < 0.45 and cands:
            b = rng.choice(sorted(cands))
            p.discard(blocks[b])
            cands.discard(b)
            p.on_hit(blocks[b], None)
            ref.clock += 1
            ref.hits[b] += 1
            ref.last[b] = ref.clock
            held.add(b)
        elif op < 0.75 and held:
            b = rng.choice(sorted(held))
            held.discard(b)
            p.on_release(blocks[b], None, ref.depth[b])
            p.add(blocks[b])
            ref.clock += 1
            ref.rel[b] = ref.clock
            cands.add(b)
        elif cands:
            got = p.pop().block_id
            scores = {b: ref.score(b) for b in cands}
            assert scores[got] >= max(scores.values()) - 1e-9  # the highest score
            p.on_evicted(blocks[got])
            cands.discard(got)
        if rng.random() < 0.2:
            p.check_invariants(sorted(cands))
            order = p.candidate_ids()
            s = [ref.score(b) for b in order]
            assert all(x >= y - 1e-9 for x, y in zip(s, s[1:]))


def test_params_load_from_the_npz_the_training_writes(tmp_path):
    params = _linear({"recency": 2.0})
    np.savez(tmp_path / "p.npz", **params)
    got = load_params(str(tmp_path / "p.npz"))
    assert set(got) == set(params) and np.array_equal(got["w0"], params["w0"])
    m = KVCacheManager(8, 2, eviction=LearnedPolicy,
                       eviction_options={"params": tmp_path / "p.npz"})
    assert m.policy.params["w0"][0, 0] == 2.0


GOOD = _linear({"recency": 1.0})


@pytest.mark.parametrize("params,err,match", [
    (None, ValueError, "needs params"),
    ("/nonexistent/p.npz", ValueError, "does not exist"),
    (42, TypeError, "path to an .npz or a mapping"),
    ({**GOOD, "mean": np.zeros(NF - 1)}, ValueError, "'mean' of shape"),
    ({**GOOD, "std": np.zeros(NF)}, ValueError, "'std' must be > 0"),
    ({k: v for k, v in GOOD.items() if k != "w0"}, ValueError, "no layer"),
    ({**GOOD, "w0": np.zeros((NF + 1, 1))}, ValueError, "layer 0"),
    ({**GOOD, "w0": np.zeros((NF, 2)), "b0": np.zeros(2)}, ValueError, "1 output"),
    ({**GOOD, "b0": np.array([math.nan])}, ValueError, "non-finite"),
])
def test_bad_params_are_refused_before_anything_is_built(params, err, match):
    from prefixcache.sim.replay import replay

    with pytest.raises(err, match=match):
        KVCacheManager(8, 2, eviction=LearnedPolicy, eviction_options={"params": params})

    def untouched():
        raise AssertionError("the trace was read before the options were checked")
        yield  # noqa: unreachable (a generator)

    with pytest.raises(err, match=match):
        replay(untouched(), num_blocks=8, block_size=2, eviction=LearnedPolicy,
               eviction_options={"params": params})


def test_every_index_tier_and_layout_of_the_compose_matrix(monkeypatch):
    from prefixcache.core.indexes import INDEXES, refusal
    from prefixcache.core.kv_groups import parse_kv_groups

    from tests.core import test_core_compose_matrix as matrix

    rng = np.random.default_rng(1)
    params = {"mean": np.zeros(NF), "std": np.ones(NF), "w0": rng.normal(size=(NF, 4)),
              "b0": np.zeros(4), "w1": rng.normal(size=(4, 1)), "b1": np.zeros(1)}
    monkeypatch.setattr(matrix, "_options", lambda eviction, prompts: {"params": params})
    ran = 0
    for index in INDEXES:
        for tier in matrix.TIERS:
            for layout in matrix.LAYOUTS:
                groups = parse_kv_groups(matrix.LAYOUTS[layout]) if matrix.LAYOUTS[layout] else None
                why = refusal(index, groups, LearnedPolicy, matrix.TIERS[tier])
                if why is not None:
                    with pytest.raises(ValueError):
                        matrix._run(index, LearnedPolicy, tier, layout, num_blocks=12)
                    continue
                matrix._run(index, LearnedPolicy, tier, layout, num_blocks=12)
                ran += 1
    assert ran >= 6


def test_sampled_pops_take_the_best_of_a_seeded_draw():
    # score = recency; sample=3 of 12 candidates: each victim is the least recently
    # released of some 3 candidates, the same ones for the same seed.
    def victims(seed):
        p = LearnedPolicy(12, block_size=4, params=_linear({"recency": 1.0}), sample=3,
                          seed=seed)
        blocks = [KVCacheBlock(i) for i in range(12)]
        for b in blocks:
            p.on_cached(b, b"h", None, 0)
            p.on_release(b, None, 0)
            p.add(b)
        out = []
        for _ in range(9):
            before = p.candidate_ids()  # (by score: the least recent first)
            got = p.pop().block_id
            assert got in before and before.index(got) <= len(before) - 3
            out.append(got)
        assert (p.num_rankings, p.num_scored) == (9, 27)  # one draw of 3 per pop
        return out

    assert victims(0) == victims(0)
    assert victims(0) != victims(1)
    assert victims(0) != list(range(9))  # not simply lru


@pytest.mark.parametrize("options,err", [
    ({"sample": -1}, ValueError), ({"sample": 2.5}, TypeError), ({"seed": "1"}, TypeError),
    ({"samples": 4}, TypeError),
])
def test_bad_sampling_options_are_refused(options, err):
    with pytest.raises(err, match="learned"):
        KVCacheManager(8, 2, eviction=LearnedPolicy,
                       eviction_options={"params": GOOD, **options})
