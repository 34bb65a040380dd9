"""The engine with `scan_layers=True` (stacked params and KV): the same greedy tokens and
logits as the unrolled engine, prefix-cache hits included; refusals at the boundary."""
import numpy as np
import pytest

from prefixcache.engine import Engine, SamplingParams
from prefixcache.model import ModelConfig

# One bucket per axis: one compiled program per engine.
COMMON = dict(num_blocks=32, block_size=8, seed=0, max_num_seqs=2, max_num_batched_tokens=64,
              max_model_len=128, token_buckets=(64,), seq_buckets=(2,), page_buckets=(16,))


def test_scanned_engine_matches_unrolled_with_prefix_hits():
    config = ModelConfig.tiny(num_layers=3)
    unrolled = Engine(config, **COMMON)
    scanned = Engine(config, model=unrolled.model, scan_layers=True, **COMMON)
    assert scanned.runner.kv_caches.shape[0] == 3  # one stacked array
    rng = np.random.default_rng(0)
    shared = rng.integers(1, config.vocab_size, 24).tolist()
    prompts = [shared + rng.integers(1, config.vocab_size, 5).tolist() for _ in range(2)]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    for engine in (unrolled, scanned):
        engine.record_logits = True
    outs = {}
    for name, engine in (("unrolled", unrolled), ("scanned", scanned)):
        first = engine.generate(prompts[:1], params)
        second = engine.generate(prompts[1:], params)  # hits the first's 3 full blocks
        assert second[0].metrics.num_cached_tokens == 24, name
        logits = [row for step in engine.step_logits for row in step.values()]
        outs[name] = ([o.token_ids for o in first + second], np.stack(logits))
    assert outs["scanned"][0] == outs["unrolled"][0]
    np.testing.assert_allclose(outs["scanned"][1], outs["unrolled"][1], rtol=1e-5, atol=1e-5)


def test_scanned_engine_refuses_the_host_tier():
    with pytest.raises(ValueError, match="scan_layers=True does not take num_host_blocks"):
        Engine(ModelConfig.tiny(), scan_layers=True, num_host_blocks=8, **COMMON)
