"""KVCacheManager + BlockPool: the seed's worked examples, isolation, failure atomicity,
free orders, events, stats, bad input. Exact block ids and queue orders throughout."""

from __future__ import annotations

import pytest

from prefixcache import BlockHasher, KVCacheManager, LoRARequest, MultiModalFeature, Request
from prefixcache.core import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    InvariantError,
    KVCacheBlock,
    PrefixCacheStats,
)


# ----------------------------------------------------------------------------- helpers
def admit(m: KVCacheManager, req: Request):
    """Prefix lookup + allocation of the whole prompt (the scheduler's WAITING path)."""
    blocks, hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return hit, new


def decode(m: KVCacheManager, req: Request, token: int):
    """One decode step: slots for the last token, then append the sampled one."""
    new = m.allocate_slots(req, 1)
    assert new is not None
    req.num_computed_tokens = req.num_computed_tokens + 1
    req.append_output_token_ids(token)
    return new


def snapshot(m: KVCacheManager):
    """Everything a failed call must leave untouched."""
    pool = m.block_pool
    return (
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        m.free_block_ids(),
        {
            h: (v.block_id if isinstance(v, KVCacheBlock) else list(v))
            for h, v in pool.cached_block_hash_to_block.items()
        },
        {rid: m.get_block_ids(rid) for rid in m.running_request_ids},
        m.counters()["evictions"],
    )


def ids(blocks):
    return [b.block_id for b in blocks]


# ------------------------------------------------------------- seed: times 1 to 6
def test_seed_worked_example_times_1_to_6():
    m = KVCacheManager(10, 4)
    # Time 1: empty cache, request 0 with 15 prompt tokens: 4 blocks, 3 full + cached.
    r0 = Request("r0", list(range(1, 16)))
    hit, new = admit(m, r0)
    assert hit == 0 and ids(new) == [0, 1, 2, 3]
    assert m.cached_block_ids() == [0, 1, 2]
    r0.append_output_token_ids(100)  # prefill samples token 16 -> block 3 holds 4 tokens
    # Time 2: the step that computes token 16 fills block 3 (cached); the next one
    # needs a new block: 4.
    assert ids(decode(m, r0, 101)) == []
    assert m.cached_block_ids() == [0, 1, 2, 3]
    assert ids(decode(m, r0, 102)) == [4]
    assert m.get_block_ids("r0") == [0, 1, 2, 3, 4]
    # Time 3: request 1, 14 prompt tokens, the first 10 equal to request 0's: only the
    # first 2 blocks (8 tokens) hit -- the third matches 2 of its 4 tokens.
    r1 = Request("r1", list(range(1, 11)) + [200, 201, 202, 203])
    hit, new = admit(m, r1)
    assert hit == 8 and ids(new) == [5, 6]
    assert m.get_block_ids("r1") == [0, 1, 5, 6]
    # Time 4: request 0 finishes; blocks 4, 3, 2 join the queue in reverse order (0, 1
    # are still used by request 1). Queue: 7 8 9 4 3 2.
    m.free(r0)
    assert m.free_block_ids() == [7, 8, 9, 4, 3, 2]
    assert m.cached_block_ids() == [0, 1, 2, 3, 5]  # block 5 filled by r1's prefill
    # Time 5: request 1 finishes. Queue: 7 8 9 4 3 2 6 5 1 0.
    m.free(r1)
    assert m.free_block_ids() == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    # Time 6: request 2, 29 prompt tokens, the first 12 equal to request 0's: hits
    # 0, 1, 2 (touched out of the queue -> 7 8 9 4 3 6 5), then 5 new blocks from the
    # head: 7, 8, 9, 4, and 3 -- which was cached and is evicted.
    r2 = Request("r2", list(range(1, 13)) + list(range(300, 317)))
    hit, new = admit(m, r2)
    assert hit == 12
    assert ids(new) == [7, 8, 9, 4, 3]
    assert m.get_block_ids("r2") == [0, 1, 2, 7, 8, 9, 4, 3]
    assert m.num_evictions == 1  # block 3 lost its hash
    assert m.free_block_ids() == [6, 5]
    m.check_invariants()


