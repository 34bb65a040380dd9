"""Replay: hand-computed hits, windows, evictions, failures, truncation, determinism."""

from __future__ import annotations

import pytest

from prefixcache.sim.replay import replay
from prefixcache.sim.trace import TraceRequest, output_tokens, read_trace


def run(reqs, **kw):
    recs = []
    summary = replay(reqs, on_record=recs.append, **kw)
    return recs, summary


def test_shared_prompt_hits_full_blocks_of_the_system_prompt():
    system = list(range(1, 43))  # 42 tokens: 5 full blocks of 8 (40 tokens) + 2
    reqs = [TraceRequest(f"q{i}", system + [100 + i] * 5, 3) for i in range(4)]
    recs, s = run(reqs, num_blocks=64, block_size=8, concurrency=2)
    assert [r["num_computed_tokens"] for r in recs] == [0, 40, 40, 40]
    assert s["hit_tokens"] == 120 and s["prompt_tokens"] == 4 * 47
    assert s["hit_rate_tokens"] == pytest.approx(120 / 188)
    assert s["requests_with_hit"] == 3 and s["failed"] == 0 and s["evictions"] == 0
    # Request 0 gets blocks 0..5 (47 tokens); the others share 0..4.
    assert recs[0]["block_ids"] == [0, 1, 2, 3, 4, 5]
    assert all(r["block_ids"][:5] == [0, 1, 2, 3, 4] for r in recs[1:])
    assert s["output_tokens"] == 4 * 3


def test_salts_and_adapters_isolate():
    p = list(range(1, 33))  # 4 blocks of 8
    reqs = [
        TraceRequest("a", p, 1, cache_salt="s1"),
        TraceRequest("b", p, 1, cache_salt="s2"),
        TraceRequest("c", p, 1, lora=("l1", "/l1")),
        TraceRequest("d", p, 1),
        TraceRequest("e", p, 1, cache_salt="s1"),
        TraceRequest("f", p, 1, lora=("l1", "/l1")),
        TraceRequest("g", p, 1, mm=(("img", 0, 8),)),
        TraceRequest("h", p, 1, mm=(("img", 0, 8),)),
    ]
    recs, _ = run(reqs, num_blocks=64, block_size=8, concurrency=8)
    assert [r["num_computed_tokens"] for r in recs] == [0, 0, 0, 0, 24, 24, 0, 24]


def test_multi_turn_hits_previous_output():
    first = TraceRequest("t0", list(range(1, 11)), 7)  # 10 prompt + 7 output tokens
    # The next turn embeds the 7 tokens turn 0 generated: 17 tokens = 4 blocks of 4.
    # Turn 0 fed back 6 of them (the last is never fed back): its KV covers 16 tokens,
    # i.e. 4 full blocks, all cached during its decode.
    second = TraceRequest("t1", first.prompt + output_tokens("t0", 7) + [900, 901], 2)
    recs, _ = run([first, second], num_blocks=32, block_size=4, concurrency=1)
    assert recs[1]["num_computed_tokens"] == 16


def test_small_pool_evicts_and_reports_failures_and_truncation():
    reqs = [
        TraceRequest("a", list(range(1, 9)), 1),  # 2 blocks of 4
        TraceRequest("b", list(range(20, 28)), 1),  # 2 blocks: frees a (window 1)
        TraceRequest("big", list(range(40, 56)), 1),  # 4 blocks > 3: fails
        TraceRequest("long", list(range(60, 68)), 10),  # decode needs a 4th block
    ]
    recs, s = run(reqs, num_blocks=3, block_size=4, concurrency=1)
    assert recs[2] == {
        "id": "big", "num_computed_tokens": 0, "block_ids": [], "failed": True,
        "prompt_tokens": 16,
    }
    # Decode step s allocates slots for 8 + s tokens: steps 1..4 fit in 3 blocks, step 5
    # needs a 4th and nothing else is running -> truncated at step 5.
    assert recs[3]["decode_truncated_at"] == 5
    assert s["failed"] == 1 and s["decode_truncated"] == 1
    assert s["admitted"] == 3 and s["requests"] == 4
    # b's allocation (window full -> a freed first) reused one of a's cached blocks
    # (free queue 2 | 1 0 after a: 2 then 1 -> block 1 evicted); long evicts more.
    assert recs[1]["block_ids"] == [2, 1]
    assert s["evictions"] >= 1


def test_admission_frees_oldest_and_retries():
    reqs = [
        TraceRequest("a", list(range(1, 9)), 1),  # blocks 0, 1
        TraceRequest("b", list(range(20, 28)), 1),  # blocks 2, 3
        TraceRequest("c", list(range(40, 48)), 1),  # needs 2, 0 free: frees a, retries
    ]
    recs, s = run(reqs, num_blocks=4, block_size=4, concurrency=3, free_order="append")
    assert [r["block_ids"] for r in recs] == [[0, 1], [2, 3], [1, 0]]
    assert s["early_finishes"] == 1 and s["evictions"] == 2


