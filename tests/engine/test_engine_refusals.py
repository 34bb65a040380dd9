"""A refused engine call changes nothing (issue 25): the LoRA adapter memo, byte-like
prompts, non-reproducible hash seeds, and configurations refused before anything is
built. Each refusal snapshots the engine before and after, then a valid call runs.

On main before issue 25: `generate`/`add_request` read each new adapter into
`engine.lora_adapters` while validating, so a later refusal (a corrupt second
adapter, a duplicate id) left it there and the trim in `finally` dropped another;
a `bytearray` prompt ran as token ids; `hash_seed=object()` was taken (its str holds
an address); bad `page_buckets` and `interpret="yes"` were refused (or not) only
after the model was initialised.
"""
from __future__ import annotations

import numpy as np
import pytest

import prefixcache.engine.engine as engine_mod
from prefixcache.core import LoRARequest
from prefixcache.engine import Engine, SamplingParams
from prefixcache.model import ModelConfig

BS = 16
COMMON = dict(num_blocks=32, block_size=BS, seed=0, max_num_seqs=4,
              max_num_batched_tokens=64, max_model_len=128, token_buckets=(64,),
              seq_buckets=(4,), page_buckets=(8,))
SP = SamplingParams(max_tokens=2)


def _snapshot(engine):
    m = engine.kv_cache_manager
    return (list(engine.lora_adapters.items()), set(engine._known_ids),
            len(engine.scheduler.requests), m.num_free_blocks)


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory, lora_helpers):
    config = ModelConfig.tiny()
    root = tmp_path_factory.mktemp("refusal_adapters")
    loras = {}
    for i, name in enumerate("acb"):
        lora_helpers.write_peft_adapter(root / name, config, rank=2, seed=i + 1)
        loras[name] = LoRARequest(name, str(root / name))
    lora_helpers.write_peft_adapter(root / "bad", config, rank=2, seed=9)
    (root / "bad" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    loras["bad"] = LoRARequest("bad", str(root / "bad"))
    engine = Engine(config, enable_lora=True, max_loras=1, max_cpu_loras=2, **COMMON)
    # The memo holds a (not in a device slot any more) and c (in the one slot).
    engine.generate([[5, 6, 7]], SP, lora_request=loras["a"])
    engine.generate([[5, 6, 8]], SP, lora_request=loras["c"])
    assert list(engine.lora_adapters) == [("a", loras["a"].path), ("c", loras["c"].path)]
    return engine, loras


def test_refused_generate_leaves_the_adapter_memo_unchanged(lora_engine):
    engine, loras = lora_engine
    before = _snapshot(engine)
    with pytest.raises(ValueError, match="bad"):
        engine.generate([[1, 2, 3], [4, 5, 6]], SP, lora_request=[loras["b"], loras["bad"]])
    assert _snapshot(engine) == before  # b not read in, a not dropped
    with pytest.raises(ValueError, match="duplicate request id"):
        engine.add_request([1, 2, 3], SP, request_id=sorted(engine._known_ids)[0],
                           lora=loras["b"])
    assert _snapshot(engine) == before
    # A valid call still runs and then adopts b (a, the least recently used, goes).
    out = engine.generate([[1, 2, 3]], SP, lora_request=loras["b"])[0]
    assert out.error is None and len(out.token_ids) == 2
    assert ("b", loras["b"].path) in engine.lora_adapters
    assert len(engine.lora_adapters) <= 2


def test_byte_like_prompts_are_refused(lora_engine):
    engine, _ = lora_engine
    before = _snapshot(engine)
    for prompt in (bytearray(b"\x01\x02\x03"), memoryview(b"\x01\x02"), b"\x01\x02\x03"):
        with pytest.raises(ValueError, match=f"got {type(prompt).__name__}"):
            engine.add_request(prompt, SP)
        with pytest.raises(ValueError, match="token ids"):
            engine.generate([prompt], SP)
        assert _snapshot(engine) == before
    assert engine.generate([[1, 2, 3]], SP)[0].error is None


@pytest.fixture
def no_build(monkeypatch):
    """Fails the test if the engine gets as far as initialising a model."""
    built = []

    def spy(*args, **kwargs):
        built.append(args)
        raise AssertionError("the model was initialised before the refusal")

    monkeypatch.setattr(engine_mod, "_init_model", spy)
    return built


@pytest.mark.parametrize("kw, exc, match", [
    (dict(page_buckets=(4,)), ValueError, r"page_buckets must end at the configured maximum 8"),
    (dict(token_buckets=(16, 32)), ValueError, r"token_buckets must end at .* 64"),
    (dict(seq_buckets=(2, 2, 4)), ValueError, r"seq_buckets must be strictly increasing"),
    (dict(interpret="yes"), ValueError, r"interpret must be a bool, got 'yes'"),
])
def test_config_refused_before_anything_is_built(no_build, kw, exc, match):
    with pytest.raises(exc, match=match):
        Engine(ModelConfig.tiny(), **{**COMMON, **kw})
    assert not no_build


def test_hash_seed_checked_before_build(no_build):
    for seed, match in ((object(), r"hash_seed must be None, a str, an int or bytes .* "
                                   r"got object <object"),
                        (1.5, r"got float 1.5"), (lambda: 0, r"got function"),
                        (True, r"got bool True")):
        with pytest.raises(TypeError, match=match):
            Engine(ModelConfig.tiny(), hash_seed=seed, **COMMON)
        assert not no_build
    for seed in ("s", 7, np.int64(7), b"seed", None):  # still accepted
        with pytest.raises(AssertionError, match="initialised"):  # got past validation
            Engine(ModelConfig.tiny(), hash_seed=seed, **COMMON)
