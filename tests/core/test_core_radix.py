"""The radix-tree index (``RadixKVCacheManager``): exact hand-computed cases, the same
hits as the hash chain with a cache that never evicts (generated workloads and both
Mooncake traces, = the ideal), and no stranded block under pressure.

The replay builds ``prefixcache.sim.replay.KVCacheManager``; until it takes ``index=``,
``replay_with`` swaps the radix manager in for that name (monkeypatch, test-local).
"""

from __future__ import annotations

import inspect
import itertools
import json

import numpy as np
import pytest

import prefixcache.sim.replay as replay_module
from prefixcache.core import (
    BlockRemoved,
    BlockStored,
    InvariantError,
    KVCacheManager,
    LoRARequest,
    MultiModalFeature,
    Request,
)
from prefixcache.core.eviction import get_policy_class, policy_names
from prefixcache.core.radix import RadixKVCacheManager as _RadixIndex
from prefixcache.core.radix import block_keys
from prefixcache.sim import workloads
from prefixcache.sim.trace import read_trace


def RadixKVCacheManager(*args, **kwargs):
    """The radix index under the one manager class."""
    if "index" in kwargs:  # (the index class itself refuses another index's name)
        return _RadixIndex(*args, **kwargs)
    return KVCacheManager(*args, index="radix", **kwargs)


_POLICIES = [p for p in policy_names() if not get_policy_class(p).needs_future]


def admit(m, req):
    """Lookup + one allocation for the whole prompt (the replay's admission)."""
    blocks, hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return [b.block_id for b in blocks], new


def ids(blocks):
    return [b.block_id for b in blocks]


# ----------------------------------------------------------------- hand-computed
def test_lookup_duplicate_and_locked_free_block():
    # Block size 4, ten blocks; the free queue starts as [0 .. 9].
    m = RadixKVCacheManager(10, 4)
    a = Request("a", list(range(1, 11)))  # blocks [1-4] [5-8] + a partial [9 10]
    hit, new = admit(m, a)
    assert hit == [] and ids(new) == [0, 1, 2]
    assert m.cached_block_ids() == [0, 1] and m.num_cached_blocks == 2
    b = Request("b", list(range(1, 9)) + [20, 21, 22])
    hit, new = admit(m, b)
    assert hit == [0, 1] and ids(new) == [3]
    # c is exactly the two cached blocks: at most num_tokens - 1 tokens hit, so only
    # block 0; its own block for [5-8] is a duplicate of block 1's node: it stays
    # uncached and c's path goes through block 1's node (locking it).
    c = Request("c", list(range(1, 9)))
    hit, new = admit(m, c)
    assert hit == [0] and ids(new) == [4]
    assert m.get_block_ids("c") == [0, 4]
    assert m.cached_block_ids() == [0, 1] and m.counters()["blocks_cached"] == 2
    assert m.free_block_ids() == [5, 6, 7, 8, 9]
    m.check_invariants()
    m.free(a)  # block 2 (partial, unhashed) to the head
    m.free(b)  # block 3 to the head; block 1 reaches ref_cnt 0 (tail) but c locks it
    assert m.free_block_ids() == [3, 2, 5, 6, 7, 8, 9, 1]
    assert m.num_free_blocks == 8 and m.num_available_blocks == 7
    m.check_invariants()
    # Eight new blocks do not fit: block 1 is free but locked. Nothing changes.
    d = Request("d", list(range(100, 132)))
    assert admit(m, d)[1] is None
    assert m.free_block_ids() == [3, 2, 5, 6, 7, 8, 9, 1] and m.num_evictions == 0
    d7 = Request("d7", list(range(100, 128)))  # seven blocks fit, without evicting
    hit, new = admit(m, d7)
    assert ids(new) == [3, 2, 5, 6, 7, 8, 9] and m.num_evictions == 0
    m.free(d7)
    m.free(c)
    m.check_invariants()
    assert m.num_stranded_blocks() == 0
    assert m.num_available_blocks == m.num_free_blocks == 10


