"""Shared helpers for the model tests: a test-written HF checkpoint and an independent
float64 numpy forward pass (dense causal attention, no cache, Hugging Face conventions)."""
import json
import math
import os

import numpy as np
import pytest
import safetensors.numpy


def random_hf_weights(hf_cfg: dict, seed: int) -> dict:
    """Random f32 weights with HF names and torch [out, in] layouts."""
    rng = np.random.default_rng(seed)
    D, V, F = hf_cfg["hidden_size"], hf_cfg["vocab_size"], hf_cfg["intermediate_size"]
    N, K = hf_cfg["num_attention_heads"], hf_cfg["num_key_value_heads"]
    H = hf_cfg.get("head_dim", D // N)
    bias = hf_cfg["architectures"][0] == "Qwen2ForCausalLM" or hf_cfg.get("attention_bias")

    def w(*shape, scale=None):
        scale = 1 / math.sqrt(shape[-1]) if scale is None else scale
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {"model.embed_tokens.weight": w(V, D, scale=0.5),
           "model.norm.weight": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)}
    if not hf_cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = w(V, D)
    for i in range(hf_cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
        out[p + "post_attention_layernorm.weight"] = (
            1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
        out[p + "self_attn.q_proj.weight"] = w(N * H, D)
        out[p + "self_attn.k_proj.weight"] = w(K * H, D)
        out[p + "self_attn.v_proj.weight"] = w(K * H, D)
        out[p + "self_attn.o_proj.weight"] = w(D, N * H)
        if bias:
            out[p + "self_attn.q_proj.bias"] = w(N * H, scale=0.2)
            out[p + "self_attn.k_proj.bias"] = w(K * H, scale=0.2)
            out[p + "self_attn.v_proj.bias"] = w(K * H, scale=0.2)
        out[p + "mlp.gate_proj.weight"] = w(F, D)
        out[p + "mlp.up_proj.weight"] = w(F, D)
        out[p + "mlp.down_proj.weight"] = w(D, F)
    return out


def write_hf_checkpoint(path, hf_cfg: dict, weights: dict, *, num_shards: int = 1):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f)
    names = sorted(weights)
    if num_shards == 1:
        safetensors.numpy.save_file(weights, os.path.join(path, "model.safetensors"))
        return
    weight_map = {}
    for s in range(num_shards):
        fn = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {k: weights[k] for k in names[s::num_shards]}
        safetensors.numpy.save_file(part, os.path.join(path, fn))
        weight_map.update({k: fn for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _inv_freq(hf_cfg: dict) -> np.ndarray:
    D, N = hf_cfg["hidden_size"], hf_cfg["num_attention_heads"]
    H = hf_cfg.get("head_dim", D // N)
    inv = 1.0 / (hf_cfg.get("rope_theta", 10000.0) ** (np.arange(0, H, 2) / H))
    rs = hf_cfg.get("rope_scaling")
    if rs:  # HF _compute_llama3_parameters, in float64
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        new = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * new / factor + smooth * new
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = np.where(medium, smoothed, new)
    return inv


def hf_layer_windows(hf_cfg: dict) -> list:
    """Each layer's sliding window (None: full attention), by transformers' rules:
    Qwen2Config (`sliding_window` only with `use_sliding_window`; `layer_types`, else
    sliding iff layer >= `max_window_layers`), MistralConfig (`sliding_window`, default
    4096, on every layer), Llama (none)."""
    L = hf_cfg["num_hidden_layers"]
    arch = hf_cfg["architectures"][0]
    if arch == "MistralForCausalLM":
        return [hf_cfg.get("sliding_window", 4096)] * L
    if arch != "Qwen2ForCausalLM":
        return [None] * L
    window = hf_cfg.get("sliding_window", 4096) if hf_cfg.get("use_sliding_window") else None
    types = hf_cfg.get("layer_types") or [
        "sliding_attention" if window is not None and i >= hf_cfg.get("max_window_layers", 28)
        else "full_attention" for i in range(L)]
    return [window if t == "sliding_attention" else None for t in types]


def np_forward(hf_cfg: dict, weights: dict, token_ids, *, mm_rows=None) -> np.ndarray:
    """Logits f64[T, V] of one sequence, dense causal attention, HF conventions.

    Sliding-window layers (`hf_layer_windows`) use HF's mask: query q sees key k iff
    `q - W < k <= q` (`masking_utils.sliding_window_overlay` and the causal mask).

    mm_rows: optional {position: f[D] embedding row} replacing token embeddings.
    """
    W = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    D, N = hf_cfg["hidden_size"], hf_cfg["num_attention_heads"]
    K = hf_cfg["num_key_value_heads"]
    H = hf_cfg.get("head_dim", D // N)
    eps = hf_cfg["rms_norm_eps"]
    ids = np.asarray(token_ids)
    T = len(ids)
    x = W["model.embed_tokens.weight"][ids]
    for pos, row in (mm_rows or {}).items():
        x[pos] = np.asarray(row, np.float64)

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w

    ang = np.arange(T)[:, None] * _inv_freq(hf_cfg)[None, :]  # [T, H/2]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]

    def rope(t):  # HF: t * cos + rotate_half(t) * sin
        rot = np.concatenate([-t[..., H // 2:], t[..., : H // 2]], -1)
        return t * cos + rot * sin

    causal = np.tril(np.ones((T, T), bool))
    windows = hf_layer_windows(hf_cfg)
    for i in range(hf_cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, W[p + "input_layernorm.weight"])
        q = h @ W[p + "self_attn.q_proj.weight"].T
        k = h @ W[p + "self_attn.k_proj.weight"].T
        v = h @ W[p + "self_attn.v_proj.weight"].T
        if p + "self_attn.q_proj.bias" in W:
            q = q + W[p + "self_attn.q_proj.bias"]
            k = k + W[p + "self_attn.k_proj.bias"]
            v = v + W[p + "self_attn.v_proj.bias"]
        q = rope(q.reshape(T, N, H))
        k = rope(k.reshape(T, K, H))
        v = v.reshape(T, K, H)
        k = np.repeat(k, N // K, axis=1)  # HF repeat_kv: q head n uses kv head n // (N/K)
        v = np.repeat(v, N // K, axis=1)
        s = np.einsum("qnh,knh->nqk", q, k) / math.sqrt(H)
        mask = causal
        if windows[i] is not None:
            qi, ki = np.arange(T)[:, None], np.arange(T)[None, :]
            mask = causal & (ki > qi - windows[i])
        s = np.where(mask[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        o = np.einsum("nqk,knh->qnh", s, v).reshape(T, N * H)
        x = x + o @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        g = h @ W[p + "mlp.gate_proj.weight"].T
        u = h @ W[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ W[p + "mlp.down_proj.weight"].T
    x = rms(x, W["model.norm.weight"])
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return x @ head.T


def llama_hf_config(**overrides) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 384,
        "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    }
    cfg.update(overrides)
    return cfg


def qwen2_hf_config(**overrides) -> dict:
    cfg = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 320,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "use_sliding_window": False,
    }
    cfg.update(overrides)
    return cfg


@pytest.fixture
def hf_helpers():
    """The helper functions, as a namespace."""
    class NS:
        pass
    ns = NS()
    ns.random_hf_weights = random_hf_weights
    ns.write_hf_checkpoint = write_hf_checkpoint
    ns.np_forward = np_forward
    ns.llama_hf_config = llama_hf_config
    ns.qwen2_hf_config = qwen2_hf_config
    ns.hf_layer_windows = hf_layer_windows
    return ns
