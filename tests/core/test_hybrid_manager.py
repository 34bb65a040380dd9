"""The hybrid (full + sliding-window) KV cache manager: exact block ids on hand-worked
cases, the layout checks, the dispatch seam, and hypothesis invariants.

vLLM parity on whole traces is pinned by tests/sim/test_sim_replay_golden_hybrid.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import KVCacheManager, Request
from prefixcache._validate import ArgumentTypeError
from prefixcache.core.hybrid import HybridKVCacheManager
from prefixcache.core.kv_cache_manager import HashKVCacheManager
from prefixcache.core.kv_groups import (
    FullAttentionSpec,
    KVCacheGroup,
    SlidingWindowSpec,
    check_kv_cache_groups,
    lookup_groups,
    parse_kv_groups,
)

FULL = FullAttentionSpec()


def _hybrid(num_blocks=20, block_size=4, window=8, **kw):
    groups = [KVCacheGroup(FULL, ["l0"]), KVCacheGroup(SlidingWindowSpec(window), ["l1"])]
    kw.setdefault("free_order", "unhashed_first")
    return KVCacheManager(num_blocks, block_size, kv_cache_groups=groups, **kw)


def _admit(m, req):
    blocks, hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return hit


# ----------------------------------------------------------------- exact block ids
def test_sliding_window_blocks_become_null_slots_and_hits_need_the_window():
    m = _hybrid()  # block 4 tokens, window 8 tokens: a hit needs ceil(7/4) = 2 blocks
    null = m.null_block_id
    assert null == 20
    a = Request("a", list(range(17)))
    assert _admit(m, a) == 0
    # 17 tokens -> 5 blocks per group, allocated group by group from the queue head.
    assert m.get_block_ids("a") == ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9])
    a.append_output_token_ids(99)
    assert [list(g) for g in m.allocate_slots(a, 1)] == [[], []]
    # The next token (position 17) sees positions 10..17: slots 0 and 1 (tokens 0..7)
    # are released, last first, to the queue tail (cached: LRU order).
    assert m.get_block_ids("a") == ([0, 1, 2, 3, 4], [null, null, 7, 8, 9])
    assert m.free_block_ids() == list(range(10, 20)) + [6, 5]
    m.check_invariants()

    # Same 16-token prefix: full attention hits blocks 0..3 from the left; the sliding
    # window searches from the right and needs 2 cached blocks ending at the hit (7, 8).
    b = Request("b", list(range(16)) + [100, 101, 102, 103])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 16
    assert [[x.block_id for x in g] for g in blocks] == [[0, 1, 2, 3], [null, null, 7, 8]]
    new = m.allocate_slots(b, 4, 16, blocks)
    assert [[x.block_id for x in g] for g in new] == [[10], [11]]
    assert m.get_block_ids("b") == ([0, 1, 2, 3, 10], [null, null, 7, 8, 11])
    m.check_invariants()

    # Freeing: group by group, each table last block first, null slots skipped.
    m.free(a)
    m.free(b)
    # a: full 4 (unhashed -> head; 3..0 still held by b), sliding 9 (head; 8, 7 held);
    # then b, whose 20 tokens fill 5 cached blocks: full 10, 3, 2, 1, 0 and sliding 11,
    # 8, 7 to the tail (LRU).
    assert m.free_block_ids() == [9, 4, 12, 13, 14, 15, 16, 17, 18, 19, 6, 5,
                                  10, 3, 2, 1, 0, 11, 8, 7]
    assert m.num_free_blocks == 20
    m.check_invariants()


def test_sliding_hit_falls_back_when_the_window_blocks_were_evicted():
    # Full attention still has the whole prefix cached, but the sliding group's blocks
    # just before the candidate hit were evicted: the right-to-left search stops at the
    # first run of 2 cached blocks, and full attention is cut to that length.
    m = KVCacheManager(16, 4, kv_cache_groups=parse_kv_groups("full,sw8"),
                       free_order="unhashed_first")
    null = m.null_block_id
    a = Request("a", list(range(24)))
    _admit(m, a)
    assert m.get_block_ids("a") == ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11])
    a.append_output_token_ids(99)
    m.allocate_slots(a, 1)  # position 24 sees 17..24: sliding slots 0..3 released
    assert m.get_block_ids("a") == ([0, 1, 2, 3, 4, 5, 12], [null] * 4 + [10, 11, 13])
    m.free(a)
    # Queue: unhashed 13, 12 at the head; then 14, 15; the window release (9, 8, 7, 6);
    # then a's full table (5..0) and its sliding blocks 11, 10.
    assert m.free_block_ids() == [13, 12, 14, 15, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 10]
    c = Request("c", [7] * 9)
    _admit(m, c)  # 3 + 3 blocks from the head: evicts sliding 9 (tokens 12..15) and 8
    assert m.get_block_ids("c") == ([13, 12, 14], [15, 9, 8])
    b = Request("b", list(range(20)) + [5])
    blocks, hit = m.get_computed_blocks(b)
    # Full: 5 blocks cached. Sliding, from the right: slot 4 (10) cached, slot 3 (9)
    # and 2 (8) evicted, slots 1, 0 (7, 6) cached: 2 contiguous -> hit at 8 tokens.
    assert (hit, [[x.block_id for x in g] for g in blocks]) == (8, [[0, 1], [6, 7]])
    m.check_invariants()


def test_window_one_past_a_block_needs_only_the_blocks_of_w_minus_one_tokens():
    # W = 5, block 4: the next token (position 12) sees positions 8..12, i.e. one
    # cached block (8..11) plus itself: ceil((5 - 1) / 4) = 1 block, not ceil(5 / 4).
    m = _hybrid(window=5)
    null = m.null_block_id
    a = Request("a", list(range(12)))
    _admit(m, a)
    assert m.get_block_ids("a") == ([0, 1, 2], [3, 4, 5])
    m.free(a)
    b = Request("b", list(range(12)) + [1])
    blocks, hit = m.get_computed_blocks(b)
    assert (hit, [[x.block_id for x in g] for g in blocks]) == (12, [[0, 1, 2], [null, null, 5]])
    m.allocate_slots(b, 1, 12, blocks)
    assert m.get_block_ids("b") == ([0, 1, 2, 6], [null, null, 5, 7])
    m.check_invariants()


def test_a_failed_decode_still_releases_the_blocks_before_the_window():
    # vLLM releases out-of-window blocks before it counts ("even if we cannot schedule
    # this request"), so the free queue after a failed step is vLLM's.
    m = _hybrid(num_blocks=8, window=12)
    a = Request("a", list(range(16)))
    _admit(m, a)
    assert m.get_block_ids("a") == ([0, 1, 2, 3], [4, 5, 6, 7])
    a.append_output_token_ids(99)
    # Position 16 sees 5..16: slot 0 (tokens 0..3) goes; 2 new blocks needed, 1 free.
    assert m.allocate_slots(a, 1) is None
    assert m.get_block_ids("a") == ([0, 1, 2, 3], [m.null_block_id, 5, 6, 7])
    assert m.free_block_ids() == [4]
    m.check_invariants()


def test_get_computed_blocks_with_two_windows_loops_until_all_agree():
    # Groups: full, W=8 and W=16 (block 4): the W=16 group needs 4 contiguous blocks.
    groups = parse_kv_groups("full,sw8,sw16")
    assert [ids for _, ids in lookup_groups(groups)] == [[0], [1], [2]]
    m = KVCacheManager(40, 4, kv_cache_groups=groups, free_order="unhashed_first")
    a = Request("a", list(range(24)))
    _admit(m, a)
    m.free(a)
    b = Request("b", list(range(24)) + [1])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 24  # every group has the whole 6-block prefix cached
    assert [len(g) for g in blocks] == [6, 6, 6]
    n = m.null_block_id
    ids = [[x.block_id for x in g] for g in blocks]
    assert ids[1][:4] == [n] * 4 and n not in ids[1][4:]  # W=8: 2 real blocks
    assert ids[2][:2] == [n] * 2 and n not in ids[2][2:]  # W=16: 4 real blocks
    assert n not in ids[0]


def test_groups_with_one_spec_are_looked_up_together():
    groups = parse_kv_groups("sw8,full,sw8")
    assert [(type(s).__name__, ids) for s, ids in lookup_groups(groups)] == [
        ("FullAttentionSpec", [1]), ("SlidingWindowSpec", [0, 2])]


def test_sliding_only_window_wider_than_any_prompt_matches_full_attention():
    # One sliding group whose window exceeds every sequence never releases a block and
    # hits exactly as full attention: same hits, same block ids, same free queue.
    groups = [KVCacheGroup(SlidingWindowSpec(10_000), ["l0"])]
    h = KVCacheManager(30, 4, kv_cache_groups=groups, free_order="unhashed_first")
    f = KVCacheManager(30, 4, free_order="unhashed_first")
    assert type(h.implementation) is HybridKVCacheManager
    assert type(f.implementation) is HashKVCacheManager
    for i, p in enumerate([list(range(13)), list(range(9)) + [50] * 6, list(range(13))]):
        rh, rf = Request(f"r{i}", p), Request(f"r{i}", p)
        assert _admit(h, rh) == _admit(f, rf)
        assert h.get_block_ids(rh.request_id) == (f.get_block_ids(rf.request_id),)
        if i == 0:
            h.free(rh)
            f.free(rf)
        assert h.free_block_ids() == f.free_block_ids()
    h.check_invariants()


def test_events_carry_plain_hashes_and_group_ids():
    m = _hybrid(enable_events=True)
    a = Request("a", list(range(9)))
    _admit(m, a)
    ev = m.take_events()
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window,
             len(e.block_hashes)) for e in ev] == [
        (0, "full_attention", None, 2), (1, "sliding_window", 8, 2)]
    assert ev[0].block_hashes == ev[1].block_hashes  # same digests, told apart by group


# ------------------------------------------------------------------- dispatch seam
def test_one_full_group_keeps_the_default_manager():
    m = KVCacheManager(8, 4, kv_cache_groups=[KVCacheGroup(FULL, ["l0"])])
    assert type(m) is KVCacheManager and type(m.implementation) is HashKVCacheManager
    assert type(KVCacheManager(8, 4).implementation) is HashKVCacheManager
    h = KVCacheManager(8, 4, kv_cache_groups=parse_kv_groups("full,full"))
    assert type(h) is KVCacheManager and type(h.implementation) is HybridKVCacheManager


# ------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("w", [0, -8, True, 8.0, "8", None])
def test_bad_sliding_window(w):
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowSpec(w)


def test_window_numpy_int_accepted_and_any_size_allowed():
    assert SlidingWindowSpec(np.int64(7)).sliding_window == 7
    assert type(SlidingWindowSpec(np.int64(7)).sliding_window) is int


@pytest.mark.parametrize("groups, match", [
    ([], "empty"),
    ("full,sw8", "list or tuple"),
    ([FULL], "not a KVCacheGroup"),
    ([KVCacheGroup(FULL, ["a"]), KVCacheGroup(SlidingWindowSpec(8), ["a"])],
     "layer 'a' is in KV cache groups 0 and 1"),
])
def test_bad_layouts_raise_before_anything_is_built(groups, match):
    with pytest.raises(ValueError, match=match):
        check_kv_cache_groups(groups)
    with pytest.raises(ValueError, match=match):
        KVCacheManager(8, 4, kv_cache_groups=groups)


@pytest.mark.parametrize("make, match", [
    (lambda: KVCacheGroup(FULL, []), "at least one layer"),
    (lambda: KVCacheGroup(FULL, "l0"), "list or tuple"),
    (lambda: KVCacheGroup(FULL, ["a", "a"]), "appear twice"),
    (lambda: KVCacheGroup(FULL, [""]), "non-empty str"),
    (lambda: KVCacheGroup("full", ["a"]), "FullAttentionSpec or SlidingWindowSpec"),
    (lambda: parse_kv_groups("full,window8"), "bad kv group"),
    (lambda: parse_kv_groups("full,sw0"), "sliding_window"),
])
def test_bad_groups(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("kw, match", [
    ({"num_host_blocks": 4, "enable_caching": False}, "needs prefix caching"),
    ({"eviction": "belady"}, "needs the trace's future"),
    ({"eviction": "nope"}, "nope"),
    ({"free_order": "fifo"}, "free_order"),
    ({"num_blocks": 0}, "num_blocks"),
])
def test_unsupported_combinations(kw, match):
    args = dict(num_blocks=8, block_size=4, kv_cache_groups=parse_kv_groups("full,sw8"))
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        KVCacheManager(**args)


def test_bad_hit_blocks_change_nothing():
    m = _hybrid()
    a = Request("a", list(range(17)))
    _admit(m, a)
    m.free(a)
    b = Request("b", list(range(16)) + [1, 2])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 16
    before = (m.free_block_ids(), m.cached_block_ids())
    with pytest.raises(ArgumentTypeError, match="per-group"):
        m.allocate_slots(b, 2, hit, blocks[0])  # a flat list (the default manager's form)
    with pytest.raises(ValueError, match="not a cached block of group 0"):
        m.allocate_slots(b, 2, hit, (blocks[1][2:] * 2, blocks[1]))
    with pytest.raises(ValueError, match="null slot"):
        m.allocate_slots(b, 2, hit, (blocks[1], blocks[1]))
    with pytest.raises(ValueError, match="same tokens"):
        m.allocate_slots(b, 2, hit, (blocks[0], blocks[1][:2]))
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        m.allocate_slots(b, 2, hit - 4, blocks)
    assert (m.free_block_ids(), m.cached_block_ids()) == before
    assert m.running_request_ids == []
    m.check_invariants()


# ---------------------------------------------------------------- hypothesis
_STEMS = [list(range(1, 13)), [1, 2, 3, 4, 20, 21, 22, 23], [30] * 9]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(["full,sw4", "full,sw5", "full,sw8,sw3", "sw6", "sw6,full,sw6",
                            "full,full", "full,sw1"]),
    num_blocks=st.integers(2, 24),
    block_size=st.sampled_from([1, 2, 4]),
    free_order=st.sampled_from(["append", "unhashed_first"]),
    ops=st.lists(st.one_of(
        st.tuples(st.just("new"), st.integers(0, 2), st.lists(st.integers(0, 3), max_size=10)),
        st.tuples(st.just("decode"), st.integers(0, 5), st.integers(1, 12)),
        st.tuples(st.just("free"), st.integers(0, 5)),
    ), max_size=30),
)
def test_random_sequences_keep_invariants_and_the_window_bound(
    layout, num_blocks, block_size, free_order, ops
):
    groups = parse_kv_groups(layout)
    m = KVCacheManager(num_blocks, block_size, kv_cache_groups=groups, free_order=free_order)
    windows = [g.spec.sliding_window for g in groups]
    null = m.null_block_id
    running: list[Request] = []
    n = 0
    for op in ops:
        if op[0] == "new":
            req = Request(f"r{n}", _STEMS[op[1]] + op[2])
            n += 1
            blocks, hit = m.get_computed_blocks(req)
            assert hit % block_size == 0 and hit < req.num_tokens
            assert all(len(g) == hit // block_size for g in blocks)
            if m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None:
                req.num_computed_tokens = req.num_tokens
                running.append(req)
        elif op[0] == "decode" and running:
            req = running[op[1] % len(running)]
            for step in range(op[2]):
                req.append_output_token_ids(7 + step % 3)
                if m.allocate_slots(req, 1) is None:
                    break
                t = req.num_computed_tokens  # the step computes position t
                for g, ids in enumerate(m.get_block_ids(req.request_id)):
                    w = windows[g]
                    real = [i for i, b in enumerate(ids) if b != null]
                    if w is None:
                        assert len(real) == len(ids)
                        continue
                    # Only blocks overlapping the window of position t, and at most
                    # ceil(W / block_size) + 1 of them.
                    start = max(0, t - w + 1)
                    assert all((i + 1) * block_size > start for i in real), (g, ids, t)
                    assert len(real) <= -(-w // block_size) + 1
                    assert all(b == null for b in ids[: len(ids) - len(real)])
                req.num_computed_tokens = t + 1
        elif op[0] == "free" and running:
            m.free(running.pop(op[1] % len(running)))
        m.check_invariants()
    for req in running:
        m.free(req)
    m.check_invariants()
    assert m.num_free_blocks == num_blocks and m.usage == 0.0  # nothing leaked


def test_hybrid_manager_host_tier_off_reports_none():
    """A bad host-tier size is a clear error before anything is built; size 0 answers
    the host-tier API with nothing (the replay and the engine call it). (A size > 0
    builds per-group host slots: tests/core/test_hybrid_host_tier.py.)"""
    from prefixcache.core import FullAttentionSpec, KVCacheGroup, KVCacheManager, SlidingWindowSpec

    groups = [KVCacheGroup(FullAttentionSpec(), ["layers.0"]),
              KVCacheGroup(SlidingWindowSpec(sliding_window=8), ["layers.1"])]
    with pytest.raises(ValueError, match="num_host_blocks"):
        KVCacheManager(16, 4, kv_cache_groups=groups, num_host_blocks=-1)
    m = KVCacheManager(16, 4, kv_cache_groups=groups, num_host_blocks=0)
    assert m.num_host_blocks == 0 and m.take_host_transfers() == []
