"""The session-7 features compose: a hybrid (sliding-window) model with LoRA adapters and
int8 KV pages, and a plain model with a host tier, LoRA adapters and the lpm
scheduler -- greedy tokens identical with the prefix cache on and off, with real hits.

Each feature has its own tests; these pin that their seams (per-group tables, per-token
adapter slots, (pages, scales) caches, host transfers, admission order) do not break
one another in one engine step.
"""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache.core import LoRARequest
from prefixcache.engine import Engine, SamplingParams
from prefixcache.model import ModelConfig

COMMON = dict(block_size=8, seed=0, max_num_seqs=4, max_num_batched_tokens=128,
              max_model_len=256, token_buckets=(128,), seq_buckets=(4,), page_buckets=(32,),
              enable_lora=True, max_loras=2, max_lora_rank=8)


def _prompts(config, rng):
    system = rng.integers(1, config.vocab_size, 40).tolist()
    return [system + rng.integers(1, config.vocab_size, 5).tolist() for _ in range(4)]


def _adapters(tmp_path, config, lora_helpers):
    out = []
    for i, targets in enumerate((("q_proj", "v_proj"), lora_helpers.LORA_MODULES)):
        path = tmp_path / f"a{i}"
        lora_helpers.write_peft_adapter(path, config, rank=4 * (i + 1), targets=targets,
                                        seed=i)
        out.append(LoRARequest(f"a{i}", str(path)))
    return out


def _run_twice(engine, prompts, loras):
    """Each prompt under each adapter mix, twice (the second round hits the cache)."""
    greedy = SamplingParams(max_tokens=6)
    tokens, cached = [], []
    for _ in range(2):
        outs = engine.generate(prompts, [greedy] * len(prompts), lora_request=loras)
        tokens.append([o.token_ids for o in outs])
        cached.append([o.metrics.num_cached_tokens for o in outs])
    return tokens, cached


def test_hybrid_model_with_lora_and_int8_pages(tmp_path, lora_helpers):
    config = ModelConfig.tiny_hybrid(dtype="float32")
    a0, a1 = _adapters(tmp_path, config, lora_helpers)
    prompts = _prompts(config, np.random.default_rng(0))
    loras = [a0, a1, None, a0]
    # 128 blocks of one layer page each: vLLM's layout (the 4 one-layer KV groups share
    # one array) -- half the bytes of 64 blocks of 4 per-layer pages.
    kw = dict(COMMON, num_blocks=128, kv_dtype="int8")
    on = Engine(config, enable_caching=True, **kw)
    off = Engine(config, enable_caching=False, share_programs_with=on, **kw)
    tok_on, cached_on = _run_twice(on, prompts, loras)
    tok_off, cached_off = _run_twice(off, prompts, loras)
    assert tok_on == tok_off
    assert tok_on[0][0] != tok_on[0][2]  # the adapter changes the output
    assert sum(cached_off[1]) == 0 and all(c >= 40 for c in cached_on[1])


def test_host_tier_with_lora_and_lpm(tmp_path, lora_helpers):
    config = ModelConfig.tiny(dtype="float32")
    a0, a1 = _adapters(tmp_path, config, lora_helpers)
    rng = np.random.default_rng(1)
    prompts = _prompts(config, rng) + _prompts(config, rng)
    loras = [a0, a1, None, a0, a1, None, a0, a1]
    kw = dict(COMMON, num_blocks=24, scheduling_policy="lpm")
    on = Engine(config, enable_caching=True, num_host_blocks=64, **kw)
    off = Engine(config, enable_caching=False, share_programs_with=on, **kw)
    tok_on, _ = _run_twice(on, prompts, loras)
    tok_off, _ = _run_twice(off, prompts, loras)
    assert tok_on == tok_off
    manager = on.kv_cache_manager
    assert manager.host_hit_tokens > 0 and manager.host_blocks_stored > 0
