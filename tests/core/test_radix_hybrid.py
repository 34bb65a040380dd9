"""The radix index over sliding-window / hybrid layouts (``core/radix_hybrid.py``):
the hash index's hits on caches that never evict, exact block ids on hand-worked
cases (tombstones, leaf-only full eviction, refills), invariants after every call
under pressure with every eviction policy, and the composition rule.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.core import KVCacheManager, Request
from prefixcache._validate import ArgumentTypeError
from prefixcache.core.block_pool import InvariantError
from prefixcache.core.eviction import POLICIES, TraceFuture
from prefixcache.core.hashing import BlockHasher
from prefixcache.core.indexes import COMBINATION_RULES, INDEXES, LAYOUT_INDEXES, refusal
from prefixcache.core.kv_groups import parse_kv_groups
from prefixcache.core.radix import RadixKVCacheManager
from prefixcache.core.radix_hybrid import RadixHybridKVCacheManager
from prefixcache.sim import workloads
from prefixcache.sim.replay import replay

BS = 4
LAYOUTS = ["full,sw8", "full,sw6,sw13", "sw8", "sw5,sw5", "full,full,sw3"]
SMALL = {
    "shared_system_prompt": dict(num_requests=24, system_len=48, unique_len=(8, 40),
                                 output_len=(4, 12)),
    "multi_turn": dict(num_conversations=5, num_turns=3, new_tokens=(10, 40),
                       output_len=(4, 16)),
    "few_shot": dict(num_headers=3, num_questions=16, header_len=60, question_len=(8, 20),
                     output_len=(4, 12)),
    "mm_salt": dict(num_requests=16, prefix_len=10, image_len=20, num_images=2,
                    suffix_len=(8, 30), output_len=(4, 12)),
    "rag": dict(num_requests=24, num_documents=8, doc_len=(30, 80), system_len=20,
                question_len=(8, 20), output_len=(4, 12)),
    "tenant_prefixes": dict(num_requests=24, num_tenants=4, prefix_len=60, question_len=(8, 30),
                            output_len=(4, 12)),
}


def _manager(layout, num_blocks=40, index="radix", **kw):
    kw.setdefault("free_order", "unhashed_first")
    return KVCacheManager(num_blocks, BS, index=index, kv_cache_groups=parse_kv_groups(layout),
                          **kw)


def _admit(m, req):
    blocks, hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    assert new is not None
    m.check_invariants()
    req.num_computed_tokens = req.num_tokens
    return hit


def _decode(m, req, n, token=99):
    for _ in range(n):
        req.append_output_token_ids(token)
        assert m.allocate_slots(req, 1) is not None
        m.check_invariants()
        req.num_computed_tokens += 1


def _shape(m, blocks):
    """Per group: the hit's block count and which slots are null."""
    null = getattr(m, "null_block", None)  # (one full-attention group: none)
    return [[b is null for b in g] for g in blocks.blocks]


# ------------------------------------------------------- radix == hash, unbounded
@pytest.mark.parametrize("layout", ["full,sw8", "full,sw6,sw13", "sw8"])
@pytest.mark.parametrize("workload", sorted(SMALL))
def test_unbounded_radix_hits_equal_hash_hits_on_the_workloads(workload, layout):
    reqs = workloads.generate(workload, **SMALL[workload])
    got = {}
    for index in INDEXES:
        recs = []
        s = replay(reqs, num_blocks=6000, block_size=BS, concurrency=4, index=index,
                   kv_cache_groups=parse_kv_groups(layout), on_record=recs.append,
                   free_order="unhashed_first")
        assert s["evictions"] == 0 and s["stranded_blocks"] == 0
        null = 6000
        got[index] = [(r["num_computed_tokens"], [[i == null for i in g] for g in r["block_ids"]])
                      for r in recs]
    assert got["radix"] == got["hash"]
    assert any(h for h, _ in got["hash"])