def test_leaf_only_eviction_order_matches_the_chain_under_lru():
    # Block size 2, six blocks. a = P X + 1 token, b = P Y + 1 token: the tree is
    # P -> {X, Y}. Freed: a's X (released first), then b's Y, then P (last release).
    def run(m):
        a = Request("a", [1, 2, 3, 4, 9])
        b = Request("b", [1, 2, 5, 6, 9])
        assert ids(admit(m, a)[1]) == [0, 1, 2]
        hit, new = admit(m, b)
        assert hit == [0] and ids(new) == [3, 4]
        m.free(a)
        m.free(b)
        # Queue: the unhashed partial blocks 4 and 2 first, then 5, then X, Y, P.
        assert m.free_block_ids() == [4, 2, 5, 1, 3, 0]
        c = Request("c", [7] * 11)  # six blocks: three free, then three victims
        hit, new = admit(m, c)
        # Leaves only: X (block 1), Y (block 3), and P (block 0) only once a leaf.
        assert ids(new) == [4, 2, 5, 1, 3, 0]
        assert m.num_evictions == 3
        m.free(c)
        m.check_invariants()

    tree = RadixKVCacheManager(6, 2)
    run(tree)
    assert tree.num_stranded_blocks() == 0
    run(KVCacheManager(6, 2, free_order="unhashed_first"))


def test_parent_waits_for_its_locked_child():
    # a caches P X; b (P X Z) runs on. Freeing a releases nothing (b holds both);
    # then b frees: Z, X, P become candidates leaf by leaf.
    m = RadixKVCacheManager(5, 2)
    a = Request("a", [1, 2, 3, 4, 9])
    admit(m, a)
    b = Request("b", [1, 2, 3, 4, 5, 6, 9])
    hit, new = admit(m, b)
    assert hit == [0, 1] and ids(new) == [3, 4]
    m.free(a)
    assert m.policy.candidate_ids() == [] and m.num_available_blocks == 1  # block 2
    e = Request("e", [8, 8, 8])  # two blocks: only one is available
    assert admit(m, e)[1] is None
    m.free(b)
    # Candidates: only the leaf Z (block 3); X and P are unlocked interior nodes.
    assert m.policy.candidate_ids() == [3] and m.num_available_blocks == 5
    f = Request("f", [8] * 9)  # five blocks: 4 and 2 unhashed, then Z, X, P
    hit, new = admit(m, f)
    assert ids(new) == [4, 2, 3, 1, 0]
    m.check_invariants()


def test_namespaces_and_multimodal_keys_match_the_chain():
    # Same tokens under other adapters / salts / images share nothing; the same image
    # at the same offset does. Hits per request equal the hash chain's.
    toks = list(range(1, 41))
    img = lambda ident, off: [MultiModalFeature(ident, off, 8)]  # noqa: E731
    lora1, lora2 = LoRARequest("l1", "/p1"), LoRARequest("l1", "/p2")
    specs = [
        dict(), dict(), dict(lora=lora1), dict(lora=lora1), dict(lora=lora2),
        dict(cache_salt="s"), dict(cache_salt="s"), dict(cache_salt="t"),
        dict(mm_features=img("im", 6)), dict(mm_features=img("im", 6)),
        dict(mm_features=img("im", 7)), dict(mm_features=img("other", 6)),
        dict(mm_features=img("im", 6), cache_salt="s", lora=lora1),
        dict(mm_features=img("im", 6), cache_salt="s", lora=lora1),
    ]
    hits = {}
    for make in (RadixKVCacheManager, KVCacheManager):
        m = make(64, 4)
        got = []
        for i, kw in enumerate(specs):
            req = Request(f"r{i}", toks + [100 + i], **kw)
            hit, new = admit(m, req)
            got.append(len(hit))
            m.free(req)
        m.check_invariants()
        hits[make] = got
    assert hits[RadixKVCacheManager] == hits[KVCacheManager]
    # The images overlap blocks 1-3, so block 0 (plain tokens) is shared with the plain
    # requests: the first of each image layout hits 1 block.
    assert hits[RadixKVCacheManager] == [0, 10, 0, 10, 0, 0, 10, 0, 1, 10, 1, 1, 0, 10]


def test_block_keys_carry_extras_where_the_chain_does():
    req = Request("r", list(range(12)), mm_features=[MultiModalFeature("im", 3, 6)],
                  cache_salt="s", lora=LoRARequest("l", "/p"))
    keys = block_keys(req, 0, 3, 4)
    raw = [req.token_bytes(4 * i, 4 * i + 4) for i in range(3)]
    # Item [3, 9) overlaps blocks 0 (offset 3), 1 (offset -1) and 2 (offset -5); the
    # salt is on block 0; the adapter selects the root, not the key.
    assert keys == [(raw[0], (("im", 3), "s")), (raw[1], (("im", -1),)), (raw[2], (("im", -5),))]
    assert block_keys(req, 1, 3, 4) == keys[1:]
    assert raw[0] == b"".join(i.to_bytes(8, "little") for i in range(4))


