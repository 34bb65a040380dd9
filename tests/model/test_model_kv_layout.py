"""vLLM's KV layout for hybrid models: `ModelConfig.kv_groups` follows vLLM 0.33's grouping
(pinned to tests/data/kv_groups_golden/vllm_groups.json, written by vLLM itself), and
`make_kv_caches` allocates one array per layer position of a group (the i-th layers of
every group share it), so the pool's bytes are pages x one group's layers."""
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from prefixcache.kv_dtypes import kv_bytes_per_block
from prefixcache.metadata import MetadataBuilder, ScheduledSeq
from prefixcache.model import ModelConfig, check_kv_cache_memory, make_kv_caches, make_step_fn

GOLDEN = pathlib.Path(__file__).parents[1] / "data" / "kv_groups_golden" / "vllm_groups.json"
KIND = {"F": "full_attention", "S": "sliding_attention"}


def _config(pattern: str, **kw) -> ModelConfig:
    return ModelConfig.tiny(num_layers=len(pattern), sliding_window=8,
                            layer_types=tuple(KIND[c] for c in pattern), **kw)


def _golden():
    data = json.loads(GOLDEN.read_text())
    assert data["vllm_version"] == "0.33.0"
    return sorted(data["groups"].items())


@pytest.mark.parametrize("pattern, want", _golden())
def test_kv_groups_are_vllms(pattern, want):
    cfg = _config(pattern)
    got = [["F" if w is None else "S", list(layers)] for w, layers in cfg.kv_groups]
    assert got == want
    # Every layer in exactly one group; the group size is the longest group (vLLM pads the
    # short ones); layer_kv_slots is each layer's position in its group.
    assert sorted(i for _, layers in cfg.kv_groups for i in layers) == list(range(len(pattern)))
    assert cfg.kv_group_size == max(len(layers) for _, layers in want)
    for g, (_, layers) in enumerate(cfg.kv_groups):
        for j, i in enumerate(layers):
            assert cfg.layer_kv_slots[i] == j and cfg.layer_kv_groups[i] == g


def test_plain_and_uniform_models_keep_one_array_per_layer():
    for cfg in (ModelConfig.tiny(), ModelConfig.tiny(num_layers=3, sliding_window=8)):
        assert len(cfg.kv_groups) == 1 and cfg.kv_group_size == cfg.num_layers
        assert cfg.layer_kv_slots == tuple(range(cfg.num_layers))
        kv = make_kv_caches(cfg, num_blocks=4, block_size=8)
        assert len(kv) == cfg.num_layers


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("pattern", ["SSFS", "FFSSS", "FSFS"])
def test_pool_bytes_are_blocks_times_one_groups_layers(pattern, kv_dtype):
    cfg = _config(pattern)
    num_blocks, bs = 6, 8
    kv = make_kv_caches(cfg, num_blocks=num_blocks, block_size=bs, kv_dtype=kv_dtype)
    assert len(kv) == cfg.kv_group_size < cfg.num_layers
    nbytes = sum(a.nbytes for c in kv for a in (c if isinstance(c, tuple) else (c,)))
    per_block = kv_bytes_per_block(num_layers=cfg.kv_group_size,
                                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                   block_size=bs, kv_dtype=kv_dtype or cfg.dtype)
    assert nbytes == (num_blocks + 1) * per_block  # + the padding page
    assert check_kv_cache_memory(cfg, num_blocks + 1, bs, kv_dtype) == nbytes
    per_layer = make_kv_caches(cfg, num_blocks=num_blocks, block_size=bs, kv_dtype=kv_dtype,
                               per_layer=True)
    assert len(per_layer) == cfg.num_layers
    assert check_kv_cache_memory(cfg, num_blocks + 1, bs, kv_dtype, per_layer=True) == (
        nbytes // cfg.kv_group_size * cfg.num_layers)


def test_shared_arrays_need_one_metadata_per_group():
    """Layers of different groups share a KV array: one table for all of them would have
    them overwrite each other's pages, so the step refuses it (per-layer caches are
    fine)."""
    from flax import nnx

    from prefixcache.model import Transformer
    cfg = ModelConfig.tiny_hybrid()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    builder = MetadataBuilder(block_size=8, num_blocks=8, max_num_seqs=4, max_num_tokens=16,
                              max_pages_per_seq=2)
    inputs = builder.build([ScheduledSeq([0], 0, [1, 2, 3])])
    step = make_step_fn(model)
    kv = make_kv_caches(cfg, num_blocks=8, block_size=8)
    with pytest.raises(ValueError, match="4 KV cache groups share 1 KV arrays: pass one"):
        step(kv, inputs.input_ids, inputs.metadata, inputs.logits_indices)
    with pytest.raises(ValueError, match="got 2 kv caches for 4 layers"):
        step(kv * 2, inputs.input_ids, (inputs.metadata,) * 4, inputs.logits_indices)
    per_layer = make_kv_caches(cfg, num_blocks=8, block_size=8, per_layer=True)
    logits, _ = step(per_layer, inputs.input_ids, inputs.metadata, inputs.logits_indices)
    assert np.isfinite(np.asarray(logits)).all() and jnp.asarray(logits).shape[1] == 512


@pytest.mark.parametrize("pattern", ["FFSSS", "SSFS"])
def test_shared_layout_logits_equal_per_layer_layout(pattern):
    """A padded pattern (F,F,S,S,S: groups (0,1), (2,4), (3,) over 2 arrays, the short
    group leaving array 1 to the others) and a one-layer-group one: two steps (prefill,
    then decode reading it back) on the shared arrays with per-group tables give the
    per-layer layout's logits."""
    from flax import nnx

    from prefixcache.model import Transformer
    cfg = _config(pattern)
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    builder = MetadataBuilder(block_size=8, num_blocks=32, max_num_seqs=4, max_num_tokens=32,
                              max_pages_per_seq=4, token_buckets=[32], seq_buckets=[4],
                              page_buckets=[4])
    tokens = np.random.default_rng(0).integers(1, cfg.vocab_size, 21).tolist()
    steps = [ScheduledSeq([0, 1, 2], 0, tokens[:20]), ScheduledSeq([0, 1, 2], 20, tokens[20:])]
    step = make_step_fn(model)
    shared = make_kv_caches(cfg, num_blocks=32, block_size=8)
    per_layer = make_kv_caches(cfg, num_blocks=32, block_size=8, per_layer=True)
    assert len(shared) == cfg.kv_group_size < len(per_layer)
    for seq in steps:
        one = builder.build([seq])
        groups = tuple(builder.build([seq._replace(block_ids=[b + 4 * g for b in seq.block_ids])
                                      ]).metadata for g in range(len(cfg.kv_groups)))
        got, shared = step(shared, one.input_ids, groups, one.logits_indices)
        want, per_layer = step(per_layer, one.input_ids, one.metadata, one.logits_indices)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
