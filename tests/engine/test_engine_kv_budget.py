"""The engine's KV pool sized by a byte budget (`Engine(kv_cache_bytes=...)`, issue 17).

A budget becomes the most blocks whose KV arrays fit it in the engine's kv_dtype,
scales and the padding page included: ``budget // kv_bytes_per_block - 1``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import prefixcache.core
from prefixcache.engine import Engine, SamplingParams
from prefixcache.engine import engine as engine_mod
from prefixcache.kv_dtypes import kv_bytes_per_block, num_pool_blocks_for_bytes
from prefixcache.model import ModelConfig

BS = 16
# ModelConfig.tiny(): 2 layers, 2 kv heads, head_dim 64; 16-token blocks:
#   f32 2 x 16 x 4 x 64 x 4 = 32768, bf16 16384, fp8/int8 2 x (16 x 4 x 64 + 4 x 4) = 8224.
TINY = {"float32": 32768, "bfloat16": 16384, "float8_e4m3fn": 8224, "int8": 8224}
# Llama-3.2-1B: 16 layers, 8 kv heads, head_dim 64:
#   bf16 16 x 16 x 16 x 64 x 2 = 524288 (512 KiB), f32 1 MiB,
#   fp8/int8 16 x (16 x 16 x 64 + 16 x 4) = 263168.
LLAMA = {"float32": 2**20, "bfloat16": 2**19, "float8_e4m3fn": 263168, "int8": 263168}
# 1 GiB of Llama-3.2-1B KV: bf16 2048 pages - 1 padding; f32 1024 - 1;
# fp8 2**30 // 263168 = 4080 pages (4080 x 263168 = 1073725440 <= 2**30) - 1.
LLAMA_1GIB = {"float32": 1023, "bfloat16": 2047, "float8_e4m3fn": 4079, "int8": 4079}
SMALL = dict(block_size=BS, seed=0, max_num_seqs=4, max_num_batched_tokens=128,
             max_model_len=256, token_buckets=(128,), seq_buckets=(4,), page_buckets=(16,))


@pytest.mark.parametrize("kv_dtype", list(TINY))
def test_budget_to_blocks_per_dtype_tiny_and_preset(kv_dtype):
    for config, per_block in ((ModelConfig.tiny(), TINY), (ModelConfig.llama_3_2_1b(), LLAMA)):
        bpb = kv_bytes_per_block(num_layers=config.num_layers,
                                 num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                 block_size=BS, kv_dtype=kv_dtype)
        assert bpb == per_block[kv_dtype]
        for budget in (2 * bpb, 2 * bpb + 1, 41 * bpb - 1, 41 * bpb, 2**30, "1GiB"):
            n, given, got_bpb = engine_mod._pool_size(
                config, num_blocks=None, kv_cache_bytes=budget, block_size=BS,
                kv_dtype=kv_dtype)
            b = 2**30 if budget == "1GiB" else budget
            assert (given, got_bpb) == (b, bpb)
            assert (n + 1) * bpb <= b < (n + 2) * bpb  # the padding page counted, exact
        assert engine_mod._pool_size(config, num_blocks=None, kv_cache_bytes=41 * bpb,
                                     block_size=BS, kv_dtype=kv_dtype)[0] == 40
        assert engine_mod._pool_size(config, num_blocks=None, kv_cache_bytes=41 * bpb - 1,
                                     block_size=BS, kv_dtype=kv_dtype)[0] == 39
    assert num_pool_blocks_for_bytes("1GiB", LLAMA[kv_dtype]) == LLAMA_1GIB[kv_dtype]


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_engine_with_a_budget_holds_exactly_its_blocks_and_serves(kv_dtype):
    config = ModelConfig.tiny()
    budget = 41 * TINY[kv_dtype] + TINY[kv_dtype] - 1  # 41 pages and not quite a 42nd
    engine = Engine(config, kv_cache_bytes=budget, kv_dtype=kv_dtype, **SMALL)
    assert engine.num_blocks == 40 and engine.kv_cache_bytes == budget
    assert engine.kv_cache_manager.num_blocks == 40
    assert len(engine.kv_cache_manager.block_pool.blocks) == 40
    assert engine.runner.builder.num_blocks == 40
    # The KV arrays the runner allocated: 41 pages per layer (scales included), in budget.
    leaves = jax.tree_util.tree_leaves(engine.runner.kv_caches)
    assert engine.runner.stacked_kv  # (the scanned step's [A, num_pages, ...] arrays)
    assert all(a.shape[:2] == (config.kv_group_size, 41) for a in leaves)
    nbytes = sum(a.nbytes for a in leaves)
    assert nbytes == engine.kv_pool_bytes == 41 * TINY[kv_dtype] <= budget
    m = engine.metrics()
    assert (m.num_blocks, m.kv_dtype, m.kv_bytes_per_block, m.kv_pool_bytes,
            m.kv_cache_bytes) == (40, kv_dtype, TINY[kv_dtype], nbytes, budget)
    # It serves, with prefix hits, and as the same engine sized by num_blocks=40.
    same = Engine(config, num_blocks=40, kv_dtype=kv_dtype, share_programs_with=engine,
                  **SMALL)
    assert same.metrics().kv_cache_bytes is None and same.kv_pool_bytes == nbytes
    rng = np.random.default_rng(0)
    system = rng.integers(1, config.vocab_size, 40).tolist()
    prompts = [system + [3, 4], system + [5]]
    greedy = SamplingParams(max_tokens=4)
    outs = {}
    for name, e in (("budget", engine), ("blocks", same)):
        e.generate(prompts[:1], [greedy])
        rest = e.generate(prompts[1:], [greedy])
        outs[name] = (rest[0].token_ids, rest[0].metrics.num_cached_tokens)
    assert outs["budget"] == outs["blocks"] and outs["budget"][1] == 32  # 2 blocks hit


def test_fp8_holds_about_twice_the_blocks_of_bf16_at_one_budget():
    config = ModelConfig.tiny()
    blocks = {dt: Engine(config, kv_cache_bytes="1MiB", kv_dtype=dt, **SMALL).num_blocks
              for dt in ("bfloat16", "float8_e4m3fn")}
    # 2**20 // 16384 - 1 = 63; 2**20 // 8224 - 1 = 127 - 1 = 126.
    assert blocks == {"bfloat16": 63, "float8_e4m3fn": 126}


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test if the manager, the model or the runner gets built."""
    def boom(*a, **k):
        raise AssertionError("built before the bad input was refused")
    monkeypatch.setattr(prefixcache.core, "KVCacheManager", boom)
    monkeypatch.setattr(engine_mod, "ModelRunner", boom)
    monkeypatch.setattr(engine_mod, "_init_model", boom)


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one of num_blocks"),
    ({"num_blocks": 8, "kv_cache_bytes": "1MiB"}, "exactly one of num_blocks"),
    ({"kv_cache_bytes": -1}, "kv_cache_bytes=-1"),
    ({"kv_cache_bytes": 0}, "kv_bytes must be >= 1"),
    ({"kv_cache_bytes": "-1GiB"}, "cannot read a byte count"),
    ({"kv_cache_bytes": "lots"}, "cannot read a byte count"),
    ({"kv_cache_bytes": "2 GiBs"}, "cannot read a byte count"),
    ({"kv_cache_bytes": 1.5e6}, "must be an int"),
    ({"kv_cache_bytes": True}, "must be an int"),
    # One block and the padding page: 2 x 8224 bytes in fp8.
    ({"kv_cache_bytes": 2 * 8224 - 1, "kv_dtype": "float8_e4m3fn"},
     r"float8_e4m3fn.*holds no allocatable block.*at least 16448 bytes"),
    ({"kv_cache_bytes": 16448, "kv_dtype": "float9"}, "unknown kv_dtype"),
    ({"num_blocks": 0}, "num_blocks must be a positive int"),
])
def test_bad_pool_size_refused_before_anything_is_built(kwargs, match, nothing_built):
    with pytest.raises(ValueError, match=match):
        Engine(ModelConfig.tiny(), **kwargs, **SMALL)
    if kwargs.get("kv_cache_bytes") == 2 * 8224 - 1:  # one byte more is enough
        with pytest.raises(AssertionError, match="built before"):
            Engine(ModelConfig.tiny(), **{**kwargs, "kv_cache_bytes": 2 * 8224}, **SMALL)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_hybrid_budget_counts_one_group_of_layers_per_block(kv_dtype):
    """A hybrid model's block id costs one page in each of its `kv_group_size` shared
    KV arrays (vLLM's layout), not one per layer: the budget buys that many blocks and
    the arrays the runner allocated are exactly `kv_pool_bytes`, within the budget."""
    config = ModelConfig.tiny_hybrid(dtype="float32")
    assert config.kv_group_size < config.num_layers  # the arrays are shared
    bpb = kv_bytes_per_block(num_layers=config.kv_group_size,
                             num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                             block_size=8, kv_dtype=kv_dtype)
    budget = 49 * bpb + bpb - 1
    engine = Engine(config, kv_cache_bytes=budget, kv_dtype=kv_dtype,
                    **dict(SMALL, block_size=8, page_buckets=(32,)))
    assert engine.num_blocks == 48 and engine.kv_bytes_per_block == bpb
    nbytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(engine.runner.kv_caches))
    assert nbytes == engine.kv_pool_bytes == 49 * bpb <= budget
