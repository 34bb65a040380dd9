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


def test_engine_residency_histograms():
    eng = Engine(ModelConfig.tiny(), residency=1.0, **SMALL)
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 200, 8).tolist()
    params = SamplingParams(max_tokens=2, temperature=0.0)
    cached = 0
    for k in range(6):  # a shared prefix, then unrelated prompts that evict it
        prompt = (prefix if k % 3 == 0 else rng.integers(3, 200, 8).tolist()) + [5 + k] * 3
        eng.add_request(prompt, params)
        while eng.has_unfinished_requests():
            for out in eng.step():
                cached += out.metrics.num_cached_tokens if out.finished else 0
    m = eng.metrics()
    gpu = m.residency["tiers"]["GPU"]
    assert m.num_evictions > 0 and cached > 0
    assert gpu["lifetime"]["count"] == gpu["hits_per_residency"]["count"] == m.num_evictions
    assert gpu["reuse_gap"]["count"] == cached // 4
    assert gpu["lifetime"]["sum"] >= 0  # wall seconds
    with pytest.raises(ValueError, match="both drain"):
        EngineCore(eng, kv_event_publisher=object())


def test_residency_off_and_checked():
    eng = Engine(ModelConfig.tiny(), **SMALL)
    assert eng.metrics().residency is None and not eng.kv_cache_manager.enable_events
    for bad in (0, 1.5, "0.1"):
        with pytest.raises(ValueError, match="sample_rate"):
            Engine(ModelConfig.tiny(), residency=bad, **SMALL)
    with pytest.raises(ValueError, match="hash index"):
        Engine(ModelConfig.tiny(), residency=1.0, index="radix", **SMALL)
