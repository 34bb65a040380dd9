"""Tiny random GGUF files written with the `gguf` package's own `GGUFWriter`.

The reference check (hf_reference.py) and the loader tests (tests/model/test_gguf.py)
share them: `write_tiny_gguf(path, spec)` writes a llama or qwen2 model with random
weights, quantized per tensor with `gguf.quants.quantize`, in llama.cpp's layout (Q/K rows
of a llama model permuted for its RoPE as `convert_hf_to_gguf.py`'s `LlamaModel.permute`).
Needs only numpy and gguf (no torch, no prefixcache).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class TinySpec:
    """A tiny model: its shape, per-tensor quantization, tied or not.

    `qtypes` maps a GGUF tensor-name suffix ("attn_q.weight", "token_embd.weight", ...)
    to a GGML type name; unnamed 2-D tensors get `default_qtype`, norms and biases F32.
    """

    name: str
    arch: str = "llama"
    vocab_size: int = 64
    d_model: int = 128  # (head_dim 64: what the paged-attention kernels support)
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    mlp_dim: int = 64
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    context_length: int = 256
    tied: bool = True
    default_qtype: str = "Q4_1"
    qtypes: tuple[tuple[str, str], ...] = ()
    seed: int = 0


# The committed files (tests/data/tiny_*.gguf): Q4_1 and Q8_0 (plus Q4_0 / F16 / F32 on
# a few tensors), tied and untied, llama (permuted Q/K) and qwen2 (q/k/v bias).
TINY_SPECS = (
    TinySpec("tiny_llama_q4_1", default_qtype="Q4_1",
             qtypes=(("token_embd.weight", "Q8_0"), ("blk.1.attn_output.weight", "Q4_0"),
                     ("blk.1.ffn_down.weight", "F16")), seed=1),
    # MHA (2 kv heads), an untied Q8_0 head, Q8_0 q/k (the permuted ones)
    TinySpec("tiny_llama_untied", default_qtype="Q4_1", tied=False, num_kv_heads=2,
             rope_theta=100000.0,
             qtypes=(("output.weight", "Q8_0"), ("attn_q.weight", "Q8_0"),
                     ("attn_k.weight", "Q8_0")), seed=2),
    TinySpec("tiny_qwen2", arch="qwen2", default_qtype="Q8_0", rms_norm_eps=1e-6,
             rope_theta=1000000.0, qtypes=(("ffn_up.weight", "Q4_1"),
                                           ("ffn_gate.weight", "Q4_1"),
                                           ("attn_output.weight", "Q4_1")), seed=3),
)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (HF rotate-half rows -> interleaved pairs)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def random_tensors(spec: TinySpec) -> dict[str, np.ndarray]:
    """GGUF name -> f32 array in HF layout ([out, in]; Q/K not yet permuted)."""
    rng = np.random.default_rng(spec.seed)
    D, V, F = spec.d_model, spec.vocab_size, spec.mlp_dim
    N, K = spec.num_heads, spec.num_kv_heads
    H = D // N

    def w(*shape, scale=None):
        scale = 1 / math.sqrt(shape[-1]) if scale is None else scale
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm():
        return (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)

    out = {"token_embd.weight": w(V, D, scale=0.5), "output_norm.weight": norm()}
    if not spec.tied:
        out["output.weight"] = w(V, D)
    for i in range(spec.num_layers):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = norm()
        out[p + "ffn_norm.weight"] = norm()
        # (q/k larger than 1/sqrt(D): sharp attention, so RoPE and its layout matter)
        out[p + "attn_q.weight"] = w(N * H, D, scale=0.5)
        out[p + "attn_k.weight"] = w(K * H, D, scale=0.5)
        out[p + "attn_v.weight"] = w(K * H, D)
        out[p + "attn_output.weight"] = w(D, N * H)
        if spec.arch == "qwen2":
            out[p + "attn_q.bias"] = w(N * H, scale=0.2)
            out[p + "attn_k.bias"] = w(K * H, scale=0.2)
            out[p + "attn_v.bias"] = w(K * H, scale=0.2)
        out[p + "ffn_gate.weight"] = w(F, D)
        out[p + "ffn_up.weight"] = w(F, D)
        out[p + "ffn_down.weight"] = w(D, F)
    return out


def write_tiny_gguf(path: str, spec: TinySpec, *, tensors: dict | None = None,
                    arch: str | None = None, shape_override: dict | None = None) -> None:
    """Writes `spec` as a GGUF file (`tensors`: GGUF name -> f32 HF-layout arrays,
    default `random_tensors(spec)`; `arch` overrides general.architecture and
    `shape_override` {name: new 2-D shape} writes a tensor of another shape: both for
    the malformed-file tests)."""
    import gguf  # noqa: PLC0415

    tensors = random_tensors(spec) if tensors is None else tensors
    arch = arch or spec.arch
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(spec.num_layers)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.d_model)
    writer.add_feed_forward_length(spec.mlp_dim)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_rope_dimension_count(spec.d_model // spec.num_heads)
    writer.add_vocab_size(spec.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    qtypes = dict(spec.qtypes)
    for name, arr in tensors.items():
        arr = np.asarray(arr, np.float32)
        if shape_override and name in shape_override:
            arr = np.resize(arr, shape_override[name]).astype(np.float32)
        if spec.arch == "llama" and name.endswith("attn_q.weight"):
            arr = permute(arr, spec.num_heads)
        elif spec.arch == "llama" and name.endswith("attn_k.weight"):
            arr = permute(arr, spec.num_kv_heads)
        qname = next((q for k, q in qtypes.items() if name.endswith(k)),
                     spec.default_qtype if arr.ndim == 2 else "F32")
        qtype = gguf.GGMLQuantizationType[qname]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, arr)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, arr.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def dequantized_tensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file dequantized (numpy shape = ggml's ne reversed)."""
    import gguf  # noqa: PLC0415

    reader = gguf.GGUFReader(path)
    return {t.name: gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(
        tuple(int(n) for n in reversed(t.shape.tolist()))) for t in reader.tensors}


