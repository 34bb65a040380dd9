"""``queue_aware`` over several KV cache groups (the hash index's hybrid coordinator):
per group, the blocks a waiting request's hit would use are evicted last (full
attention: every prompt block; a sliding window: only the blocks inside the window at
the aligned hit; a state group: the state block at the hit), admission and
``drop_waiting`` drop the interest (the leak check fails on a corrupted state), random
operations keep the invariants and the protection order, and the one rule serves the
radix tree's multi-group manager too (its own tests:
``test_core_queue_aware_radix_groups.py``).
"""

from __future__ import annotations

import random

import pytest

from prefixcache import KVCacheManager, Request
from prefixcache.core.block_pool import InvariantError
from prefixcache.core.indexes import COMBINATION_RULES, refusal
from prefixcache.core.kv_groups import parse_kv_groups

BS = 2


def _prefill(m, req, hit, blocks) -> bool:
    """Allocate the prompt in the chunks a scheduler splits it into (a state group
    keeps a state where a chunk ends); False if the first chunk does not fit."""
    chunks = m.prefill_chunks(req, hit)
    if m.allocate_slots(req, chunks[0], hit, blocks) is None:
        return False
    req.num_computed_tokens = hit + chunks[0]
    for c in chunks[1:]:
        if m.allocate_slots(req, c) is None:  # a later chunk may not fit: give up
            m.free(req)
            return False
        req.num_computed_tokens += c
    return True


def _admit(m, rid, prompt):
    req = Request(rid, prompt)
    blocks, hit = m.get_computed_blocks(req)
    assert _prefill(m, req, hit, blocks)
    m.check_invariants()
    return req, hit


def _group_of(m, bid):
    return int.from_bytes(m.block_pool.blocks[bid].block_hash[-4:], "big")


