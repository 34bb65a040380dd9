"""GGUF files (llama.cpp's format) -> `ModelConfig` + `Transformer`.

    from prefixcache.model.gguf import load_gguf
    config, model = load_gguf(".../SmolLM2-135M-Instruct.Q4_1.gguf")

Read with the `gguf` package (llama.cpp's own Python reader, the optional extra
`prefixcache[gguf]`; imported lazily, so the core does not need it) and dequantized at
load with `gguf.quants.dequantize`: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the
K-quants (Q2_K..Q6_K) and i-quants the installed package covers. The params are float32
(or `dtype="bfloat16"`): the quantized values are expanded once, so the model computes
on exactly the dequantized weights (as transformers' GGUF loading does).

Architectures: `llama` (also Mistral/SmolLM2 files, which llama.cpp writes as llama),
`qwen2` (q/k/v bias) and `gemma3` (text; see below). Tensor names (numpy shapes, i.e. ggml's `ne` reversed = torch's
[out_features, in_features]) and their HF counterparts (`prefixcache.model.loading`):

  token_embd.weight [V, D]        model.embed_tokens.weight
  output_norm.weight [D]          model.norm.weight
  output.weight [V, D]            lm_head.weight (absent: tied embeddings)
  blk.i.attn_norm.weight          model.layers.i.input_layernorm.weight
  blk.i.ffn_norm.weight           model.layers.i.post_attention_layernorm.weight
  blk.i.attn_{q,k,v}.weight       model.layers.i.self_attn.{q,k,v}_proj.weight
  blk.i.attn_{q,k,v}.bias         ....{q,k,v}_proj.bias (qwen2)
  blk.i.attn_output.weight        model.layers.i.self_attn.o_proj.weight
  blk.i.ffn_{gate,up,down}.weight model.layers.i.mlp.{gate,up,down}_proj.weight

RoPE layout: llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`)
reorders the rows of a llama model's Q and K weights from HF's rotate-half layout to
GPT-J's interleaved pairs, per head: `w.reshape(n_head, 2, H // 2, D).swapaxes(1, 2)`.
We undo it (`_unpermute`, transformers' `reverse_permute_weights`); qwen2 and gemma3
files are not permuted (llama.cpp runs them with NEOX rope).

Gemma 3 (`Gemma3ForCausalLM`, as llama.cpp's `gemma3` graph and transformers' GGUF loading
read it): four norms per layer and per-head q/k norms,

  blk.i.attn_norm.weight          model.layers.i.input_layernorm.weight
  blk.i.post_attention_norm.weight model.layers.i.post_attention_layernorm.weight
  blk.i.ffn_norm.weight           model.layers.i.pre_feedforward_layernorm.weight
  blk.i.post_ffw_norm.weight      model.layers.i.post_feedforward_layernorm.weight
  blk.i.attn_{q,k}_norm.weight    model.layers.i.self_attn.{q,k}_norm.weight

every norm weight stored as 1 + w (llama.cpp's converter adds the 1; we subtract it, as
transformers' `Gemma2TensorProcessor`); the sliding window from
`gemma3.attention.sliding_window` on five layers of six (every 6th full: llama.cpp's
`set_swa_pattern(6)`, transformers' `sliding_window_pattern`); RoPE base
`gemma3.rope.freq_base` on the full layers and `gemma3.rope.freq_base_swa` (default
10000) on the sliding ones; attention scale 1/sqrt(head_dim), as llama.cpp (whose
exception, the 62-layer 27B, takes d_model / head_count: both are Gemma 3's
`query_pre_attn_scalar`); GeGLU with the tanh GELU; embeddings times sqrt(d_model).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from prefixcache._gguf import plain_array_reader
from prefixcache.model.config import ModelConfig, gemma3_layer_types
from prefixcache.model.llama import Transformer
from prefixcache.model.loading import build_transformer, hf_param_map

__all__ = ["GGUF_ARCHITECTURES", "gguf_config", "load_gguf", "load_gguf_reader", "read_gguf"]

# GGUF `general.architecture` -> (our HF architecture name, q/k rows permuted for RoPE).
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "gemma3": ("Gemma3ForCausalLM", False),
}

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GEMMA3_PER_LAYER = {
    **{k: v for k, v in _PER_LAYER.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# llama.cpp's Gemma 3 27B (its only model type whose attention scale is not head_dim).
_GEMMA3_27B_LAYERS = 62


def _import_gguf():
    try:
        import gguf  # noqa: PLC0415
    except ImportError as e:
        raise ImportError("reading GGUF files needs the `gguf` package: "
                          "pip install 'prefixcache[gguf]'") from e
    return gguf


def read_gguf(path: str | os.PathLike):
    """`gguf.GGUFReader(path)` (memory-mapped), with every failure as a ValueError.

    Raises:
      ValueError: not a file, not a GGUF file (wrong magic), an unsupported GGUF version,
        or a truncated / corrupt header or tensor table (named, with the path).
    """
    gguf = _import_gguf()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        return plain_array_reader(gguf)(path, "r")
    except Exception as e:  # noqa: BLE001 (the reader raises ValueError, IndexError, ...)
        raise ValueError(f"{path}: unreadable GGUF file (truncated or corrupt?): "
                         f"{type(e).__name__}: {e}") from None


def _field(reader, key: str, default: Any = KeyError) -> Any:
    """A metadata value: str, int, float, bool; arrays as their length (see callers)."""
    field = reader.fields.get(key)
    if field is None:
        if default is KeyError:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    gguf = _import_gguf()
    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        return len(field.data)
    part = field.parts[field.data[0]]
    if vtype == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    value = part.tolist()[0]
    if vtype == gguf.GGUFValueType.BOOL:
        return bool(value)
    return value


def _int(reader, key: str, default: Any = KeyError) -> int:
    v = _field(reader, key, default)
    if v is None:
        return v
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"GGUF metadata {key!r} must be an integer, got {v!r}")
    return v


def gguf_config(reader, *, dtype: str | None = None) -> ModelConfig:
    """The `ModelConfig` a GGUF file's metadata describes.

    Keys (`arch` = `general.architecture`): `{arch}.block_count`, `.embedding_length`,
    `.feed_forward_length`, `.attention.head_count`, `.attention.head_count_kv` (default:
    head_count), `.attention.key_length` (head_dim; default embedding_length /
    head_count), `.attention.layer_norm_rms_epsilon`, `.rope.freq_base` (default 1e4),
    `.rope.dimension_count` (must be head_dim: no partial rotary), `.rope.scaling.type`
    (none or absent only), `.context_length`; the vocab size from `tokenizer.ggml.tokens`
    (else `{arch}.vocab_size`, else the embedding's rows); tied embeddings when there is
    no `output.weight` tensor.

    Args:
      reader: a `gguf.GGUFReader`.
      dtype: "float32" (default: the dequantized values exactly) or "bfloat16".

    Raises:
      ValueError: an unknown architecture, a missing or invalid key, or a feature the
        model does not support (partial rotary, RoPE scaling, llama3 `rope_freqs`), named.
    """
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} not supported; supported: "
                         f"{sorted(GGUF_ARCHITECTURES)}")
    hf_arch, _ = GGUF_ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}
    d_model = _int(reader, f"{arch}.embedding_length")
    num_heads = _int(reader, f"{arch}.attention.head_count")
    num_kv_heads = _int(reader, f"{arch}.attention.head_count_kv", num_heads)
    if num_heads < 1 or d_model % num_heads:
        raise ValueError(f"GGUF {arch}.embedding_length {d_model} is not a multiple of "
                         f"{arch}.attention.head_count {num_heads}")
    head_dim = _int(reader, f"{arch}.attention.key_length", d_model // num_heads)
    value_dim = _int(reader, f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ValueError(f"GGUF {arch}.attention.value_length {value_dim} != key_length "
                         f"{head_dim}: not supported")
    rope_dim = _int(reader, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"GGUF {arch}.rope.dimension_count {rope_dim} != head_dim "
                         f"{head_dim}: partial rotary embeddings are not supported")
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"GGUF {arch}.rope.scaling.type {scaling!r} not supported "
                         "(only unscaled RoPE)")
    factor = _field(reader, f"{arch}.rope.scaling.factor", 1.0)
    if factor not in (0, 1):  # (Gemma 3 1B files write a factor of 1 and no type)
        raise ValueError(f"GGUF {arch}.rope.scaling.factor {factor!r} not supported "
                         "(only unscaled RoPE)")
    if "rope_freqs.weight" in tensors:
        raise ValueError("GGUF tensor 'rope_freqs.weight' (llama3 RoPE frequency factors) "
                         "not supported")
    if "tokenizer.ggml.tokens" in reader.fields:
        vocab = _field(reader, "tokenizer.ggml.tokens")
    else:
        vocab = _int(reader, f"{arch}.vocab_size", None)
        if vocab is None:
            emb = tensors.get("token_embd.weight")
            if emb is None:
                raise ValueError("GGUF file has no tokenizer.ggml.tokens, no "
                                 f"{arch}.vocab_size and no token_embd.weight")
            vocab = int(emb.shape[-1])
    eps = _field(reader, f"{arch}.attention.layer_norm_rms_epsilon")
    theta = _field(reader, f"{arch}.rope.freq_base", 10000.0)
    gemma = {}
    if arch == "gemma3":
        num_layers = _int(reader, f"{arch}.block_count")
        gemma = dict(
            sliding_window=_int(reader, f"{arch}.attention.sliding_window"),
            layer_types=gemma3_layer_types(num_layers) if num_layers > 0 else None,
            rope_local_theta=_field(reader, f"{arch}.rope.freq_base_swa", 10000.0),
            hidden_act="gelu_pytorch_tanh",
            query_pre_attn_scalar=float(d_model // num_heads if num_layers ==
                                        _GEMMA3_27B_LAYERS else head_dim))
    for key, v in (("attention.layer_norm_rms_epsilon", eps), ("rope.freq_base", theta),
                   ("rope.freq_base_swa", gemma.get("rope_local_theta", 1.0))):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"GGUF metadata {arch}.{key} must be a number, got {v!r}")
    try:
        return ModelConfig(
            vocab_size=vocab, d_model=d_model,
            num_layers=_int(reader, f"{arch}.block_count"),
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            mlp_dim=_int(reader, f"{arch}.feed_forward_length"),
            # (f32 in the file: 1e-5 reads 9.99999974738e-06; transformers reads it so too)
            rms_norm_eps=float(eps), rope_theta=float(theta),
            max_position_embeddings=_int(reader, f"{arch}.context_length"),
            tie_embeddings="output.weight" not in tensors,
            qkv_bias=arch == "qwen2",
            dtype=dtype or "float32", architecture=hf_arch, **gemma)
    except ValueError as e:
        raise ValueError(f"GGUF metadata: {e}") from None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's `permute` of Q/K rows (interleaved pairs -> rotate-half)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def load_gguf(path: str | os.PathLike, *, dtype: str | None = None,
              progress: bool = True, stacked: bool = True,
              converted_cache: bool | str | os.PathLike = False
              ) -> tuple[ModelConfig, Transformer]:
    """Loads a llama / qwen2 / gemma3 GGUF file (weights dequantized; see the module
    docstring).

    Every check runs before any weight is converted: the header, the config, the set of
    tensors (none missing or unexpected), each tensor's shape and quantization type.

    Args:
      path: the .gguf file.
      dtype: "float32" (default) or "bfloat16".
      progress: show a tqdm bar over the tensors.
      stacked: the layers' params in the stacked layout (`Transformer.stacked`: held
        once, as the scanned step reads them; the default), or False: per layer.
      converted_cache: keep the converted (dequantized, stacked) weights on disk and
        read them back on the next load of the same file bytes and dtype
        (`prefixcache.model.converted`): a cache directory, True (`PREFIXCACHE_CACHE_DIR`
        or ~/.cache/prefixcache), or False (convert every time). Stacked loads only.

    Returns:
      (config, model).

    Raises:
      ValueError: not a GGUF file, truncated, unknown architecture, a missing or
        unexpected tensor, a tensor of the wrong shape, or one of a quantization type
        `gguf.quants.dequantize` does not cover (all named).
    """
    path = os.fspath(path)
    return load_gguf_reader(read_gguf(path), path, dtype=dtype, progress=progress,
                            stacked=stacked, converted_cache=converted_cache)


def load_gguf_reader(reader, path: str, *, dtype: str | None = None,
                     progress: bool = True, stacked: bool = True,
                     converted_cache: bool | str | os.PathLike = False
                     ) -> tuple[ModelConfig, Transformer]:
    """`load_gguf` on an open `read_gguf(path)` reader (`path` names it in errors)."""
    gguf = _import_gguf()
    config = gguf_config(reader, dtype=dtype)
    if not isinstance(converted_cache, (bool, str, os.PathLike)):
        raise ValueError(f"converted_cache must be a bool or a directory, got "
                         f"{type(converted_cache).__name__}")
    copy_dir = None
    if converted_cache is not False and stacked:
        from prefixcache.model import converted  # noqa: PLC0415

        cache_dir = (converted.default_cache_dir() if converted_cache is True
                     else os.fspath(converted_cache))
        copy_dir = converted.converted_dir(cache_dir, converted.file_sha256(path),
                                           config.dtype)
        model = converted.load_converted(config, copy_dir)
        if model is not None:
            return config, model
    _, permuted = GGUF_ARCHITECTURES[_field(reader, "general.architecture")]

    to_hf = dict(_GLOBAL)
    per_layer = _GEMMA3_PER_LAYER if config.gemma else _PER_LAYER
    for i in range(config.num_layers):
        to_hf.update({f"blk.{i}.{k}": f"model.layers.{i}.{v}" for k, v in per_layer.items()})
    shapes = {hf: shape for hf, shape, *_ in hf_param_map(config).values()}
    tensors = {t.name: t for t in reader.tensors}
    wanted = {g: hf for g, hf in to_hf.items() if hf in shapes}
    missing = sorted(set(wanted) - tensors.keys())
    if missing:
        raise ValueError(f"{path}: GGUF file lacks tensors {missing}")
    extra = sorted(tensors.keys() - wanted.keys())
    if extra:
        raise ValueError(f"{path}: unexpected tensors for {config.architecture} "
                         f"(block_count {config.num_layers}): {extra}")
    bad = []
    for name, hf in wanted.items():
        t = tensors[name]
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        if shape != shapes[hf]:
            bad.append(f"{name}: {shape} != expected {shapes[hf]}")
    if bad:
        raise ValueError(f"{path}: GGUF tensor shape mismatch: " + "; ".join(bad))
    for name in wanted:  # every type dequantizes (probed on one row) and every byte is there
        t = tensors[name]
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(t.shape.tolist())) // block * type_size
        if t.data.nbytes != nbytes:
            raise ValueError(f"{path}: GGUF tensor {name!r} ({qtype.name}) has {t.data.nbytes} "
                             f"bytes of data, expected {nbytes} (truncated file?)")
        try:
            gguf.quants.dequantize(np.asarray(t.data.reshape(t.data.shape[0] if
                                                             t.data.ndim > 1 else 1, -1)[:1]),
                                   qtype)
        except NotImplementedError:
            raise ValueError(f"{path}: GGUF tensor {name!r} has quantization type "
                             f"{qtype.name}, which gguf.quants.dequantize does not cover"
                             ) from None
    by_hf = {hf: g for g, hf in wanted.items()}
    q_names = {f"model.layers.{i}.self_attn.q_proj.weight" for i in range(config.num_layers)}
    k_names = {f"model.layers.{i}.self_attn.k_proj.weight" for i in range(config.num_layers)}

    def get(hf_name: str) -> np.ndarray:
        t = tensors[by_hf[hf_name]]
        w = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType(
            t.tensor_type)).reshape(shapes[hf_name])
        if permuted and hf_name in q_names:
            w = _unpermute(w, config.num_heads)
        elif permuted and hf_name in k_names:
            w = _unpermute(w, config.num_kv_heads)
        elif config.gemma and hf_name.endswith("norm.weight"):
            w = w - np.float32(1)  # the file holds 1 + w (see the module docstring)
        return w

    model = build_transformer(config, get, progress=progress,
                              desc=f"load {os.path.basename(path)}", stacked=stacked)
    if copy_dir is not None:
        from prefixcache.model import converted  # noqa: PLC0415

        os.makedirs(os.path.dirname(copy_dir), exist_ok=True)
        converted.save_converted(model, copy_dir)
    return config, model