def test_seed_duplicate_block_example():
    A, B, C, D, E, F, G, H, I = range(1, 10)
    m = KVCacheManager(10, 4)
    r1 = Request("req1", [A, B, C, D, E, F])
    hit, new = admit(m, r1)
    assert hit == 0 and ids(new) == [0, 1]
    r1.append_output_token_ids(G)  # time 0: [0 (ABCD), 1 (EFG)], cached 0
    assert m.cached_block_ids() == [0]
    decode(m, r1, H)
    decode(m, r1, I)  # time 1: computing H fills block 1 -> cached 0, 1
    assert m.cached_block_ids() == [0, 1]
    decode(m, r1, 10)  # time 2: [0, 1, 2 (I)]
    assert m.get_block_ids("req1") == [0, 1, 2]
    # Request 2: the same prompt and (greedy) the same output.
    r2 = Request("req2", [A, B, C, D, E, F])
    hit, new = admit(m, r2)
    assert hit == 4 and ids(new) == [3]
    assert m.get_block_ids("req2") == [0, 3]
    r2.append_output_token_ids(G)
    decode(m, r2, H)
    decode(m, r2, I)  # block 3 (EFGH) is full: cached again, a duplicate of block 1
    assert m.get_block_ids("req2") == [0, 3]  # append-only: not rewritten to [0, 1]
    assert m.cached_block_ids() == [0, 1, 3]
    key = r1.block_hashes[1]
    assert r2.block_hashes[1] == key
    both = m.block_pool.cached_block_hash_to_block[key]
    assert isinstance(both, dict) and sorted(both) == [1, 3]
    m.check_invariants()
    m.free(r1)
    m.free(r2)
    m.check_invariants()
    # A lookup still hits through one of the duplicates (the first cached: block 1).
    r3 = Request("req3", [A, B, C, D, E, F, G, H, 77])
    blocks, hit = m.get_computed_blocks(r3)
    assert hit == 8 and ids(blocks) == [0, 1]
    assert ids(m.allocate_slots(r3, 1, 8, blocks)) == [4]
    m.check_invariants()
    m.free(r3)
    # Evicting one duplicate keeps the other findable.
    pool = m.block_pool
    pool._evict(pool.blocks[1])
    assert m.block_pool.get_cached_block(key).block_id == 3
    m.check_invariants()


IMG_PROMPT = [1, 3, 7493, 1681, 1294, 1593, 3937, 9551] + [0] * 41 + [4]  # 50 tokens


def test_seed_image_example():
    hasher = BlockHasher("sha256")
    m = KVCacheManager(32, 16)
    img = MultiModalFeature("image-hash-a", 8, 41)
    r = Request("img", IMG_PROMPT, mm_features=[img])
    hit, _ = admit(m, r)
    assert hit == 0
    # Every block overlapping the image carries ("mm", identifier, offset - start).
    hs = r.block_hashes
    assert len(hs) == 3  # the fourth block (tokens 48..49) is not full yet
    parent = None
    for i in range(3):
        expect = hasher.hash_block(
            parent, IMG_PROMPT[16 * i : 16 * i + 16], (("mm", "image-hash-a", 8 - 16 * i),)
        )
        assert hs[i] == expect
        parent = expect
    assert m.cached_block_ids() == [0, 1, 2]
    # The fourth block carries the key once it fills (decode 14 more tokens).
    r.append_output_token_ids(500)
    for t in range(501, 515):
        decode(m, r, t)
    tokens = list(r.all_token_ids)
    assert r.block_hashes[3] == hasher.hash_block(
        parent, tokens[48:64], (("mm", "image-hash-a", 8 - 48),)
    )
    assert m.cached_block_ids() == [0, 1, 2, 3]
    m.free(r)
    # Another image, the same image at another offset, or another salt: no hit.
    misses = [
        Request("other-img", IMG_PROMPT, mm_features=[MultiModalFeature("image-hash-b", 8, 41)]),
        Request("other-off", IMG_PROMPT, mm_features=[MultiModalFeature("image-hash-a", 9, 40)]),
        Request("salted", IMG_PROMPT, mm_features=[img], cache_salt="tenant-1"),
        Request("no-image", IMG_PROMPT),
    ]
    for q in misses:
        assert m.get_computed_blocks(q) == ([], 0), q.request_id
    same = Request("same", IMG_PROMPT, mm_features=[MultiModalFeature("image-hash-a", 8, 41)])
    blocks, hit = m.get_computed_blocks(same)
    assert hit == 48 and ids(blocks) == [0, 1, 2]