def _script(seed: int, n: int = 40):
    """Random prompts over shared stems, chunked prefills, decode runs and frees."""
    rng = random.Random(seed)
    stems = [[rng.randrange(1, 40) for _ in range(rng.randrange(5, 30))] for _ in range(4)]
    ops = []
    for i in range(n):
        p = list(rng.choice(stems)) + [rng.randrange(40, 60) for _ in range(rng.randrange(0, 9))]
        ops.append(("new", i, p, rng.choice([3, 5, 8, 64]), rng.randrange(0, 14)))
        if rng.random() < 0.5:
            ops.append(("free", rng.randrange(8)))
    return ops


def _drive(m, ops, check=True):
    """Run ``ops`` (chunked prefill of ``chunk`` tokens, then decode steps); returns
    each admission's (hit tokens, hit shape). Every allocation must succeed."""
    running = []
    out = []
    for op in ops:
        if op[0] == "free":
            if running:
                m.free(running.pop(op[1] % len(running)))
        else:
            _, i, prompt, chunk, num_out = op
            r = Request(f"r{i}", prompt)
            blocks, hit = m.get_computed_blocks(r)
            out.append((hit, _shape(m, blocks)))
            n = min(chunk, r.num_tokens - hit)
            assert m.allocate_slots(r, n, hit, blocks) is not None
            r.num_computed_tokens = hit + n
            while r.num_computed_tokens < r.num_tokens:
                n = min(chunk, r.num_tokens - r.num_computed_tokens)
                assert m.allocate_slots(r, n) is not None
                r.num_computed_tokens += n
            for t in range(num_out):
                r.append_output_token_ids(70 + t % 5)
                assert m.allocate_slots(r, 1) is not None
                r.num_computed_tokens += 1
            running.append(r)
        if check:
            m.check_invariants()
    for r in running:
        m.free(r)
    if check:
        m.check_invariants()
    return out


@pytest.mark.parametrize("layout", LAYOUTS + ["full,sw1", "full,full"])
@pytest.mark.parametrize("seed", [0, 1])
def test_unbounded_hits_equal_with_chunked_prefill_and_duplicates(layout, seed):
    ops = _script(seed)
    got = {}
    for index in INDEXES:
        m = _manager(layout, 2000, index=index)
        got[index] = _drive(m, ops, check=index == "radix")
        assert m.num_evictions == 0
    assert got["radix"] == got["hash"]
    assert any(h for h, _ in got["hash"]) or layout == "full,sw1"  # (W = 1 never hits)
    if layout == "full,full":  # no sliding window: the plain radix index's hits
        m = KVCacheManager(2000, BS, index="radix", free_order="unhashed_first")
        assert [(h, s[:1]) for h, s in got["radix"]] == _drive(m, ops)


# ------------------------------------------------------------ hand-worked cases
def test_released_sliding_blocks_are_evicted_first_and_the_full_path_stays():
    m = _manager("full,sw8", 16)  # block 4 tokens, window 8: a hit needs 2 sliding blocks
    null = m.null_block_id
    a = Request("a", list(range(24)))
    _admit(m, a)
    assert m.get_block_ids("a") == ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11])
    _decode(m, a, 1)  # position 24 sees 17..24: sliding slots 0..3 released (cached)
    assert m.get_block_ids("a") == ([0, 1, 2, 3, 4, 5, 12], [null] * 4 + [10, 11, 13])
    assert m.policy.candidate_ids() == [9, 8, 7, 6]  # released last slot first
    m.free(a)
    # LRU: the window's earlier releases, then a's positions deepest first (sliding 11
    # before its node's full block 5, the only full leaf), then 10.
    assert m.policy.candidate_ids() == [9, 8, 7, 6, 11, 5, 10]
    c = Request("c", [7] * 9)
    _admit(m, c)  # 3 + 3 blocks: 4 unhashed free (13, 12, 14, 15), then 9 and 8 tombstoned
    assert m.get_block_ids("c") == ([13, 12, 14], [8, 9, 15])
    assert m.num_evictions == 2 and m.num_stranded_blocks() == 0
    # Full attention still caches all 6 blocks of a; the W=8 group lost slots 2, 3.
    b = Request("b", list(range(24)) + [5])
    blocks, hit = m.get_computed_blocks(b)
    assert (hit, blocks.get_block_ids()) == (24, ([0, 1, 2, 3, 4, 5], [null] * 4 + [10, 11]))
    b = Request("b", list(range(20)) + [5])  # ends at slot 4: needs slots 3, 4 -> falls back
    blocks, hit = m.get_computed_blocks(b)
    assert (hit, blocks.get_block_ids()) == (8, ([0, 1], [6, 7]))
    m.check_invariants()