# --------------------------------------------------------------------------- Gemma 3
@dataclasses.dataclass(frozen=True)
class TinyGemma3Spec:
    """A tiny Gemma 3: five sliding-window layers per full-attention one (llama.cpp and
    transformers place the full layer at every 6th index), q/k norms, sandwich norms, a
    SentencePiece-style ("llama") tokenizer vocabulary with byte fallback. head_dim 256
    as the real models: transformers' GGUF path takes `query_pre_attn_scalar` from
    Gemma3TextConfig's default (256), llama.cpp from head_dim, so the two agree here."""

    name: str = "tiny_gemma3"
    vocab_size: int = 512
    d_model: int = 64
    num_layers: int = 6
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 256
    mlp_dim: int = 256
    sliding_window: int = 8
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    context_length: int = 256
    seed: int = 5
    # As the real Q4_K_M file where gguf.quants can write the type (token_embd Q8_0,
    # q/k/gate/up Q5_0, v Q8_0); its Q4_K / Q6_K tensors (attn_output, ffn_down) become
    # Q4_1 / Q5_1 here (gguf.quants has no K-quant encoder; the real file covers them).
    qtypes: tuple[tuple[str, str], ...] = (
        ("token_embd.weight", "Q8_0"), ("attn_q.weight", "Q5_0"), ("attn_k.weight", "Q5_0"),
        ("attn_v.weight", "Q8_0"), ("attn_output.weight", "Q4_1"),
        ("ffn_gate.weight", "Q5_0"), ("ffn_up.weight", "Q5_0"), ("ffn_down.weight", "Q5_1"))


TINY_GEMMA3 = TinyGemma3Spec()

# The tiny vocabulary: Gemma's specials (ids 0-4 as in the real file), turn markers,
# newline runs (USER_DEFINED), space runs (stored as real spaces, as Gemma's file does),
# the 256 byte-fallback tokens, then BPE pieces learned from this text, in merge order.
_GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>",
                   "<end_of_turn>")
_TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the "
    "fox runs into the forest. A cache keeps the keys and values of the tokens it has "
    "seen, so the next request that shares the prefix starts from there. Sliding window "
    "attention looks at the last few tokens only; full attention looks at all of them. "
    "Hello world! How are you today? I am fine, thank you. Numbers: 12 345 6789.")


def tiny_gemma3_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of the tiny Gemma vocabulary (`size` entries)."""
    tokens = list(_GEMMA_SPECIALS) + ["\n", "\n\n", "  ", "   "]
    types = [3] * len(_GEMMA_SPECIALS) + [4, 4, 1, 1]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    text = _TINY_CORPUS.replace(" ", "\u2581")
    chars = sorted(set(text))
    tokens += chars
    types += [1] * len(chars)
    words = [list(w) for w in text.split("\u2581") if w]
    words = [["\u2581"] + w for w in words]
    while len(tokens) < size:
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for a, b in zip(w, w[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + 1
        best = max(counts.items(), key=lambda kv: (kv[1], kv[0]), default=None)
        if best is None or best[1] < 2:
            break
        (a, b), _ = best
        tokens.append(a + b)
        types.append(1)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [a + b]
                i += 1
    i = 0
    while len(tokens) < size:  # (filler pieces, never produced by the merges above)
        tokens.append(f"\u2581zz{i}")
        types.append(1)
        i += 1
    scores = [-1000.0 if t in (3, 4) else 0.0 if t == 6 else -float(i)
              for i, t in enumerate(types)]
    return tokens, scores, types


def gemma3_random_tensors(spec: TinyGemma3Spec) -> dict[str, np.ndarray]:
    """GGUF name -> f32 array, HF layout ([out, in]); norms as HF stores them (the GGUF
    holds 1 + w: `write_tiny_gemma3_gguf` adds the 1, as llama.cpp's converter does)."""
    rng = np.random.default_rng(spec.seed)
    D, V, F, H = spec.d_model, spec.vocab_size, spec.mlp_dim, spec.head_dim
    N, K = spec.num_heads, spec.num_kv_heads

    def w(*shape, scale=None):
        scale = 1 / math.sqrt(shape[-1]) if scale is None else scale
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(n):
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    out = {"token_embd.weight": w(V, D, scale=0.5), "output_norm.weight": norm(D)}
    for i in range(spec.num_layers):
        p = f"blk.{i}."
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            out[p + name + ".weight"] = norm(D)
        out[p + "attn_q_norm.weight"] = norm(H)
        out[p + "attn_k_norm.weight"] = norm(H)
        out[p + "attn_q.weight"] = w(N * H, D)
        out[p + "attn_k.weight"] = w(K * H, D)
        out[p + "attn_v.weight"] = w(K * H, D)
        out[p + "attn_output.weight"] = w(D, N * H)
        out[p + "ffn_gate.weight"] = w(F, D)
        out[p + "ffn_up.weight"] = w(F, D)
        out[p + "ffn_down.weight"] = w(D, F)
    return out


def write_tiny_gemma3_gguf(path: str, spec: TinyGemma3Spec = TINY_GEMMA3) -> None:
    """Writes `spec` as a gemma3 GGUF file, as llama.cpp's converter lays one out: norm
    weights + 1, Q/K rows unpermuted (NEOX RoPE), no output.weight (tied), the sliding
    window in `gemma3.attention.sliding_window`, a "llama" (SentencePiece) tokenizer."""
    import gguf  # noqa: PLC0415

    tensors = gemma3_random_tensors(spec)
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_block_count(spec.num_layers)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.d_model)
    writer.add_feed_forward_length(spec.mlp_dim)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_sliding_window(spec.sliding_window)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tokens, scores, types = tiny_gemma3_vocab(spec.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    qtypes = dict(spec.qtypes)
    for name, arr in tensors.items():
        arr = np.asarray(arr, np.float32)
        if name.endswith("norm.weight"):
            arr = (arr + 1).astype(np.float32)
        qname = next((q for k, q in qtypes.items() if name.endswith(k)),
                     "F32" if arr.ndim == 1 else "Q8_0")
        qtype = gguf.GGMLQuantizationType[qname]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, arr)
        else:
            writer.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