def test_salt_only_in_first_block_and_isolates():
    hasher = BlockHasher("sha256")
    prompt = list(range(1, 41))  # 40 tokens: 2 full blocks of 16
    m = KVCacheManager(16, 16)
    a = Request("a", prompt, cache_salt="s1")
    admit(m, a)
    h0 = hasher.hash_block(None, prompt[:16], (("cache_salt", "s1"),))
    assert a.block_hashes[0] == h0
    assert a.block_hashes[1] == hasher.hash_block(h0, prompt[16:32], None)  # no salt key
    for rid, salt in [("b", "s2"), ("c", None)]:
        assert m.get_computed_blocks(Request(rid, prompt, cache_salt=salt))[1] == 0
    blocks, hit = m.get_computed_blocks(Request("d", prompt, cache_salt="s1"))
    assert hit == 32 and ids(blocks) == ids(m.get_blocks("a")[:2])


def test_lora_isolates_and_keys_every_block():
    hasher = BlockHasher("sha256")
    prompt = list(range(1, 41))
    lora = LoRARequest("adapter-a", "/adapters/a")
    m = KVCacheManager(16, 16)
    a = Request("a", prompt, lora=lora)
    admit(m, a)
    key = (("lora", "adapter-a", "/adapters/a"),)
    h0 = hasher.hash_block(None, prompt[:16], key)
    assert a.block_hashes[:2] == [h0, hasher.hash_block(h0, prompt[16:32], key)]
    for rid, other in [
        ("b", LoRARequest("adapter-b", "/adapters/a")),
        ("c", LoRARequest("adapter-a", "/adapters/other")),
        ("d", None),
    ]:
        assert m.get_computed_blocks(Request(rid, prompt, lora=other))[1] == 0
    assert m.get_computed_blocks(Request("e", prompt, lora=LoRARequest("adapter-a", "/adapters/a")))[1] == 32


def test_full_prompt_hit_recomputes_last_token():
    m = KVCacheManager(16, 16)
    prompt = list(range(100, 148))  # 48 tokens = 3 full blocks
    a = Request("a", prompt)
    admit(m, a)
    assert m.cached_block_ids() == [0, 1, 2]
    b = Request("b", prompt)
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 32 and ids(blocks) == [0, 1]  # the third block is recomputed
    new = m.allocate_slots(b, 16, 32, blocks)
    assert ids(new) == [3] and m.get_block_ids("b") == [0, 1, 3]
    # Block 3 is a duplicate of block 2 and is cached under the same key.
    assert sorted(m.block_pool.cached_block_hash_to_block[a.block_hashes[2]]) == [2, 3]
    m.check_invariants()


def test_get_computed_blocks_changes_no_block_state():
    m = KVCacheManager(8, 4)
    a = Request("a", list(range(1, 13)))
    admit(m, a)
    m.free(a)
    before = snapshot(m)
    blocks, hit = m.get_computed_blocks(Request("b", list(range(1, 13))))
    assert hit == 8 and ids(blocks) == [0, 1]
    assert snapshot(m) == before