def test_full_blocks_are_evicted_leaf_first_with_what_the_leaf_holds():
    m = _manager("full,sw8", 12)
    a = Request("a", list(range(16)))
    _admit(m, a)  # 4 + 4 blocks: full 0..3, sliding 4..7
    m.free(a)
    # Candidates: sliding 7, then full leaf 3, sliding 6, 5, 4 (position by position).
    assert m.policy.candidate_ids() == [7, 3, 6, 5, 4]
    c = Request("c", [9] * 13)  # 4 + 4 blocks: 4 unhashed, then 4 victims
    _admit(m, c)
    # Victims 7 (node 3's sliding block: a tombstone), 3 (the leaf's full block: node 3
    # goes, node 2 becomes the leaf), then 6 and 2: whole positions, deepest first.
    assert m.get_block_ids("c") == ([8, 9, 10, 11], [2, 6, 3, 7])
    assert m.num_evictions == 4 and m.num_nodes == 2 + 3
    b = Request("b", list(range(16)) + [1])
    blocks, hit = m.get_computed_blocks(b)
    assert (hit, blocks.get_block_ids()) == (8, ([0, 1], [4, 5]))
    assert m.num_stranded_blocks() == 0
    m.check_invariants()


def test_a_tombstoned_sliding_slot_is_refilled_by_the_next_request_computing_it():
    m = _manager("full,sw8", 14)
    a = Request("a", list(range(12)))
    _admit(m, a)  # full 0, 1, 2; sliding 3, 4, 5
    m.free(a)
    filler = Request("f", [50] * 21)  # 6 + 6 blocks: 8 unhashed, then 5, 2 ... tombstones
    _admit(m, filler)
    m.free(filler)
    before = m.get_computed_blocks(Request("x", list(range(12)) + [1]))[1]
    # Recompute a's prompt without a hit: its slot-0/1 sliding blocks fill the nodes'
    # tombstones, so the same lookup now hits the whole prefix again.
    r = Request("r", list(range(12)) + [2])
    m.allocate_slots(r, r.num_tokens)
    m.check_invariants()
    r.num_computed_tokens = r.num_tokens
    m.free(r)
    after = m.get_computed_blocks(Request("y", list(range(12)) + [1]))[1]
    assert before < after == 12
    m.check_invariants()


def test_sliding_only_nodes_without_blocks_are_kept_while_deeper_blocks_hang_below():
    m = _manager("sw8", 8)
    null = m.null_block_id
    a = Request("a", list(range(20)))
    _admit(m, a)
    _decode(m, a, 1)  # position 20 sees 13..20: slots 0..2 released (cached)
    assert m.get_block_ids("a") == ([null] * 3 + [3, 4, 5],)
    m.free(a)
    c = Request("c", [9] * 13)  # 4 blocks: 3 unhashed (5, 6, 7), then the oldest victim
    _admit(m, c)                # 2 (slots 2, 1, 0 were released in that order)
    assert m.get_block_ids("c") == ([2, 5, 6, 7],)
    assert m.num_nodes == 5 + 3 and m.num_cached_blocks == 4 + 3  # node 2: a tombstone
    b = Request("b", list(range(20)) + [5])
    blocks, hit = m.get_computed_blocks(b)
    # The walk passes the blockless node 2 and hits at 20 tokens (slots 3, 4 cached).
    assert (hit, blocks.get_block_ids()) == (20, ([null] * 3 + [3, 4],))
    m.free(c)
    m.reset_prefix_cache()
    assert m.num_nodes == 0 and m.cached_block_ids() == []
    m.check_invariants()


