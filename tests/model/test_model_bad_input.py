"""Bad input at the model boundaries added in session 7: ModelConfig(sliding_window=,
layer_types=), from_hf_config with malformed HF dicts, load_lora_adapter with malformed
directories, read_safetensors with malformed files. Every case is a ValueError naming
the problem (never another exception type).

Regressions (round 4, s7-fuzz-new; each raised TypeError / KeyError / AttributeError /
OverflowError / RecursionError / MemoryError before): from_hf_config with a non-list
`architectures`, an unhashable `model_type`, a non-mapping `rope_scaling`, non-numeric
`rms_norm_eps` / `rope_theta` / `hidden_size`; an adapter with `lora_alpha` past a
float's range or a deeply nested adapter_config.json; a safetensors header whose length
exceeds the file, or that is not an object of tensor entries.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.model import ModelConfig
from prefixcache.model.config import FULL_ATTENTION, SLIDING_ATTENTION
from prefixcache.model.loading import read_safetensors
from prefixcache.model.lora import load_lora_adapter

FAST = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 40), st.just(2**70), st.just(10**400),
    st.floats(), st.text(max_size=8),
    st.lists(st.sampled_from([FULL_ATTENTION, SLIDING_ATTENTION, "x", None, 1]), max_size=5),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


# --------------------------------------------------------------- ModelConfig
@FAST
@given(w=ANY, types=ANY)
def test_model_config_window_and_layer_types(w, types):
    try:
        cfg = ModelConfig.tiny(sliding_window=w, layer_types=types)
    except ValueError as e:
        assert "sliding_window" in str(e) or "layer_types" in str(e), e
        return
    # Accepted: a positive int window (or None) and per-layer HF names that agree with it.
    assert w is None or (type(w) is int and w >= 1)
    assert len(cfg.attention_types) == cfg.num_layers
    assert (SLIDING_ATTENTION in cfg.attention_types) == (w is not None)


HF_KEYS = st.sampled_from([
    "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    "num_hidden_layers", "architectures", "model_type", "rope_scaling", "rope_theta",
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "torch_dtype",
    "vocab_size", "tie_word_embeddings", "rms_norm_eps", "max_position_embeddings",
    "intermediate_size", "hidden_act", "mlp_bias", "attention_bias", "rope_parameters"])
HF_BASES = [ModelConfig.tiny_hybrid().to_hf_config(),
            ModelConfig.tiny(architecture="MistralForCausalLM", sliding_window=8).to_hf_config(),
            ModelConfig.tiny().to_hf_config()]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(i=st.integers(0, len(HF_BASES) - 1), changes=st.dictionaries(HF_KEYS, ANY, max_size=3),
       drop=st.lists(HF_KEYS, max_size=2))
def test_from_hf_config_malformed_dicts_raise_value_error(i, changes, drop):
    hf = dict(HF_BASES[i])
    hf.update(changes)
    for k in drop:
        hf.pop(k, None)
    try:
        ModelConfig.from_hf_config(hf)
    except ValueError:
        pass


@pytest.mark.parametrize("changes, match", [
    ({"architectures": 24}, "architectures must be a list"),
    ({"architectures": [1]}, "architectures must be a list"),
    ({"architectures": None, "model_type": ["llama"]}, "model_type must be a str"),
    ({"rope_scaling": 3}, "rope_scaling must be a mapping"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "x", "low_freq_factor": 1,
                       "high_freq_factor": 4, "original_max_position_embeddings": 64}},
     "rope_scaling factor"),
    ({"rms_norm_eps": None}, "rms_norm_eps"),
    ({"rope_theta": [1]}, "rope_theta"),
    ({"rope_theta": 10**400}, "rope_theta"),
    ({"hidden_size": None, "head_dim": None}, "hidden_size"),
    ({"num_attention_heads": [], "head_dim": None}, "num_attention_heads"),
])
def test_from_hf_config_named_errors(changes, match):
    hf = {**ModelConfig.tiny().to_hf_config(), **changes}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config(hf)


def test_from_hf_config_round_trips_still():
    for cfg in (ModelConfig.tiny(), ModelConfig.tiny_hybrid()):
        assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


# --------------------------------------------------------------- LoRA adapters
LORA_FIELDS = ["r", "lora_alpha", "target_modules", "layers_to_transform", "bias", "peft_type",
               "use_dora", "modules_to_save", "fan_in_fan_out", "rank_pattern",
               "layers_pattern", "use_rslora"]


@pytest.fixture(scope="module")
def good_adapter(tmp_path_factory, lora_helpers):
    path = tmp_path_factory.mktemp("lora") / "good"
    lora_helpers.write_peft_adapter(path, ModelConfig.tiny(), rank=4, alpha=8.0)
    with open(path / "adapter_config.json") as f:
        return path, json.load(f), (path / "adapter_model.safetensors").read_bytes()


def _write(dst, cfg_text, weights):
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        f.write(cfg_text)
    with open(os.path.join(dst, "adapter_model.safetensors"), "wb") as f:
        f.write(weights)


@FAST
@given(changes=st.dictionaries(st.sampled_from(LORA_FIELDS), ANY, min_size=1, max_size=3))
def test_lora_config_fields_of_any_type(tmp_path_factory, good_adapter, changes):
    _, cfg, weights = good_adapter
    dst = str(tmp_path_factory.mktemp("bad"))
    _write(dst, json.dumps({**cfg, **changes}), weights)
    try:
        ad = load_lora_adapter(dst, ModelConfig.tiny(), max_lora_rank=16)
    except ValueError as e:
        assert dst in str(e)
        return
    assert np.isfinite(ad.scaling) and ad.scaling > 0 and 1 <= ad.rank <= 16


@pytest.mark.parametrize("text, match", [
    ("[" * 100_000 + "]" * 100_000, "unreadable adapter_config.json"),
    ("[]", "JSON object"), ("NaN", "JSON object"), ("\udcff", "unreadable"),
])
def test_lora_config_files_malformed(tmp_path, good_adapter, text, match):
    _, _, weights = good_adapter
    dst = str(tmp_path / "a")
    os.makedirs(dst)
    with open(os.path.join(dst, "adapter_config.json"), "w", errors="surrogateescape") as f:
        f.write(text)
    with open(os.path.join(dst, "adapter_model.safetensors"), "wb") as f:
        f.write(weights)
    with pytest.raises(ValueError, match=match):
        load_lora_adapter(dst, ModelConfig.tiny(), max_lora_rank=16)


@pytest.mark.parametrize("alpha", [10**400, -(10**400), float("inf"), 0, True, "8"])
def test_lora_alpha_out_of_range(tmp_path, good_adapter, alpha):
    _, cfg, weights = good_adapter
    _write(str(tmp_path), json.dumps({**cfg, "lora_alpha": alpha}), weights)
    with pytest.raises(ValueError, match="lora_alpha"):
        load_lora_adapter(str(tmp_path), ModelConfig.tiny(), max_lora_rank=16)


def _header(obj) -> bytes:
    raw = json.dumps(obj).encode()
    return struct.pack("<Q", len(raw)) + raw


SAFETENSORS = [
    b"", b"\x00" * 4, struct.pack("<Q", 2**60) + b"{}", _header([]), _header(None),
    _header({"a": 1}), _header({"a": {"dtype": ["BF16"]}}), _header({"a": {"shape": [1]}}),
    _header({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}) + b"\0",
    _header({"a": {"dtype": "BF16", "shape": [2]}}) + b"\0" * 4,
    _header({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 400]}}) + b"\0" * 8,
    _header({"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}}) + b"\0",
    b"\xff" * 8 + b"{}",
]


@pytest.mark.parametrize("raw", SAFETENSORS, ids=range(len(SAFETENSORS)))
def test_malformed_safetensors_raise_value_error(tmp_path, good_adapter, raw):
    p = tmp_path / "x.safetensors"
    p.write_bytes(raw)
    with pytest.raises(ValueError, match="safetensors|too short"):
        read_safetensors(str(p))
    _, cfg, _ = good_adapter
    _write(str(tmp_path / "ad"), json.dumps(cfg), raw)
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        load_lora_adapter(str(tmp_path / "ad"), ModelConfig.tiny(), max_lora_rank=16)


@FAST
@given(raw=st.binary(max_size=64))
def test_random_bytes_as_safetensors(tmp_path_factory, raw):
    p = tmp_path_factory.mktemp("st") / "x.safetensors"
    p.write_bytes(raw)
    with pytest.raises(ValueError):
        read_safetensors(str(p))
