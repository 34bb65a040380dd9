"""LoRA adapters through the engine (tiny model, f32): the prefix cache keys on the
adapter (same adapter + prompt hits, another never does), greedy tokens and logits are
the same with the cache on and off for batches mixing adapters and the base model, one
compiled program serves every adapter mix, and requests whose adapter gets no slot wait."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from prefixcache.core import LoRARequest
from prefixcache.engine import Engine, SamplingParams
from prefixcache.model import ModelConfig

BS = 16
BUCKETS = dict(token_buckets=(128,), seq_buckets=(8,), page_buckets=(16,))
COMMON = dict(num_blocks=96, block_size=BS, seed=0, max_num_seqs=8,
              max_num_batched_tokens=128, max_model_len=256, enable_lora=True,
              max_loras=2, max_lora_rank=8, **BUCKETS)


@pytest.fixture(scope="module")
def config():
    return ModelConfig.tiny()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, config, lora_helpers):
    """Three adapters (names a, b, c) of different ranks and targets."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {"a": dict(rank=4, seed=1), "b": dict(rank=8, seed=2, use_rslora=True),
             "c": dict(rank=2, seed=3, targets=("k_proj", "o_proj", "up_proj"))}
    out = {}
    for name, kw in specs.items():
        lora_helpers.write_peft_adapter(root / name, config, **kw)
        out[name] = LoRARequest(name, str(root / name))
    return out


@pytest.fixture(scope="module")
def engines(config):
    cached = Engine(config, enable_caching=True, **COMMON)
    uncached = Engine(config, enable_caching=False, share_programs_with=cached, **COMMON)
    cached.record_logits = uncached.record_logits = True
    return cached, uncached


def test_cache_hits_only_under_the_same_adapter(config, adapters, engines):
    engine = Engine(config, share_programs_with=engines[0], **COMMON)  # a fresh cache
    mgr = engine.kv_cache_manager
    prompt = np.random.default_rng(0).integers(1, config.vocab_size, 48).tolist()
    a, b = adapters["a"], adapters["b"]
    sp = SamplingParams(max_tokens=4)
    first = engine.generate([prompt], sp, lora_request=a)[0]
    mgr.make_prefix_cache_stats()  # the stats of an interval (reset on each call)
    again = engine.generate([prompt], sp, lora_request=a)[0]
    stats1 = mgr.make_prefix_cache_stats()
    # 48 tokens: at most 47 can hit, i.e. two full blocks of 16.
    assert first.metrics.num_cached_tokens == 0 and again.metrics.num_cached_tokens == 32
    assert (stats1.requests, stats1.queries, stats1.hits) == (1, 48, 32)
    assert again.token_ids == first.token_ids
    # Another adapter, or none, on the same tokens never hits the adapter's blocks.
    other = engine.generate([prompt], sp, lora_request=b)[0]
    base = engine.generate([prompt], sp)[0]
    stats2 = mgr.make_prefix_cache_stats()
    assert other.metrics.num_cached_tokens == base.metrics.num_cached_tokens == 0
    assert (stats2.requests, stats2.queries, stats2.hits) == (2, 96, 0)
    assert len({tuple(o.token_ids) for o in (first, other, base)}) == 3


def _logits_by_request(engine):
    out = {}
    for step in engine.step_logits:
        for rid, row in step.items():
            out.setdefault(rid, []).append(row)
    engine.step_logits.clear()
    return out