def test_window_of_one_token_is_never_cached_and_never_hits():
    m = _manager("full,sw1", 20)
    a = Request("a", list(range(12)))
    _admit(m, a)
    assert m.num_cached_blocks == 3  # the full group's only
    m.free(a)
    assert m.get_computed_blocks(Request("b", list(range(12)) + [1]))[1] == 0


def test_events_name_the_group_of_each_stored_and_removed_block():
    m = _manager("full,sw8", 10, enable_events=True)
    a = Request("a", list(range(9)))
    _admit(m, a)
    ev = m.take_events()
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window,
             len(e.block_hashes)) for e in ev] == [
        (0, "full_attention", None, 2), (1, "sliding_window", 8, 2)]
    assert ev[0].block_hashes == ev[1].block_hashes
    m.free(a)
    _admit(m, Request("c", [5] * 17))  # 5 + 5 blocks: 4 unhashed, then 6 evicted
    removed = [e.group_idx for e in m.take_events() if type(e).__name__ == "BlockRemoved"]
    assert sorted(removed) == [0, 0, 1, 1]


# ------------------------------------------------------------- under pressure
def _future(prompts):
    h = BlockHasher("sha256", None)
    return TraceFuture.from_hashes(h.hash_token_blocks(p, BS) for p in prompts)


