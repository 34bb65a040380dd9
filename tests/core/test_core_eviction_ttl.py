"""Time-varying eviction: the ``TimedPolicy`` seam (a priority computed when the pool
pops, from the driver's clock) and ``ttl_lru`` on it -- hand-computed orders, random
operations against plain-Python references, bad options and clocks, and the drivers
(replay, DES) telling the clock."""

from __future__ import annotations

import math
import random

import pytest

from prefixcache.core import KVCacheManager, Request
from prefixcache.core.block_pool import KVCacheBlock
from prefixcache.core.eviction import TimedPolicy, make_policy, policy_clock
from prefixcache.sim.trace import TraceRequest

TTL3 = {"ttl": 3, "unit": "steps"}


def _admit(m, rid, prompt):
    r = Request(rid, prompt)
    blocks, hit = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
    m.check_invariants()
    return r, hit


def _setup(eviction, index="hash"):
    """a (5 tokens: blocks 0, 1 cached, 2 partial) admitted at step 0, b (blocks 3, 4
    cached, 5 partial) admitted and freed at step 4, a freed at step 5: a long request
    that finished after a short one."""
    m = KVCacheManager(8, 2, eviction=eviction, index=index, free_order="unhashed_first",
                       eviction_options=TTL3 if eviction == "ttl_lru" else None)
    clock = policy_clock(m)
    tick = clock if clock is not None else (lambda now_s, step: None)
    tick(None, 0)
    a, _ = _admit(m, "a", [1, 2, 3, 4, 5])
    tick(None, 4)
    b, _ = _admit(m, "b", [6, 7, 8, 9, 10])
    assert m.get_block_ids("a") == [0, 1, 2] and m.get_block_ids("b") == [3, 4, 5]
    m.free(b)
    tick(None, 5)
    m.free(a)
    m.check_invariants()
    return m, tick


def test_ttl_lru_hand_computed_order():
    m, tick = _setup("ttl_lru")
    # Released (LRU order, next victim first): 4, 3 (b, step 4), 1, 0 (a, step 5).
    # Last use: blocks 0, 1 at step 0, blocks 3, 4 at step 4; ttl 3 steps.
    # Step 6: a's blocks are idle 6 > 3 (expired), b's 2 (fresh until step 7):
    #   [1, 0 | 4, 3]   expired first, LRU in each class
    tick(None, 6)
    assert m.policy.candidate_ids() == [1, 0, 4, 3]
    # c needs 5 blocks: the 4 unhashed free ones (2, 5, 6, 7), then one victim: 1.
    c, _ = _admit(m, "c", list(range(20, 30)))
    assert 1 in m.get_block_ids("c") and 4 not in m.get_block_ids("c")
    m.free(c)  # (c's 4 full blocks join the fresh class at step 6)
    # Step 8: b's blocks expired too (8 > 4 + 3): [4, 3, 0 | c's]
    tick(None, 8)
    assert m.policy.candidate_ids()[:3] == [4, 3, 0]
    # Lookups: a keeps its first block, b both.
    assert m.get_computed_blocks(Request("a2", [1, 2, 3, 4, 5]))[1] == 2
    assert m.get_computed_blocks(Request("b2", [6, 7, 8, 9, 10]))[1] == 4


def test_lru_evicts_the_short_request_first_in_the_same_scenario():
    m, _ = _setup("lru", index="radix")  # (the keyed lru: candidate_ids to read)
    # The radix tree's candidates are leaves: 4 (b), then 1 (a): LRU takes b's first.
    assert m.policy.candidate_ids() == [4, 1]
    t, _ = _setup("ttl_lru", index="radix")
    t.policy.set_time(None, 6)  # (a's leaf expired at step 3, b's fresh until 7)
    assert t.policy.candidate_ids() == [1, 4]


