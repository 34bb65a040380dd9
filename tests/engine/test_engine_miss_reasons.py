"""Miss reasons in the engine (issue 26 item 1): per request in
``RequestOutput.metrics.miss_reasons``, summed in ``EngineMetrics.miss_reasons``; equal
to the replay's on the same requests; ``preempted`` for KV a preempted request lost."""

from __future__ import annotations

import random
import zlib

import pytest

from prefixcache.core import KVCacheManager, LoRARequest, Request
from prefixcache.engine import Engine, SamplingParams
from prefixcache.engine.scheduler import EngineRequest, Scheduler
from prefixcache.model import ModelConfig
from prefixcache.sim.misses import REASONS, MissAccountant
from prefixcache.sim.replay import replay
from prefixcache.sim.trace import TraceRequest


def _blocks(n, bs):
    return -(-n // bs)


def test_preempted_blocks_and_the_sum_per_admission():
    # 6 blocks of 4: two requests of 8 prompt tokens growing by decode; b is preempted
    # and its computed blocks are reused by a before b comes back.
    bs = 4
    mgr = KVCacheManager(6, bs)
    sched = Scheduler(mgr, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1000)
    acct = sched.miss_accountant = MissAccountant.for_manager(mgr)
    admissions = []
    admit = acct.admit

    def spy(request, num_hit, reasons=None):
        admissions.append((request.request_id, request.num_tokens, num_hit,
                           request.num_preemptions, dict(reasons)))
        return admit(request, num_hit, reasons)

    acct.admit = spy
    states = {}
    for rid, toks in (("a", range(1, 9)), ("b", range(20, 28))):
        states[rid] = EngineRequest(Request(rid, list(toks)), SamplingParams(max_tokens=12), 0)
        sched.add_request(states[rid])
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sampled = {s.request_id: 1 + zlib.crc32(f"{s.request_id}:{s.state.num_output_tokens}"
                                                .encode()) % 50
                   for s in out.scheduled if s.completes_sequence}
        sched.update_from_output(out, sampled)
    assert states["b"].num_preemptions >= 1
    for rid, n, hit, preemptions, reasons in admissions:
        assert sum(v for k, v in reasons.items() if k in REASONS) == _blocks(n, bs) - hit // bs
        if not preemptions:
            assert "preempted" not in reasons  # only a re-admission lost its own KV
    assert sum(r[4].get("preempted", 0) for r in admissions) > 0
    # The scheduler's per-request sum is the admissions' sum.
    mr = states["b"].miss_reasons
    assert sum(mr.values()) == sum(sum(r[4].values()) for r in admissions if r[0] == "b")


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_engine_reasons_equal_the_replays(index):
    bs = 16
    engine = Engine(ModelConfig.tiny(), lora_cache_key_only=True, num_blocks=12,
                    block_size=bs, seed=0, max_num_seqs=4, max_num_batched_tokens=128,
                    max_model_len=256, token_buckets=(128,), seq_buckets=(4,),
                    page_buckets=(16,), miss_reasons=True, index=index)
    system = list(range(1, 49))  # 3 blocks shared
    trace = []
    for i in range(10):
        salt = "t1" if i in (3, 4) else None
        lora = ("x", "/x") if i == 6 else None
        body = [50 + (i * 7 + j) % 60 for j in range(8 + 11 * (i % 4))]
        trace.append(TraceRequest(f"r{i}", system + body, 1, cache_salt=salt, lora=lora))
    # exactly r1's first 4 blocks, all cached (last_token); r2 again, evicted by then
    trace.insert(2, TraceRequest("x1", trace[1].prompt[:64], 1))
    trace.append(TraceRequest("x2", trace[3].prompt, 1))
    outs = []
    for tr in trace:  # one at a time: each request sees its predecessors' blocks
        lora = LoRARequest(*tr.lora) if tr.lora else None
        req = Request(tr.id, tr.prompt, cache_salt=tr.cache_salt, lora=lora)
        outs += engine.generate([req], SamplingParams(max_tokens=1))
    recs = []
    mgr = engine.kv_cache_manager
    pool = getattr(mgr, "block_pool", None)
    summary = replay(trace, num_blocks=12, block_size=bs, concurrency=1, index=index,
                     hash_algo="sha256",
                     free_order=pool.free_order if pool is not None else "append",
                     max_model_len=256, miss_reasons=True, on_record=recs.append)
    assert [o.metrics.miss_reasons for o in outs] == [r["miss_reasons"] for r in recs]
    got = {r for o in outs for r in o.metrics.miss_reasons}
    assert {"cold", "isolated", "partial", "evicted", "last_token"} <= got, got
    m = engine.metrics()
    assert m.miss_reasons == summary["miss_reasons"]
    assert m.miss_reasons["missed_blocks"] == sum(
        _blocks(o.metrics.num_prompt_tokens, bs) - o.metrics.num_cached_tokens // bs
        for o in outs)
    engine.reset_metrics()
    assert engine.metrics().miss_reasons["missed_blocks"] == 0


def _sliding_trace(seed, n=20):
    # Random prompts of at most 63 tokens (one step: no chunked prefill), half of them
    # a prefix of an earlier one plus new tokens; a salted copy (isolated) and an exact
    # whole-block prefix of an earlier prompt (last_token).
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        if prompts and rng.random() < 0.5:
            p = rng.choice(prompts)
            p = p[:rng.randrange(8, len(p) + 1)] + [rng.randrange(1, 200)
                                                     for _ in range(rng.randrange(0, 20))]
        else:
            p = [rng.randrange(1, 200) for _ in range(rng.randrange(10, 40))]
        prompts.append(p[:63])
    trace = [TraceRequest(f"r{i}", p, 1) for i, p in enumerate(prompts)]
    trace.insert(3, TraceRequest("salted", trace[2].prompt, 1, cache_salt="t1"))
    trace.insert(4, TraceRequest("exact", trace[2].prompt[:8], 1))
    return trace


def test_engine_sliding_window_reasons_equal_the_replays():
    # A sliding-window model (S,S,F,S, window 16 = 2 blocks), the hash index with and
    # without a host tier, the radix index (SWA radix tree): the engine probes its hybrid coordinator (no events), and its
    # reasons, per request and summed (window ones included), are the replay's (events
    # mode) on the same trace. The KV events a publisher would send are byte-equal to
    # those of the same engine without miss reasons (the accountant takes none).
    from prefixcache.serve.kv_events import encode_batch

    bs = 8
    config = ModelConfig.tiny_hybrid()
    first = None
    for index, num_host, evicted, seed in (("hash", 16, "evicted_host", 4),
                                           ("hash", 0, "evicted_device", 4),
                                           ("radix", 0, "evicted_device", 0)):
        trace = _sliding_trace(seed)  # (seeds whose traces have window misses)
        kw = dict(index=index, num_blocks=24, num_host_blocks=num_host, block_size=bs, seed=0,
                  max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                  token_buckets=(64,), seq_buckets=(4,), page_buckets=(16,),
                  manager_kwargs={"enable_events": True})
        engine = Engine(config, miss_reasons=True, share_programs_with=first, **kw)
        first = first or engine
        plain = Engine(config, share_programs_with=first, **kw)
        outs, wires = [], {id(engine): [], id(plain): []}
        for tr in trace:  # one at a time: each request sees its predecessors' blocks
            for e in (engine, plain):
                o = e.generate([Request(tr.id, tr.prompt, cache_salt=tr.cache_salt)],
                               SamplingParams(max_tokens=1))
                if e is engine:
                    outs += o
                wires[id(e)].append(encode_batch(e.kv_cache_manager.take_events(), ts=0.0))
        assert wires[id(engine)] == wires[id(plain)]
        assert sum(len(w) for w in wires[id(plain)]) > 40 * len(trace)  # (events queued)
        assert plain.metrics().miss_reasons is None
        recs = []
        mgr = engine.kv_cache_manager
        pool = getattr(mgr, "block_pool", None)
        summary = replay(trace, index=index, num_blocks=24, num_host_blocks=num_host,
                         block_size=bs,
                         concurrency=1, kv_cache_groups=mgr.kv_cache_groups,
                         hash_algo="sha256",
                         free_order=pool.free_order if pool is not None else "append",
                         max_model_len=128, miss_reasons=True, on_record=recs.append)
        assert [o.metrics.miss_reasons for o in outs] == [r["miss_reasons"] for r in recs]
        got = {r for o in outs for r in o.metrics.miss_reasons}
        assert {"cold", "isolated", "partial", evicted, "last_token", "window"} <= got, got
        m = engine.metrics()
        assert m.miss_reasons == summary["miss_reasons"]
        assert m.miss_reasons["missed_blocks"] == sum(
            _blocks(o.metrics.num_prompt_tokens, bs) - o.metrics.num_cached_tokens // bs
            for o in outs)
    # a reset (not an eviction) starts the accounting afresh: the evictions before it
    # are forgotten, the prompts are cold again
    before = set(engine.scheduler.miss_accountant._dropped)
    assert before
    assert mgr.reset_prefix_cache()
    again = engine.generate([Request("again", trace[-1].prompt)], SamplingParams(max_tokens=1))
    assert set(again[0].metrics.miss_reasons) <= {"cold", "partial"}
    assert not before & set(engine.scheduler.miss_accountant._dropped)


def test_engine_off_and_refusals():
    # One rule (misses.probe_refusal): the engine probes the hash or radix index, of one
    # full-attention group or of a layout of full-attention and sliding-window groups;
    # anything else is refused before anything is built (the replay classifies it from
    # events).
    from prefixcache.core.kv_cache_manager import HashKVCacheManager
    from prefixcache.core.kv_groups import parse_kv_groups
    from prefixcache.sim.misses import probe_refusal

    assert probe_refusal("hash", None) is None and probe_refusal("radix", None) is None
    assert probe_refusal("radix", parse_kv_groups("full,sw16")) is None
    assert "state checkpoints" in probe_refusal("hash", parse_kv_groups("full,mamba"))
    assert "only sliding-window" in probe_refusal("hash", parse_kv_groups("sw16,sw32"))

    class MyIndex(HashKVCacheManager):
        INDEX_NAME = "my_index"

    with pytest.raises(ValueError, match="miss_reasons=True: .*index=.*MyIndex.* probe "
                                         "the hash or radix index"):
        Engine(ModelConfig.tiny(), num_blocks=8, block_size=16, miss_reasons=True,
               index=MyIndex)