# (full + one window under every policy: tests/core/test_core_compose_matrix.py)
@pytest.mark.parametrize("layout", ["sw8", "full,sw6,sw13"])
@pytest.mark.parametrize("eviction", sorted(POLICIES))
def test_every_policy_under_pressure_keeps_invariants_and_the_window_bound(layout, eviction):
    rng = random.Random(7)
    stems = [[rng.randrange(1, 30) for _ in range(rng.randrange(6, 24))] for _ in range(3)]
    prompts = [list(rng.choice(stems)) + [rng.randrange(30, 40) for _ in range(rng.randrange(1, 8))]
               for _ in range(30)]
    opts = {"future": _future(prompts)} if POLICIES[eviction].needs_future else None
    m = _manager(layout, 24, eviction=eviction, eviction_options=opts)
    # A policy that reads the waiting queue (queue_aware): each request waits from its
    # arrival to its admission (which drops it) or its failure (drop_waiting).
    waits = POLICIES[eviction].needs_waiting
    windows = [g.spec.sliding_window for g in m.kv_cache_groups]
    null = m.null_block_id
    running = []
    num_hits = 0
    for i, p in enumerate(prompts):
        r = Request(f"r{i}", p)
        m.on_arrival(r, i)
        if waits:
            r.bind_hasher(m.hasher, BS)
            m.on_waiting(r.request_id, r.block_hashes[: (r.num_tokens - 1) // BS])
            m.check_invariants()
        while True:
            blocks, hit = m.get_computed_blocks(r)
            new = m.allocate_slots(r, r.num_tokens - hit, hit, blocks)
            m.check_invariants()
            if new is not None or not running:
                break
            m.free(running.pop(0))
            m.check_invariants()
        if new is None:
            m.drop_waiting(r.request_id)  # (a no-op unless the policy reads the queue)
            continue
        num_hits += hit > 0
        r.num_computed_tokens = r.num_tokens
        running.append(r)
        for t in range(rng.randrange(1, 12)):
            r.append_output_token_ids(50 + t)
            if m.allocate_slots(r, 1) is None:
                break
            m.check_invariants()
            pos = r.num_computed_tokens  # the step computes this position
            for g, ids in enumerate(m.get_block_ids(r.request_id)):
                w = windows[g]
                real = [k for k, b in enumerate(ids) if b != null]
                if w is not None:  # only blocks overlapping the window of pos
                    assert all((k + 1) * BS > pos - w + 1 for k in real), (g, ids, pos)
                    assert len(real) <= -(-w // BS) + 1
            r.num_computed_tokens += 1
        assert m.num_stranded_blocks() == 0
        if len(running) > 2:
            m.free(running.pop(0))
            m.check_invariants()
    for r in running:
        m.free(r)
    m.check_invariants()
    assert m.num_free_blocks == 24 and m.num_evictions > 0 and num_hits > 0
    if waits:  # every request was admitted or dropped: no interest left
        assert m.policy.waiting_ids() == [] and m.policy.wanted == {}


# ------------------------------------------------------- rule, refusals, bad input
def test_every_index_serves_sliding_window_layouts_and_the_tier_stays_refused():
    assert set(LAYOUT_INDEXES) | {"hash"} == set(INDEXES)
    assert ("hybrid", "index") not in COMBINATION_RULES
    groups = parse_kv_groups("full,sw8")
    assert refusal("radix", groups, "lru", 0) is None
    m = KVCacheManager(8, BS, index="radix", kv_cache_groups=groups)
    assert type(m.implementation) is RadixHybridKVCacheManager
    why = refusal("radix", groups, "lru", 4)
    assert why is not None and "radix layout index" in why
    with pytest.raises(ValueError) as e:
        KVCacheManager(8, BS, index="radix", kv_cache_groups=groups, num_host_blocks=4)
    assert str(e.value) == why
    # The one-group class does not take a layout it does not serve.
    with pytest.raises(ValueError, match="one full-attention group"):
        RadixKVCacheManager(8, BS, kv_cache_groups=groups)
    # One full-attention group keeps the plain radix class.
    assert type(KVCacheManager(8, BS, index="radix",
                               kv_cache_groups=parse_kv_groups("full")).implementation) is (
        RadixKVCacheManager)


@pytest.mark.parametrize("index", ["radix", "hash"])  # (one hit-list rule: check_group_hits)
def test_bad_hit_blocks_raise_and_change_nothing(index):
    m = _manager("full,sw8", 20, index=index)
    a = Request("a", list(range(17)))
    _admit(m, a)
    m.free(a)
    other = _manager("full,sw8", 20, index=index)
    _admit(other, Request("a", list(range(17))))
    b = Request("b", list(range(16)) + [1, 2])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 16

    def snapshot():  # (the hash index's "lru" runs without a policy object)
        return (m.free_block_ids(), m.cached_block_ids(),
                m.policy.candidate_ids() if m.policy is not None else None)

    before = snapshot()
    g0, g1 = blocks.blocks
    ob = other.get_computed_blocks(Request("b", list(range(16)) + [1, 2]))[0].blocks
    cases = [
        (ArgumentTypeError, "per-group", g0),  # a flat list
        (ValueError, "not a cached block of group 1", (g0, g0)),
        (ValueError, "same tokens", (g0[:2], g1)),
        (ValueError, "full attention", (g1, g1)),
        (ValueError, "not a cached block of group", ob),  # another manager's
        (ValueError, "not the cached block", (g0[::-1], g1)),  # reordered
    ]
    if index == "radix":  # (the hash index's position check takes a nulled window)
        cases.append((ValueError, "not the cached block", (g0, [m.null_block] * 4)))
    for exc, match, bad in cases:
        with pytest.raises(exc, match=match):
            m.allocate_slots(b, 2, hit, bad)
        assert snapshot() == before
        m.check_invariants()
    assert m.allocate_slots(b, 2, hit, blocks) is not None
    m.check_invariants()


@pytest.mark.parametrize("index", ["radix", "hash"])  # (one rule: check_leading_nulls)
def test_a_mistracked_run_of_null_slots_breaks_the_invariants(index):
    m = _manager("full,sw8", 20, index=index)
    a = Request("a", list(range(17)))
    _admit(m, a)
    _decode(m, a, 8)  # past the window: group 1's first blocks are released
    impl = m.implementation
    st = impl._states["a"]
    assert st.num_null[1] > 0
    st.num_null[1] -= 1
    st.idle_until, st.idle_nc = impl._idle_bounds(st)  # (checked before the slots)
    with pytest.raises(InvariantError, match="leading null slots, tracked"):
        m.check_invariants()


@pytest.mark.parametrize("layout", ["full", "full,sw8"])  # (one rule: radix._check_root)
def test_a_malformed_root_breaks_both_trees_invariants(layout):
    m = _manager(layout, 20)
    _admit(m, Request("a", list(range(9))))
    (root,) = m.implementation._roots.values()
    root.key = ("another namespace",)
    with pytest.raises(InvariantError, match="is malformed"):
        m.check_invariants()


def test_replay_runs_the_radix_index_on_sliding_window_layouts_with_belady():
    reqs = workloads.generate("shared_system_prompt", **SMALL["shared_system_prompt"])
    s = replay(reqs, num_blocks=60, block_size=BS, concurrency=2, index="radix",
               eviction="belady", kv_cache_groups=parse_kv_groups("full,sw8"))
    assert s["index"] == "radix" and s["evictions"] > 0 and s["hit_tokens"] > 0
    assert s["stranded_blocks"] == 0


# ---------------------------------------------------------------- hypothesis
_STEMS = [list(range(1, 13)), [1, 2, 3, 4, 20, 21, 22, 23], [30] * 9]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(["full,sw4", "full,sw5", "full,sw8,sw3", "sw6", "sw6,full,sw6",
                            "full,full", "full,sw1"]),
    num_blocks=st.integers(2, 24),
    block_size=st.sampled_from([1, 2, 4]),
    eviction=st.sampled_from(["lru", "lfu", "fifo", "priority"]),
    ops=st.lists(st.one_of(
        st.tuples(st.just("new"), st.integers(0, 2), st.lists(st.integers(0, 3), max_size=10),
                  st.integers(1, 16)),
        st.tuples(st.just("decode"), st.integers(0, 5), st.integers(1, 12)),
        st.tuples(st.just("free"), st.integers(0, 5)),
        st.tuples(st.just("lookup"), st.integers(0, 2), st.integers(0, 12)),
    ), max_size=30),
)
def test_random_sequences_keep_invariants_and_never_strand(layout, num_blocks, block_size,
                                                            eviction, ops):
    m = KVCacheManager(num_blocks, block_size, index="radix", eviction=eviction,
                       kv_cache_groups=parse_kv_groups(layout))
    running: list[Request] = []
    n = 0
    for op in ops:
        if op[0] == "new":  # admit, then prefill in chunks of op[3] tokens
            req = Request(f"r{n}", _STEMS[op[1]] + op[2])
            n += 1
            blocks, hit = m.get_computed_blocks(req)
            assert hit % block_size == 0 and hit < req.num_tokens
            assert all(len(g) == hit // block_size for g in blocks.blocks)
            k = min(op[3], req.num_tokens - hit)
            if m.allocate_slots(req, k, hit, blocks) is None:
                m.check_invariants()
                continue
            req.num_computed_tokens = hit + k
            running.append(req)
            while req.num_computed_tokens < req.num_tokens:
                m.check_invariants()
                k = min(op[3], req.num_tokens - req.num_computed_tokens)
                if m.allocate_slots(req, k) is None:
                    m.free(running.pop())  # (preempted: drops everything)
                    break
                req.num_computed_tokens += k
        elif op[0] == "decode" and running:
            req = running[op[1] % len(running)]
            if req.num_computed_tokens < req.num_tokens:
                continue
            for step in range(op[2]):
                req.append_output_token_ids(7 + step % 3)
                if m.allocate_slots(req, 1) is None:
                    break
                m.check_invariants()
                req.num_computed_tokens += 1
        elif op[0] == "free" and running:
            m.free(running.pop(op[1] % len(running)))
        elif op[0] == "lookup":  # peek and lookup agree, change no block state
            req = Request(f"q{n}", _STEMS[op[1]][: op[2] + 1])
            before = (m.free_block_ids(), m.cached_block_ids())
            assert m.peek_computed_tokens(req) == m.get_computed_blocks(req)[1]
            assert (m.free_block_ids(), m.cached_block_ids()) == before
        m.check_invariants()
        assert m.num_stranded_blocks() == 0
    for req in running:
        m.free(req)
    m.check_invariants()
    assert m.num_free_blocks == num_blocks and m.usage == 0.0  # nothing leaked
