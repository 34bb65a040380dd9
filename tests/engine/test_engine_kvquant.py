"""Quantized KV pages in the engine (tiny model, CPU): kv_dtype end to end.

Greedy tokens are identical with prefix caching on and off at each KV dtype, with
real prefix hits (quantized pages shared), including blocks written by decode steps
(multi-turn); a shared full page is never rewritten (bit-stable bytes and scales); the
int8 and float8 logits stay close to those of float32 pages (the real-checkpoint check
is tests/model/test_smollm2.py's, int8 there).

The engines of one KV dtype share their compiled programs (`compiled`): compiling is most
of this module's time on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prefixcache.engine import Engine, SamplingParams
from prefixcache.kv_dtypes import KV_DTYPES, kv_bytes_per_block, num_blocks_for_bytes, parse_bytes
from prefixcache.model import ModelConfig, check_kv_cache_memory, make_kv_caches

BS = 16
COMMON = dict(num_blocks=40, block_size=BS, seed=0, max_num_seqs=4,
              max_num_batched_tokens=128, max_model_len=256, token_buckets=(128,),
              seq_buckets=(4,), page_buckets=(16,))


def _arrays(kv):
    """The runner's KV as a list of per-array caches (the scanned step keeps them stacked)."""
    from prefixcache.model.llama import _unstack_kv, is_stacked

    return _unstack_kv(kv) if is_stacked(kv) else list(kv)


@pytest.fixture(scope="module")
def compiled():
    """`compiled(kv_dtype)`: an engine of this module's shapes whose programs the tests'
    own engines share (built on first use, one per KV dtype)."""
    engines = {}

    def get(kv_dtype):
        if kv_dtype not in engines:
            engines[kv_dtype] = Engine(ModelConfig.tiny(), kv_dtype=kv_dtype, **COMMON)
        return engines[kv_dtype]

    return get


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8", "float8_e4m3fn"])
def test_greedy_tokens_identical_cache_on_off_with_shared_quantized_pages(kv_dtype, compiled):
    config = ModelConfig.tiny()
    on = Engine(config, enable_caching=True, kv_dtype=kv_dtype,
                share_programs_with=compiled(kv_dtype), **COMMON)
    off = Engine(config, enable_caching=False, kv_dtype=kv_dtype, share_programs_with=on,
                 **COMMON)
    assert on.kv_dtype == kv_dtype
    pages0 = _arrays(on.runner.kv_caches)[0]
    if kv_dtype == "bfloat16":
        assert pages0.dtype == jnp.bfloat16
    else:
        pages0, scales0 = pages0
        assert pages0.dtype == jnp.dtype(kv_dtype) and scales0.shape == (41, 4)
    rng = np.random.default_rng(0)
    system = rng.integers(1, config.vocab_size, 40).tolist()
    other = system + rng.integers(1, config.vocab_size, 9).tolist()
    greedy = SamplingParams(max_tokens=20)
    outs = {}
    for name, engine in (("on", on), ("off", off)):
        first = engine.generate([system + [7, 8, 9]], [greedy])[0]
        # Multi-turn: the second prompt holds the first answer (pages written by decode).
        turn2 = system + [7, 8, 9] + first.token_ids + [11, 12]
        rest = engine.generate([turn2, other], [greedy, greedy])
        outs[name] = ([first.token_ids] + [o.token_ids for o in rest],
                      [o.metrics.num_cached_tokens for o in rest])
    assert outs["on"][0] == outs["off"][0]
    assert outs["on"][1] == [48, 32] and outs["off"][1] == [0, 0]  # 3 and 2 blocks hit