def test_allocation_failure_changes_nothing():
    m = KVCacheManager(6, 4)
    a = Request("a", list(range(1, 13)))  # 3 blocks, cached
    admit(m, a)
    m.free(a)
    hold = Request("hold", [900, 901, 902, 903, 904])  # 2 blocks held
    admit(m, hold)
    assert m.free_block_ids() == [5, 2, 1, 0]
    # b hits blocks 0, 1, both in the free queue: touching them takes 2 of the 4 free
    # blocks, and b needs 3 new ones -> 5 > 4, does not fit.
    b = Request("b", list(range(1, 9)) + list(range(50, 62)))  # 20 tokens, 5 blocks
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 8 and ids(blocks) == [0, 1]
    before = snapshot(m)
    assert m.allocate_slots(b, 12, 8, blocks) is None
    assert snapshot(m) == before
    assert m.counters()["failed_allocations"] == 1
    # A running request whose decode does not fit changes nothing either.
    c = Request("c", list(range(70, 78)))  # 2 blocks: 5 and (evicting) 2
    admit(m, c)
    c.append_output_token_ids(1)
    full = Request("full", list(range(80, 84)) + [1])
    admit(m, full)  # takes the last free blocks
    assert m.num_free_blocks == 0
    before = snapshot(m)
    assert m.allocate_slots(c, 1) is None
    assert snapshot(m) == before
    m.check_invariants()


# ------------------------------------------------------------------ free orders
def _three_and_a_half(m):
    r = Request("r", list(range(1, 15)))  # 14 tokens: 3 full blocks + 2 tokens
    admit(m, r)
    return r


def test_free_order_append_exact():
    m = KVCacheManager(6, 4, free_order="append")
    r = _three_and_a_half(m)
    assert m.get_block_ids("r") == [0, 1, 2, 3] and m.free_block_ids() == [4, 5]
    m.free(r)
    # Every freed block to the tail, last block first: 4 5 | 3 2 1 0.
    assert m.free_block_ids() == [4, 5, 3, 2, 1, 0]


def test_free_order_unhashed_first_exact():
    m = KVCacheManager(6, 4, free_order="unhashed_first")
    r = _three_and_a_half(m)
    m.free(r)
    # Unhashed block 3 to the head (reused first); cached 2 1 0 to the tail.
    assert m.free_block_ids() == [3, 4, 5, 2, 1, 0]
    # Two unhashed blocks keep the reversed order at the head.
    m2 = KVCacheManager(8, 4, free_order="unhashed_first")
    r2 = Request("r2", list(range(1, 7)))  # 6 tokens: block 0 full, block 1 partial
    admit(m2, r2)
    r2.append_output_token_ids(7)
    for t in range(8, 11):
        decode(m2, r2, t)  # tokens 1..10 -> blocks 0, 1 full (cached), block 2 partial
    assert m2.get_block_ids("r2") == [0, 1, 2] and m2.cached_block_ids() == [0, 1]
    m2.free(r2)
    assert m2.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]


def test_shared_block_is_freed_only_by_last_user():
    m = KVCacheManager(8, 4)
    a = Request("a", list(range(1, 10)))
    b = Request("b", list(range(1, 10)))
    admit(m, a)
    hit, _ = admit(m, b)
    assert hit == 8
    assert m.get_block_ids("b") == [0, 1, 3]
    m.free(a)
    assert m.free_block_ids() == [4, 5, 6, 7, 2]  # 0, 1 still used by b
    m.free(b)
    assert m.free_block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    m.check_invariants()