# --------------------------------------------------------------- random operations
class _Reference:
    """A plain-Python model of a time-ranked candidate set: ``rank(bid, now)``."""

    def __init__(self, rank):
        self.rank = rank
        self.last_use: dict[int, float] = {}
        self.released: dict[int, int] = {}
        self.candidates: set[int] = set()
        self.seq = 0

    def order(self, now):
        return sorted(self.candidates, key=lambda b: self.rank(self, b, now))


def _ttl_rank(ttl):
    def rank(ref, bid, now):
        return (0 if now > ref.last_use[bid] + ttl else 1, ref.released[bid])
    return rank


class _Sawtooth(TimedPolicy):
    """A toy whose ranks change at any time: idle time modulo 5 (smaller first), LRU
    ties; ``until = now`` (recomputed at every later pop)."""

    name = "sawtooth"

    def __init__(self, num_blocks, *, unit="s"):
        super().__init__(num_blocks, unit=unit)
        self.last_use = [0.0] * num_blocks

    def on_cached(self, block, block_hash, request, position):
        super().on_cached(block, block_hash, request, position)
        self.last_use[block.block_id] = self.now

    def on_hit(self, block, request):
        self.last_use[block.block_id] = self.now

    def priority(self, block, now):
        bid = block.block_id
        return ((now - self.last_use[bid]) % 5, self.released_at[bid]), now


def _saw_rank(ref, bid, now):
    return ((now - ref.last_use[bid]) % 5, ref.released[bid])


@pytest.mark.parametrize("make,rank", [
    (lambda n: make_policy("ttl_lru", num_blocks=n, ttl=2.5, unit="s"), _ttl_rank(2.5)),
    (lambda n: make_policy("ttl_lru", num_blocks=n, ttl=4, unit="steps"), _ttl_rank(4.0)),
    (lambda n: _Sawtooth(n), _saw_rank),
], ids=["ttl_lru_s", "ttl_lru_steps", "continuous"])
@pytest.mark.parametrize("seed", range(4))
def test_random_operations_match_the_reference(make, rank, seed):
    rng = random.Random(seed)
    n = 12
    p = make(n)
    blocks = [KVCacheBlock(i) for i in range(n)]
    ref = _Reference(rank)
    held: set[int] = set()  # cached, in use
    now = 0
    for _ in range(600):
        op = rng.random()
        free_ids = [b for b in range(n) if b not in held and b not in ref.candidates]
        if op < 0.2 and free_ids:  # a request caches a block
            b = rng.choice(free_ids)
            p.on_cached(blocks[b], b"h%d" % b, None, 0)
            ref.last_use[b] = now
            held.add(b)
        elif op < 0.35 and (held or ref.candidates):  # a lookup adopts a cached block
            b = rng.choice(sorted(held | ref.candidates))
            if b in ref.candidates:
                p.discard(blocks[b])
                ref.candidates.discard(b)
            p.on_hit(blocks[b], None)
            ref.last_use[b] = now
            held.add(b)
        elif op < 0.6 and held:  # its last holder releases it: a candidate
            b = rng.choice(sorted(held))
            held.discard(b)
            p.on_release(blocks[b], None, 0)
            p.add(blocks[b])
            ref.seq += 1
            ref.released[b] = ref.seq
            ref.candidates.add(b)
        elif op < 0.8:  # the driver's clock moves (or not)
            now += rng.choice([0, 0, 1, 2, 3])
            p.set_time(float(now), now)
        elif ref.candidates:  # the pool pops a victim
            want = ref.order(now)[0]
            got = p.pop()
            assert got.block_id == want, (now, ref.order(now))
            p.on_evicted(got)
            ref.candidates.discard(want)
        if rng.random() < 0.2:
            assert p.candidate_ids() == ref.order(now)
            p.check_invariants(sorted(ref.candidates))
    assert len(p) == len(ref.candidates)