def test_shared_full_pages_are_bit_stable(compiled):
    config = ModelConfig.tiny()
    engine = Engine(config, kv_dtype="int8", share_programs_with=compiled("int8"), **COMMON)
    rng = np.random.default_rng(1)
    system = rng.integers(1, config.vocab_size, 40).tolist()
    greedy = SamplingParams(max_tokens=4)
    engine.generate([system + [5]], [greedy])
    full = sorted(_cached_block_ids(engine))
    assert len(full) == 2, "the system prompt's two full blocks are cached"
    before = [(np.asarray(p)[full], np.asarray(s)[full]) for p, s in _arrays(engine.runner.kv_caches)]
    outs = engine.generate([system + rng.integers(1, 500, n).tolist() for n in (3, 30)],
                           [greedy, greedy])
    assert [o.metrics.num_cached_tokens for o in outs] == [32, 32]
    for (p0, s0), (p, s) in zip(before, _arrays(engine.runner.kv_caches)):
        np.testing.assert_array_equal(np.asarray(p)[full], p0)
        np.testing.assert_array_equal(np.asarray(s)[full], s0)


@pytest.mark.parametrize("kv_dtype, bound", [("int8", 0.05), ("float8_e4m3fn", 0.15)])
def test_quantized_logits_stay_close_to_float32_pages(kv_dtype, bound, compiled):
    """The first step's logits of each prompt, quantized pages vs the model's own float32
    pages, within `bound` of the row's largest (measured on CPU, per prompt: int8
    0.013-0.024, float8 0.032-0.073), and greedy continuations that agree for a median of
    >= 2 tokens (measured: int8 [8, 8, 1, 8], float8 [8, 6, 1, 8] of 8). Wrong page scales
    or a dequantization that skips them miss both by far."""
    config = ModelConfig.tiny()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, config.vocab_size, n).tolist() for n in (20, 33, 47, 60)]
    greedy = SamplingParams(max_tokens=8)

    def run(kv):
        engine = Engine(config, kv_dtype=kv, share_programs_with=compiled(kv), **COMMON)
        engine.record_logits = True
        outs = engine.generate(prompts, greedy)
        return ([o.token_ids for o in outs],
                [next(s[o.request_id] for s in engine.step_logits if o.request_id in s)
                 for o in outs])

    ref_tokens, ref_rows = run("float32")
    tokens, rows = run(kv_dtype)
    first_diff = [next((j for j, (a, b) in enumerate(zip(t, w)) if a != b), len(w))
                  for t, w in zip(tokens, ref_tokens)]
    assert np.median(first_diff) >= 2, first_diff
    err = [float(np.abs(r - w).max() / np.abs(w).max()) for r, w in zip(rows, ref_rows)]
    assert 0 < max(err) <= bound, err  # (0: the pages were not quantized at all)


def _cached_block_ids(engine) -> set[int]:
    ids = set()
    for entry in engine.kv_cache_manager.block_pool.cached_block_hash_to_block.values():
        for blk in (entry.values() if isinstance(entry, dict) else [entry]):
            ids.add(blk.block_id)
    return ids


def test_bytes_per_block_and_caches_follow_kv_dtype():
    tiny, llama = ModelConfig.tiny(), ModelConfig.llama_3_2_1b()

    def per_token(cfg, dt):
        return kv_bytes_per_block(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                  head_dim=cfg.head_dim, block_size=BS, kv_dtype=dt) / BS

    # tiny: 2 layers x 2 kv heads x 64; Llama-3.2-1B: 16 layers x 8 kv heads x 64.
    assert [per_token(tiny, d) for d in KV_DTYPES] == [1024, 2048, 514, 514]
    assert [per_token(llama, d) for d in KV_DTYPES] == [32768, 65536, 16448, 16448]
    nbytes = check_kv_cache_memory(tiny, 9, BS, "int8")
    assert nbytes == 9 * 514 * BS
    caches = make_kv_caches(tiny, num_blocks=8, block_size=BS, kv_dtype="float8_e4m3fn")
    assert len(caches) == 2
    assert sum(x.nbytes for x in jax.tree.leaves(caches)) == nbytes
    assert caches[0][0].dtype == jnp.float8_e4m3fn and caches[0][1].dtype == jnp.float32
    plain = make_kv_caches(tiny, num_blocks=8, block_size=BS, kv_dtype="bfloat16")
    assert plain[0].dtype == jnp.bfloat16 and plain[0].shape == (9, BS, 4, 64)
    assert num_blocks_for_bytes("1MiB", 514 * BS) == 2**20 // (514 * BS)
    assert parse_bytes("2GiB") == 2**31 and parse_bytes(1000) == 1000


