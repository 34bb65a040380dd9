"""Bad Engine arguments added in session 7 (kv_cache_bytes, kv_dtype, num_host_blocks,
host_eviction, enable_lora, max_loras, max_lora_rank) and bad kv_scales for the
kernels: a clear ValueError / TypeError naming the argument, before the manager, the
model or the runner is built.

Regressions (round 4, s7-fuzz-new): `enable_lora` accepted any value (`"no"` turned
LoRA on); `enable_lora=True` with `max_loras` / `max_lora_rank` too large for memory
built the manager and the model before LoRASlots refused it; `write_kv` /
`paged_attention` with a non-array `kv_scales` raised AttributeError.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import prefixcache_kernels as kernels
import prefixcache.core
import prefixcache.engine.engine as engine_mod
from prefixcache.engine import Engine
from prefixcache.model import ModelConfig

SMALL = dict(max_num_seqs=2, max_num_batched_tokens=32)
BAD = [True, 3.0, -1, 0, float("nan"), "3", None, [3], np.float64(2.0), np.bool_(True),
       "no", {"a": 1}, 2**70]


class Built(AssertionError):
    pass


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test if the manager, the model or the runner gets built."""
    def boom(*a, **k):
        raise Built("built before the bad input was refused")
    monkeypatch.setattr(prefixcache.core, "KVCacheManager", boom)
    monkeypatch.setattr(engine_mod, "ModelRunner", boom)
    monkeypatch.setattr(engine_mod, "_init_model", boom)


def _refused(kw, match):
    try:
        Engine(ModelConfig.tiny(), **SMALL, **kw)
    except Built:
        return False
    except (ValueError, TypeError) as e:
        assert any(m in str(e) for m in match), (kw, e)
        return True
    raise AssertionError(f"{kw} was not refused")


VALID = {"num_host_blocks": (0, np.int64(3), 2**70), "max_loras": (np.int64(3), 2**70),
         "max_lora_rank": (np.int64(3), 2**70), "enable_lora": (True, np.bool_(True)),
         "kv_dtype": (None,)}


@pytest.mark.parametrize("name, match", [
    ("kv_cache_bytes", ("kv_cache_bytes", "KV cache")),
    ("kv_dtype", ("kv_dtype",)),
    ("num_host_blocks", ("num_host_blocks", "host tier")),
    ("host_eviction", ("eviction",)),
    ("enable_lora", ("enable_lora",)),
    ("max_loras", ("max_loras",)),
    ("max_lora_rank", ("max_lora_rank",)),
])
@pytest.mark.parametrize("bad", BAD + ["belady", "float16", "1e400", "lots"], ids=repr)
def test_bad_engine_args_refused_before_anything_is_built(name, match, bad, nothing_built):
    if any(bad is v or (type(bad) is type(v) and bad == v) for v in VALID.get(name, ())):
        return
    kw = {name: bad}
    if name != "kv_cache_bytes":
        kw["num_blocks"] = 8
    if name in ("max_loras", "max_lora_rank") and type(bad) is int and bad == 2**70:
        kw["enable_lora"] = True  # too large only when LoRA is on (memory)
    assert _refused(kw, match)


@pytest.mark.parametrize("name", ["max_loras", "max_lora_rank"])
def test_lora_weights_beyond_memory_refused_before_anything_is_built(name, nothing_built):
    assert _refused({"num_blocks": 8, "enable_lora": True, name: 2**40}, ("LoRA",))


def test_engine_bad_arg_fuzz_builds_nothing(nothing_built):
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(kw=st.fixed_dictionaries({}, optional={
        "kv_dtype": st.sampled_from(["int8", "float8_e4m3fn", "int4", 8, None]),
        "num_host_blocks": st.one_of(st.integers(-2, 4), st.floats(), st.booleans()),
        "enable_lora": st.one_of(st.booleans(), st.integers(0, 2), st.text(max_size=2)),
        "max_loras": st.one_of(st.integers(-1, 3), st.floats()),
        "kv_cache_bytes": st.one_of(st.integers(-1, 1 << 22), st.text(max_size=5)),
    }))
    def run(kw):
        kw = dict(kw)
        if "kv_cache_bytes" not in kw:
            kw["num_blocks"] = 8
        try:
            Engine(ModelConfig.tiny(), **SMALL, **kw)
        except Built:
            pass  # valid: it got as far as building
        except (ValueError, TypeError):
            pass
    run()


# --------------------------------------------------------------- kernels kv_scales
@pytest.mark.parametrize("scales, match", [
    ([[1.0, 1.0]] * 4, "kv_scales must be"), (1.0, "kv_scales must be"),
    ("x", "kv_scales must be"), ((jnp.ones((4, 2)),), "kv_scales must be"),
    (jnp.ones((4,), jnp.float32), "kv_scales shape"),
    (jnp.ones((5, 2), jnp.float32), "kv_scales shape"),
    (jnp.ones((4, 2), jnp.bfloat16), "kv_scales dtype"),
    (np.ones((4, 2), np.float64), "kv_scales dtype"),
])
def test_kv_scales_of_wrong_kind_shape_dtype(scales, match):
    pages = jnp.zeros((4, 16, 2, 64), jnp.int8)
    k = jnp.ones((3, 1, 64), jnp.float32)
    sm = jnp.array([0, 1, 2], jnp.int32)
    with pytest.raises((ValueError, TypeError), match=match):
        kernels.write_kv(pages, k, k, sm, kv_scales=scales)
    q = jnp.ones((3, 2, 64), jnp.float32)
    with pytest.raises((ValueError, TypeError), match=match):
        kernels.paged_attention(
            q, pages, jnp.array([3], jnp.int32), jnp.zeros((1, 4), jnp.int32),
            jnp.array([0, 3], jnp.int32), jnp.array([1], jnp.int32), sm_scale=0.3,
            backend="reference", kv_scales=scales)
    with pytest.raises(ValueError, match="only float8_e4m3fn and int8"):
        kernels.write_kv(jnp.zeros((4, 16, 2, 64), jnp.float32), k, k, sm,
                         kv_scales=jnp.ones((4, 2), jnp.float32))
