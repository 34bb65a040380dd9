"""``queue_aware`` on the radix index's multi-group manager (``core/radix_hybrid.py``):
per group, the blocks a waiting request's hit would use are evicted last (full
attention: every prompt block; a sliding window: only the blocks inside the window at
the aligned hit), bad hashes raise and change nothing, admission drops the interest,
the leak and hash-index checks fire on a corrupted state, the keys equal the hash
index's on a cache that never evicts (and the index-free walk's under evictions), random
operations keep the invariants and the protection order, and the replay's look-ahead
turns the protection into hits.
"""

from __future__ import annotations

import random

import pytest

from prefixcache import KVCacheManager, Request
from prefixcache._validate import ArgumentTypeError
from prefixcache.core.block_pool import InvariantError
from prefixcache.core.indexes import COMBINATION_RULES, refusal
from prefixcache.core.kv_groups import parse_kv_groups
from prefixcache.core.radix import _tree_edges
from prefixcache.core.radix_hybrid import RadixHybridKVCacheManager
from prefixcache.sim import workloads
from prefixcache.sim.replay import replay

BS = 2


def _manager(layout, num_blocks=40, eviction="queue_aware", index="radix"):
    return KVCacheManager(num_blocks, BS, index=index, eviction=eviction,
                          kv_cache_groups=parse_kv_groups(layout), free_order="unhashed_first")


def _admit(m, rid, prompt):
    req = Request(rid, prompt)
    blocks, hit = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    m.check_invariants()
    return req, hit