def test_sliding_window_protects_only_the_window_at_the_hit():
    # full + sliding window W=3 (2 blocks of 2 tokens reach back past the window).
    m = KVCacheManager(40, BS, eviction="queue_aware", kv_cache_groups=parse_kv_groups("full,sw3"))
    prompt = list(range(1, 12))  # 11 tokens: 5 full blocks cached per group
    req, _ = _admit(m, "a", prompt)
    m.free(req)
    m.check_invariants()
    w = Request("w", prompt + [99])  # hits 10 tokens (5 blocks): needs (12 - 1) // 2
    w.bind_hasher(m.hasher, BS)
    hashes = w.block_hashes[: (w.num_tokens - 1) // BS]
    keys = m.waiting_keys(hashes)
    # full: all 5 prompt blocks; sw3 at hit 10: skipped (10 - 3 + 1) // 2 = 4 -> block 4.
    assert keys == [(h, 0) for h in hashes] + [(hashes[4], 1)]
    m.on_waiting("w", hashes)
    p = m.policy
    order = p.candidate_ids()
    wanted = [b for b in order if p.key(p._block_objs[b])[0] == 1]
    assert sorted((_group_of(m, b), m.block_pool.blocks[b].block_hash[:-4]) for b in wanted) \
        == sorted([(0, h) for h in hashes] + [(1, hashes[4])])
    assert order[-len(wanted):] == wanted  # evicted last
    # The sliding window's blocks 0..3 are not protected (outside the window at the hit).
    sw_unwanted = [b for b in order if _group_of(m, b) == 1 and b not in wanted]
    assert len(sw_unwanted) == 4
    # Admission drops the interest; the hit is unchanged.
    blocks, hit = m.get_computed_blocks(w)
    assert hit == 10
    assert m.allocate_slots(w, w.num_tokens - hit, hit, blocks) is not None
    assert p.waiting_ids() == [] and p.wanted == {}
    m.check_invariants()


def test_state_group_protects_the_state_at_the_hit_and_bad_hashes_change_nothing():
    m = KVCacheManager(40, BS, eviction="queue_aware",
                       kv_cache_groups=parse_kv_groups("full,mamba"))
    prompt = list(range(1, 10))
    req, _ = _admit(m, "a", prompt)
    m.free(req)
    w = Request("w", prompt[:8] + [50, 51, 52])
    w.bind_hasher(m.hasher, BS)
    hashes = w.block_hashes[: (w.num_tokens - 1) // BS]
    hit = m.peek_computed_tokens(w)
    assert hit > 0 and hit % BS == 0
    keys = m.waiting_keys(hashes)
    assert keys == [(h, 0) for h in hashes] + [(hashes[hit // BS - 1], 1)]
    with pytest.raises(TypeError, match="bytes"):
        m.on_waiting("w", ["nope"])
    assert m.policy.waiting_ids() == []
    m.on_waiting("w", hashes)
    with pytest.raises(ValueError, match="already waiting"):
        m.on_waiting("w", hashes)
    m.drop_waiting("w")
    m.drop_waiting("w")  # not waiting: a no-op
    assert m.policy.wanted == {}
    m.check_invariants()


def test_leak_is_caught():
    m = KVCacheManager(20, BS, eviction="queue_aware", kv_cache_groups=parse_kv_groups("full,sw3"))
    req, _ = _admit(m, "a", [1, 2, 3, 4, 5])
    m.policy.on_waiting("a", [])  # a running request still waiting: a leak
    with pytest.raises(InvariantError, match="a leak"):
        m.check_invariants()


def test_lru_hybrid_has_no_waiting_work():
    m = KVCacheManager(20, BS, kv_cache_groups=parse_kv_groups("full,sw3"))
    assert m.policy is None and m.implementation._waiting_policy is None
    m.on_waiting("w", [b"x" * 32])  # no policy reads it: nothing is done
    m.drop_waiting("w")


def test_radix_layout_is_served_by_the_rule():
    # The radix tree's multi-group manager has the per-group waiting hooks too
    # (tests/core/test_core_queue_aware_radix_groups.py): same keys as this coordinator.
    groups = parse_kv_groups("full,sw3")
    assert refusal("radix", groups, "queue_aware", 0) is None
    assert refusal("hash", groups, "queue_aware", 0) is None
    ms = [KVCacheManager(20, BS, index=i, eviction="queue_aware", kv_cache_groups=groups)
          for i in ("hash", "radix")]
    prompt = list(range(1, 12))
    for m in ms:
        req = Request("a", prompt)
        blocks, hit = m.get_computed_blocks(req)
        assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
        m.free(req)
    w = Request("w", prompt + [99])
    keys = []
    for m in ms:
        w.bind_hasher(m.hasher, BS)
        keys.append(m.waiting_keys(w.block_hashes[: (w.num_tokens - 1) // BS]))
        m.on_waiting("w", w.block_hashes[: (w.num_tokens - 1) // BS])
        m.check_invariants()
    assert keys[0] == keys[1] and len(keys[0]) == 6
    assert ("hybrid", "waiting") not in COMBINATION_RULES


@pytest.mark.parametrize("layout", ["full,sw3", "full,sw5,mamba", "sw3", "full,mamba_r0"])
def test_random_operations_keep_invariants(layout):
    rng = random.Random(f"qag-{layout}")
    m = KVCacheManager(30, BS, eviction="queue_aware", kv_cache_groups=parse_kv_groups(layout),
                       free_order="unhashed_first")
    p = m.policy
    prefixes = [[rng.randrange(20) for _ in range(rng.randrange(2, 9))] for _ in range(5)]
    waiting: dict[str, Request] = {}
    live = []
    seen_protected = 0
    for i in range(160):
        op = rng.random()
        if op < 0.35:  # a request joins the queue
            prompt = rng.choice(prefixes) + [rng.randrange(20) for _ in range(rng.randrange(1, 5))]
            req = Request(f"r{i}", prompt)
            req.bind_hasher(m.hasher, BS)
            m.on_waiting(req.request_id, req.block_hashes[: (req.num_tokens - 1) // BS])
            waiting[req.request_id] = req
        elif op < 0.65 and waiting:  # the oldest waiting request is admitted (or not)
            req = waiting.pop(next(iter(waiting)))
            blocks, hit = m.get_computed_blocks(req)
            if _prefill(m, req, hit, blocks):
                live.append(req)
            else:
                m.drop_waiting(req.request_id)
        elif op < 0.72 and waiting:  # a waiting request is aborted
            m.drop_waiting(waiting.pop(rng.choice(list(waiting))).request_id)
        elif live:
            m.free(live.pop(rng.randrange(len(live))))
        m.check_invariants()
        assert p.waiting_ids() == list(waiting)
        order = [p.key(p._block_objs[b])[0] for b in p.candidate_ids()]
        assert order == sorted(order), order  # wanted candidates go last
        seen_protected += any(order)
        if m.num_groups > 1:
            g1 = [k for k in p.wanted if k[1] == 1]  # non-full group keys: hit-bounded
            assert len(g1) <= sum(len(h) for h in p._waiting.values())
    assert m.num_evictions > 0 and seen_protected > 0
    for req in live:
        m.free(req)
    for rid in list(waiting):
        m.drop_waiting(rid)
    assert p.wanted == {}  # no interest left behind
    m.check_invariants()


@pytest.mark.parametrize("kw", [
    dict(kv_cache_groups=parse_kv_groups("full,sw5"), eviction="queue_aware"),
    dict(kv_cache_groups=parse_kv_groups("full,sw5"), eviction="queue_aware", index="radix"),
    dict(num_host_blocks=4, host_eviction="queue_aware"),  # only the host tier reads it
    dict(num_host_blocks=4, host_eviction="queue_aware", index="radix"),
    dict(kv_cache_groups=parse_kv_groups("full,sw5"), num_host_blocks=4,
         host_eviction="queue_aware"),
])
def test_engine_scheduler_reports_its_waiting_queue(kw):
    from prefixcache.engine.sampling_params import SamplingParams
    from prefixcache.engine.scheduler import EngineRequest, Scheduler

    m = KVCacheManager(16, 4, **kw)
    # (the policy that reads the queue: the device's, else the host tier's)
    p = m.policy if getattr(m.policy, "needs_waiting", False) else m.host_tier.policy
    sched = Scheduler(m, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=100)
    for rid in ("a", "b", "c"):
        sched.add_request(EngineRequest(Request(rid, list(range(1, 10))),
                                        SamplingParams(max_tokens=2), seed=0))
    assert p.waiting_ids() == ["a", "b", "c"]
    sched.schedule()  # admits a (one sequence at a time)
    assert p.waiting_ids() == ["b", "c"]
    assert p.wanted  # b and c hold a's prompt blocks
    sched.abort_request("c")
    assert p.waiting_ids() == ["b"]
    m.check_invariants()
