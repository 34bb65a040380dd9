"""The scanned step (`make_step_fn`'s default, stacked params and KV): the same logits and
KV as the unrolled step (`scan_layers=False`), for one attention kind, a hybrid model with
shared KV arrays, Gemma 3's 5:1 units (a partial last unit too), int8 KV and LoRA, from a
per-layer and from a stacked model; and one program whose size does not grow with
depth."""
import re

import jax
import numpy as np
import pytest
from flax import nnx

from prefixcache.metadata import MetadataBuilder, ScheduledSeq
from prefixcache.model import ModelConfig, Transformer, make_kv_caches, make_step_fn
from prefixcache.model.config import gemma3_layer_types
from prefixcache.model.llama import (
    layer_period,
    stack_layer_params,
    stack_layers,
    unstack_layers,
)
from prefixcache.model.lora import LoRABatch, LoRASlots

BS = 8
NUM_BLOCKS = 40


def _builder():
    return MetadataBuilder(block_size=BS, num_blocks=NUM_BLOCKS, max_num_seqs=2,
                           max_num_tokens=32, max_pages_per_seq=6, token_buckets=[32],
                           seq_buckets=[2], page_buckets=[6])


def _steps(config, vocab, *, per_layer=False):
    """Three steps (two prefills over a shared prefix, then decodes) as step inputs; a
    hybrid model gets one metadata per KV group (group g's blocks moved by 6 * g)."""
    rng = np.random.default_rng(3)
    a = rng.integers(0, vocab, 30).tolist()
    b = a[:16] + rng.integers(0, vocab, 6).tolist()
    schedule = [[ScheduledSeq([0, 1, 2, 3], 0, a[:20]), ScheduledSeq([4, 5], 0, b[:3])],
                [ScheduledSeq([0, 1, 2, 3], 20, a[20:29]), ScheduledSeq([0, 1, 5], 16, b[16:22])],
                [ScheduledSeq([0, 1, 2, 3], 29, a[29:30])]]
    builder = _builder()
    out = []
    for seqs in schedule:
        groups = 1 if per_layer else len(config.kv_groups)
        built = [builder.build([ScheduledSeq([i + 6 * g for i in s.block_ids],
                                             s.num_computed_tokens, s.token_ids)
                                for s in seqs]) for g in range(groups)]
        md = built[0].metadata if groups == 1 else tuple(x.metadata for x in built)
        out.append((built[0].input_ids, md, built[0].logits_indices))
    return out


def _random_lora(config):
    weights = LoRASlots(config, max_loras=2, max_lora_rank=2).weights
    rng = np.random.default_rng(4)
    return {m: tuple(rng.standard_normal(x.shape).astype(np.float32) * 0.1 for x in ab)
            for m, ab in weights.items()}


def _run_both(config, *, kv_dtype=None, lora=False, per_layer=False, stacked_model=False):
    model = Transformer(config, rngs=nnx.Rngs(1))
    unrolled = make_step_fn(model, scan_layers=False)
    if stacked_model:  # the loaders' layout: the step reads the model's own stack
        stack_layers(model)
        assert model.stacked
    scanned = make_step_fn(model)
    kv_list = make_kv_caches(config, num_blocks=NUM_BLOCKS, block_size=BS, kv_dtype=kv_dtype,
                             per_layer=per_layer)
    kv_stack = make_kv_caches(config, num_blocks=NUM_BLOCKS, block_size=BS, kv_dtype=kv_dtype,
                              per_layer=per_layer, stacked=True)
    weights = _random_lora(config) if lora else None
    for n, (ids, md, li) in enumerate(_steps(config, config.vocab_size, per_layer=per_layer)):
        extra = {}
        if lora:
            extra["lora"] = LoRABatch(np.arange(ids.shape[0], dtype=np.int32) % 2, weights)
        want, kv_list = unrolled(kv_list, ids, md, li, **extra)
        got, kv_stack = scanned(kv_stack, ids, md, li, **extra)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                                   err_msg=f"step {n}")
    return kv_list, kv_stack


def _gemma(n):
    return ModelConfig.tiny_gemma3(num_layers=n, layer_types=gemma3_layer_types(n))


def test_scanned_step_equals_unrolled_gemma3_units():
    # Gemma 3, 12 layers: two scanned units of (5 sliding + 1 full), six KV groups of
    # two layers sharing two arrays (unit u's layers all use array u), one metadata per
    # group
    kv_list, kv_stack = _run_both(_gemma(12), stacked_model=True)
    assert kv_stack.shape == (2, *kv_list[0].shape)
    for i, arr in enumerate(kv_list):
        np.testing.assert_allclose(np.asarray(kv_stack[i]), np.asarray(arr), rtol=1e-5,
                                   atol=1e-5, err_msg=f"KV array {i}")
    assert np.asarray(kv_stack).any()


