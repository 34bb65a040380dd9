"""``queue_aware`` reads the waiting queue in the DES (``des.simulate``) and as the host
tier's policy: the DES announces every request joining its queue (arrival and
preemption) and the manager drops it at admission (no interest left at the end, the
leak check holds); a host entry a waiting request holds is evicted from the host last;
a manager whose policies do not read the queue is told nothing."""

from __future__ import annotations

import random

import pytest

from prefixcache import KVCacheManager, Request
from prefixcache.core.eviction import reads_waiting_queue
from prefixcache.sim import cost_model as cm
from prefixcache.sim import des

from tests.sim.test_sim_des import TOY_MODEL, _req

BS = 4


def _spy_simulate(monkeypatch, reqs, cost_model=TOY_MODEL, **kw):
    """``des.simulate`` with the manager kept and its waiting calls recorded."""
    made = []
    calls = []

    def build(**mkw):
        m = KVCacheManager(**mkw)
        on_waiting, drop_waiting = m.on_waiting, m.drop_waiting

        def spy_on(rid, hashes):
            calls.append(("on", rid, tuple(hashes)))
            on_waiting(rid, hashes)

        def spy_drop(rid):
            calls.append(("drop", rid))
            drop_waiting(rid)

        m.on_waiting, m.drop_waiting = spy_on, spy_drop
        made.append(m)
        return m

    monkeypatch.setattr(des, "KVCacheManager", build)
    summary = des.simulate(reqs, cost_model=cost_model, block_size=BS, **kw)
    return summary, made[0], calls


def _trace(n=40, seed=0):
    rng = random.Random(seed)
    docs = [[rng.randrange(1, 200) for _ in range(12)] for _ in range(4)]
    return [_req(f"q{i}", rng.choice(docs) + [rng.randrange(200, 300) for _ in range(3)],
                 out=rng.randrange(1, 14), t=0.01 * i) for i in range(n)]


SCHED = des.SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=3)