# ------------------------------------------------------------- bad options, clocks
@pytest.mark.parametrize("options,err", [
    ({"ttl": 0}, ValueError), ({"ttl": -1.0}, ValueError), ({"ttl": True}, ValueError),
    ({"ttl": "5"}, ValueError), ({"ttl": math.inf}, ValueError),
    ({"ttl": math.nan}, ValueError), ({"unit": "min"}, ValueError),
    ({"ttl_s": 5}, TypeError),
])
def test_bad_options_are_refused_before_anything_is_built(options, err):
    from prefixcache.sim.replay import replay

    with pytest.raises(err, match="ttl_lru"):
        KVCacheManager(8, 2, eviction="ttl_lru", eviction_options=options)

    def untouched():
        raise AssertionError("the trace was read before the options were checked")
        yield  # noqa: unreachable (a generator)

    with pytest.raises(err, match="ttl_lru"):
        replay(untouched(), num_blocks=8, block_size=2, eviction="ttl_lru",
               eviction_options=options)


def test_bad_clock_readings_change_nothing():
    p = make_policy("ttl_lru", num_blocks=4, ttl=1.0, unit="s")
    p.set_time(5.0, 0)
    with pytest.raises(ValueError, match="went back"):
        p.set_time(4.0, 1)
    for bad in (math.nan, -1.0, True, "6"):
        with pytest.raises(ValueError, match="finite number"):
            p.set_time(bad, 1)
    with pytest.raises(ValueError, match="timestamp"):
        p.set_time(None, 1)  # unit "s" without a clock in seconds
    assert p.now == 5.0
    # A device and a host policy: the second one's refusal leaves the first unchanged.
    m = KVCacheManager(4, 2, eviction="ttl_lru", eviction_options={"unit": "s"},
                       num_host_blocks=4, host_eviction="ttl_lru")
    set_time = policy_clock(m)
    set_time(1.0, 1)
    with pytest.raises(ValueError, match="went back"):
        set_time(2.0, 0)
    assert (m.policy.now, m.host_tier.policy.now) == (1.0, 1.0)
    assert policy_clock(KVCacheManager(4, 2)) is None  # no time-varying policy: no clock


# --------------------------------------------------------------------- drivers
def _multi_turn(n=10, **kw):
    from prefixcache.sim import workloads

    return workloads.generate("multi_turn", seed=0, num_conversations=n, **kw)


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_replay_ttl_lru_equals_lru_when_requests_finish_in_order(index):
    from prefixcache.sim.replay import replay

    # The replay frees requests in admission order, so last use follows release order:
    # the expired blocks are the least recently released ones, and ttl_lru is lru.
    trace = _multi_turn()
    out = {}
    for name, opts in (("lru", None), ("ttl_lru", {"ttl": 2}),
                       ("ttl_lru", {"ttl": 1.0, "unit": "s"})):
        recs = []
        s = replay(trace, num_blocks=60, block_size=16, concurrency=4, index=index,
                   free_order="unhashed_first", eviction=name, eviction_options=opts,
                   on_record=recs.append)
        assert s["evictions"] > 0
        out[(name, str(opts))] = recs
    first, *rest = out.values()
    assert all(r == first for r in rest)


def test_replay_clock_in_seconds_needs_timestamps():
    from prefixcache.sim.replay import replay

    untimed = [TraceRequest(id="a", prompt=[1, 2, 3], output_len=1)]
    seconds = {"unit": "s"}
    with pytest.raises(ValueError, match="timestamp"):
        replay(untimed, num_blocks=8, block_size=2, eviction="ttl_lru",
               eviction_options=seconds)
    backwards = [TraceRequest(id=str(i), prompt=[1, 2, 3], output_len=1, timestamp=t)
                 for i, t in enumerate([2.0, 1.0])]
    with pytest.raises(ValueError, match="went back"):
        replay(backwards, num_blocks=8, block_size=2, eviction="ttl_lru",
               eviction_options=seconds)
    # steps (the default unit) need no timestamps
    assert replay(untimed, num_blocks=8, block_size=2, eviction="ttl_lru")["requests"] == 1


