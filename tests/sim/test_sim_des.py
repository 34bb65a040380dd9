"""Discrete-event simulation: hand-computed TTFTs, cache effects, preemption, errors."""

import pytest

from prefixcache.sim import cost_model as cm
from prefixcache.sim import des
from prefixcache.sim.trace import TraceRequest

TOY = cm.ModelShape(num_layers=1, d_model=4, num_q_heads=2, num_kv_heads=1, head_dim=2,
                    ffn_dim=8, vocab_size=10, dtype_bytes=2)
# Compute-only toy chip: bandwidth so high that every step is compute bound.
TOY_MODEL = cm.CostModel(TOY, cm.Accelerator("toy", peak_flops=1000.0, hbm_bandwidth=1e30,
                                             hbm_bytes=1e6))


def _req(rid, prompt, out=1, t=0.0, **kw):
    return TraceRequest(id=rid, prompt=list(prompt), output_len=out, timestamp=t, **kw)


def _run(reqs, **kw):
    recs = []
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("cost_model", TOY_MODEL)
    summary = des.simulate(reqs, on_record=recs.append, **kw)
    return summary, {r["id"]: r for r in recs}


def test_single_request_ttft_is_the_prefill_time():
    summary, recs = _run([_req("a", range(1, 11), out=1, t=2.0)])
    # Alone, no queue: TTFT = prefill of 10 tokens = prefill_flops(10, 0) / 1000.
    assert recs["a"]["ttft_s"] == pytest.approx(cm.prefill_flops(TOY, 10, 0) / 1000.0)
    assert recs["a"]["queue_s"] == 0.0
    assert summary["makespan_s"] == pytest.approx(2.0 + recs["a"]["ttft_s"])
    assert summary["cache_state"] == "cold"


def test_chunked_prefill_sums_chunk_times_and_decode_steps():
    sched = des.SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=4)
    _, recs = _run([_req("a", range(1, 11), out=3)], scheduler=sched)
    f = lambda n, c: cm.prefill_flops(TOY, n, c) / 1000.0  # noqa: E731
    # Chunks of 4, 4, 2 tokens; then 2 decode steps over 10 and 11 cached tokens.
    ttft = f(4, 0) + f(4, 4) + f(2, 8)
    assert recs["a"]["ttft_s"] == pytest.approx(ttft)
    assert recs["a"]["e2e_s"] == pytest.approx(ttft + f(1, 10) + f(1, 11))
    assert recs["a"]["output_tokens"] == 3


def test_more_cached_tokens_lower_ttft():
    # The same 33-token prompt with 0, 1, ..., 8 leading blocks cached (block size 4):
    # each probe's prefix was prefilled by a warm-up request earlier.
    prompt = list(range(100, 133))
    reqs, warm = [], []
    for k in range(9):
        head = prompt[: 4 * k]
        probe = head + [1000 + 50 * k + j for j in range(33 - len(head))]
        warm.append(_req(f"w{k}", head + [999], t=0.0) if head else None)
        reqs.append(_req(f"p{k}", probe, t=1000.0 * (k + 1)))  # far apart: no queueing
    summary, recs = _run(reqs, warmup=[w for w in warm if w is not None], num_blocks=256)
    assert summary["cache_state"] == "warm" and summary["warmup_prompts"] == 8
    hits = [recs[f"p{k}"]["num_cached_tokens"] for k in range(9)]
    assert hits == [4 * k for k in range(9)]
    ttfts = [recs[f"p{k}"]["ttft_s"] for k in range(9)]
    assert all(a > b for a, b in zip(ttfts, ttfts[1:])), ttfts


def test_second_identical_request_hits_and_queues_behind_the_first():
    p = list(range(1, 42))
    summary, recs = _run([_req("a", p, out=1, t=0.0), _req("b", p, out=1, t=0.0)],
                         scheduler=des.SchedulerConfig(max_num_batched_tokens=41))
    # Both arrive at 0; the budget fits one prompt, so b waits one step and then
    # hits a's 10 full blocks (40 tokens).
    assert recs["b"]["num_cached_tokens"] == 40
    assert recs["b"]["queue_s"] == pytest.approx(recs["a"]["ttft_s"])
    assert summary["hit_tokens"] == 40


def test_small_pool_preempts_but_finishes_everything():
    reqs = [_req(f"r{i}", [i + 1] * 12, out=8, t=0.0) for i in range(6)]
    # 6 blocks of 4: each request needs ceil((12 + 7) / 4) = 5 blocks at its end.
    summary, recs = _run(reqs, num_blocks=6)
    assert summary["finished"] == 6 and summary["failed"] == 0
    assert summary["preemptions"] > 0
    assert all(r["output_tokens"] == 8 for r in recs.values())


def test_request_larger_than_the_pool_fails_and_others_go_on():
    reqs = [_req("big", range(1, 40), out=1), _req("ok", range(50, 60), out=2, t=1.0)]
    summary, recs = _run(reqs, num_blocks=4)  # big needs 10 blocks
    assert recs["big"]["failed"].startswith("needs 10 blocks")
    assert "ttft_s" not in recs["big"]
    assert recs["ok"]["output_tokens"] == 2
    assert (summary["finished"], summary["failed"]) == (1, 1)


def test_poisson_arrivals_and_timestamp_errors():
    no_ts = [TraceRequest(id=f"x{i}", prompt=[1, 2, 3], output_len=1) for i in range(3)]
    with pytest.raises(ValueError, match="no timestamp"):
        _run(no_ts)
    s1, r1 = _run(no_ts, arrival_rate=2.0, seed=1)
    s2, r2 = _run(no_ts, arrival_rate=2.0, seed=1)
    assert r1 == r2 and s1["finished"] == 3  # deterministic
    with pytest.raises(ValueError, match="non-decreasing"):
        _run([_req("a", [1, 2], t=5.0), _req("b", [1, 2], t=1.0)])
    with pytest.raises(ValueError, match="arrival_rate"):
        _run(no_ts, arrival_rate=0.0)


def test_bucket_by_and_percentiles():
    recs = [{"c": 0, "v": 1.0}, {"c": 5, "v": 3.0}, {"c": 10, "v": 5.0}, {"c": 3}]
    out = des.bucket_by(recs, "c", "v", [0, 5, 10])
    assert [(b["lo"], b["hi"], b["count"], b["mean"]) for b in out] == [
        (0, 5, 1, 1.0), (5, 10, 2, 4.0)]
    with pytest.raises(ValueError, match="increasing"):
        des.bucket_by(recs, "c", "v", [0, 0])


def test_eviction_policy_passes_to_the_manager():
    # The same preempting run under each online policy finishes everything; belady
    # (offline) is rejected before anything runs.
    reqs = [_req(f"r{i}", [i % 2 + 1] * 8 + [i + 3] * 4, out=8, t=0.0) for i in range(6)]
    for ev in ("fifo", "lfu", "cost"):
        summary, recs = _run(reqs, num_blocks=8, eviction=ev)
        assert summary["finished"] == 6 and summary["evictions"] > 0
    with pytest.raises(ValueError, match="needs the trace's future"):
        _run(reqs, eviction="belady")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        _run(reqs, eviction="nope")