def test_events_match_the_chain_without_duplicates():
    events = {}
    for make in (RadixKVCacheManager, KVCacheManager):
        m = make(4, 2, enable_events=True, free_order="unhashed_first")
        a = Request("a", [1, 2, 3, 4, 5])
        admit(m, a)
        m.free(a)
        b = Request("b", [1, 2, 7, 8, 9, 9, 9])  # hits P, evicts X (its leaf)
        admit(m, b)
        m.free(b)
        events[make] = m.take_events()
    assert events[RadixKVCacheManager] == events[KVCacheManager]
    # a stores P X; b hits P, its third block evicts X (the queue: a's partial block,
    # the never-used block 3, then X), then b stores its two new full blocks under P.
    kinds = [type(e) for e in events[KVCacheManager]]
    assert kinds == [BlockStored, BlockRemoved, BlockStored]
    assert events[KVCacheManager][2].parent_block_hash == events[KVCacheManager][0].block_hashes[0]


def test_errors_change_nothing():
    with pytest.raises(ValueError, match="radix"):
        RadixKVCacheManager(4, 2, index="hash")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        RadixKVCacheManager(4, 2, eviction="nope")
    with pytest.raises(ValueError, match="eviction_options"):
        RadixKVCacheManager(4, 2, eviction_options=[("x", 1)])
    m = RadixKVCacheManager(8, 2)
    a = Request("a", [1, 2, 3, 4, 5])
    admit(m, a)
    other = Request("o", [1, 2, 6, 6, 5])  # block 1 of a is not o's block 1
    blocks = m.get_blocks("a")[:2]
    before = (m.free_block_ids(), m.cached_block_ids(), m.num_available_blocks)
    with pytest.raises(ValueError, match="not the cached block #1"):
        m.allocate_slots(other, 1, 4, blocks)
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        m.allocate_slots(other, 1, 2, blocks)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0"):
        m.allocate_slots(other, -1)
    assert (m.free_block_ids(), m.cached_block_ids(), m.num_available_blocks) == before
    with pytest.raises(ValueError, match="holds no blocks"):
        m.free("zzz")
    m.check_invariants()
    assert not m.reset_prefix_cache()  # a holds blocks
    m.free(a)
    assert m.reset_prefix_cache() and m.cached_block_ids() == [] and m.num_cached_blocks == 0
    m.check_invariants()
    assert admit(m, Request("a2", [1, 2, 3, 4, 5]))[0] == []


def test_invariant_check_catches_a_broken_lock():
    m = RadixKVCacheManager(8, 2)
    a = Request("a", [1, 2, 3, 4, 5])
    admit(m, a)
    m.implementation._nodes[0].lock += 1  # a lock no running path holds
    with pytest.raises(InvariantError, match="lock"):
        m.check_invariants()


def test_policy_surface():
    m = RadixKVCacheManager(8, 2, eviction="lru")
    assert m.index == "radix" and m.eviction == "lru" and m.policy.name == "lru"
    seen = []
    m.policy.on_arrival = lambda request, index: seen.append((request.request_id, index))
    a = Request("a", [1, 2, 3])
    m.on_arrival(a, 7)
    assert seen == [("a", 7)]


# --------------------------------------------------- replays: the chain vs the tree
def replay_with(index, trace, **kwargs):
    """``replay`` through the manager of ``index``; per-request records and summary."""
    records = []
    if "index" in inspect.signature(replay_module.replay).parameters:
        summary = replay_module.replay(trace, index=index, on_record=records.append, **kwargs)
        return records, summary, None
    made = []

    def factory(*args, **kw):
        cls = RadixKVCacheManager if index == "radix" else KVCacheManager
        made.append(cls(*args, **kw))
        return made[-1]

    saved = replay_module.KVCacheManager
    replay_module.KVCacheManager = factory
    try:
        summary = replay_module.replay(trace, on_record=records.append, **kwargs)
    finally:
        replay_module.KVCacheManager = saved
    return records, summary, made[0]


# Small versions of every generated workload (the full ones take seconds each).
SMALL = {
    "shared_system_prompt": dict(num_requests=250),
    "multi_turn": dict(num_conversations=40),
    "few_shot": dict(num_questions=15),
    "mm_salt": dict(num_requests=150),
    "rag": dict(num_requests=200),
    "tenant_prefixes": dict(num_requests=120, num_tenants=6, prefix_len=200),
    "agentic": dict(num_sessions=2, mean_steps=8, system_tokens=300, tool_tokens=600,
                    compact_at=8000, summary_tokens=500),
}


def test_small_covers_every_workload():
    assert set(SMALL) == set(workloads.WORKLOADS)