def test_des_ttl_keeps_the_short_request_a_long_one_outlived():
    from prefixcache.sim import cost_model as cm
    from prefixcache.sim.des import simulate

    toy = cm.ModelShape(num_layers=1, d_model=4, num_q_heads=2, num_kv_heads=1, head_dim=2,
                        ffn_dim=8, vocab_size=10, dtype_bytes=2)
    model = cm.CostModel(toy, cm.Accelerator("toy", peak_flops=1000.0, hbm_bandwidth=1e30,
                                             hbm_bytes=1e6))
    long_p, short_p = list(range(1, 10)), list(range(101, 110))
    # L (30 output tokens) runs from step 0 to ~30; S arrives mid-way (admitted ~step 15)
    # and finishes first; X (6 blocks) arrives after both and must evict. LRU takes S's
    # blocks (released first); with a TTL of 20 steps L's early blocks (last used at
    # step 0-10) are expired at X's admission and go first, S's are fresh and stay.
    trace = [TraceRequest("L", long_p, 30, timestamp=0.0),
             TraceRequest("S", short_p, 1, timestamp=15.0),
             TraceRequest("X", list(range(201, 225)), 1, timestamp=60.0),
             TraceRequest("L2", long_p + [50], 1, timestamp=160.0),
             TraceRequest("S2", short_p + [60], 1, timestamp=260.0)]
    hits = {}
    for name, opts in (("lru", None), ("ttl_lru", {"ttl": 20, "unit": "steps"}),
                       ("ttl_lru", {"ttl": 1e6, "unit": "steps"})):
        recs = []
        simulate(trace, cost_model=model, num_blocks=16, block_size=4, eviction=name,
                 eviction_options=opts, free_order="unhashed_first", on_record=recs.append)
        hits[name, str(opts)] = {r["id"]: r["num_cached_tokens"] for r in recs}
    lru, ttl, never = hits.values()
    assert (lru["L2"], lru["S2"]) == (8, 0)
    assert (ttl["L2"], ttl["S2"]) == (8, 8)
    assert never == lru  # nothing expires: lru


class _ClockLog(TimedPolicy):
    """lru that logs every clock reading it is told (``log``: a list)."""

    name = "clock_log"

    def __init__(self, num_blocks, *, log, unit="s"):
        super().__init__(num_blocks, unit=unit)
        self.log = log

    def set_time(self, now_s, step):
        super().set_time(now_s, step)
        self.log.append((now_s, step))

    def priority(self, block, now):
        return self.released_at[block.block_id], math.inf


def test_drivers_tell_the_clock():
    from prefixcache.sim import cost_model as cm
    from prefixcache.sim.des import simulate
    from prefixcache.sim.replay import replay

    trace = [TraceRequest(str(i), [1, 2, 3, i], 2, timestamp=0.5 * i) for i in range(4)]
    log: list = []
    replay(trace, num_blocks=8, block_size=2, eviction=_ClockLog,
           eviction_options={"log": log})
    assert log == [(0.0, 0), (0.5, 1), (1.0, 2), (1.5, 3)]  # (timestamp, request index)
    log.clear()
    toy = cm.ModelShape(num_layers=1, d_model=4, num_q_heads=2, num_kv_heads=1, head_dim=2,
                        ffn_dim=8, vocab_size=10, dtype_bytes=2)
    s = simulate(trace, cost_model=cm.CostModel(toy, cm.Accelerator(
        "toy", peak_flops=1000.0, hbm_bandwidth=1e30, hbm_bytes=1e6)), num_blocks=8,
        block_size=2, eviction=_ClockLog, eviction_options={"log": log})
    # one reading per step: the step's start (simulated seconds) and the steps before it
    assert [step for _, step in log] == list(range(s["steps"]))
    assert all(a[0] <= b[0] for a, b in zip(log, log[1:])) and log[0][0] == 0.0