def test_scanned_step_equals_unrolled_partial_unit_int8_kv_and_lora():
    # hybrid (S, S, F, S) with one array per layer and one metadata: a scanned unit
    # (S, S, F), then the last S layer after the scan; int8 pages with their scales, and
    # two LoRA adapters over the tokens
    config = ModelConfig.tiny_hybrid()
    kv_list, (pages, scales) = _run_both(config, kv_dtype="int8", lora=True, per_layer=True)
    assert pages.shape[0] == 4
    for i, (p, s) in enumerate(kv_list):
        np.testing.assert_array_equal(np.asarray(pages[i]), np.asarray(p), err_msg=f"layer {i}")
        np.testing.assert_array_equal(np.asarray(scales[i]), np.asarray(s), err_msg=f"layer {i}")


def test_layer_period():
    assert layer_period(ModelConfig.tiny(num_layers=5)) == 1
    assert layer_period(ModelConfig.tiny_hybrid()) == 4
    gemma = ModelConfig.gemma3_270m()  # 18 layers: three (5 sliding + 1 full) units
    assert gemma.layer_kv_slots == tuple(i // 6 for i in range(18))
    assert layer_period(gemma) == 6
    assert _gemma(12).layer_kv_slots == (0,) * 6 + (1,) * 6 and layer_period(_gemma(12)) == 6
    assert layer_period(ModelConfig.tiny_hybrid(), per_group=False) == 3
    stacked = stack_layer_params(Transformer(ModelConfig.tiny(num_layers=3), rngs=nnx.Rngs(0)))
    assert stacked["mlp"]["down_proj"].shape == (3, 256, 128)


def _hlo_ops(config, *, scan_layers=None):
    """Op count of the step's lowered StableHLO and its number of while loops (None:
    `make_step_fn`'s default)."""
    model = Transformer(config, rngs=nnx.Rngs(0))
    step = (make_step_fn(model) if scan_layers is None
            else make_step_fn(model, scan_layers=scan_layers))
    scan_layers = step.scan_layers
    kv = make_kv_caches(config, num_blocks=NUM_BLOCKS, block_size=BS, stacked=scan_layers)
    si = _builder().build([ScheduledSeq([0, 1], 0, list(range(1, 12)))])
    kv_arg = kv if scan_layers else list(kv)
    text = step.jitted.lower(step.params, kv_arg, si.input_ids, si.metadata,
                             si.logits_indices).as_text()
    ops = [ln for ln in text.splitlines() if re.search(r"= stablehlo\.|^\s*stablehlo\.", ln)]
    return len(ops), text.count("stablehlo.while")


def test_one_program_whatever_the_depth():
    shallow, deep = ModelConfig.tiny(num_layers=2), ModelConfig.tiny(num_layers=8)
    ops2, loops2 = _hlo_ops(shallow)  # (the default step)
    ops8, loops8 = _hlo_ops(deep)
    # (the attention itself loops too: the same whiles at either depth, one more than
    # the unrolled 2-layer step has per layer)
    assert ops2 == ops8 and loops2 == loops8
    # the unrolled step grows with depth (the count above would see it)
    assert _hlo_ops(deep, scan_layers=False)[0] > _hlo_ops(shallow, scan_layers=False)[0]


def test_layouts_must_match_the_step():
    config = ModelConfig.tiny()
    model = Transformer(config, rngs=nnx.Rngs(0))
    si = _builder().build([ScheduledSeq([0], 0, [1, 2, 3])])
    args = (si.input_ids, si.metadata, si.logits_indices)
    stacked = make_kv_caches(config, num_blocks=NUM_BLOCKS, block_size=BS, stacked=True)
    with pytest.raises(ValueError, match="unrolled step .* not the stacked KV layout"):
        make_step_fn(model, scan_layers=False)(stacked, *args)
    # the scanned step takes a list too (stacked inside), and returns a list
    listed = make_kv_caches(config, num_blocks=NUM_BLOCKS, block_size=BS)
    got, listed = make_step_fn(model)(listed, *args)
    want, stacked = make_step_fn(model)(stacked, *args)
    assert isinstance(listed, list) and len(listed) == 2
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(listed[1]), np.asarray(stacked[1]))
    mesh = jax.make_mesh((1,), ("model",))
    listed = make_kv_caches(config, num_blocks=NUM_BLOCKS, block_size=BS, mesh=mesh)
    with pytest.raises(ValueError, match="scanned step on a mesh takes the stacked KV"):
        make_step_fn(model, mesh=mesh)(listed, *args)


def test_stacked_model_holds_the_weights_once():
    config = ModelConfig.tiny(num_layers=3)
    model = Transformer(config, rngs=nnx.Rngs(0))
    want = np.asarray(model.layers[2].mlp.down_proj[...])
    assert stack_layers(model) is model and model.stacked
    # the per-layer modules keep shapes only; the stack holds the arrays
    leaves = jax.tree.leaves(nnx.state(model.layers[2]))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    np.testing.assert_array_equal(np.asarray(model.layer_stack.mlp.down_proj[...])[2], want)
    # the default step reads the model's own stack (no second copy)
    step = make_step_fn(model)
    own = jax.tree.leaves(nnx.state(model.layer_stack))
    assert all(a is b for a, b in zip(jax.tree.leaves(step.params["layers"]), own))
    back = unstack_layers(model)
    assert not back.stacked and back is not model
    np.testing.assert_array_equal(np.asarray(back.layers[2].mlp.down_proj[...]), want)
    assert unstack_layers(back) is back
