"""Bad input at the core's boundaries (issue 13, item 4): a clear error, and the full
state of the manager exactly as it was before the call."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import KVCacheManager, Request
from prefixcache._validate import (ArgumentTypeError, check_count, check_host_memory,
                                   check_int_sequence)

BS = 4


def snapshot(m: KVCacheManager):
    """Everything a call could change: blocks, queue order, hash map, per-request state,
    counters, stats, events."""
    pool = m.block_pool
    return (
        [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        m.free_block_ids(),
        {h: (sorted(e) if type(e) is dict else e.block_id)
         for h, e in pool.cached_block_hash_to_block.items()},
        {rid: ([b.block_id for b in st.blocks], st.num_cached_blocks, st.idle_until,
               st.request.num_computed_tokens, st.request.num_tokens)
         for rid, st in m.implementation._states.items()},
        len(m.implementation._states_by_request),
        m.counters(),
        dataclasses.asdict(m.prefix_cache_stats),
        list(pool.events),
    )


def setup():
    """A manager with a cached prefix, a running request and a new request that hits."""
    m = KVCacheManager(12, BS, enable_events=True)
    a = Request("a", list(range(1, 13)))
    blocks, n = m.get_computed_blocks(a)
    m.allocate_slots(a, 12 - n, n, blocks)
    a.num_computed_tokens = 12
    m.free(a)
    run = Request("run", [50, 51, 52, 53, 54])
    m.allocate_slots(run, 5)
    run.num_computed_tokens = 5
    run.append_output_token_ids(55)
    new = Request("new", list(range(1, 13)) + [99])
    return m, run, new


BAD_COUNTS = [np.float64(10.0), 10.0, 1.5, True, np.bool_(True), "3", None, -1]


@pytest.mark.parametrize("bad", BAD_COUNTS, ids=repr)
@pytest.mark.parametrize("arg", ["num_new_tokens", "num_new_computed_tokens",
                                 "num_lookahead_tokens"])
def test_bad_count_on_a_new_request_changes_nothing(bad, arg):
    m, _, new = setup()
    blocks, hit = m.get_computed_blocks(new)
    assert hit == 12  # three hit blocks: a call that got past them would touch them
    kw = dict(num_new_tokens=new.num_tokens - hit, num_new_computed_tokens=hit,
              num_lookahead_tokens=0)
    kw[arg] = bad
    before = snapshot(m)
    with pytest.raises(ValueError, match=arg):
        m.allocate_slots(new, kw["num_new_tokens"], kw["num_new_computed_tokens"], blocks,
                         kw["num_lookahead_tokens"])
    assert snapshot(m) == before
    m.check_invariants()


@pytest.mark.parametrize("bad", BAD_COUNTS, ids=repr)
def test_bad_count_on_a_running_request_changes_nothing(bad):
    """The decode fast path must not take a float (1.0 <= idle bound would return [])."""
    m, run, _ = setup()
    before = snapshot(m)
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots(run, bad)
    assert snapshot(m) == before
    m.check_invariants()


def test_bad_num_computed_tokens_on_a_running_request():
    m, run, _ = setup()
    before = snapshot(m)
    for bad in (5.0, np.float64(5), np.int64(5), None, "5", -1, True):
        run.num_computed_tokens = bad
        with pytest.raises(ValueError, match="num_computed_tokens"):
            m.allocate_slots(run, 1)
        assert snapshot(m)[:3] == before[:3]
    run.num_computed_tokens = 5
    assert snapshot(m) == before


def test_float_count_regression_from_the_issue():
    """issue 13: np.float64(10.0) on a new request raised from inside the pool after
    registering it and raising the hit blocks' ref counts."""
    m, _, new = setup()
    blocks, hit = m.get_computed_blocks(new)
    with pytest.raises(TypeError, match="num_new_tokens must be an int"):
        m.allocate_slots(new, np.float64(new.num_tokens - hit), hit, blocks)
    m.check_invariants()
    assert "new" not in m.running_request_ids


def test_numpy_int_counts_are_accepted():
    m, run, new = setup()
    blocks, hit = m.get_computed_blocks(new)
    got = m.allocate_slots(new, np.int64(new.num_tokens - hit), np.int32(hit), blocks)
    assert len(got) == 1 and m.get_block_ids("new")[:3] == [b.block_id for b in blocks]
    assert m.allocate_slots(run, np.int64(1)) == []
    m.check_invariants()


@pytest.mark.parametrize("bad_blocks", [
    "set", "ints", "generator", "foreign"])
def test_bad_hit_blocks_change_nothing(bad_blocks):
    m, _, new = setup()
    blocks, hit = m.get_computed_blocks(new)
    other = KVCacheManager(12, BS)
    bad = {"set": set(blocks), "ints": [b.block_id for b in blocks],
           "generator": (b for b in blocks),
           "foreign": other.block_pool.blocks[:3]}[bad_blocks]
    if bad_blocks == "foreign":
        for b in bad:
            b.block_hash = b"x"  # looks cached, but not in this manager
    before = snapshot(m)
    with pytest.raises(ValueError, match="block"):
        m.allocate_slots(new, new.num_tokens - hit, hit, bad)
    assert snapshot(m) == before