# --------------------------------------------------------------- events / stats
def test_events_content():
    m = KVCacheManager(4, 4, enable_events=True, int_event_hashes=False)
    lora = LoRARequest("lo", "/p")
    r = Request(
        "r", [0, 0, 0, 5, 6, 7, 8, 9, 10], lora=lora, cache_salt="salt",
        mm_features=[MultiModalFeature("img", 1, 5)],
    )
    admit(m, r)
    (ev,) = m.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == list(r.block_hashes[:2])
    assert ev.parent_block_hash is None
    assert ev.token_ids == [0, 0, 0, 5, 6, 7, 8, 9]
    assert ev.block_size == 4 and ev.medium == "GPU" and ev.group_idx == 0
    assert ev.kv_cache_spec_kind == "full_attention"
    assert ev.lora_name == "lo" and ev.lora_id is None  # this LoRARequest has no int id
    # Untagged per-block keys (vLLM's to_event_extra_keys): lora name, (mm id, offset
    # in block) pairs, salt on block 0 only.
    assert ev.extra_keys == [("lo", ("img", 1), "salt"), ("lo", ("img", -3))]
    assert m.take_events() == []
    r.append_output_token_ids(11)
    decode(m, r, 12)
    decode(m, r, 13)
    assert m.take_events() == []
    decode(m, r, 14)  # computing the 12th token fills block 2 -> stored, parent = block 1
    (ev2,) = m.take_events()
    assert ev2.block_hashes == [r.block_hashes[2]]
    assert ev2.parent_block_hash == r.block_hashes[1]
    assert ev2.token_ids == [10, 11, 12, 13]
    assert ev2.extra_keys == [("lo",)]
    m.free(r)
    # Reusing cached blocks evicts them: one BlockRemoved per block, head first.
    q = Request("q", list(range(100, 113)))  # 13 tokens: 4 blocks
    admit(m, q)
    evs = m.take_events()
    removed = [e for e in evs if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [[r.block_hashes[i]] for i in (2, 1, 0)]
    assert all(e.medium == "GPU" and e.group_idx == 0 for e in removed)
    m.free(q)
    m.take_events()
    assert m.reset_prefix_cache() is True
    assert m.take_events() == [AllBlocksCleared()]


# What vLLM 0.33's own KVCacheManager emitted (block size 4, sha256, default seed) for
# the request below: prompt [0,0,0,5,6,7,8,9,10], lora ("lo", "/p"), salt "salt", image
# "img" at [1, 6); outputs 11..14 fed back one by one. Captured with the peer venv.
VLLM_EVENTS = [
    dict(block_hashes=[9959413242104870094, 12108145508639339920], parent_block_hash=None,
         token_ids=[0, 0, 0, 5, 6, 7, 8, 9], block_size=4, medium="GPU", lora_name="lo",
         extra_keys=[["lo", ["img", 1], "salt"], ["lo", ["img", -3]]], group_idx=0,
         kv_cache_spec_kind="full_attention"),
    dict(block_hashes=[6577136746596553227], parent_block_hash=12108145508639339920,
         token_ids=[10, 11, 12, 13], block_size=4, medium="GPU", lora_name="lo",
         extra_keys=[["lo"]], group_idx=0, kv_cache_spec_kind="full_attention"),
]


def test_events_carry_the_lora_int_id():
    m = KVCacheManager(16, 4, enable_events=True)
    a = Request("a", list(range(1, 10)), lora=LoRARequest("lo", "/p", int_id=3))
    admit(m, a)
    (ev,) = m.take_events()
    assert ev.lora_id == 3 and ev.lora_name == "lo"
    # The id is not part of the cache key (vLLM: name and path are).
    b = Request("b", list(range(1, 10)), lora=LoRARequest("lo", "/p", int_id=4))
    assert m.get_computed_blocks(b)[1] == 8
    for bad in (0, -1, True, 1.0, "1"):
        with pytest.raises(ValueError, match="int_id"):
            LoRARequest("lo", "/p", int_id=bad)


def test_events_equal_vllm_events():
    import json

    m = KVCacheManager(16, 4, enable_events=True, hash_seed="vllm-none-hash")
    r = Request(
        "r", [0, 0, 0, 5, 6, 7, 8, 9, 10], lora=LoRARequest("lo", "/p"), cache_salt="salt",
        mm_features=[MultiModalFeature("img", 1, 5)],
    )
    admit(m, r)
    for t in (11, 12, 13, 14):
        r.append_output_token_ids(t)
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens = r.num_computed_tokens + 1
    evs = m.take_events()
    # NOTE: lora_id (vLLM's deprecated integer adapter id, assigned by its frontend) is
    # LoRARequest.int_id: compared in test_events_carry_the_lora_int_id.
    got = [
        json.loads(json.dumps({k: getattr(e, k) for k in VLLM_EVENTS[0]})) for e in evs
    ]
    assert got == VLLM_EVENTS


def test_events_disabled_gives_nothing():
    m = KVCacheManager(4, 4)
    admit(m, Request("r", list(range(1, 10))))
    assert m.take_events() == []


def test_prefix_cache_stats_and_counters():
    m = KVCacheManager(16, 4)
    a = Request("a", list(range(1, 11)))
    admit(m, a)
    admit(m, Request("b", list(range(1, 11))))  # hits 8
    s = m.make_prefix_cache_stats()
    assert isinstance(s, PrefixCacheStats)
    assert (s.requests, s.queries, s.hits, s.reset) == (2, 20, 8, False)
    assert s.hit_rate == pytest.approx(0.4)
    s2 = m.make_prefix_cache_stats()
    assert (s2.requests, s2.queries, s2.hits) == (0, 0, 0)
    c = m.counters()
    assert c["lookups"] == 2 and c["lookup_tokens"] == 20 and c["hit_tokens"] == 8
    assert c["blocks_cached"] == 2  # a's two full blocks; b only hit them
    assert c["blocks_allocated"] == 3 + 1 and c["evictions"] == 0
    assert KVCacheManager(4, 4, log_stats=False).make_prefix_cache_stats() is None


def test_prefix_cache_stats_count_preempted_admissions():
    m = KVCacheManager(16, 4)
    a = Request("a", list(range(1, 11)))
    admit(m, a)  # never preempted: 10 queried, no hit
    m.free(a)
    # The scheduler preempted it (blocks freed, computed tokens reset) and admits it
    # again: the admission counts as preempted, with its hit (8 tokens of its own blocks).
    a.num_computed_tokens = 0
    a.num_preemptions += 1
    assert admit(m, a)[0] == 8
    admit(m, Request("b", list(range(1, 6))))  # a fresh one: 5, hit 4
    s = m.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (2, 15, 4)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 10, 8)


