"""HF checkpoint loading: a test-written checkpoint's logits equal an independent numpy
float64 forward pass; save/load round trip; bf16 files; errors name the problem."""
import json
import os
import struct

import jax
import ml_dtypes
import numpy as np
import pytest

from prefixcache.metadata import MetadataBuilder, ScheduledSeq
from prefixcache.model import (
    ModelConfig,
    load_hf_checkpoint,
    make_kv_caches,
    make_step_fn,
    read_safetensors,
    save_hf_checkpoint,
)

BS = 8


def run_prefixes(config, model, tokens, lengths):
    """Logits of the last token of each prefix of `tokens`, one step, own blocks each."""
    builder = MetadataBuilder(block_size=BS, num_blocks=32, max_num_seqs=4,
                              max_num_tokens=64, max_pages_per_seq=8,
                              token_buckets=[64], seq_buckets=[4], page_buckets=[8])
    seqs, nxt = [], 0
    for n in lengths:
        need = -(-n // BS)
        seqs.append(ScheduledSeq(list(range(nxt, nxt + need)), 0, tokens[:n]))
        nxt += need
    step_in = builder.build(seqs)
    kv = make_kv_caches(config, num_blocks=32, block_size=BS)
    step = make_step_fn(model)
    logits, _ = step(kv, step_in.input_ids, step_in.metadata, step_in.logits_indices)
    return np.asarray(logits)[: len(lengths)]


@pytest.mark.parametrize("flavour, shards", [("llama", 2), ("qwen2", 1)])
def test_loaded_logits_match_numpy_forward(tmp_path, hf_helpers, flavour, shards):
    hf_cfg = (hf_helpers.llama_hf_config() if flavour == "llama"
              else hf_helpers.qwen2_hf_config())
    weights = hf_helpers.random_hf_weights(hf_cfg, seed=1)
    hf_helpers.write_hf_checkpoint(tmp_path, hf_cfg, weights, num_shards=shards)
    config, model = load_hf_checkpoint(str(tmp_path), dtype="float32")
    assert config.architecture == hf_cfg["architectures"][0]
    assert config.qkv_bias == (flavour == "qwen2")
    assert config.tie_embeddings == (flavour == "qwen2")
    assert (config.rope_scaling is not None) == (flavour == "llama")
    tokens = np.random.default_rng(2).integers(0, hf_cfg["vocab_size"], 40).tolist()
    lengths = [1, 7, 40]
    got = run_prefixes(config, model, tokens, lengths)
    want = hf_helpers.np_forward(hf_cfg, weights, tokens)
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(got[row], want[n - 1], rtol=2e-4, atol=2e-4,
                                   err_msg=f"prefix of {n} tokens")
    # The comparison is not vacuous: logits vary across prefixes and vocab.
    assert np.abs(want[lengths[-1] - 1] - want[0]).max() > 0.1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_then_load_round_trip(tmp_path, dtype):
    config = ModelConfig.tiny(tie_embeddings=False, qkv_bias=True, o_bias=True, dtype=dtype)
    from flax import nnx

    from prefixcache.model import Transformer
    model = Transformer(config, rngs=nnx.Rngs(3))
    names = save_hf_checkpoint(model, str(tmp_path), max_shard_bytes=200_000)
    assert len(names) > 1 and os.path.exists(tmp_path / "model.safetensors.index.json")
    config2, model2 = load_hf_checkpoint(str(tmp_path))
    assert config2 == config and model2.stacked
    from prefixcache.model.llama import unstack_layers
    model2 = unstack_layers(model2)
    a = jax.tree_util.tree_leaves(nnx.state(model))
    b = jax.tree_util.tree_leaves(nnx.state(model2))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype == np.dtype(jax.numpy.dtype(dtype))
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    # HF layout on disk: q_proj.weight is [N*H, D].
    t = {}
    for fn in names:
        t.update(read_safetensors(str(tmp_path / fn)))
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 64, 128)
    np.testing.assert_array_equal(
        t["model.layers.1.mlp.down_proj.weight"],
        np.asarray(model.layers[1].mlp.down_proj[...], np.float32).T)


