"""A Llama checkpoint with attention_bias=True (issue 25): transformers biases q/k/v AND
o_proj. Before, `ModelConfig.from_hf_config` took it as q/k/v bias only and loading
then failed on the unexpected `o_proj.bias` tensors; now the o_proj bias is loaded and
the logits equal transformers' own (golden written by
`tests/data/llama_attention_bias/make_golden.py` with torch 2.13.0+cpu and
transformers 5.24.0)."""
import json
import os

import numpy as np
import pytest

from prefixcache.model import ModelConfig, load_hf_checkpoint, save_hf_checkpoint
from prefixcache.model.llama import unstack_layers
from test_model_checkpoint import run_prefixes

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "llama_attention_bias")


def test_llama_attention_bias_checkpoint_matches_transformers(tmp_path):
    with open(os.path.join(GOLDEN, "tokens.json")) as f:
        tokens = json.load(f)["tokens"]
    want = np.load(os.path.join(GOLDEN, "logits.npy"))
    config, model = load_hf_checkpoint(GOLDEN, dtype="float32")
    assert config.qkv_bias and config.o_bias
    # D 32, 2 heads and 1 kv head of 64, F 48, V 64, 2 layers, untied: + 32 per layer.
    D, NH, KH, F, V = 32, 128, 64, 48, 64
    layer = 2 * D * NH + 2 * D * KH + (NH + 2 * KH) + D + 3 * D * F + 2 * D
    assert config.num_params == 2 * layer + 2 * V * D + D
    lengths = [1, 9, len(tokens)]
    got = run_prefixes(config, model, tokens, lengths)
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(got[row], want[n - 1], rtol=2e-4, atol=2e-4,
                                   err_msg=f"prefix of {n} tokens")
    # Not vacuous: the biases are far from 0 (transformers' logits use them).
    model = unstack_layers(model)  # (per-layer views of the loaded stack)
    assert min(np.abs(np.asarray(layer.attn.o_bias[...])).max() for layer in model.layers) > 0.1
    # Save / load round trip keeps the bias (attention_bias=True in config.json).
    save_hf_checkpoint(model, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["attention_bias"] is True
    config2, model2 = load_hf_checkpoint(str(tmp_path), dtype="float32")
    assert config2 == config
    for a, b in zip(model.layers, unstack_layers(model2).layers):
        np.testing.assert_array_equal(np.asarray(a.attn.o_bias[...]),
                                      np.asarray(b.attn.o_bias[...]))

def test_o_bias_config_rules():
    base = dict(vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                head_dim=64, mlp_dim=48)
    with pytest.raises(ValueError, match="o_bias must be a bool"):
        ModelConfig(**base, o_bias=1)
    # Llama ties the two biases in its config.json: one without the other cannot be saved.
    with pytest.raises(ValueError, match="attention_bias biases q/k/v and o_proj together"):
        ModelConfig(**base, qkv_bias=True).to_hf_config()
    with pytest.raises(ValueError, match="Qwen2ForCausalLM has no o_proj bias"):
        ModelConfig(**base, qkv_bias=True, o_bias=True,
                    architecture="Qwen2ForCausalLM").to_hf_config()
    hf = ModelConfig(**base, qkv_bias=True, o_bias=True).to_hf_config()
    assert ModelConfig.from_hf_config(hf).o_bias