def test_mixed_adapters_same_tokens_cache_on_and_off(config, adapters, engines):
    cached, uncached = engines
    rng = np.random.default_rng(1)
    shared = rng.integers(1, config.vocab_size, 40).tolist()
    prompts, loras = [], []
    # Each adapter (and the base model) on the shared prefix and on its own prompt; three
    # adapters for max_loras=2 slots: some requests wait for a slot, slots are reloaded.
    for k, lo in enumerate([adapters["a"], None, adapters["b"], adapters["c"],
                            adapters["a"], None, adapters["c"], adapters["b"]]):
        tail = rng.integers(1, config.vocab_size, 5 + 3 * k).tolist()
        prompts.append(shared + tail if k % 2 == 0 else tail + shared)
        loras.append(lo)
    sp = SamplingParams(max_tokens=6)
    outs = {}
    for engine in (cached, uncached):
        with jax.transfer_guard("disallow"):
            outs[engine] = engine.generate(prompts, sp, lora_request=loras)
        outs[engine, "logits"] = _logits_by_request(engine)
    for c, u in zip(outs[cached], outs[uncached]):
        assert c.error is None and u.error is None
        assert c.token_ids == u.token_ids, c.request_id
        np.testing.assert_allclose(np.stack(outs[cached, "logits"][c.request_id]),
                                   np.stack(outs[uncached, "logits"][u.request_id]),
                                   atol=1e-4, rtol=1e-4)
    assert cached.metrics().num_cached_tokens > 0
    assert uncached.metrics().num_cached_tokens == 0
    # The same prompt under the same adapter twice (k=0 and k=4 share only `shared`):
    # the cache reused 32 tokens of the shared prefix for k=4 but not for k=2 (adapter b).
    hits = [o.metrics.num_cached_tokens for o in outs[cached]]
    assert hits[4] == 32 and hits[2] == 0
    assert cached.runner.lora_slots.num_loads >= 3  # 3 adapters through 2 slots
    # One compiled step program for every mix of adapters (same shapes).
    before = cached.runner.program._jitted_packed._cache_size()
    cached.generate(prompts[:3][::-1], sp, lora_request=[adapters["c"], None, adapters["a"]])
    assert cached.runner.program._jitted_packed._cache_size() == before


@pytest.fixture(scope="module")
def one_slot(config):
    """An engine with a single adapter slot (its compiled programs are shared)."""
    return Engine(config, **dict(COMMON, max_loras=1))


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_adapter_without_a_slot_waits(config, adapters, policy, one_slot):
    engine = Engine(config, scheduling_policy=policy, share_programs_with=one_slot,
                    **dict(COMMON, max_loras=1))
    sp = SamplingParams(max_tokens=3)
    ids = [engine.add_request([5, 6, 7], sp, lora_request=adapters["a"]),
           engine.add_request([5, 6, 8], sp, lora_request=adapters["b"]),
           engine.add_request([5, 6, 9], sp),
           engine.add_request([5, 6, 10], sp, lora_request=adapters["a"])]
    engine.step()
    # b gets no slot while a runs: skipped (not blocking the base and the other a).
    assert [s.request_id for s in engine.last_scheduler_output.scheduled] == [
        ids[0], ids[2], ids[3]]
    assert [s.request_id for s in engine.scheduler.waiting] == [ids[1]]
    finished = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None and len(out.token_ids) == 3
            finished.append(out.request_id)
    assert finished[-1] == ids[1]
    assert engine.runner.lora_slots.num_loads == 2


def test_sharded_engine_applies_adapters_as_one_device(config, adapters, engines):
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    one = engines[1]  # no prefix caching: the cache state of earlier tests is irrelevant
    one.step_logits.clear()
    two = Engine(config, mesh=mesh, **COMMON)
    assert len(two.runner.lora_slots.weights["q_proj"][0].sharding.device_set) == 2
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, config.vocab_size, n).tolist() for n in (9, 30, 17)]
    loras = [adapters["a"], None, adapters["c"]]
    sp = SamplingParams(max_tokens=5)
    two.record_logits = True
    outs1 = one.generate(prompts, sp, lora_request=loras)
    outs2 = two.generate(prompts, sp, lora_request=loras)
    assert [o.token_ids for o in outs2] == [o.token_ids for o in outs1]
    l1, l2 = _logits_by_request(one), _logits_by_request(two)
    for o1, o2 in zip(outs1, outs2):
        np.testing.assert_allclose(np.stack(l2[o2.request_id]), np.stack(l1[o1.request_id]),
                                   atol=1e-4, rtol=1e-4)
