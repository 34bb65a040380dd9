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


# -- the host memo of adapters (max_cpu_loras) ---------------------------------------


@pytest.fixture(scope="module")
def many_adapters(tmp_path_factory, config, lora_helpers):
    """Six adapters m0..m5 (ranks 2-4)."""
    root = tmp_path_factory.mktemp("many")
    out = []
    for k in range(6):
        lora_helpers.write_peft_adapter(root / f"m{k}", config, rank=2 + k % 3, seed=10 + k)
        out.append(LoRARequest(f"m{k}", str(root / f"m{k}")))
    return out


def _key(lo):
    return (lo.name, lo.path)


def test_host_adapter_memo_is_bounded_and_tokens_unchanged(config, many_adapters, engines):
    bounded = Engine(config, share_programs_with=engines[0], **dict(COMMON, max_cpu_loras=3))
    unbounded = Engine(config, share_programs_with=engines[0],
                       **dict(COMMON, max_cpu_loras=100))
    bounded.record_logits = unbounded.record_logits = True
    rng = np.random.default_rng(3)
    # 12-token prompts: no full block, so nothing is served from the prefix cache and
    # every token is computed with the adapter weights as (re-)read.
    prompt0 = rng.integers(1, config.vocab_size, 12).tolist()
    sp = SamplingParams(max_tokens=4)
    m = many_adapters
    first = bounded.generate([prompt0], sp, lora_request=m[0])[0]
    first_logits = _logits_by_request(bounded)[first.request_id]
    read0 = bounded.lora_adapters[_key(m[0])]
    sizes, dropped0 = [], False
    # One at a time, then a batch naming five adapters at once: all pinned while they
    # wait, with m4 still in a device slot, the memo holds six until the next add
    # trims it; then single ones again.
    batches = [[m[1]], [m[2]], [m[3]], [m[4]], [m[5], m[1], m[3], m[0], m[2]], [None],
               [m[4]], [m[5]]]
    for loras in batches:
        prompts = [rng.integers(1, config.vocab_size, 12).tolist() for _ in loras]
        out_b = bounded.generate(prompts, sp, lora_request=loras)
        out_u = unbounded.generate(prompts, sp, lora_request=loras)
        assert [o.token_ids for o in out_b] == [o.token_ids for o in out_u]
        assert all(o.error is None for o in out_b)
        sizes.append(len(bounded.lora_adapters))
        dropped0 |= _key(m[0]) not in bounded.lora_adapters
    _logits_by_request(bounded), _logits_by_request(unbounded)
    assert sizes == [2, 3, 3, 3, 6, 3, 3, 3]
    assert len(unbounded.lora_adapters) == 6
    # m0 was dropped and read again (a new object) by the batch; now dropped again.
    assert dropped0 and _key(m[0]) not in bounded.lora_adapters
    again = bounded.generate([prompt0], sp, lora_request=m[0])[0]
    assert bounded.lora_adapters[_key(m[0])] is not read0  # re-read from disk
    assert again.token_ids == first.token_ids
    np.testing.assert_allclose(np.stack(_logits_by_request(bounded)[again.request_id]),
                               np.stack(first_logits), atol=1e-6, rtol=1e-6)
    # Least recently used first: m0 (just added and run) is the most recent.
    assert list(bounded.lora_adapters)[-1] == _key(m[0]) and len(bounded.lora_adapters) == 3


def test_memo_keeps_adapters_of_waiting_requests_and_device_slots(config, adapters,
                                                                   one_slot):
    engine = Engine(config, share_programs_with=one_slot,
                    **dict(COMMON, max_loras=1, max_cpu_loras=1))
    sp = SamplingParams(max_tokens=2)
    a, b, c = adapters["a"], adapters["b"], adapters["c"]
    for k, lo in enumerate((a, b, c)):
        engine.add_request([5, 6, 7 + k], sp, lora_request=lo)
    # Three waiting requests name three adapters: none may go (a step reads them).
    assert list(engine.lora_adapters) == [_key(a), _key(b), _key(c)]
    while engine.has_unfinished_requests():
        engine.step()
    # One slot: a, then b, then c ran; c holds the slot. The next add trims the memo
    # to what is pinned: c (in the slot); the new request names no adapter.
    assert list(engine.runner.lora_slots.resident) == [_key(c)]
    engine.add_request([5, 6, 9], sp)
    assert list(engine.lora_adapters) == [_key(c)]
    while engine.has_unfinished_requests():
        engine.step()


