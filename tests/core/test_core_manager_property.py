"""Property test: random new/append/allocate/free/reset sequences over random pools keep
every invariant (each eviction policy's own state included), and once everything is
freed all blocks are free and usage is 0.

Runs for both indexes: the hash chain (``KVCacheManager``) and the radix tree
(``RadixKVCacheManager``), under every eviction policy (``belady`` with the future of
the operation sequence), with the tree's lock and candidate invariants after every
operation and no stranded block ever in the tree.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import KVCacheManager, Request
from prefixcache.core.eviction import TraceFuture, policy_names

# Small alphabets and shared stems so that prefixes collide, hit, duplicate and evict.
_STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 20, 21, 22, 23], [30] * 9]

_op = st.one_of(
    st.tuples(
        st.just("new"), st.integers(0, 2), st.lists(st.integers(0, 3), max_size=10),
        st.sampled_from([None, None, "salt"]),  # namespaces: a salted request shares nothing
    ),
    st.tuples(st.just("append"), st.integers(0, 7), st.integers(1, 4)),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("reset"),),
)


@pytest.mark.parametrize("index", ["hash", "radix"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 4]),
    free_order=st.sampled_from(["append", "unhashed_first"]),
    eviction=st.sampled_from(policy_names()),
    ops=st.lists(_op, max_size=40),
)
def test_random_operation_sequences_keep_invariants(
    index, num_blocks, block_size, free_order, eviction, ops
):
    news = [op for op in ops if op[0] == "new"]
    options = None
    if eviction == "belady":
        # The future of this operation sequence: its prompts' block hashes, in order
        # (the hasher is deterministic: sha256 with the default root).
        hasher = KVCacheManager(1, block_size).hasher
        options = {"future": TraceFuture.from_hashes(
            hasher.hash_token_blocks(_STEMS[s] + t, block_size, cache_salt=salt)
            for _, s, t, salt in news
        )}
    m = KVCacheManager(num_blocks, block_size, free_order=free_order, eviction=eviction,
                       eviction_options=options, index=index)
    running: list[Request] = []
    n = 0
    for op in ops:
        kind = op[0]
        if kind == "new":
            _, stem, tail, salt = op
            req = Request(f"r{n}", _STEMS[stem] + tail, cache_salt=salt, priority=n % 3)
            m.on_arrival(req, n)
            n += 1
            blocks, hit = m.get_computed_blocks(req)
            assert hit % block_size == 0 and hit <= req.num_tokens - 1
            new = m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
            if new is not None:
                req.num_computed_tokens = req.num_tokens
                req.append_output_token_ids(7)  # the prefill's sampled token
                running.append(req)
                assert m.get_block_ids(req.request_id)[: len(blocks)] == [
                    b.block_id for b in blocks
                ]
        elif kind == "append" and running:
            _, i, k = op
            req = running[i % len(running)]
            for t in range(k):
                before = m.get_block_ids(req.request_id)
                new = m.allocate_slots(req, 1)
                if new is None:
                    # Nothing changed; the request keeps its table.
                    assert m.get_block_ids(req.request_id) == before
                    break
                assert m.get_block_ids(req.request_id) == before + [b.block_id for b in new]
                req.num_computed_tokens = req.num_computed_tokens + 1
                req.append_output_token_ids(t % 3 + 1)
        elif kind == "free" and running:
            m.free(running.pop(op[1] % len(running)))
        elif kind == "reset":
            ok = m.reset_prefix_cache()
            assert ok == (not running)
            if ok:
                assert m.cached_block_ids() == []
        m.check_invariants()
        held = {bid for r in running for bid in m.get_block_ids(r.request_id)}
        assert m.num_free_blocks == num_blocks - len(held)
        assert m.num_cached_blocks == len(m.cached_block_ids())
        if index == "radix":
            assert m.num_stranded_blocks() == 0
    for req in running:
        m.free(req)
        m.check_invariants()
    assert m.num_free_blocks == num_blocks
    assert sorted(m.free_block_ids()) == list(range(num_blocks))
    assert m.usage == 0.0
    blocks = m.block_pool.blocks if index == "hash" else m.blocks
    assert all(b.ref_cnt == 0 for b in blocks)
