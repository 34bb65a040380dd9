"""Block residency histograms (prefixcache.core.residency) against a per-block log built
independently: snapshots of the pool's cached hashes after every operation."""

import random

import pytest

from prefixcache.core.block_pool import _int_block_hash as _event_hash
from prefixcache.core.kv_cache_manager import KVCacheManager
from prefixcache.core.request import Request
from prefixcache.core.residency import BUCKETS, Histogram, ManagerResidency, ResidencyTracker


def _cached_keys(manager) -> dict:
    """hash (event form) -> number of cached blocks holding it, read from the pool."""
    out = {}
    for h, entry in manager.block_pool.cached_block_hash_to_block.items():
        out[_event_hash(h)] = len(entry) if isinstance(entry, dict) else 1
    return out


def _drive(seed: int, *, num_ops: int = 120, sample_rate: float = 1.0, managed: bool = False):
    """Random admissions / decodes / frees on a small pool; the tracker fed with events,
    hits and releases (``managed``: through ``ManagerResidency``, as the DES feeds it); a
    brute-force log from pool snapshots after each operation."""
    rng = random.Random(seed)
    m = KVCacheManager(num_blocks=24, block_size=4, enable_caching=True, enable_events=True)
    feed = ManagerResidency(m, sample_rate, log=True) if managed else None
    tracker = feed.tracker if managed else ResidencyTracker(sample_rate, log=True)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 17))] for _ in range(4)]
    running = []
    stored_at, hits, last_hit, last_rel = {}, {}, {}, {}
    ends, gaps = [], []
    prev = {}
    for t in range(num_ops):
        now = float(t)
        op = rng.random()
        if op < 0.55 or not running:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))]
            req = Request(f"r{t}", prompt)
            blocks, n_hit = m.get_computed_blocks(req)
            if m.allocate_slots(req, len(prompt) - n_hit, n_hit, blocks) is None:
                continue
            req.num_computed_tokens = len(prompt)
            hit_keys = [_event_hash(h) for h in req.block_hashes[:n_hit // 4]]
            if managed:
                feed.admitted(req, n_hit, now)
            else:
                tracker.on_events(m.take_events(), now)
                tracker.on_hits(hit_keys, now)
            running.append(req)
            for k in hit_keys:  # the brute-force side of a hit
                gaps.append(now - last_hit.get(k, stored_at[k]))
                last_hit[k] = now
                hits[k] += 1
        elif op < 0.75:
            req = rng.choice(running)
            req.append_output_token_ids(rng.randrange(1, 50))
            if m.allocate_slots(req, 1) is not None:  # (no block: the token waits)
                req.num_computed_tokens += 1
            if managed:
                feed.drain(now)
            else:
                tracker.on_events(m.take_events(), now)
        else:
            req = running.pop(rng.randrange(len(running)))
            keys = [_event_hash(h) for h in req.block_hashes[:req.num_computed_tokens // 4]]
            m.free(req)
            if managed:
                feed.released(keys, now)
            else:
                tracker.on_events(m.take_events(), now)
                tracker.on_release(keys, now)
            for k in keys:
                if k in stored_at:
                    last_rel[k] = now
        cur = _cached_keys(m)
        for k in cur.keys() - prev.keys():
            stored_at[k], hits[k] = now, 0
            last_hit.pop(k, None)
            last_rel.pop(k, None)
        for k in prev.keys() - cur.keys():
            idle_from = last_rel.get(k, stored_at[k])
            ends.append((now - stored_at[k], now - idle_from, hits[k]))
            del stored_at[k]
        prev = cur
    tracker.finish(float(num_ops))
    return tracker, ends, gaps


@pytest.mark.parametrize("managed", [False, True], ids=["tracker", "manager_feed"])
@pytest.mark.parametrize("seed", range(6))
def test_histograms_equal_a_per_block_log(seed, managed):
    tracker, ends, gaps = _drive(seed, managed=managed)
    assert ends, "the pool never evicted: the test would check nothing"
    got = tracker.hist["GPU"]
    for i, name in enumerate(("lifetime", "idle_before_evict", "hits_per_residency")):
        want = Histogram(got[name].bounds)
        for e in ends:
            want.observe(e[i])
        assert got[name].counts == want.counts, name
        assert got[name].sum == pytest.approx(want.sum)
    want = Histogram(BUCKETS)
    for g in gaps:
        want.observe(g)
    assert got["reuse_gap"].counts == want.counts and got["reuse_gap"].count == len(gaps) > 0


def test_sampling_keeps_a_fixed_subset():
    full, ends, _ = _drive(3, num_ops=200)
    half, _, _ = _drive(3, num_ops=200, sample_rate=0.5)
    again, _, _ = _drive(3, num_ops=200, sample_rate=0.5)
    n_full = full.hist["GPU"]["lifetime"].count
    n_half = half.hist["GPU"]["lifetime"].count
    assert 0 < n_half < n_full == len(ends)
    assert half.summary() == again.summary()  # the same blocks every run
    sampled = {r["key"] for r in half.log if "lifetime" in r}
    assert sampled <= {r["key"] for r in full.log if "lifetime" in r}


@pytest.mark.parametrize("rate", [0, 1.5, "1", True])
def test_bad_sample_rate(rate):
    with pytest.raises(ValueError, match="sample_rate"):
        ResidencyTracker(rate)


def test_take_changed_and_apply_changed():
    """Only the histograms that observed something travel; applied to another tracker
    they give the same summary; a wrong bucket count is refused."""
    src, dst = ResidencyTracker(1.0), ResidencyTracker(1.0)
    assert src.take_changed() is None
    src._store(1, "GPU", 0.0)
    src.on_hits([1], 2.0)
    changed = src.take_changed()
    assert set(changed) == {"GPU"} and set(changed["GPU"]) == {"reuse_gap"}
    dst.apply_changed(changed)
    src._remove(1, "GPU", 5.0)
    src._store(2, "CPU", 5.0)
    src._remove(2, "CPU", 6.5)
    changed = src.take_changed()
    assert set(changed["GPU"]) == {"lifetime", "idle_before_evict", "hits_per_residency"}
    dst.apply_changed(changed)
    assert src.take_changed() is None
    assert dst.summary()["tiers"] == src.summary()["tiers"]
    with pytest.raises(ValueError, match="GPU/lifetime: 1 buckets"):
        dst.apply_changed({"GPU": {"lifetime": [[1], 1.0, 1]}})