def test_dropped_adapter_is_validated_again(config, one_slot, tmp_path, lora_helpers):
    engine = Engine(config, share_programs_with=one_slot,
                    **dict(COMMON, max_loras=1, max_cpu_loras=1))
    x, y = (LoRARequest(n, str(tmp_path / n)) for n in "xy")
    lora_helpers.write_peft_adapter(tmp_path / "x", config, rank=4, seed=5)
    lora_helpers.write_peft_adapter(tmp_path / "y", config, rank=4, seed=6)
    sp = SamplingParams(max_tokens=2)
    engine.generate([[1, 2, 3]], sp, lora_request=x)
    engine.generate([[1, 2, 4]], sp, lora_request=y)
    # When y was added, x still held the slot; the next add drops x (neither named by a
    # request nor in the slot any more).
    assert list(engine.lora_adapters) == [_key(x), _key(y)]
    engine.generate([[1, 2, 6]], sp)
    assert list(engine.lora_adapters) == [_key(y)]
    # The file changed on disk: requesting x again reads and checks it again.
    lora_helpers.write_peft_adapter(tmp_path / "x", config, rank=12, seed=5)
    with pytest.raises(ValueError, match=r"rank r=12 exceeds max_lora_rank=8"):
        engine.add_request([1, 2, 5], sp, lora_request=x)
    assert not engine.has_unfinished_requests()
    assert list(engine.lora_adapters) == [_key(y)]


# -- refused before anything is built --------------------------------------------------


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test if the manager, the model, the LoRA slots or the runner get built."""
    import prefixcache.core
    import prefixcache.model.lora
    from prefixcache.engine import engine as engine_mod

    def boom(*a, **k):
        raise AssertionError("built before the bad input was refused")
    monkeypatch.setattr(prefixcache.core, "KVCacheManager", boom)
    monkeypatch.setattr(prefixcache.model.lora, "LoRASlots", boom)
    monkeypatch.setattr(engine_mod, "ModelRunner", boom)
    monkeypatch.setattr(engine_mod, "_init_model", boom)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_cpu_loras": 1}, r"max_cpu_loras \(1\) must be >= max_loras \(2\)"),
    ({"max_cpu_loras": 0}, "max_cpu_loras must be a positive int"),
    ({"max_cpu_loras": 2.0}, "max_cpu_loras must be a positive int"),
    ({"max_cpu_loras": True}, "max_cpu_loras must be a positive int"),
])
def test_bad_max_cpu_loras_refused(config, kwargs, match, nothing_built):
    with pytest.raises(ValueError, match=match):
        Engine(config, **dict(COMMON, **kwargs))


def test_lora_weights_counted_with_the_kv_arrays_before_anything_is_built(
        config, engines, monkeypatch, nothing_built):
    import prefixcache._validate
    from prefixcache.model import check_kv_cache_memory
    from prefixcache.model.lora import lora_weights_nbytes

    lora_bytes = lora_weights_nbytes(config, max_loras=2, max_lora_rank=8)
    # The formula is the bytes of the arrays an engine holds (3 slots, rank 8).
    held = engines[0].runner.lora_slots.weights
    assert lora_bytes == sum(a.nbytes + b.nbytes for a, b in held.values())
    kv_bytes = check_kv_cache_memory(config, COMMON["num_blocks"] + 1, BS)
    avail = kv_bytes + lora_bytes - 1
    monkeypatch.setattr(prefixcache._validate, "available_host_memory", lambda: avail)
    # Each fits alone; together they do not.
    with pytest.raises(ValueError, match=(
            r"the stacked LoRA weights \(max_loras=2 \+ 1 slots x max_lora_rank=8: A and "
            rf"B of 7 modules x {config.num_layers} layers, float32\), {lora_bytes} bytes")):
        Engine(config, **COMMON)
    with pytest.raises(AssertionError, match="built before"):  # no LoRA: the KV fits
        Engine(config, **dict(COMMON, enable_lora=False))
    monkeypatch.setattr(prefixcache._validate, "available_host_memory",
                        lambda: avail + 1)
    with pytest.raises(AssertionError, match="built before"):  # exactly enough
        Engine(config, **COMMON)


def test_device_check_counts_replicated_lora_weights_per_device(config):
    """On a device reporting its memory, a mesh splits the KV heads over "model" but
    every device holds all the LoRA weights."""
    import types

    from prefixcache.model import check_kv_cache_memory

    kv = check_kv_cache_memory(config, 9, BS)

    class Device:
        free = kv // 2 + 1000

        def memory_stats(self):
            return {"bytes_limit": self.free + 5, "bytes_in_use": 5}

    mesh = types.SimpleNamespace(shape={"model": 2}, devices=np.array([Device()]))
    assert check_kv_cache_memory(config, 9, BS, mesh=mesh, extra=[("w", 1000)]) == kv
    with pytest.raises(ValueError, match=(r"with w, 1001 bytes .*needs about .* GiB per "
                                          r"device but only .* GiB of device memory")):
        check_kv_cache_memory(config, 9, BS, mesh=mesh, extra=[("w", 1001)])