def _blocks_needed(trace, bs):
    return sum(-(-(len(t.prompt) + max(t.output_len, 1)) // bs) for t in trace)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_unbounded_cache_hits_equal_the_chain(name):
    trace = workloads.generate(name, **SMALL[name])
    kw = dict(num_blocks=_blocks_needed(trace, 16), block_size=16, concurrency=4)
    hash_recs, hash_sum, _ = replay_with("hash", trace, **kw)
    radix_recs, radix_sum, _ = replay_with("radix", trace, **kw)
    assert hash_sum["evictions"] == radix_sum["evictions"] == 0
    assert [r["num_computed_tokens"] for r in radix_recs] == [
        r["num_computed_tokens"] for r in hash_recs
    ]
    assert radix_sum["hit_tokens"] == hash_sum["hit_tokens"] > 0


def _mooncake_ideal(path, n, bs=512):
    """Hit tokens with an infinite cache from the trace's hash_ids alone: a request hits
    the longest run of its full prompt blocks whose prefixes an earlier request held as
    full blocks (at most num_tokens - 1 tokens; a block that only fills with a
    request's own output tokens is unique to it)."""
    seen, total = set(), 0
    with open(path) as f:
        for line in itertools.islice(f, n):
            obj = json.loads(line)
            hids, n_in = obj["hash_ids"], obj["input_length"]
            max_blocks = (n_in - 1) // bs
            k = 0
            while k < max_blocks and tuple(hids[: k + 1]) in seen:
                k += 1
            total += k * bs
            seen.update(tuple(hids[: j + 1]) for j in range(n_in // bs))
    return total


@pytest.mark.parametrize("trace_name", ["conversation_trace", "synthetic_trace"])
def test_mooncake_unbounded_hits_equal_the_chain_and_the_ideal(trace_name, local_datasets):
    from prefixcache.sim import datasets

    path = datasets.path_of("mooncake_" + trace_name.removesuffix("_trace"), download=False)
    n = 120
    trace = list(itertools.islice(read_trace(path), n))
    kw = dict(num_blocks=_blocks_needed(trace, 512), block_size=512, hash_algo="xxhash",
              hash_seed=0)
    hash_recs, hash_sum, _ = replay_with("hash", trace, **kw)
    radix_recs, radix_sum, _ = replay_with("radix", trace, **kw)
    assert hash_sum["evictions"] == radix_sum["evictions"] == 0
    assert [r["num_computed_tokens"] for r in radix_recs] == [
        r["num_computed_tokens"] for r in hash_recs
    ]
    assert radix_sum["hit_tokens"] == _mooncake_ideal(path, n) > 0


# ------------------------------------------------------------------- under pressure
def _chain_stranded(m: KVCacheManager, parent_of: dict) -> int:
    """Blocks cached in the chain whose chain of parents has a hole (unreachable)."""
    cached = m.block_pool.cached_block_hash_to_block
    n = 0
    for h, entry in cached.items():
        p = parent_of[h]
        while p is not None and p in cached:
            p = parent_of[p]
        if p is not None:
            n += len(entry) if type(entry) is dict else 1
    return n


def test_chain_stranded_count():
    # The count the chain is measured with: drop block 0's digest from the hash map (as
    # an interior eviction would) and blocks 1 and 2 become unreachable.
    m = KVCacheManager(8, 2)
    req = Request("a", [1, 2, 3, 4, 5, 6, 7])
    admit(m, req)
    m.free(req)
    hs = req.block_hashes
    parent_of = dict(zip(hs, [None, *hs[:-1]]))
    assert _chain_stranded(m, parent_of) == 0
    m.block_pool._evict(m.block_pool.blocks[0])
    assert _chain_stranded(m, parent_of) == 2


@pytest.mark.parametrize("eviction", _POLICIES)
def test_tree_never_strands_under_pressure(eviction):
    # Every workload at a quarter of what it would need: many evictions; after every
    # request the tree has no stranded block and its invariants hold.
    for name in ("multi_turn", "rag"):
        trace = workloads.generate(name, **SMALL[name])[:120]
        m = RadixKVCacheManager(256, 16, eviction=eviction)
        for i, t in enumerate(trace):
            req = Request(t.id, t.prompt, cache_salt=t.cache_salt)
            m.on_arrival(req, i)
            if admit(m, req)[1] is None:
                continue
            for step in range(min(t.output_len, 20)):
                req.append_output_token_ids(1 + step)
                if m.allocate_slots(req, 1) is None:
                    break
                req.num_computed_tokens += 1
            m.free(req)
            assert m.num_stranded_blocks() == 0
        m.check_invariants()
        assert m.num_evictions > 0


def test_chain_strands_where_the_tree_cannot():
    """Under pressure some policy evicts an interior chain block and strands the blocks
    after it; the tree, evicting leaves only, never does. (LRU with vLLM's free order
    evicts a request's last block first and strands nothing on these workloads.)"""
    policies = [p for p in _POLICIES if p != "lru"]
    assert policies  # fifo, lfu, slru, priority, length, cost
    stranded = {}
    for eviction in policies:
        for name in ("multi_turn", "rag"):
            trace = workloads.generate(name, **SMALL[name])
            counts = {}
            for index in ("hash", "radix"):
                cls = KVCacheManager if index == "hash" else RadixKVCacheManager
                m = cls(256, 16, eviction=eviction)
                parent_of, worst = {}, 0
                for t in trace:
                    req = Request(t.id, t.prompt, cache_salt=t.cache_salt)
                    if admit(m, req)[1] is not None:
                        m.free(req)
                    hs = req.block_hashes
                    parent_of.update(zip(hs, [None, *hs[:-1]]))
                    now = m.num_stranded_blocks()
                    if index == "hash":  # the manager's own count = this test's walk
                        assert now == _chain_stranded(m, parent_of)
                    worst = max(worst, now)
                counts[index] = worst
            assert counts["radix"] == 0
            stranded[(eviction, name)] = counts["hash"]
    assert any(stranded.values()), stranded


def test_inlined_policy_stamps_equal_the_calls():
    # The manager inlines KeyedPolicy's on_release / on_cached; forcing the calls must
    # give the same stamps, victims and block tables.
    trace = workloads.generate("multi_turn", **SMALL["multi_turn"])[:80]
    runs = []
    for inline in (True, False):
        m = RadixKVCacheManager(128, 16)
        impl = m.implementation
        assert impl._stamp_release and impl._stamp_cached  # lru keeps the base's
        impl._stamp_release = impl._stamp_cached = inline
        tables = []
        for t in trace:
            req = Request(t.id, t.prompt)
            tables.append(admit(m, req)[1] and m.get_block_ids(t.id))
            if tables[-1]:
                m.free(req)
        runs.append((tables, m.policy.clock, list(m.policy.released_at),
                     list(m.policy.cached_at), m.num_evictions))
    assert runs[0] == runs[1] and runs[0][4] > 0


def test_adoption_checks_a_changed_hit_list_and_caching_off():
    m = RadixKVCacheManager(8, 2)
    a = Request("a", [1, 2, 3, 4, 5])
    admit(m, a)
    b = Request("b", [1, 2, 3, 4, 6])
    blocks, hit = m.get_computed_blocks(b)
    assert ids(blocks) == [0, 1]
    blocks[0], blocks[1] = blocks[1], blocks[0]  # in place: no longer b's prefix
    with pytest.raises(ValueError, match="not the cached block #0"):
        m.allocate_slots(b, 1, 4, blocks)
    m.check_invariants()
    off = RadixKVCacheManager(4, 2, enable_caching=False)
    c = Request("c", [1, 2, 3, 4, 5])
    assert admit(off, c) == ([], off.get_blocks("c"))
    off.free(c)
    assert admit(off, Request("d", [1, 2, 3, 4, 5]))[0] == [] and off.cached_block_ids() == []
    off.check_invariants()


@pytest.mark.parametrize("bad", [
    dict(num_new_tokens=np.float64(10.0)),
    dict(num_new_tokens=True),
    dict(num_new_tokens=-1),
    dict(num_new_tokens=4, num_new_computed_tokens=4),  # hit tokens without hit blocks
])
def test_bad_calls_raise_the_same_errors_on_both_indexes_and_change_nothing(bad):
    # Both indexes share one set of admission checks (kv_cache_manager._admission_checks).
    errors = []
    for index in ("hash", "radix"):
        m = KVCacheManager(16, 4, index=index)
        warm = Request("warm", list(range(1, 14)))
        admit(m, warm)
        m.free(warm)
        before = (m.free_block_ids(), m.cached_block_ids(), m.counters())
        req = Request("r", list(range(1, 14)))
        with pytest.raises((TypeError, ValueError)) as e:
            m.allocate_slots(req, **bad)
        errors.append((type(e.value), str(e.value)))
        assert (m.free_block_ids(), m.cached_block_ids(), m.counters()) == before
        m.check_invariants()
        # ... and a running request's decode step with a float count takes the slow path.
        admit(m, req)
        req.num_computed_tokens = req.num_tokens
        with pytest.raises((TypeError, ValueError)):
            m.allocate_slots(req, np.float64(1.0))
        m.check_invariants()
    assert errors[0] == errors[1]