def test_prefix_cache_stats_count_admissions_not_lookups():
    """vLLM 0.33 records at admission: a lookup whose allocation does not fit, retried
    later, counts once; a lookup never followed by an admission not at all."""
    m = KVCacheManager(4, 4)
    a = Request("a", list(range(1, 14)))  # 4 blocks: the whole pool
    admit(m, a)
    b = Request("b", list(range(1, 10)) + [99, 98])  # shares a's first 2 blocks
    for _ in range(3):  # the scheduler retries while a runs: nothing fits
        blocks, hit = m.get_computed_blocks(b)
        assert hit == 8 and m.allocate_slots(b, b.num_tokens - hit, hit, blocks) is None
    s = m.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (1, 13, 0)  # a only
    m.free(a)
    assert admit(m, b)[1] is not None
    m.get_computed_blocks(Request("c", [5, 6, 7, 8, 9]))  # looked up, never admitted
    s = m.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (1, 11, 8)  # b, once
    assert m.counters()["lookups"] == 1 + 3 + 1 + 1  # counters count every lookup
    # Caching off: nothing is looked up, nothing recorded.
    off = KVCacheManager(4, 4, enable_caching=False)
    admit(off, Request("d", [1, 2, 3]))
    assert off.make_prefix_cache_stats().requests == 0


def test_reset_prefix_cache():
    m = KVCacheManager(8, 4)
    a = Request("a", list(range(1, 10)))
    admit(m, a)
    before = snapshot(m)
    assert m.reset_prefix_cache() is False  # a still holds blocks
    assert snapshot(m) == before
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.cached_block_ids() == []
    assert m.get_computed_blocks(Request("b", list(range(1, 10)))) == ([], 0)
    assert m.make_prefix_cache_stats().reset is True
    m.check_invariants()


def test_caching_disabled():
    m = KVCacheManager(8, 4, enable_caching=False)
    a = Request("a", list(range(1, 10)))
    admit(m, a)
    m.free(a)
    assert m.get_computed_blocks(Request("b", list(range(1, 10)))) == ([], 0)
    assert m.cached_block_ids() == []
    m.check_invariants()


