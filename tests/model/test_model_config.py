"""ModelConfig: presets, HF config round trip, RoPE frequencies, validation errors."""
import dataclasses
import math

import numpy as np
import pytest

from prefixcache.model import ModelConfig, RopeScaling
from prefixcache.model.llama import rope_inv_freq


def test_presets_have_the_published_sizes():
    tiny = ModelConfig.tiny()
    assert (tiny.num_heads, tiny.num_kv_heads, tiny.head_dim, tiny.dtype) == (4, 2, 64,
                                                                             "float32")
    # Llama-3.2-1B: 1.236B parameters (tied); Qwen2.5-0.5B: 494M (tied, qkv bias).
    assert ModelConfig.llama_3_2_1b().num_params == 1_235_814_400
    assert ModelConfig.qwen2_5_0_5b().num_params == 494_032_768
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny.d_model = 3


@pytest.mark.parametrize("preset", ["tiny", "llama_3_2_1b", "qwen2_5_0_5b"])
def test_hf_config_round_trip(preset):
    cfg = getattr(ModelConfig, preset)()
    if preset == "tiny":
        cfg = cfg.replace(tie_embeddings=False, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 512))
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


def test_from_hf_config_defaults_and_new_style_rope():
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 128,
          "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}}
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 64 and cfg.rope_theta == 1234.0
    assert not cfg.tie_embeddings and not cfg.qkv_bias and cfg.dtype == "float32"
    assert ModelConfig.from_hf_config({**hf, "model_type": "qwen2", "architectures": []}
                                      ).qkv_bias


def test_llama3_rope_scaling_matches_hf_formula():
    cfg = ModelConfig.llama_3_2_1b()
    got = rope_inv_freq(cfg).astype(np.float64)
    # HF _compute_llama3_parameters (transformers), written out independently.
    base = 1.0 / (500000.0 ** (np.arange(0, 64, 2) / 64))
    low_wl, high_wl = 8192 / 1.0, 8192 / 4.0
    want = []
    for f in base:
        wl = 2 * math.pi / f
        if wl < high_wl:
            want.append(f)
        elif wl > low_wl:
            want.append(f / 32.0)
        else:
            s = (8192 / wl - 1.0) / (4.0 - 1.0)
            want.append((1 - s) * f / 32.0 + s * f)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert (got < base * 0.99).any() and (got == base.astype(np.float32)).any()


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(num_heads=3), r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
        (dict(head_dim=63), "head_dim must be even"),
        (dict(d_model=0), "d_model must be a positive int"),
        (dict(vocab_size=True), "vocab_size must be a positive int"),
        (dict(dtype="float16"), "dtype must be one of"),
        (dict(rms_norm_eps=-1.0), "rms_norm_eps"),
        (dict(rope_theta=float("nan")), "rope_theta"),
        (dict(rope_scaling={"factor": 8}), "rope_scaling must be a RopeScaling"),
        (dict(architecture="GemmaForCausalLM"), "architecture 'GemmaForCausalLM'"),
        (dict(tie_embeddings=1), "tie_embeddings must be a bool"),
    ],
)
def test_config_validation(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.tiny(**changes)


def test_rope_scaling_and_hf_errors():
    with pytest.raises(ValueError, match="high_freq_factor"):
        RopeScaling(8.0, 4.0, 1.0, 512)
    base = ModelConfig.tiny().to_hf_config()
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn",
                                                             "factor": 2.0}})
    with pytest.raises(ValueError, match="lacks 'intermediate_size'"):
        ModelConfig.from_hf_config({k: v for k, v in base.items()
                                    if k != "intermediate_size"})
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf_config({**base, "use_sliding_window": True})
    with pytest.raises(ValueError, match="Qwen2ForCausalLM always has q/k/v bias"):
        ModelConfig.tiny(architecture="Qwen2ForCausalLM").to_hf_config()