def test_bad_kv_dtype_inputs(monkeypatch):
    config = ModelConfig.tiny()
    with pytest.raises(ValueError, match=r"unknown kv_dtype 'fp8'.*float8_e4m3fn"):
        Engine(config, kv_dtype="fp8", **COMMON)
    with pytest.raises(ValueError, match="unknown kv_dtype"):
        make_kv_caches(config, num_blocks=4, block_size=BS, kv_dtype="float16")
    with pytest.raises(ValueError, match="dtype float32 and kv_dtype int8 differ"):
        make_kv_caches(config, num_blocks=4, block_size=BS, dtype="float32", kv_dtype="int8")
    with pytest.raises(ValueError, match="smaller than one block"):
        num_blocks_for_bytes(1000, 514 * BS)
    for bad in ("2 parsecs", "-5", 0, 1.5, True):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    # fp8 pages on a compiled pallas_gpu older than sm_89: refused before anything is
    # built (the platform and device are faked; nothing reaches a GPU).
    import prefixcache_kernels.api

    class OldGPU:
        compute_capability = "8.0"

    built = []
    monkeypatch.setattr(prefixcache_kernels.api.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(prefixcache_kernels.api.jax, "devices", lambda *a: [OldGPU()])
    monkeypatch.setattr("prefixcache.engine.engine._init_model",
                        lambda *a: built.append(a))
    with pytest.raises(ValueError, match=(r"the Pallas gpu backend needs compute "
                                          r"capability 8\.9.*float8_e4m3fn")):
        Engine(config, kv_dtype="float8_e4m3fn", attention_backend="auto", **COMMON)
    assert not built


def test_two_device_int8_engine_matches_one_device(compiled):
    from jax.sharding import Mesh

    devices = jax.devices()
    if len(devices) < 2:
        pytest.fail(f"tests/conftest.py should provide 8 CPU devices, got {len(devices)}")
    config = ModelConfig.tiny()  # 2 kv heads: one per device
    mesh = Mesh(np.array(devices[:2]), ("model",))
    one = Engine(config, kv_dtype="int8", share_programs_with=compiled("int8"), **COMMON)
    two = Engine(config, kv_dtype="int8", mesh=mesh, **COMMON)
    pages, scales = _arrays(two.runner.kv_caches)[0]
    assert len(pages.sharding.device_set) == 2 and len(scales.sharding.device_set) == 2
    assert scales.addressable_shards[0].data.shape == (41, 2)  # K and V of one kv head
    rng = np.random.default_rng(2)
    system = rng.integers(1, config.vocab_size, 40).tolist()
    prompts = [system + rng.integers(1, config.vocab_size, n).tolist() for n in (3, 20)]
    greedy = [SamplingParams(max_tokens=6)] * 2
    outs1, outs2 = one.generate(prompts, greedy), two.generate(prompts, greedy)
    assert [o.token_ids for o in outs2] == [o.token_ids for o in outs1]
    # The same pages up to the f32 rounding of the sharded matmuls (a scale's last
    # bit; a value one int8 step at a rounding boundary).
    for (p1, s1), (p2, s2) in zip(_arrays(one.runner.kv_caches),
                                    _arrays(two.runner.kv_caches)):
        diff = np.abs(np.asarray(p2, np.int32) - np.asarray(p1, np.int32))
        assert diff.max() <= 1 and (diff > 0).mean() < 1e-3
        np.testing.assert_allclose(np.asarray(s2), np.asarray(s1), rtol=1e-5)

