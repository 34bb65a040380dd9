"""EngineMetrics.per_tenant / per_adapter: reuse by cache salt and by LoRA adapter."""

from prefixcache.core import LoRARequest, Request
from prefixcache.engine import Engine, EngineMetrics, SamplingParams
from prefixcache.model import ModelConfig

BS = 16


def test_reuse_per_tenant_and_adapter_sums_to_the_totals():
    engine = Engine(ModelConfig.tiny(), lora_cache_key_only=True, num_blocks=64,
                    block_size=BS, seed=0, max_num_seqs=8, max_num_batched_tokens=256,
                    max_model_len=512, token_buckets=(256,), seq_buckets=(8,),
                    page_buckets=(32,))
    toks = list(range(1, 40))  # 2 full blocks + 7 tokens
    reqs = [Request("a1", toks, cache_salt="t1"), Request("a2", toks, cache_salt="t1"),
            Request("b1", toks, cache_salt="t2", lora=LoRARequest("x", "/x")),
            Request("b2", toks, cache_salt="t2", lora=LoRARequest("x", "/x")),
            Request("c1", toks), Request("c2", toks, lora=LoRARequest("y", "/y"))]
    for r in reqs:  # one at a time: each request sees its predecessors' blocks
        engine.generate([r], SamplingParams(max_tokens=1))
    m = engine.metrics()
    assert isinstance(m, EngineMetrics)
    n = len(toks)
    assert m.per_tenant == {
        "": {"requests": 2, "prompt_tokens": 2 * n, "cached_tokens": 0, "token_hit_rate": 0.0},
        "t1": {"requests": 2, "prompt_tokens": 2 * n, "cached_tokens": 32,
               "token_hit_rate": 32 / (2 * n)},
        "t2": {"requests": 2, "prompt_tokens": 2 * n, "cached_tokens": 32,
               "token_hit_rate": 32 / (2 * n)}}
    assert {k: v["cached_tokens"] for k, v in m.per_adapter.items()} == {"": 32, "x": 32,
                                                                           "y": 0}
    assert sum(v["cached_tokens"] for v in m.per_adapter.values()) == m.num_cached_tokens
    assert sum(v["prompt_tokens"] for v in m.per_tenant.values()) == m.num_prompt_tokens
    assert m.to_dict()["per_tenant"] == m.per_tenant
    engine.reset_metrics()
    assert engine.metrics().per_tenant == {} == engine.metrics().per_adapter
