"""Residency with tiers below the host: each hit counts on the tier it was served from
(device, host, disk), in the replay and through ``ManagerResidency`` (the DES's and the
engine's feed)."""

from __future__ import annotations

import pytest

from prefixcache.core import CacheConfig, KVCacheManager, Request
from prefixcache.core.residency import ManagerResidency, hit_media
from prefixcache.sim import workloads
from prefixcache.sim.replay import replay

BS = 2


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_replay_counts_each_hit_on_its_tier(index):
    reqs = workloads.generate("multi_turn", num_conversations=12, seed=3)
    cfg = CacheConfig(num_blocks=60, block_size=16, index=index, num_host_blocks=30,
                      disk_bytes=6000, page_bytes=100)
    s = replay(reqs, cache_config=cfg, concurrency=4, residency=1.0)
    gaps = {m: t["reuse_gap"]["count"] for m, t in s["residency"]["tiers"].items()}
    by_tier = s["hit_tokens_by_tier"]
    assert by_tier["disk"] > 0 and by_tier["host"] > 0
    assert gaps == {"GPU": by_tier["device"] // 16, "CPU": by_tier["host"] // 16,
                    "DISK": by_tier["disk"] // 16}


def _admit(m, feed, rid, prompt, now):
    r = Request(rid, prompt)
    blocks, hit = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
    feed.admitted(r, hit, now, computed=blocks)
    keys = feed.release_keys(r)
    m.free(r)
    feed.released(keys, now)
    m.check_invariants()
    return blocks, hit


def test_manager_residency_counts_disk_and_host_hits_there():
    # device 2 blocks, host 1 slot, disk 4 pages: r0's block goes device -> host -> disk
    m = KVCacheManager(3, BS, enable_events=True, num_host_blocks=1, disk_bytes=400,
                       page_bytes=100)
    feed = ManagerResidency(m, 1.0, log=True)
    for i in range(4):
        _admit(m, feed, f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3], float(i))
    blocks, hit = _admit(m, feed, "again0", [1, 2, 3], 10.0)  # r0's block: on the disk
    assert hit == BS and hit_media(blocks) == ["DISK"]
    blocks, hit = _admit(m, feed, "again2", [21, 22, 3], 11.0)  # r2's block: the host's
    assert hit == BS and hit_media(blocks) == ["CPU"]
    s = feed.summary(12.0)["tiers"]
    # r0's block reached the disk at t=3 (r3's admission pushed it out of the host)
    assert s["DISK"]["reuse_gap"]["count"] == 1 and s["DISK"]["reuse_gap"]["sum"] == 10.0 - 3.0
    assert s["CPU"]["reuse_gap"]["count"] == 1
    assert s["GPU"]["reuse_gap"]["count"] == 0
    assert m.hit_tokens_by_tier == {"device": 0, "host": BS, "disk": BS}