@pytest.mark.parametrize("bad", ["new", 5, None, object()], 
                         ids=lambda v: "object()" if type(v) is object else repr(v))
def test_not_a_request(bad):
    m, _, _ = setup()
    before = snapshot(m)
    with pytest.raises(TypeError, match="request must be a prefixcache Request"):
        m.allocate_slots(bad, 4)
    with pytest.raises(TypeError, match="request must be a prefixcache Request"):
        m.get_computed_blocks(bad)
    assert snapshot(m) == before


@pytest.mark.parametrize("bad", [{1, 2, 3}, frozenset({1}), {1: 2}, "abc", b"ab",
                                 np.array([1.0, 2.0]), np.array([[1, 2]]), 5, None],
                         ids=repr)
def test_prompt_containers_rejected(bad):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("r", bad)
    req = Request("r", [1, 2])
    with pytest.raises(ValueError, match="output token ids"):
        req.append_output_token_ids(bad if not isinstance(bad, int) else [1.5])
    assert list(req.all_token_ids) == [1, 2]


def test_pool_sizes_beyond_host_memory_are_refused_up_front():
    # 2**40 blocks of ~128 bytes: refused at once instead of building objects for hours.
    with pytest.raises(ValueError, match=r"num_blocks=1099511627776 needs about .* GiB"):
        KVCacheManager(2**40, 16)
    with pytest.raises(ValueError, match="needs about 1 GiB .* only 0.5 GiB"):
        check_host_memory("x", 2**30, available=2**29)
    check_host_memory("x", 2**29, available=2**30)


def test_validation_helpers():
    assert check_count("n", np.int16(3)) == 3 and type(check_count("n", np.int16(3))) is int
    for bad in (1.0, np.float32(1), True, "1", None, [1]):
        with pytest.raises(ArgumentTypeError, match="n must be an int"):
            check_count("n", bad)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        check_count("n", 0, min=1)
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ArgumentTypeError, ValueError)
    for ok in ([1], (1,), range(3), np.arange(3), np.zeros(2, np.uint8)):
        check_int_sequence("ids", ok)
    for bad in ({1}, {1: 1}, "a", b"a", bytearray(b"a"), memoryview(b"a"), np.zeros(2),
                np.zeros((1, 2), int), 3):
        with pytest.raises(ArgumentTypeError, match="ids"):
            check_int_sequence("ids", bad)


_bad_value = st.sampled_from(BAD_COUNTS + [np.float32(2.0), 2**80 * 1.0])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["new", "decode", "free", "bad_new",
                                               "bad_decode"]),
                              st.integers(0, 5), _bad_value), max_size=30))
def test_random_sequences_with_bad_calls(ops):
    """Good and bad calls interleaved: every bad call leaves the state as it was, and
    once all are freed every block is free."""
    m = KVCacheManager(8, BS)
    running: list[Request] = []
    n = 0
    for kind, k, bad in ops:
        if kind in ("new", "bad_new"):
            req = Request(f"r{n}", [1, 2, 3, 4, 5, 6, 7][: 2 + k] + [n])
            n += 1
            blocks, hit = m.get_computed_blocks(req)
            if kind == "bad_new":
                before = snapshot(m)
                with pytest.raises(ValueError):
                    m.allocate_slots(req, bad, hit, blocks)
                assert snapshot(m) == before
                continue
            if m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None:
                req.num_computed_tokens = req.num_tokens
                running.append(req)
        elif running:
            req = running[k % len(running)]
            if kind == "free":
                m.free(running.pop(k % len(running)))
            elif kind == "bad_decode":
                before = snapshot(m)
                with pytest.raises(ValueError):
                    m.allocate_slots(req, bad)
                assert snapshot(m) == before
            else:
                req.append_output_token_ids(9)
                if m.allocate_slots(req, 1) is not None:
                    req.num_computed_tokens += 1
                else:
                    req.num_computed_tokens = req.num_computed_tokens  # unchanged
        m.check_invariants()
    for req in running:
        m.free(req)
    m.check_invariants()
    assert m.num_free_blocks == 8


@pytest.mark.parametrize("bad", [{1, 2, 3, 4}, {1: 0, 2: 0}, "abcd"], ids=repr)
def test_hasher_rejects_unordered_token_containers(bad):
    from prefixcache.core import BlockHasher

    h = BlockHasher("sha256", seed=0)
    with pytest.raises(ValueError, match="token"):
        h.hash_block(None, bad)  # a set used to hash in its iteration order
    with pytest.raises(ValueError, match="token_ids"):
        h.hash_token_blocks(bad, 2)


@pytest.mark.parametrize("rid", [5, ("a", 1), ["unhashable"]], ids=repr)
def test_free_of_an_unknown_id_of_any_type(rid):
    m, _, _ = setup()
    before = snapshot(m)
    with pytest.raises(ValueError, match="holds no blocks"):
        m.free(rid)
    assert snapshot(m) == before


def test_free_by_a_non_string_id():
    m = KVCacheManager(4, BS)
    req = Request(7, [1, 2, 3])
    m.allocate_slots(req, 3)
    m.free(7)
    assert m.num_free_blocks == 4
    m.check_invariants()
