"""Eviction policies: the exact victim order of each policy on a small hand-computed
trace, the pool's rules around them (unhashed blocks first, in-use blocks never), the
keyed ``lru`` pinned to the free queue's order, and bad input."""

from __future__ import annotations

import pytest

from prefixcache import KVCacheManager, Request
from prefixcache.core.eviction import (
    POLICIES,
    EvictionPolicy,
    KeyedPolicy,
    PolicyError,
    TraceFuture,
    make_policy,
    policy_names,
)
from prefixcache.core.eviction.belady import NEVER

BS = 2


def _admit(m, rid, prompt, priority=0, index=None):
    req = Request(rid, prompt, priority=priority)
    if index is not None:
        m.on_arrival(req, index)
    blocks, hit = m.get_computed_blocks(req)
    assert m.allocate_slots(req, len(prompt) - hit, hit, blocks) is not None
    req.num_computed_tokens = len(prompt)
    m.check_invariants()
    return req, hit


def _run(m, trace):
    """Admit and free each request in turn (one at a time)."""
    for i, (prompt, prio) in enumerate(trace):
        req, _ = _admit(m, f"r{i}", prompt, prio)
        m.free(req)
        m.check_invariants()


# Six blocks of 2 tokens. Each 3-token prompt caches its first block and holds a
# partial (never cached) second block, which goes back to the queue head when freed.
#   r0 [1,1,9] caches A = block 0      r3 [1,1,8] hits A
#   r1 [2,2,9] caches B = block 1      r4 [1,1,7] hits A    (A: 2 hits)
#   r2 [3,3,9] caches C = block 2      r5 [2,2,8] hits B    (B: 1 hit)
#   r6 [4,4,9] caches D = block 3
# Last releases: C (r2) < A (r4) < B (r5) < D (r6); cached: A < B < C < D.
# Unhashed free blocks at the end: 4 (head), 5.
TRACE = [([1, 1, 9], 0), ([2, 2, 9], 5), ([3, 3, 9], 0), ([1, 1, 8], 0), ([1, 1, 7], 0),
         ([2, 2, 8], 0), ([4, 4, 9], 2)]