def _write_bf16_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr.astype(ml_dtypes.bfloat16)).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(arr.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_bf16_checkpoint_loads(tmp_path, hf_helpers):
    hf_cfg = hf_helpers.qwen2_hf_config(num_hidden_layers=1)
    weights = hf_helpers.random_hf_weights(hf_cfg, seed=4)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf_cfg, f)
    _write_bf16_safetensors(tmp_path / "model.safetensors", weights)
    config, model = load_hf_checkpoint(str(tmp_path))
    assert config.dtype == "bfloat16"
    got = np.asarray(model.layer_stack.attn.k_proj[...][0].astype(np.float32))
    want = weights["model.layers.0.self_attn.k_proj.weight"].astype(ml_dtypes.bfloat16)
    want = want.astype(np.float32).T.reshape(64, 2, 64)
    np.testing.assert_array_equal(got, want)


def _mutate(tmp_path, hf_helpers, *, cfg_changes=None, drop=None, add=None, reshape=None):
    hf_cfg = hf_helpers.qwen2_hf_config(num_hidden_layers=1, **(cfg_changes or {}))
    weights = hf_helpers.random_hf_weights(hf_helpers.qwen2_hf_config(num_hidden_layers=1), 0)
    if drop:
        del weights[drop]
    if add:
        weights[add] = np.zeros(3, np.float32)
    if reshape:
        weights[reshape] = weights[reshape][:-1]
    hf_helpers.write_hf_checkpoint(tmp_path, hf_cfg, weights)
    return str(tmp_path)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(cfg_changes={"architectures": ["GPT2LMHeadModel"]}),
         "unknown architecture 'GPT2LMHeadModel'"),
        (dict(drop="model.layers.0.mlp.up_proj.weight"),
         r"lacks tensors \['model.layers.0.mlp.up_proj.weight'\]"),
        (dict(add="model.layers.0.self_attn.q_norm.weight"),
         r"unexpected tensors .*q_norm"),
        (dict(reshape="model.layers.0.self_attn.v_proj.bias"),
         r"model.layers.0.self_attn.v_proj.bias: \(127,\) != expected \(128,\)"),
        (dict(cfg_changes={"hidden_act": "gelu"}), "hidden_act 'gelu'"),
    ],
)
def test_checkpoint_errors(tmp_path, hf_helpers, kw, match):
    path = _mutate(tmp_path, hf_helpers, **kw)
    with pytest.raises(ValueError, match=match):
        load_hf_checkpoint(path)


def test_missing_config_and_files(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(ModelConfig.tiny().to_hf_config()))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_hf_checkpoint(str(tmp_path))


@pytest.mark.parametrize("flavour", ["llama", "qwen2"])
def test_bf16_model_logits_track_the_float64_forward(tmp_path, hf_helpers, flavour):
    """The model run in bfloat16 (weights, activations, KV cache) against the float64
    oracle: errors of bf16 rounding size, far below what a real bug changes."""
    hf_cfg = (hf_helpers.llama_hf_config() if flavour == "llama"
              else hf_helpers.qwen2_hf_config())
    weights = hf_helpers.random_hf_weights(hf_cfg, seed=1)
    hf_helpers.write_hf_checkpoint(tmp_path, hf_cfg, weights)
    config, model = load_hf_checkpoint(str(tmp_path), dtype="bfloat16")
    assert config.dtype == "bfloat16"
    tokens = np.random.default_rng(3).integers(0, hf_cfg["vocab_size"], 40).tolist()
    lengths = [1, 17, 40]  # 58 tokens: one step
    got = run_prefixes(config, model, tokens, lengths).astype(np.float64)
    want = hf_helpers.np_forward(hf_cfg, weights, tokens)
    for row, n in enumerate(lengths):
        ref = want[n - 1]
        scale = np.abs(ref).max()
        # Measured: max error 0.9-1.4% of the largest |logit| (bf16 keeps 8 mantissa
        # bits); a wrong position, mask or RoPE moves logits by ~100% of it.
        err = np.abs(got[row] - ref).max()
        assert err <= 0.03 * scale, f"{flavour}, prefix of {n}: max error {err:.4f} vs {scale:.3f}"
        assert got[row].argmax() == ref.argmax()
        if n > 1:  # the tolerance is far below what one token of context changes
            assert np.abs(want[n - 2] - ref).max() > 10 * 0.03 * scale
