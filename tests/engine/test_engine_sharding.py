"""Sharded engine (tensor parallel over kv heads on 8 simulated CPU devices) == 1 device."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from prefixcache.engine import Engine, SamplingParams
from prefixcache.model import ModelConfig


def test_eight_device_run_matches_one_device():
    devices = jax.devices()
    if len(devices) < 8:
        pytest.fail(f"tests/conftest.py should provide 8 CPU devices, got {len(devices)}")
    # 8 kv heads so that all 8 devices hold a share of every layer (8-way TP).
    config = ModelConfig.tiny(num_heads=16, num_kv_heads=8)
    mesh = Mesh(np.array(devices[:8]), ("model",))
    common = dict(num_blocks=48, block_size=16, seed=0, max_num_seqs=4,
                  max_num_batched_tokens=128, max_model_len=512, token_buckets=(128,),
                  seq_buckets=(4,), page_buckets=(32,))
    one = Engine(config, **common)
    eight = Engine(config, mesh=mesh, **common)
    # The KV pages really are split over the 8 devices (2 slots = 1 kv head each).
    kv = eight.runner.kv_caches[0]
    assert len(kv.sharding.device_set) == 8
    assert kv.addressable_shards[0].data.shape[2] == 2
    rng = np.random.default_rng(0)
    system = rng.integers(1, config.vocab_size, 40).tolist()
    prompts = [system + rng.integers(1, config.vocab_size, n).tolist() for n in (3, 20, 9)]
    params = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8),
              SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=4)]
    one.record_logits = eight.record_logits = True
    outs1 = one.generate(prompts, params)
    outs8 = eight.generate(prompts, params)
    assert [o.token_ids for o in outs8] == [o.token_ids for o in outs1]
    assert [o.metrics.num_cached_tokens for o in outs8] == [0, 32, 32]
    for s1, s8 in zip(one.step_logits, eight.step_logits):
        assert s1.keys() == s8.keys()
        for rid in s1:
            np.testing.assert_allclose(s8[rid], s1[rid], atol=1e-4, rtol=0)