def _prompt_hashes(m, req):
    req.bind_hasher(m.hasher, BS)
    return req.block_hashes[: (req.num_tokens - 1) // BS]


def _cached(m, bid):
    """(group, hash) of cached block ``bid``."""
    return m.implementation._owner_group[bid], m.blocks[bid].block_hash


@pytest.mark.parametrize("layout,full,sw", [("full,sw3", 0, 1), ("sw3,full", 1, 0)])
def test_waiting_request_keeps_its_full_blocks_and_only_its_window(layout, full, sw):
    # 11 tokens: 5 full blocks per group enter the tree; after the free the
    # candidates are the leaf's full block and every sliding-window block.
    prompt = list(range(1, 12))
    w = Request("w", prompt + [99])  # can hit 10 tokens (5 blocks): (12 - 1) // 2

    def run(eviction):
        m = _manager(layout, 14, eviction=eviction)
        assert isinstance(m.implementation, RadixHybridKVCacheManager)
        req, _ = _admit(m, "a", prompt)
        m.free(req)
        m.check_invariants()
        hashes = _prompt_hashes(m, w)
        m.on_waiting("w", hashes)
        m.check_invariants()
        return m, hashes

    m, hashes = run("queue_aware")
    keys = m.waiting_keys(hashes)
    # full: all 5 prompt blocks; sw3 at hit 10: skipped (10 - 3 + 1) // 2 = 4 -> block 4.
    assert sorted(keys) == sorted([(h, full) for h in hashes] + [(hashes[4], sw)])
    p = m.policy
    order = p.candidate_ids()
    wanted = [b for b in order if p.key(p._block_objs[b])[0] == 1]
    # (only the leaf's full block is a candidate: full KV is evicted leaf by leaf)
    assert sorted(_cached(m, b) for b in wanted) == sorted([(full, hashes[4]), (sw, hashes[4])])
    assert order[-len(wanted):] == wanted  # evicted last
    sw_unwanted = [b for b in order if m.implementation._owner_group[b] == sw and b not in wanted]
    assert sorted(m.blocks[b].block_hash for b in sw_unwanted) == sorted(hashes[:4])
    # Pressure: an unrelated request needs 8 blocks, 4 are free unhashed -> 4 evictions,
    # all of them sliding-window blocks outside w's window: w's hit survives.
    x, _ = _admit(m, "x", [50, 51, 52, 53, 54, 55, 56])
    assert m.num_evictions == 4
    assert m.peek_computed_tokens(w) == 10
    m.free(x)
    # LRU (same calls) evicts w's in-window block and its leaf first: the hit shrinks.
    lru, _ = run("lru")
    y, _ = _admit(lru, "x", [50, 51, 52, 53, 54, 55, 56])
    assert lru.num_evictions == 4 and lru.peek_computed_tokens(w) < 10
    # Admission drops the interest; the hit is unchanged.
    blocks, hit = m.get_computed_blocks(w)
    assert hit == 10
    assert m.allocate_slots(w, w.num_tokens - hit, hit, blocks) is not None
    assert p.waiting_ids() == [] and p.wanted == {}
    m.check_invariants()


def test_bad_hashes_raise_and_change_nothing():
    m = _manager("full,sw3")
    req, _ = _admit(m, "a", list(range(1, 10)))
    m.free(req)
    p = m.policy
    w = Request("w", list(range(1, 10)) + [7])
    hashes = _prompt_hashes(m, w)
    before = [p.key(p._block_objs[b]) for b in p.candidate_ids()]
    for bad in (b"abc", "abc", ["nope"], [hashes[0], 3], [bytearray(hashes[0])]):
        with pytest.raises(ArgumentTypeError, match="bytes"):
            m.on_waiting("w", bad)
        with pytest.raises(ArgumentTypeError, match="bytes"):
            m.waiting_keys(bad)
        assert p.waiting_ids() == [] and p.wanted == {}
        assert [p.key(p._block_objs[b]) for b in p.candidate_ids()] == before
        m.check_invariants()
    m.on_waiting("w", hashes)
    wanted = dict(p.wanted)
    with pytest.raises(ValueError, match="already waiting"):
        m.on_waiting("w", hashes)
    assert p.wanted == wanted and p.waiting_ids() == ["w"]
    m.drop_waiting("w")
    m.drop_waiting("w")  # not waiting: a no-op
    assert p.wanted == {} and p.waiting_ids() == []
    assert m.waiting_keys([]) == []
    m.check_invariants()


def test_leak_and_a_stale_hash_index_are_caught():
    m = _manager("full,sw3", 20)
    _admit(m, "a", [1, 2, 3, 4, 5])
    m.policy.on_waiting("a", [])  # a running request still waiting: a leak
    with pytest.raises(InvariantError, match="a leak"):
        m.check_invariants()
    m.policy.drop_waiting("a")
    m.check_invariants()
    h, node = next(iter(m.implementation._node_by_hash.items()))
    del m.implementation._node_by_hash[h]  # a node the index lost
    with pytest.raises(InvariantError, match="hash index"):
        m.check_invariants()


def test_no_waiting_policy_keeps_no_index():
    m = _manager("full,sw3", 20, eviction="lru")
    assert m.implementation._waiting_policy is None and m.implementation._node_by_hash is None
    req, _ = _admit(m, "a", [1, 2, 3, 4, 5])
    m.on_waiting("w", [b"x" * 32])  # no policy reads it: nothing is done
    m.drop_waiting("w")
    m.free(req)
    m.check_invariants()


def _random_prompts(rng, n=30):
    stems = [[rng.randrange(1, 20) for _ in range(rng.randrange(2, 12))] for _ in range(4)]
    return [list(rng.choice(stems)) + [rng.randrange(20, 30) for _ in range(rng.randrange(1, 6))]
            for _ in range(n)]


@pytest.mark.parametrize("layout", ["full,sw3", "sw4,full", "sw3", "full,sw5,sw3"])
def test_waiting_keys_equal_the_hash_index_on_a_cache_that_never_evicts(layout):
    rng = random.Random(f"qarg-keys-{layout}")
    prompts = _random_prompts(rng)
    ms = [_manager(layout, 400, index=i) for i in ("hash", "radix")]
    for i, prompt in enumerate(prompts):
        probe = Request(f"p{i}", prompt)
        keys = [m.waiting_keys(_prompt_hashes(m, probe)) for m in ms]
        assert keys[0] == keys[1], i
        for m in ms:
            req, _ = _admit(m, f"r{i}", prompt)
            for t in range(rng.randrange(0, 4)):  # decode: windows release blocks
                req.append_output_token_ids(40 + t)
                assert m.allocate_slots(req, 1) is not None
                req.num_computed_tokens += 1
            if rng.random() < 0.7:
                m.free(req)
            m.check_invariants()
    assert ms[1].num_evictions == 0


@pytest.mark.parametrize("layout", ["sw3", "full,sw3", "sw4,full"])
def test_index_free_walk_agrees_with_the_hash_index_under_evictions(layout):
    # Nothing waits, so queue_aware orders victims as LRU does: the two trees stay
    # equal, one answering waiting_keys from its hash index, the other (no waiting
    # policy) from a walk over the present blocks -- tombstones included.
    rng = random.Random(f"qarg-walk-{layout}")
    prompts = _random_prompts(rng, 40)
    ms = [_manager(layout, 20, eviction=e) for e in ("queue_aware", "lru")]
    assert ms[0].implementation._node_by_hash is not None and ms[1].implementation._node_by_hash is None
    running = []
    seen_tombstone = False
    for i, prompt in enumerate(prompts):
        probe = Request(f"p{i}", prompt)
        assert ms[0].waiting_keys(_prompt_hashes(ms[0], probe)) == ms[1].waiting_keys(
            _prompt_hashes(ms[1], probe)), i
        got = []
        for m in ms:
            req = Request(f"r{i}", prompt)
            blocks, hit = m.get_computed_blocks(req)
            if m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None:
                req.num_computed_tokens = req.num_tokens
                got.append(req)
            m.check_invariants()
        assert len(got) in (0, 2) and ms[0].cached_block_ids() == ms[1].cached_block_ids()
        if got:
            running.append(got)
        while running and (len(running) > 2 or not got):  # make room / bound the batch
            for m, req in zip(ms, running.pop(0)):
                m.free(req)
                m.check_invariants()
        seen_tombstone |= any(None in n.blocks for _, n in _tree_edges(ms[1].implementation._roots, "blocks"))
    assert ms[1].num_evictions > 0 and seen_tombstone


@pytest.mark.parametrize("layout", ["full,sw3", "sw4,full"])
def test_random_operations_keep_invariants(layout):
    rng = random.Random(f"qarg-{layout}")
    m = _manager(layout, 30)
    p = m.policy
    prefixes = [[rng.randrange(20) for _ in range(rng.randrange(2, 9))] for _ in range(5)]
    waiting: dict[str, Request] = {}
    live = []
    seen_protected = 0
    sw = [g for g, w in enumerate(m.implementation._windows) if w is not None]
    for i in range(200):
        op = rng.random()
        if op < 0.35:  # a request joins the queue
            prompt = rng.choice(prefixes) + [rng.randrange(20) for _ in range(rng.randrange(1, 5))]
            req = Request(f"r{i}", prompt)
            m.on_waiting(req.request_id, _prompt_hashes(m, req))
            waiting[req.request_id] = req
        elif op < 0.65 and waiting:  # the oldest waiting request is admitted (or not)
            req = waiting.pop(next(iter(waiting)))
            blocks, hit = m.get_computed_blocks(req)
            if m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None:
                req.num_computed_tokens = req.num_tokens
                live.append(req)
            else:
                m.drop_waiting(req.request_id)
        elif op < 0.72 and waiting:  # a waiting request is aborted
            m.drop_waiting(waiting.pop(rng.choice(list(waiting))).request_id)
        elif op < 0.8 and live:  # a decode step (a window releases blocks)
            req = rng.choice(live)
            req.append_output_token_ids(rng.randrange(20))
            if m.allocate_slots(req, 1) is not None:
                req.num_computed_tokens += 1
        elif live:
            m.free(live.pop(rng.randrange(len(live))))
        m.check_invariants()
        assert p.waiting_ids() == list(waiting)
        order = [p.key(p._block_objs[b])[0] for b in p.candidate_ids()]
        assert order == sorted(order), order  # wanted candidates go last
        seen_protected += any(order)
        # Sliding-window keys are bounded by the window at the hit (<= 2 blocks here).
        for hashes in p._waiting.values():
            assert sum(1 for k in hashes if k[1] in sw) <= 2
    assert m.num_evictions > 0 and seen_protected > 0
    for req in live:
        m.free(req)
    for rid in list(waiting):
        m.drop_waiting(rid)
    assert p.wanted == {}  # no interest left behind
    m.check_invariants()


def test_rule_serves_radix_layouts_and_refuses_an_index_without_waiting_hooks():
    groups = parse_kv_groups("full,sw3")
    assert refusal("radix", groups, "queue_aware", 0) is None
    assert refusal("hash", groups, "queue_aware", 0) is None

    class Layout(RadixHybridKVCacheManager):  # a plug-in's layout without the hooks
        on_waiting = drop_waiting = waiting_keys = None

    class MyIndex:
        INDEX_NAME = "mine"
        LAYOUT_CLASS = Layout
        LAYOUT_KINDS = ("full_attention", "sliding_window")

        def find_longest_cache_hit(self, request): ...
        def allocate_slots(self, request, n): ...
        def free(self, request): ...
        def check_invariants(self): ...

    why = refusal(MyIndex, groups, "queue_aware", 0)
    assert why is not None and COMBINATION_RULES[("layout index", "waiting")] in why
    with pytest.raises(ValueError) as e:
        KVCacheManager(20, BS, index=MyIndex, eviction="queue_aware", kv_cache_groups=groups)
    assert str(e.value) == why
    assert refusal(MyIndex, groups, "lru", 0) is None


def test_replay_look_ahead_gives_hits_on_the_radix_tree():
    trace = workloads.generate("multi_turn", seed=0, num_conversations=40)
    kw = dict(kv_cache_groups=parse_kv_groups("full,sw32"), num_blocks=300, block_size=16,
              concurrency=4)
    hits = {(i, e): replay(trace, index=i, eviction=e, **kw)["hit_tokens"]
            for i in ("radix", "hash") for e in ("lru", "queue_aware")}
    assert hits[("radix", "queue_aware")] > hits[("radix", "lru")] > 0
    # (the two indexes order victims differently; the protection helps both alike)
    assert hits[("radix", "queue_aware")] >= 0.9 * hits[("hash", "queue_aware")]