def test_usage_and_lookahead():
    m = KVCacheManager(10, 4)
    r = Request("r", list(range(1, 6)))
    blocks, hit = m.get_computed_blocks(r)
    new = m.allocate_slots(r, 5, 0, blocks, num_lookahead_tokens=4)
    assert ids(new) == [0, 1, 2]  # 5 + 4 slots
    assert m.usage == pytest.approx(0.3)
    r.num_computed_tokens = 5
    r.append_output_token_ids(6)
    # A running step with lookahead: 5 computed + 1 new + 7 lookahead = 13 slots -> 4 blocks.
    assert ids(m.allocate_slots(r, 1, num_lookahead_tokens=7)) == [3]
    assert ids(m.allocate_slots(r, 1)) == []  # the slots are there already
    assert m.usage == pytest.approx(0.4)
    m.check_invariants()
    m.free(r)
    assert m.usage == 0.0


def test_check_invariants_catches_corruption():
    m = KVCacheManager(6, 4)
    r = Request("r", list(range(1, 10)))
    admit(m, r)
    m.block_pool.blocks[1].ref_cnt += 1
    with pytest.raises(InvariantError, match="block 1 has ref_cnt 2 but 1 requests"):
        m.check_invariants()
    m.block_pool.blocks[1].ref_cnt -= 1
    m.check_invariants()
    h = m.block_pool.blocks[0].block_hash
    m.block_pool.blocks[0].block_hash = b"x" * 32
    with pytest.raises(InvariantError, match=f"hash {h.hex()} maps to block 0"):
        m.check_invariants()
    m.block_pool.blocks[0].block_hash = h
    # The decode fast path's bound: 9 tokens in 3 blocks, 2 cached -> 11 (the 12th token
    # fills block 2, which must then be cached). A stale bound would skip that.
    st = m.implementation._states["r"]
    assert st.idle_until == 11
    st.idle_until = 12
    with pytest.raises(InvariantError, match="fast-path bound 12 != 11"):
        m.check_invariants()
    assert st.idle_until == 12  # checking repairs nothing
    st.idle_until = 11
    m.check_invariants()
    m.free(r)
    q = m.block_pool.free_block_queue
    q.remove(m.block_pool.blocks[3])
    with pytest.raises(InvariantError, match="block 3 has ref_cnt 0 but is not in the free queue"):
        m.check_invariants()