@pytest.mark.parametrize("host", [0, 8])
def test_des_reports_its_waiting_queue(monkeypatch, host):
    kw = dict(num_blocks=12, eviction="queue_aware", scheduler=SCHED)
    if host:  # the host tier's policy reads the queue too (the device's as well)
        link = cm.HostLink("test", 1e9, 1.0, 1e-6)
        kw.update(num_host_blocks=host, host_eviction="queue_aware",
                  cost_model=cm.CostModel(TOY_MODEL.shape, TOY_MODEL.accelerator,
                                          host_link=link))
    reqs = _trace()
    summary, m, calls = _spy_simulate(monkeypatch, reqs, **kw)
    ons = [c for c in calls if c[0] == "on"]
    # Every arrival once, every preemption once more; the prompt blocks a lookup can adopt.
    assert len(ons) == len(reqs) + summary["preemptions"]
    assert summary["preemptions"] > 0 and summary["evictions"] > 0
    first = {c[1]: c[2] for c in reversed(ons)}
    for r in reqs:
        want = m.hasher.hash_token_blocks(r.prompt, BS)[: (len(r.prompt) - 1) // BS]
        assert first[r.id] == tuple(want)
    assert m.policy.waiting_ids() == [] and m.policy.wanted == {}  # admission dropped all
    if host:
        assert m.host_tier.policy.waiting_ids() == [] and m.host_tier.policy.wanted == {}
        assert summary["host_blocks_stored"] > 0
    m.check_invariants()


def test_the_queue_changes_what_the_des_evicts():
    # Before the wiring queue_aware was plain LRU in the DES (the same hits); with the
    # queue announced it keeps the blocks the queued requests will hit (measured on
    # this trace: 284 hit tokens vs LRU's 272).
    kw = dict(cost_model=TOY_MODEL, block_size=BS, num_blocks=12, scheduler=SCHED)
    lru = des.simulate(_trace(), eviction="lru", **kw)
    qa = des.simulate(_trace(), eviction="queue_aware", **kw)
    assert qa["hit_tokens"] > lru["hit_tokens"]


def test_a_request_that_fails_is_dropped_from_the_queue(monkeypatch):
    # 6 blocks of 4: a 30-token prompt needs 8 > 6 blocks: failed at arrival, never
    # announced.
    reqs = [_req("ok", list(range(1, 10)), out=1), _req("big", list(range(50, 80)), out=1)]
    summary, m, calls = _spy_simulate(monkeypatch, reqs, num_blocks=6, eviction="queue_aware")
    assert [c[1] for c in calls if c[0] == "on"] == ["ok"]  # big failed at arrival
    assert summary["failed"] == 1
    assert m.policy.waiting_ids() == []


def test_other_policies_hear_nothing(monkeypatch):
    summary, m, calls = _spy_simulate(monkeypatch, _trace(10), num_blocks=20, eviction="lru")
    assert calls == [] and not reads_waiting_queue(m)


def _admit(m, rid, prompt):
    req = Request(rid, prompt)
    blocks, hit = m.get_computed_blocks(req)
    assert m.allocate_slots(req, len(prompt) - hit, hit, blocks) is not None
    req.num_computed_tokens = len(prompt)
    m.take_host_transfers()
    m.check_invariants()
    return req, hit


@pytest.mark.parametrize("host_eviction,kept", [("lru", "B"), ("queue_aware", "A")])
def test_host_tier_keeps_what_a_waiting_request_holds(host_eviction, kept):
    # Two device blocks of 2 tokens; each 3-token prompt caches one block (A, B, C, D in
    # turn) and demotes the previous one to the 2-slot host. When D's prompt demotes C,
    # the host is full (A, B): lru drops A (demoted first), queue_aware drops B (w waits
    # for A), and w's admission then hits A from the host.
    m = KVCacheManager(2, 2, num_host_blocks=2, host_eviction=host_eviction)
    assert reads_waiting_queue(m) == (host_eviction == "queue_aware")
    h = {k: m.hasher.hash_token_blocks(p, 2)[0]
         for k, p in {"A": [1, 1], "B": [2, 2], "C": [3, 3], "D": [4, 4]}.items()}
    for i, t in enumerate([1, 2, 3]):  # A, B, C
        req, _ = _admit(m, f"r{i}", [t, t, 9])
        m.free(req)
    m.on_waiting("w", [h["A"]])  # w = [1, 1, 5]
    req, _ = _admit(m, "r3", [4, 4, 9])  # C demoted: the host evicts one of A, B
    m.free(req)
    on_host = set(m.host_tier.hash_to_slot)
    assert h["C"] in on_host and h[kept] in on_host and len(on_host) == 2
    req, hit = _admit(m, "w", [1, 1, 5])
    assert hit == (2 if kept == "A" else 0)
    if host_eviction == "queue_aware":
        assert m.host_tier.policy.waiting_ids() == []  # admission dropped it


def test_waiting_fanout_forwards_to_both_tiers():
    from prefixcache.core.eviction import WaitingFanout, make_policy

    dev, host = (make_policy("queue_aware", num_blocks=4) for _ in range(2))
    f = WaitingFanout(dev, None, host)
    f.on_waiting("w", iter([b"a" * 32, b"b" * 32]))  # (an iterator: read once)
    assert dev.wanted == host.wanted == {b"a" * 32: 1, b"b" * 32: 1}
    with pytest.raises(ValueError, match="already waiting"):
        f.on_waiting("w", [b"c" * 32])
    assert dev.wanted == host.wanted and f.waiting_ids() == ["w"]
    f.drop_waiting("w")
    assert dev.wanted == host.wanted == {} and f.waiting_ids() == []
    with pytest.raises(ValueError, match="does not read the waiting queue"):
        WaitingFanout(make_policy("lru", num_blocks=4))