def test_decode_failure_frees_oldest_other():
    reqs = [
        TraceRequest("a", list(range(1, 5)), 1),  # 1 block
        TraceRequest("b", list(range(20, 24)), 5),  # 1 block; decode steps 1..4 need a 2nd
    ]
    recs, s = run(reqs, num_blocks=2, block_size=4, concurrency=2)
    assert "decode_truncated_at" not in recs[1]
    assert s["early_finishes"] == 1 and s["decode_truncated"] == 0


def test_deterministic_and_streaming(tmp_path):
    reqs = [TraceRequest(f"r{i}", [1, 2, 3, 4, 5, i + 10] * 3, 4) for i in range(30)]
    r1, s1 = run(iter(reqs), num_blocks=12, block_size=4, concurrency=3)
    r2, s2 = run((r for r in reqs), num_blocks=12, block_size=4, concurrency=3)
    assert r1 == r2
    s1.pop("timing"), s2.pop("timing")
    for k in ("requests_per_s", "prompt_tokens_per_s"):
        s1.pop(k), s2.pop(k)
    assert s1 == s2


def test_mooncake_three_requests(tmp_path):
    p = tmp_path / "mc.jsonl"
    p.write_text(
        '{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2]}\n'
        '{"timestamp": 10, "input_length": 1300, "output_length": 1, "hash_ids": [1, 2, 3]}\n'
        '{"timestamp": 20, "input_length": 600, "output_length": 1, "hash_ids": [1, 4]}\n'
    )
    recs, s = run(read_trace(p), num_blocks=256, block_size=16, concurrency=1)
    # r2 shares r1's 1000 tokens (block 1 + the first 488 of block 2): 62 full blocks.
    # r3 shares only hash block 1: 512 tokens = 32 blocks.
    assert [r["num_computed_tokens"] for r in recs] == [0, 992, 512]
    assert [r["id"] for r in recs] == ["mc-1", "mc-2", "mc-3"]


def test_bad_configuration():
    with pytest.raises(ValueError, match="concurrency"):
        replay([], num_blocks=4, block_size=4, concurrency=0)
    with pytest.raises(ValueError, match="md5"):
        replay([], num_blocks=4, block_size=4, hash_algo="md5")
    with pytest.raises(ValueError, match="free_order"):
        replay([], num_blocks=4, block_size=4, free_order="fifo")
    with pytest.raises(ValueError, match="num_blocks"):
        replay([], num_blocks=0, block_size=4)


def test_duplicate_running_id_is_an_error():
    reqs = [TraceRequest("same", [1, 2, 3], 1), TraceRequest("same", [4, 5, 6], 1)]
    with pytest.raises(ValueError, match="already running"):
        replay(reqs, num_blocks=8, block_size=4, concurrency=2)


def test_progress_bar_does_not_change_results():
    reqs = [TraceRequest(f"r{i}", [1, 2, 3, 4, 5, i + 10], 2) for i in range(5)]
    a, _ = run(reqs, num_blocks=8, block_size=4, concurrency=2)
    b, _ = run(reqs, num_blocks=8, block_size=4, concurrency=2, progress=True)
    assert a == b and [r["num_computed_tokens"] for r in a] == [0, 4, 4, 4, 4]


def test_residency_statistics_in_the_replay():
    """residency=: histograms whose counts the replay's own totals fix; off: nothing
    else in the summary changes."""
    from prefixcache.sim import workloads

    reqs = workloads.generate("multi_turn", num_conversations=12, seed=3)

    def run(**kw):
        s = replay(reqs, num_blocks=150, block_size=16, concurrency=4, **kw)
        for k in ("timing", "requests_per_s", "prompt_tokens_per_s"):
            s.pop(k)
        return s

    off, on = run(), run(residency=1.0)
    res = on.pop("residency")
    assert on == off
    gpu = res["tiers"]["GPU"]
    assert gpu["lifetime"]["count"] == on["evictions"] > 0  # every eviction ends a stay
    assert gpu["hits_per_residency"]["count"] == on["evictions"]
    assert gpu["reuse_gap"]["count"] == on["hit_tokens"] // 16  # one gap per hit block
    assert res["resident_at_end"]["GPU"] == on["blocks_cached"] - on["evictions"]
    tier = run(residency=1.0, num_host_blocks=150)["residency"]["tiers"]
    t = run(num_host_blocks=150)
    assert tier["CPU"]["reuse_gap"]["count"] == t["host_hit_tokens"] // 16 > 0
    assert tier["GPU"]["reuse_gap"]["count"] == t["device_hit_tokens"] // 16
    half = run(residency=0.5)["residency"]["tiers"]["GPU"]
    assert 0 < half["lifetime"]["count"] < gpu["lifetime"]["count"]
    assert half == run(residency=0.5)["residency"]["tiers"]["GPU"]  # the same blocks
    for bad in (0, 1.5, "0.1"):
        with pytest.raises(ValueError, match="sample_rate"):
            replay(iter(()), num_blocks=10, block_size=16, residency=bad)
