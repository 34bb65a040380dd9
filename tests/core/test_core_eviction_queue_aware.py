"""``queue_aware`` (vllm#48485): the blocks waiting requests hold are evicted last.

Hand-computed victim orders on the shared trace of ``test_core_eviction.py`` (through
the manager, hash and radix), admission and ``drop_waiting`` dropping a request's
interest, the leak checks failing on a corrupted state, random operations (queue
changes, admissions, frees, aborts; with and without a host tier) with invariants and
the protection order checked after each, and the replay's look-ahead queue.
"""

from __future__ import annotations

import random

import pytest

from prefixcache import KVCacheManager, Request
from prefixcache.core.eviction import PolicyError, get_policy_class
from prefixcache.core.block_pool import InvariantError
from prefixcache.sim import replay as replay_mod
from prefixcache.sim.replay import replay
from prefixcache.sim.trace import TraceRequest

from tests.core.test_core_eviction import BS, TRACE, A, B, C, D, _admit, _run


def _hashes(m, prompt):
    return m.hasher.hash_token_blocks(prompt, BS)


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_waiting_blocks_are_evicted_last(index):
    m = KVCacheManager(6, BS, eviction="queue_aware", index=index)
    _run(m, TRACE)
    assert m.policy.candidate_ids() == [C, A, B, D]  # nobody waits: lru's order
    # w waits for B's block ([2, 2]): B goes last, the others keep LRU order.
    m.on_waiting("w", _hashes(m, [2, 2, 9]))
    assert m.policy.candidate_ids() == [C, A, D, B]
    m.check_invariants()
    req, hit = _admit(m, "big", list(range(100, 111)))  # needs all 6 blocks
    assert hit == 0 and m.get_block_ids("big")[2:] == [C, A, D, B]
    assert m.policy.waiting_ids() == ["w"]  # still waiting: nothing drops it but it
    m.drop_waiting("w")
    assert m.policy.waiting_ids() == [] and m.policy.wanted == {}
    m.drop_waiting("w")  # not waiting: a no-op
    m.check_invariants()


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_admission_drops_the_interest(index):
    m = KVCacheManager(6, BS, eviction="queue_aware", index=index)
    _run(m, TRACE)
    m.on_waiting("r9", _hashes(m, [1, 1, 5]))
    m.on_waiting("r10", _hashes(m, [1, 1, 6]))
    assert m.policy.wanted == {_hashes(m, [1, 1])[0]: 2}
    with pytest.raises(ValueError, match="already waiting"):
        m.on_waiting("r9", _hashes(m, [3, 3]))
    assert m.policy.wanted == {_hashes(m, [1, 1])[0]: 2}  # nothing changed
    req, hit = _admit(m, "r9", [1, 1, 5])
    assert hit == BS and m.policy.waiting_ids() == ["r10"]
    m.free(req)
    assert m.policy.candidate_ids()[-1] == A  # r10 still holds A
    _admit(m, "r10", [1, 1, 6])
    assert m.policy.waiting_ids() == [] and m.policy.wanted == {}
    m.check_invariants()


def test_corrupted_queue_state_is_caught():
    m = KVCacheManager(6, BS, eviction="queue_aware")
    _run(m, TRACE)
    m.on_waiting("w", _hashes(m, [2, 2, 9]))
    m.policy.wanted[b"x" * 32] = 1  # a count no waiting request holds
    with pytest.raises(PolicyError, match="wanted counts"):
        m.check_invariants()
    del m.policy.wanted[b"x" * 32]
    m.policy.wanted.clear()  # B's class changed without a rekey
    with pytest.raises(PolicyError):
        m.check_invariants()
    m.policy.wanted[_hashes(m, [2, 2])[0]] = 1
    m.check_invariants()
    req, _ = _admit(m, "r", [4, 4, 1])
    m.policy._waiting["r"] = ()  # admitted but still listed: the manager's leak check
    with pytest.raises(InvariantError, match="leak"):
        m.check_invariants()


def _protected_last(m):
    p = m.policy
    order = [p.key(p._block_objs[b])[0] for b in p.candidate_ids()]
    assert order == sorted(order), order


@pytest.mark.parametrize("index,num_host_blocks", [("hash", 0), ("radix", 0), ("hash", 6),
                                                   ("radix", 6)])