A, B, C, D = 0, 1, 2, 3
EXPECTED = {
    "lru": [C, A, B, D],  # least recently released first
    "fifo": [A, B, C, D],  # first cached first; hits do not refresh
    "lfu": [C, D, B, A],  # hits 0, 0, 1, 2 (C before D: LRU among equals)
    "slru": [C, B, D, A],  # probationary (< 2 hits) C, B, D in LRU order; protected A
    # block priority = max over its requests: A 0, B max(5, 0) = 5, C 0, D 2;
    # A and C tie at 0: C was released first.
    "priority": [C, A, D, B],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_victim_order_hand_computed(name):
    options = {"fast_path": False} if name == "lru" else None
    m = KVCacheManager(6, BS, eviction=name, eviction_options=options)
    _run(m, TRACE)
    assert m.policy.candidate_ids() == EXPECTED[name]
    assert m.free_block_ids()[:2] == [4, 5]  # unhashed free blocks lead the queue
    # One request needing every block: the unhashed ones first, then the victims in
    # the policy's order.
    req, hit = _admit(m, "big", list(range(100, 111)))
    assert hit == 0
    assert m.get_block_ids("big") == [4, 5, *EXPECTED[name]]
    assert m.num_evictions == 4 and m.num_cached_blocks == 5


def test_lru_fast_path_has_the_same_victim_order():
    # The default (no policy object, the free queue itself) with vLLM's free order.
    m = KVCacheManager(6, BS, free_order="unhashed_first")
    assert m.policy is None and m.eviction == "lru" and m.index == "hash"
    _run(m, TRACE)
    assert m.free_block_ids() == [4, 5, *EXPECTED["lru"]]
    _admit(m, "big", list(range(100, 111)))
    assert m.get_block_ids("big") == [4, 5, *EXPECTED["lru"]]


def test_length_and_cost_hand_computed():
    # rA [1,1,9] caches A0 = block 0 (position 0); rB [2,2,3,3,9] caches B0 = block 1
    # (position 0) and B1 = block 2 (position 1); freeing rB releases B1 before B0.
    # Releases: A0 < B1 < B0.
    trace = [([1, 1, 9], 0), ([2, 2, 3, 3, 9], 0)]
    m = KVCacheManager(6, BS, eviction="length")
    _run(m, trace)
    assert m.policy.candidate_ids() == [2, 0, 1]  # deepest first, then LRU: B1, A0, B0
    m = KVCacheManager(6, BS, eviction="cost")
    _run(m, trace)
    pol = m.policy
    v0, v1 = pol.value(0), pol.value(1)
    # A deeper block saves more attention FLOPs per byte.
    assert v1 > v0 > 0
    # GreedyDual: H = L + value, L = 0 so far: A0 (v0), B0 (v0, released later), B1 (v1).
    assert pol.candidate_ids() == [0, 1, 2]
    # Evict one block (a 3-token prompt with one new cached block + one partial: the
    # two unhashed free blocks suffice) -- then force one eviction: L rises to v0.
    req, _ = _admit(m, "x", list(range(100, 107)))  # 4 blocks: 3 unhashed + A0
    assert m.get_block_ids("x")[-1] == 0 and pol.inflation == v0
    m.free(req)  # its 3 cached blocks come back at H = v0 + value(p) > v1 (aging)
    m.check_invariants()
    assert pol.candidate_ids()[:2] == [1, 2]  # B0 (v0), B1 (v1) before the new ones


def _future(trace, hasher):
    return TraceFuture.from_hashes(hasher.hash_token_blocks(p, BS) for p, _ in trace)


def test_belady_hand_computed():
    # r0..r2 cache A, B, C; then r3 [2,2,8] uses B, r4 [1,1,8] uses A; C is never used
    # again. Before r3 arrives: next uses C never, A at 4, B at 3 -> C, A, B
    # (LRU would be A, B, C). When r3 arrives, B has no later use: B and C tie at
    # "never", B was released first -> B, C, A.
    trace = [([1, 1, 9], 0), ([2, 2, 9], 0), ([3, 3, 9], 0), ([2, 2, 8], 0), ([1, 1, 8], 0)]
    hasher = KVCacheManager(1, BS).hasher
    m = KVCacheManager(6, BS, eviction="belady",
                       eviction_options={"future": _future(trace, hasher)})
    for i, (p, _) in enumerate(trace[:3]):
        req, _ = _admit(m, f"r{i}", p, index=i)
        m.free(req)
    pol = m.policy
    assert pol.candidate_ids() == [2, 0, 1]
    assert [pol.future.next_use(pol.slot[b]) for b in (0, 1, 2)] == [4, 3, NEVER]
    req = Request("r3", trace[3][0])
    m.on_arrival(req, 3)
    m.check_invariants()  # re-keyed: every live key equals the key now
    assert pol.candidate_ids() == [1, 2, 0]
    with pytest.raises(ValueError, match="trace order"):
        m.on_arrival(Request("old", [1, 1, 9]), 2)


def test_unbounded_cache_every_policy_hits_the_same():
    trace = [([1, 1, 2, 2, 9], 0), ([1, 1, 2, 2, 8], 1), ([1, 1, 3, 3, 9], 2),
             ([4, 4, 9], 0), ([1, 1, 2, 2, 7], 0), ([4, 4, 1], 3)]
    hasher = KVCacheManager(1, BS).hasher
    hits = {}
    for name in policy_names():
        opts = {"future": _future(trace, hasher)} if name == "belady" else None
        m = KVCacheManager(64, BS, eviction=name, eviction_options=opts)
        got = []
        for i, (p, prio) in enumerate(trace):
            req, hit = _admit(m, f"r{i}", p, prio, index=i if name == "belady" else None)
            got.append(hit)
            m.free(req)
        hits[name] = got
        assert m.num_evictions == 0
    assert all(h == hits["lru"] for h in hits.values()), hits
    assert hits["lru"] == [0, 4, 2, 0, 4, 2]  # the ideal: every earlier full block hits


def test_in_use_blocks_are_never_candidates():
    for name in ("fifo", "lfu", "length", "cost", "priority", "slru"):
        m = KVCacheManager(4, BS, eviction=name)
        r0, _ = _admit(m, "r0", [1, 1, 9])
        r1, hit = _admit(m, "r1", [1, 1, 8])  # hits block 0: now held twice
        assert hit == 2
        m.free(r0)
        assert m.policy.candidate_ids() == []  # block 0 is still held by r1
        # 4 blocks: r1 holds 0 and 1; two unhashed are free; a 5-token prompt needs 3.
        assert m.allocate_slots(Request("r2", [5, 5, 6, 6, 7]), 5) is None
        m.check_invariants()
        m.free(r1)
        assert m.policy.candidate_ids() == [0]


def test_stranded_blocks_and_cached_count():
    m = KVCacheManager(4, BS, eviction="cost")
    r0, _ = _admit(m, "r0", [1, 1, 2, 2, 9])  # blocks 0 (pos 0), 1 (pos 1), 2 partial
    m.free(r0)
    assert m.num_cached_blocks == 2 and m.num_stranded_blocks() == 0
    # cost evicts the shallow block first (lower value): block 1 is stranded.
    r1, _ = _admit(m, "r1", [5, 5, 9])  # the unhashed 2, 3; caches 2
    m.free(r1)  # 3 (partial) back to the head, 2 a candidate (H = v0, after block 0)
    r2, _ = _admit(m, "r2", [6, 6, 9])  # 3, then the victim 0 (its partial block)
    assert m.get_block_ids("r2") == [3, 0]
    assert m.cached_block_ids() == [1, 2, 3]
    assert m.num_stranded_blocks() == 1
    assert m.num_cached_blocks == len(m.cached_block_ids()) == 3
    m.free(r2)
    assert m.reset_prefix_cache()
    assert m.num_cached_blocks == 0 and m.policy.candidate_ids() == []
    m.check_invariants()


def test_check_invariants_catches_a_policy_out_of_step():
    m = KVCacheManager(4, BS, eviction="lfu")
    r0, _ = _admit(m, "r0", [1, 1, 9])
    m.free(r0)
    m.policy.hits[0] += 1  # metadata changed without a rekey
    with pytest.raises(PolicyError, match="without a rekey"):
        m.check_invariants()
    m = KVCacheManager(4, BS, eviction="fifo")
    r0, _ = _admit(m, "r0", [1, 1, 9])
    m.free(r0)
    m.policy.discard(m.block_pool.blocks[0])  # the pool's free cached block is lost
    with pytest.raises(PolicyError, match="missing"):
        m.check_invariants()


def test_bad_input_is_rejected_before_anything_changes():
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'.*lru"):
        KVCacheManager(4, BS, eviction="nope")
    with pytest.raises(ValueError, match="unknown index 'nope'.*hash"):
        KVCacheManager(4, BS, index="nope")
    with pytest.raises(ValueError, match="belady needs the trace's future: run it through the replay"):
        KVCacheManager(4, BS, eviction="belady")
    with pytest.raises(TypeError, match="eviction policy 'fifo'.*unexpected keyword.*colour"):
        KVCacheManager(4, BS, eviction="fifo", eviction_options={"colour": 1})
    with pytest.raises(TypeError, match="eviction_options must be a mapping"):
        KVCacheManager(4, BS, eviction="fifo", eviction_options=["x"])
    with pytest.raises(ValueError, match="unknown model preset"):
        KVCacheManager(4, BS, eviction="cost", eviction_options={"model": "gpt-9"})
    for bad in ("1", 1.5, True, None):
        with pytest.raises(ValueError, match="priority must be an int"):
            Request("r", [1, 2, 3], priority=bad)
    assert Request("r", [1, 2, 3], priority=-3).priority == -3
    assert Request("r", [1, 2, 3]).priority == 0


def test_registry_is_read_only_and_policies_are_keyed_where_they_can_be():
    with pytest.raises(TypeError):
        POLICIES["mine"] = object  # type: ignore[index]
    for name, cls in POLICIES.items():
        assert cls.name == name and issubclass(cls, EvictionPolicy)
        if name not in ("arc", "s3fifo", "random"):  # their victim is not fixed by a key at add()
            assert issubclass(cls, KeyedPolicy), name
    p = make_policy("cost", num_blocks=8, block_size=16)
    assert p.block_size == 16
    with pytest.raises(ValueError, match="needs block_size"):
        make_policy("cost", num_blocks=8)


def test_stranded_blocks_are_counted_down_the_chain():
    # cost evicts the shallowest block of a 3-block chain: its child and grandchild
    # (whose own parent is still cached) are both unreachable.
    m = KVCacheManager(4, BS, eviction="cost")
    r0, _ = _admit(m, "r0", [1, 1, 2, 2, 3, 3, 9])  # blocks 0, 1, 2 cached, 3 partial
    m.free(r0)
    r1, _ = _admit(m, "r1", [5, 5, 9])  # 3, then the victim 0 (H = v0, the smallest)
    assert m.get_block_ids("r1") == [3, 0]
    assert m.cached_block_ids() == [1, 2, 3]
    assert sorted(m.block_pool.stranded_block_ids()) == [1, 2]
    assert m.num_stranded_blocks() == 2


class _OtherIndex:
    """A stand-in for another index's implementation class."""

    def __init__(self, num_blocks, block_size, *, index, **kwargs):
        self.args = (num_blocks, block_size, index, kwargs)

    def free(self, request):
        return ("freed", request)


def test_index_registry_builds_the_registered_implementation(monkeypatch):
    from types import MappingProxyType

    from prefixcache.core import indexes

    monkeypatch.setattr(indexes, "INDEXES", MappingProxyType({
        **indexes.INDEXES,
        "other": f"{__name__}:_OtherIndex",
    }))
    m = KVCacheManager(8, BS, index="other", eviction="lfu")
    # One manager class for every index (no __new__ dispatch): the implementation
    # below it gets the keywords, its public methods are bound; its own attributes are read on it.
    assert type(m) is KVCacheManager
    assert m.implementation.args == (8, BS, "other", {
        "eviction": "lfu", "kv_cache_groups": None, "num_host_blocks": 0})
    assert m.free("x") == ("freed", "x")
    with pytest.raises(ValueError, match="unknown index 'nope'.*'other'"):
        KVCacheManager(8, BS, index="nope")
    assert type(KVCacheManager(8, BS, index="hash")) is KVCacheManager
