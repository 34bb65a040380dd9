"""Block residency in the engine (``Engine(residency=RATE)`` -> ``EngineMetrics.residency``):
the histograms' counts are the run's own totals; off: None and no events queued."""

import numpy as np
import pytest

from prefixcache.engine import Engine, SamplingParams
from prefixcache.model import ModelConfig
from prefixcache.serve.engine_core import EngineCore

SMALL = dict(num_blocks=12, block_size=4, max_num_seqs=2, seq_buckets=(2,),
             max_num_batched_tokens=32, token_buckets=(32,), max_model_len=32,
             page_buckets=(8,), seed=0)


def test_engine_residency_histograms_and_the_engine_core_connection():
    """The histograms' counts are the run's own totals; the engine core's output batches,
    msgpack-encoded as between processes, carry the histograms that changed, so the
    front end's copy ends equal to the engine's and renders in /metrics."""
    import msgspec

    from prefixcache.serve.app import build_app
    from prefixcache.serve.engine_core import Output
    from prefixcache.serve.engine_loop import ServingEngine

    eng = Engine(ModelConfig.tiny(), residency=1.0, **SMALL)
    core = EngineCore(eng)
    front = ServingEngine(eng)  # (not started: fed the decoded batches below)
    assert front.residency is not None and front.residency.sample_rate == 1.0
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Output)
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 200, 8).tolist()
    params = SamplingParams(max_tokens=2, temperature=0.0)
    cached = carried = 0
    for k in range(6):  # a shared prefix, then unrelated prompts that evict it
        prompt = (prefix if k % 3 == 0 else rng.integers(3, 200, 8).tolist()) + [5 + k] * 3
        eng.add_request(prompt, params)
        while eng.has_unfinished_requests():
            core.step()
            out = dec.decode(enc.encode(core.take_outputs()))
            cached += sum(u.num_cached_tokens for u in out.updates if u.finish_reason)
            carried += out.residency is not None
            front._process(out)
    assert core.take_outputs().residency is None  # (nothing changed since)
    m = eng.metrics()
    gpu = m.residency["tiers"]["GPU"]
    assert m.num_evictions > 0 and cached > 0
    assert gpu["lifetime"]["count"] == gpu["hits_per_residency"]["count"] == m.num_evictions
    assert gpu["reuse_gap"]["count"] == cached // 4
    assert gpu["lifetime"]["sum"] >= 0  # wall seconds
    assert carried and front.residency.summary()["tiers"] == m.residency["tiers"]
    app = build_app(eng, serving=front, served_model_name="tiny", tokenizer=None)
    assert (f'prefixcache:kv_block_reuse_gap_seconds_count{{model_name="tiny",tier="GPU"}} '
            f'{float(cached // 4)}') in app.state.metrics.render()[0].decode()
    with pytest.raises(ValueError, match="both drain"):
        EngineCore(eng, kv_event_publisher=object())


def test_residency_off_and_checked():
    eng = Engine(ModelConfig.tiny(), **SMALL)
    assert eng.metrics().residency is None and not eng.kv_cache_manager.enable_events
    from prefixcache.serve.engine_loop import ServingEngine

    assert ServingEngine(eng).residency is None
    for bad in (0, 1.5, "0.1"):
        with pytest.raises(ValueError, match="sample_rate"):
            Engine(ModelConfig.tiny(), residency=bad, **SMALL)
    with pytest.raises(ValueError, match="hash index"):
        Engine(ModelConfig.tiny(), residency=1.0, index="radix", **SMALL)


def test_metrics_render_residency_histograms():
    from prefixcache.core.residency import ResidencyTracker
    from prefixcache.serve.metrics import ServerMetrics

    tr = ResidencyTracker(1.0)
    tr._store(7, "GPU", 0.0)
    tr.on_hits([7], 0.5)
    tr.on_hits([7], 2.0)
    tr._remove(7, "GPU", 10.0)
    m = ServerMetrics("tiny")
    m.watch_residency(tr.summary)
    text = m.render()[0].decode()
    assert 'prefixcache:kv_block_lifetime_seconds_count{model_name="tiny",tier="GPU"} 1.0' in text
    assert 'prefixcache:kv_block_lifetime_seconds_sum{model_name="tiny",tier="GPU"} 10.0' in text
    assert 'prefixcache:kv_block_reuse_gap_seconds_count{model_name="tiny",tier="GPU"} 2.0' in text
    assert ('prefixcache:kv_block_hits_per_residency_bucket{le="2.0",model_name="tiny",'
            'tier="GPU"} 1.0') in text
    empty = ServerMetrics("tiny")
    empty.watch_residency(lambda: None)
    assert "kv_block_lifetime_seconds_count" not in empty.render()[0].decode()


def test_serve_flag():
    from prefixcache.serve.cli import parse_args

    args = parse_args(["serve", "tiny", "--engine-in-process", "--residency", "0.01"])
    assert args.residency == 0.01
    for bad in (["--residency", "0"], ["--residency", "x"], ["--engine-in-process",
                "--residency", "1", "--kv-events-endpoint", "tcp://127.0.0.1:5557"]):
        with pytest.raises(SystemExit):
            parse_args(["serve", "tiny", *bad])
    assert parse_args(["serve", "tiny", "--residency", "0.5"]).residency == 0.5  # (either mode)