def test_random_operations_keep_invariants(index, num_host_blocks):
    rng = random.Random(f"qa-{index}-{num_host_blocks}")
    m = KVCacheManager(12, BS, eviction="queue_aware", index=index,
                       num_host_blocks=num_host_blocks, host_eviction="lru")
    prefixes = [[rng.randrange(20) for _ in range(rng.randrange(2, 9))] for _ in range(6)]
    waiting: dict[str, Request] = {}
    live = []
    for i in range(200):
        op = rng.random()
        if op < 0.35:  # a request joins the queue
            prompt = rng.choice(prefixes) + [rng.randrange(20) for _ in range(rng.randrange(1, 5))]
            req = Request(f"r{i}", prompt)
            req.bind_hasher(m.hasher, BS)
            m.on_waiting(req.request_id, req.block_hashes)
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
        elif live:
            m.free(live.pop(rng.randrange(len(live))))
        m.take_host_transfers() if num_host_blocks else None
        m.check_invariants()
        assert m.policy.waiting_ids() == list(waiting)
        _protected_last(m)
    assert m.num_evictions > 0
    for req in live:
        m.free(req)
    assert m.reset_prefix_cache() and m.num_cached_blocks == 0
    m.check_invariants()  # waiting requests keep waiting; no block is listed
    for rid in list(waiting):
        m.drop_waiting(rid)
    assert m.policy.wanted == {}


def _trace(n=120, seed=0):
    rng = random.Random(seed)
    docs = [[rng.randrange(1, 500) for _ in range(48)] for _ in range(8)]
    return [TraceRequest(id=f"q{i}", prompt=rng.choice(docs) + [rng.randrange(1, 500)
                                                               for _ in range(8)],
                         output_len=4) for i in range(n)]


def test_replay_waiting_queue():
    reqs = _trace()
    lru = replay(reqs, num_blocks=48, block_size=16, concurrency=2)
    qa = replay(reqs, num_blocks=48, block_size=16, concurrency=2, eviction="queue_aware",
                queue_depth=6)
    assert qa["queue_depth"] == 6 and "queue_depth" not in lru
    assert qa["hit_tokens"] > lru["hit_tokens"]  # (126 vs 116 hit blocks on this trace)
    # No waiting request at all (every announced one admitted): the look-ahead is lru.
    radix = replay(reqs, num_blocks=48, block_size=16, concurrency=2, eviction="queue_aware",
                   queue_depth=6, index="radix")
    assert radix["hit_tokens"] == qa["hit_tokens"]
    with pytest.raises(ValueError, match="queue_depth"):
        replay(reqs, num_blocks=48, block_size=16, eviction="lru", queue_depth=4)
    with pytest.raises(ValueError, match="queue_depth"):
        replay(reqs, num_blocks=48, block_size=16, eviction="queue_aware", queue_depth=0)


def test_default_replay_adds_no_queue_work(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the look-ahead ran for a policy that does not read the queue")

    monkeypatch.setattr(replay_mod, "_announce_waiting", boom)
    assert not get_policy_class("lru").needs_waiting
    s = replay(_trace(20), num_blocks=48, block_size=16, concurrency=2)
    assert s["requests"] == 20
    m = KVCacheManager(8, BS)
    assert m.implementation._waiting_policy is None and m.policy is None


def test_engine_scheduler_reports_its_waiting_queue():
    from prefixcache.engine.sampling_params import SamplingParams
    from prefixcache.engine.scheduler import EngineRequest, Scheduler

    m = KVCacheManager(16, 4, eviction="queue_aware")
    sched = Scheduler(m, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=100)
    for rid in ("a", "b", "c"):
        sched.add_request(EngineRequest(Request(rid, list(range(1, 10))),
                                        SamplingParams(max_tokens=2), seed=0))
    assert m.policy.waiting_ids() == ["a", "b", "c"]
    sched.schedule()  # admits a (one sequence at a time)
    assert m.policy.waiting_ids() == ["b", "c"]
    assert len(m.policy.wanted) == 2  # (9 - 1) // 4 blocks each, shared
    sched.abort_request("c")
    assert m.policy.waiting_ids() == ["b"]
    m.check_invariants()