# -------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_blocks=0, block_size=4), "num_blocks"),
        (dict(num_blocks=-3, block_size=4), "num_blocks"),
        (dict(num_blocks=4, block_size=0), "block_size"),
        (dict(num_blocks=4, block_size=-16), "block_size"),
        (dict(num_blocks=4, block_size=4, hash_algo="md5"), "md5"),
        (dict(num_blocks=4, block_size=4, free_order="lifo"), "free_order"),
        (dict(num_blocks=4, block_size=4, max_model_len=0), "max_model_len"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVCacheManager(**kwargs)


def test_bad_requests_are_rejected_by_request():
    with pytest.raises(ValueError, match="empty prompt"):
        Request("e", [])
    with pytest.raises(ValueError, match="negative"):
        Request("n", [1, -2, 3])
    with pytest.raises(ValueError, match="beyond"):
        Request("m", [0] * 10, mm_features=[MultiModalFeature("i", 8, 5)])
    with pytest.raises(ValueError, match="overlap"):
        Request(
            "o", [0] * 10,
            mm_features=[MultiModalFeature("i", 0, 5), MultiModalFeature("j", 4, 3)],
        )


def test_bad_manager_calls_change_nothing():
    m = KVCacheManager(8, 4, max_model_len=12)
    a = Request("a", list(range(1, 10)))
    admit(m, a)
    a.append_output_token_ids(5)
    before = snapshot(m)
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots(a, -1)
    with pytest.raises(ValueError, match="max_model_len"):
        m.allocate_slots(a, 4)  # 9 + 4 = 13 > 12
    with pytest.raises(ValueError, match="unknown request id 'ghost'"):
        m.free("ghost")
    with pytest.raises(ValueError, match="unknown request id"):
        m.free(Request("ghost2", [1]))
    with pytest.raises(ValueError, match="unknown request id"):
        m.get_block_ids("ghost")
    long = Request("long", list(range(1, 14)))  # 13 tokens > max_model_len
    blocks, hit = m.get_computed_blocks(long)
    with pytest.raises(ValueError, match="max_model_len"):
        m.allocate_slots(long, 13 - hit, hit, blocks)
    b = Request("b", list(range(1, 10)))
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 8
    with pytest.raises(ValueError, match="does not match"):
        m.allocate_slots(b, 1, 4, blocks)
    with pytest.raises(ValueError, match="running"):
        m.allocate_slots(a, 1, 8, blocks)
    foreign = Request("f", [1, 2, 3], hasher=BlockHasher("sha256_cbor"), block_size=4)
    with pytest.raises(ValueError, match="bound to"):
        m.allocate_slots(foreign, 3)
    dup = Request("a", [500, 501])  # same id as a running request, another object
    with pytest.raises(ValueError, match="already running"):
        m.allocate_slots(dup, 2)
    assert snapshot(m) == before
    m.check_invariants()


def test_bad_num_computed_tokens_changes_nothing():
    """num_computed_tokens is a plain attribute (vLLM's): the manager rejects a value
    that is not an int in [0, num_tokens] before it changes anything."""
    m = KVCacheManager(8, 4)
    a = Request("a", list(range(1, 7)))  # 6 tokens: blocks [0, 4) [4, 8)
    admit(m, a)
    a.append_output_token_ids(7)  # 7 tokens
    before = snapshot(m)
    for bad in (-1, 1.5, True, None, "6"):  # the decode fast path's checks
        a.num_computed_tokens = bad
        with pytest.raises(ValueError, match="num_computed_tokens"):
            m.allocate_slots(a, 1)
        with pytest.raises(InvariantError, match="num_computed_tokens"):
            m.check_invariants()
    a.num_computed_tokens = 9  # > num_tokens, and the step needs a new block
    with pytest.raises(ValueError, match="num_computed_tokens=9 > num_tokens=7"):
        m.allocate_slots(a, 1)
    with pytest.raises(InvariantError, match="num_computed_tokens=9 is not an int in"):
        m.check_invariants()
    assert snapshot(m) == before
    a.num_computed_tokens = 6
    m.check_invariants()
    assert m.allocate_slots(a, 1) == []
    b = Request("b", list(range(1, 7)))
    blocks, hit = m.get_computed_blocks(b)
    for bad in (7, -1, 2.0):  # a new request (the slow path)
        b.num_computed_tokens = bad
        with pytest.raises(ValueError, match="num_computed_tokens"):
            m.allocate_slots(b, b.num_tokens - hit, hit, blocks)
    c = Request("c", [90, 91, 92])  # no prefix hit: only the range check can refuse it
    c.num_computed_tokens = 4
    with pytest.raises(ValueError, match="num_computed_tokens=4 is not an int in"):
        m.allocate_slots(c, 3)
    assert snapshot(m) == before
    m.check_invariants()


def test_a_freed_request_object_never_reaches_a_new_one_with_its_id():
    """The decode fast path finds a request's state by the object: freeing must drop
    that entry, or the freed object would keep stepping on stale (freed) blocks."""
    m = KVCacheManager(8, 4)
    a = Request("x", list(range(1, 7)))
    admit(m, a)
    a.append_output_token_ids(7)  # the prefill's sampled token
    decode(m, a, 9)
    m.free(a)
    b = Request("x", list(range(20, 26)))  # the id again, another object
    admit(m, b)
    before = snapshot(m)
    with pytest.raises(ValueError, match="already running as another Request"):
        m.allocate_slots(a, 1)
    assert snapshot(m) == before
    m.check_invariants()
    m.free("x")
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_public_exports():
    import prefixcache
    import prefixcache.core as core

    for name in ("KVCacheManager", "Request", "MultiModalFeature", "LoRARequest", "BlockHasher"):
        assert getattr(prefixcache, name) is getattr(core, name)
    for name in ("KVCacheBlock", "BlockStored", "BlockRemoved", "AllBlocksCleared",
                 "PrefixCacheStats", "InvariantError"):
        assert hasattr(core, name)
    assert KVCacheManager(4, 4).hasher == BlockHasher("sha256")
