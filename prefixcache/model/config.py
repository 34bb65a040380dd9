"""`ModelConfig`: the shape of a Llama-style decoder (Llama 2/3, Qwen2, Mistral, Gemma 3),
with presets."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from prefixcache._validate import check_positive_int

__all__ = ["ATTENTION_TYPES", "HIDDEN_ACTS", "ModelConfig", "RopeScaling",
           "SUPPORTED_ARCHITECTURES", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = ("float32", "bfloat16")
# HF `architectures[0]` -> our flavour (Llama, Qwen2 and Mistral differ only in defaults:
# Qwen2 has q/k/v bias, Mistral a sliding window on every layer; Gemma 3 is the Gemma
# block: see `ModelConfig.gemma`).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Gemma3ForCausalLM": "gemma3",
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "mistral": "MistralForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# MLP activations by their HF names: SwiGLU's SiLU, GeGLU's tanh-approximated GELU.
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
# Per-layer attention kinds, with Hugging Face's names (`config.layer_types`).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
ATTENTION_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def _positive_int(name: str, v: Any) -> int:
    # The one rule for sizes (_validate): numpy ints are ints, bools are not.
    return check_positive_int(name, v)


def _positive_float(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {v!r}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 RoPE frequency scaling (HF `rope_type: "llama3"`).

    Wavelengths longer than `original_max_position_embeddings / low_freq_factor` are divided
    by `factor`; shorter than `.../ high_freq_factor` kept; in between, smoothly interpolated.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        _positive_float("rope_scaling.factor", self.factor)
        _positive_float("rope_scaling.low_freq_factor", self.low_freq_factor)
        _positive_float("rope_scaling.high_freq_factor", self.high_freq_factor)
        _positive_int("rope_scaling.original_max_position_embeddings",
                      self.original_max_position_embeddings)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, RoPE (HF rotate-half), GQA, gated MLP.

    Invariants (checked in `__post_init__`): all sizes positive; `num_heads` a multiple of
    `num_kv_heads`; `head_dim` even (RoPE rotates pairs of halves); `dtype` one of
    `SUPPORTED_DTYPES` (params, activations and the KV cache; norms, softmax and logits run
    in float32).

    Attributes:
      vocab_size: V. d_model: D (hidden size). num_layers: L. num_heads: N (query heads).
      num_kv_heads: K. head_dim: H. mlp_dim: F (SwiGLU intermediate size).
      rms_norm_eps: RMSNorm epsilon. rope_theta: RoPE base.
      rope_scaling: Llama-3 scaling or None.
      max_position_embeddings: the longest sequence the model is meant for.
      tie_embeddings: the LM head reuses the input embedding.
      qkv_bias: q/k/v projections carry a bias (Qwen2; Llama with attention_bias).
      o_bias: the output projection carries a bias too (Llama with attention_bias=True:
        transformers puts a bias on q/k/v AND o_proj; Qwen2 has none on o_proj).
      dtype: "float32" or "bfloat16".
      architecture: the HF architecture name written by `save_hf_checkpoint`.
      sliding_window: W, the window of the sliding-window layers, or None (no such layer).
        HF semantics: a query at position p attends to the keys at positions (p - W, p]
        (W keys, itself included), as `kernels.paged_attention(sliding_window=W)`.
      layer_types: per layer "full_attention" or "sliding_attention" (HF's names), or
        None for a uniform model: every layer sliding when `sliding_window` is set
        (Mistral), else every layer full. A uniform tuple is stored as None, so equal
        models compare equal; `attention_types` is always the resolved tuple.
      hidden_act: the gated MLP's activation, "silu" (SwiGLU) or "gelu_pytorch_tanh"
        (GeGLU with tanh-approximated GELU, Gemma).
      query_pre_attn_scalar: attention scores are scaled by its -1/2 power; None:
        head_dim (Gemma 3 sets it; 256 for 270M..12B).
      rope_local_theta: the RoPE base of the sliding-window layers (Gemma 3's
        `rope_local_base_freq`, 10000); None: `rope_theta` on every layer.

    Gemma 3 (`architecture="Gemma3ForCausalLM"`, `gemma` true) also has, fixed by the
    architecture as in transformers' `Gemma3TextModel`: RMSNorm as `x_normed * (1 + w)`
    in float32 (weights stored as HF stores them, 0 = identity), RMSNorms on q and k per
    head before RoPE, a norm on the attention output and on the MLP output before each
    residual add (four norms per layer), and the embedding scaled by `sqrt(d_model)`.
    """

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 8192
    tie_embeddings: bool = True
    qkv_bias: bool = False
    dtype: str = "float32"
    architecture: str = "LlamaForCausalLM"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    o_bias: bool = False
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "mlp_dim", "max_position_embeddings"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        _positive_float("rms_norm_eps", self.rms_norm_eps)
        _positive_float("rope_theta", self.rope_theta)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling must be a RopeScaling or None, got "
                             f"{self.rope_scaling!r}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} not supported; expected one "
                             f"of {sorted(SUPPORTED_ARCHITECTURES)}")
        for name in ("tie_embeddings", "qkv_bias", "o_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got "
                             f"{self.hidden_act!r}")
        for name in ("query_pre_attn_scalar", "rope_local_theta"):
            if getattr(self, name) is not None:
                _positive_float(name, getattr(self, name))
                object.__setattr__(self, name, float(getattr(self, name)))
        if self.gemma and (self.qkv_bias or self.o_bias):
            raise ValueError("Gemma3ForCausalLM has no attention bias; set qkv_bias=False "
                             "and o_bias=False")
        self._check_layer_types()

    def _check_layer_types(self) -> None:
        """Validates `sliding_window` / `layer_types` and stores a uniform tuple as None."""
        w = check_positive_int("sliding_window", self.sliding_window, optional=True)
        object.__setattr__(self, "sliding_window", w)
        types = self.layer_types
        if types is None:
            return
        if isinstance(types, str) or not isinstance(types, (tuple, list)):
            raise ValueError(f"layer_types must be a tuple of {ATTENTION_TYPES} per layer, "
                             f"got {types!r}")
        types = tuple(types)
        if len(types) != self.num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for num_layers="
                             f"{self.num_layers}")
        unknown = sorted({str(t) for t in types if t not in ATTENTION_TYPES})
        if unknown:
            raise ValueError(f"layer_types has unknown attention types {unknown}; expected "
                             f"{ATTENTION_TYPES}")
        num_sliding = types.count(SLIDING_ATTENTION)
        if num_sliding and w is None:
            raise ValueError(f"layer_types has {num_sliding} sliding_attention layers but "
                             "sliding_window is None")
        if not num_sliding and w is not None:
            raise ValueError(f"sliding_window={w} but layer_types has no sliding_attention "
                             "layer (set sliding_window=None)")
        # NOTE: uniform -> None, so a config equals itself after a round trip through HF.
        object.__setattr__(self, "layer_types",
                           None if num_sliding in (0, len(types)) else types)

    # ----------------------------------------------------------------- derived
    @property
    def gemma(self) -> bool:
        """The Gemma 3 block (see the class docstring): (1 + w) norms, q/k norms, norms
        on the attention and MLP outputs, embedding scaled by sqrt(d_model)."""
        return self.architecture == "Gemma3ForCausalLM"

    @property
    def attention_scale(self) -> float:
        """The softmax scale: `query_pre_attn_scalar ** -0.5` (default head_dim)."""
        s = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return float(s) ** -0.5

    @property
    def embedding_scale(self) -> float | None:
        """The factor on the token embeddings (Gemma: sqrt(d_model)), or None."""
        return math.sqrt(self.d_model) if self.gemma else None

    @property
    def layer_rope_thetas(self) -> tuple[float, ...]:
        """Each layer's RoPE base: `rope_local_theta` on sliding-window layers when set,
        else `rope_theta`."""
        local = self.rope_theta if self.rope_local_theta is None else self.rope_local_theta
        return tuple(self.rope_theta if w is None else local for w in self.layer_windows)

    @property
    def attention_types(self) -> tuple[str, ...]:
        """Each layer's attention kind, "full_attention" or "sliding_attention"."""
        if self.layer_types is not None:
            return self.layer_types
        kind = FULL_ATTENTION if self.sliding_window is None else SLIDING_ATTENTION
        return (kind,) * self.num_layers

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None for full attention)."""
        return tuple(self.sliding_window if t == SLIDING_ATTENTION else None
                     for t in self.attention_types)

    @property
    def kv_groups(self) -> tuple[tuple[int | None, tuple[int, ...]], ...]:
        """KV cache groups as (sliding_window or None, layer indices), built by vLLM 0.33's
        rule (`_get_kv_cache_groups_uniform_page_size`): layers bucketed by attention
        kind in first-seen layer order; the group size is the smallest bucket's layer
        count (the largest's when it is < 1.5x the smallest); a bucket of n layers makes
        ceil(n / size) groups, group i holding its layers [i::num_groups] (the last may be
        short: vLLM's padding layers). Every group has its own block table; the i-th layer
        of every group shares KV array i (`layer_kv_slots`), so a block id holds
        `kv_group_size` layers' KV. One attention kind -> one group of every layer.
        tiny_hybrid (S, S, F, S): ((W, (0,)), (W, (1,)), (W, (3,)), (None, (2,)))."""
        buckets: dict[int | None, list[int]] = {}
        for i, w in enumerate(self.layer_windows):
            buckets.setdefault(w, []).append(i)
        sizes = [len(v) for v in buckets.values()]
        size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
        groups = []
        for w, layers in buckets.items():
            n = -(-len(layers) // size)
            groups += [(w, tuple(layers[i::n])) for i in range(n)]
        return tuple(groups)

    @property
    def kv_group_size(self) -> int:
        """Layers per KV cache group (vLLM's group size, padding included): the number of
        KV arrays (`make_kv_caches`); `num_layers` for a model with one attention kind."""
        return max(len(layers) for _, layers in self.kv_groups)

    @property
    def layer_kv_slots(self) -> tuple[int, ...]:
        """The KV array each layer reads and writes: its position in its group."""
        out = [0] * self.num_layers
        for _, layers in self.kv_groups:
            for j, i in enumerate(layers):
                out[i] = j
        return tuple(out)

    @property
    def layer_kv_groups(self) -> tuple[int, ...]:
        """The index in `kv_groups` of each layer's group."""
        out = [0] * self.num_layers
        for g, (_, layers) in enumerate(self.kv_groups):
            for i in layers:
                out[i] = g
        return tuple(out)

    @property
    def num_groups(self) -> int:
        """Query heads per kv head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @property
    def num_params(self) -> int:
        """Parameter count."""
        D, N, K, H, F, V = (self.d_model, self.num_heads, self.num_kv_heads, self.head_dim,
                            self.mlp_dim, self.vocab_size)
        attn = (D * N * H + 2 * D * K * H + N * H * D + (N * H + 2 * K * H) * self.qkv_bias
                + D * self.o_bias)
        layer = attn + 3 * D * F + 2 * D + (2 * D + 2 * H) * self.gemma
        return self.num_layers * layer + V * D * (1 if self.tie_embeddings else 2) + D

    def replace(self, **changes) -> ModelConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------- presets
    @classmethod
    def tiny(cls, **overrides) -> ModelConfig:
        """A 2-layer f32 model for tests on CPU (~0.46M params; head_dim 64 as the Pallas
        kernels require; GQA with 2 query heads per kv head)."""
        cfg = dict(vocab_size=512, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=64, mlp_dim=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                   max_position_embeddings=8192, tie_embeddings=True, dtype="float32")
        cfg.update(overrides)
        return cls(**cfg)

    @classmethod
    def tiny_hybrid(cls, **overrides) -> ModelConfig:
        """`tiny()` with 4 layers, sliding window 16 on layers 0, 1 and 3, full attention on
        layer 2 (a Gemma-style local/global mix), as a Qwen2 checkpoint (q/k/v bias)."""
        cfg = dict(num_layers=4, sliding_window=16,
                   layer_types=(SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION,
                                SLIDING_ATTENTION),
                   qkv_bias=True, architecture="Qwen2ForCausalLM")
        cfg.update(overrides)
        return cls.tiny(**cfg)

    @classmethod
    def tiny_gemma3(cls, **overrides) -> ModelConfig:
        """`tiny()` as a Gemma 3: 6 layers, five with a sliding window of 16 and a full one
        (Gemma's 5:1 pattern), one kv head, GeGLU, local/global RoPE bases, a query
        scale of 1/sqrt(32)."""
        cfg = dict(num_layers=6, num_kv_heads=1, sliding_window=16,
                   layer_types=gemma3_layer_types(6), architecture="Gemma3ForCausalLM",
                   hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=32.0,
                   rope_theta=1000000.0, rope_local_theta=10000.0, rms_norm_eps=1e-6)
        cfg.update(overrides)
        return cls.tiny(**cfg)

    @classmethod
    def gemma3_270m(cls, **overrides) -> ModelConfig:
        """google/gemma-3-270m (18 layers: 15 sliding-window of 512 and 3 full, tied
        embeddings, head_dim 256, one kv head; f32 as the GGUF loader gives it)."""
        cfg = dict(vocab_size=262144, d_model=640, num_layers=18, num_heads=4,
                   num_kv_heads=1, head_dim=256, mlp_dim=2048, rms_norm_eps=1e-6,
                   rope_theta=1000000.0, rope_local_theta=10000.0,
                   max_position_embeddings=32768, tie_embeddings=True, dtype="float32",
                   architecture="Gemma3ForCausalLM", hidden_act="gelu_pytorch_tanh",
                   query_pre_attn_scalar=256.0, sliding_window=512,
                   layer_types=gemma3_layer_types(18))
        cfg.update(overrides)
        return cls(**cfg)

    @classmethod
    def llama_3_2_1b(cls, **overrides) -> ModelConfig:
        """meta-llama/Llama-3.2-1B (bf16, tied embeddings, Llama-3 RoPE scaling)."""
        cfg = dict(vocab_size=128256, d_model=2048, num_layers=16, num_heads=32,
                   num_kv_heads=8, head_dim=64, mlp_dim=8192, rms_norm_eps=1e-5,
                   rope_theta=500000.0,
                   rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0,
                                            original_max_position_embeddings=8192),
                   max_position_embeddings=131072, tie_embeddings=True, dtype="bfloat16",
                   architecture="LlamaForCausalLM")
        cfg.update(overrides)
        return cls(**cfg)

    @classmethod
    def qwen2_5_0_5b(cls, **overrides) -> ModelConfig:
        """Qwen/Qwen2.5-0.5B (bf16, tied embeddings, q/k/v bias)."""
        cfg = dict(vocab_size=151936, d_model=896, num_layers=24, num_heads=14,
                   num_kv_heads=2, head_dim=64, mlp_dim=4864, rms_norm_eps=1e-6,
                   rope_theta=1000000.0, max_position_embeddings=32768, tie_embeddings=True,
                   qkv_bias=True, dtype="bfloat16", architecture="Qwen2ForCausalLM")
        cfg.update(overrides)
        return cls(**cfg)

    # -------------------------------------------------------------- HF config
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], *, dtype: str | None = None) -> ModelConfig:
        """Builds a config from a Hugging Face `config.json` dict (Llama, Qwen2, Mistral,
        Gemma 3 text: `Gemma3ForCausalLM` / model_type "gemma3_text").

        Args:
          hf: the parsed config.json.
          dtype: override of the checkpoint's `torch_dtype` ("float32" or "bfloat16");
            default: "bfloat16" for bf16/f16 checkpoints, else "float32".

        Raises:
          ValueError: unknown architecture, unsupported features (activation other than
            SiLU, MLP bias, sliding window, a RoPE scaling other than "llama3"; for Gemma
            3: logit soft-capping, bidirectional attention, RoPE scaling), or missing or
            invalid fields (named).
        """
        if not isinstance(hf, Mapping):
            raise ValueError(f"HF config must be a mapping, got {type(hf).__name__}")
        archs = hf.get("architectures") or []
        if not isinstance(archs, (list, tuple)) or not all(isinstance(a, str) for a in archs):
            raise ValueError(f"HF config: architectures must be a list of str, got {archs!r}")
        model_type = hf.get("model_type")
        if model_type is not None and not isinstance(model_type, str):
            raise ValueError(f"HF config: model_type must be a str, got {model_type!r}")
        arch = archs[0] if archs else _MODEL_TYPES.get(model_type)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {arch!r} (architectures={archs!r}, "
                f"model_type={hf.get('model_type')!r}); supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        flavour = SUPPORTED_ARCHITECTURES[arch]
        if flavour == "gemma3":
            return _gemma3_from_hf(cls, hf, dtype)

        def need(key):
            if key not in hf:
                raise ValueError(f"HF config for {arch} lacks {key!r}")
            return hf[key]

        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} not supported (only 'silu')")
        if hf.get("mlp_bias", False):
            raise ValueError("mlp_bias=True not supported")
        sliding_window, layer_types = _hf_layer_types(hf, arch, flavour)

        def number(key, v, kind=float):  # float()/int() as before, errors named
            try:
                return kind(v)
            except (TypeError, ValueError, OverflowError):
                raise ValueError(f"HF config for {arch}: {key} must be a number, got "
                                 f"{v!r}") from None

        # Newer transformers nest RoPE settings under `rope_parameters`.
        if not isinstance(hf.get("rope_scaling") or {}, Mapping):
            raise ValueError(f"HF config for {arch}: rope_scaling must be a mapping or null, "
                             f"got {hf.get('rope_scaling')!r}")
        rope = dict(hf.get("rope_scaling") or {})
        rope_params = hf.get("rope_parameters")
        rope_theta = hf.get("rope_theta")
        if isinstance(rope_params, Mapping):
            rope = dict(rope_params)
            rope_theta = rope.get("rope_theta", rope_theta)
        rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
        if rope_type == "llama3":
            try:
                omp = number("rope_scaling original_max_position_embeddings",
                             rope["original_max_position_embeddings"], int)
                scaling = RopeScaling(
                    factor=number("rope_scaling factor", rope["factor"]),
                    low_freq_factor=number("rope_scaling low_freq_factor",
                                           rope["low_freq_factor"]),
                    high_freq_factor=number("rope_scaling high_freq_factor",
                                            rope["high_freq_factor"]),
                    original_max_position_embeddings=omp,
                )
            except KeyError as e:
                raise ValueError(f"llama3 rope_scaling lacks {e.args[0]!r}") from None
        elif rope_type == "default":
            scaling = None
        else:
            raise ValueError(f"rope scaling type {rope_type!r} not supported "
                             "(only 'default' and 'llama3')")

        num_heads = need("num_attention_heads")
        d_model = need("hidden_size")
        head_dim = hf.get("head_dim")
        if not head_dim:  # (checked as ints first: the division needs them)
            _positive_int("hidden_size", d_model)
            _positive_int("num_attention_heads", num_heads)
            head_dim = d_model // num_heads
        if dtype is None:
            torch_dtype = str(hf.get("torch_dtype", hf.get("dtype", "float32")))
            dtype = "bfloat16" if torch_dtype in ("bfloat16", "float16") else "float32"
        return cls(
            vocab_size=need("vocab_size"),
            d_model=d_model,
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=(hf.get("num_key_value_heads", 8 if flavour == "mistral" else None)
                          or num_heads),
            head_dim=head_dim,
            mlp_dim=need("intermediate_size"),
            rms_norm_eps=number("rms_norm_eps",
                                hf.get("rms_norm_eps", 1e-5 if flavour == "llama" else 1e-6)),
            rope_theta=number("rope_theta", rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if flavour == "qwen2" else bool(hf.get("attention_bias", False)),
            # transformers' Llama/Mistral attention_bias=True biases o_proj as well.
            o_bias=flavour == "llama" and bool(hf.get("attention_bias", False)),
            dtype=dtype,
            architecture=arch,
            sliding_window=sliding_window,
            layer_types=layer_types,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict of this config (inverse of `from_hf_config`)."""
        flavour = SUPPORTED_ARCHITECTURES[self.architecture]
        if flavour == "gemma3":
            return self._gemma3_hf_config()
        if self.hidden_act != "silu" or self.query_pre_attn_scalar is not None or (
                self.rope_local_theta is not None):
            raise ValueError(f"{self.architecture} has SiLU, scale 1/sqrt(head_dim) and one "
                             "RoPE base: hidden_act, query_pre_attn_scalar and "
                             "rope_local_theta are Gemma 3's (architecture="
                             "'Gemma3ForCausalLM')")
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": flavour,
            "vocab_size": self.vocab_size,
            "hidden_size": self.d_model,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.mlp_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "torch_dtype": self.dtype,
        }
        if flavour == "qwen2":
            if not self.qkv_bias:
                raise ValueError("Qwen2ForCausalLM always has q/k/v bias; set qkv_bias=True")
            if self.o_bias:
                raise ValueError("Qwen2ForCausalLM has no o_proj bias; set o_bias=False")
            out["use_sliding_window"] = self.sliding_window is not None
            if self.sliding_window is not None:
                types = self.attention_types
                full = [i for i, t in enumerate(types) if t == FULL_ATTENTION]
                out["sliding_window"] = self.sliding_window
                # The HF rule's max_window_layers where it describes the layers, else the
                # explicit list (which takes precedence in transformers).
                out["max_window_layers"] = len(full) if full == list(range(len(full))) else 0
                out["layer_types"] = list(types)
        else:
            if (self.qkv_bias or self.o_bias) and flavour == "mistral":
                raise ValueError("MistralForCausalLM has no attention bias; set "
                                 "qkv_bias=False and o_bias=False")
            if flavour == "llama":
                if self.qkv_bias != self.o_bias:
                    raise ValueError(
                        f"LlamaForCausalLM's attention_bias biases q/k/v and o_proj together; "
                        f"got qkv_bias={self.qkv_bias}, o_bias={self.o_bias}")
                out["attention_bias"] = self.qkv_bias
                out["mlp_bias"] = False
                if self.sliding_window is not None:
                    raise ValueError("LlamaForCausalLM has no sliding-window attention; use "
                                     "Qwen2ForCausalLM or MistralForCausalLM")
            elif self.layer_types is not None:
                raise ValueError("MistralForCausalLM applies its sliding window to every "
                                 "layer; a per-layer mix needs Qwen2ForCausalLM")
            else:
                out["sliding_window"] = self.sliding_window
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"rope_type": "llama3",
                                   **dataclasses.asdict(self.rope_scaling)}
        return out

    def _gemma3_hf_config(self) -> dict[str, Any]:
        """transformers' `Gemma3TextConfig` (5.x keys: `rope_parameters` per layer type)."""
        if self.rope_scaling is not None:
            raise ValueError("Gemma3ForCausalLM: Llama-3 rope_scaling is not Gemma's")
        local = self.rope_theta if self.rope_local_theta is None else self.rope_local_theta
        return {
            "architectures": [self.architecture],
            "model_type": "gemma3_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.d_model,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.mlp_dim,
            "hidden_activation": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_embeddings,
            "query_pre_attn_scalar": (self.head_dim if self.query_pre_attn_scalar is None
                                      else self.query_pre_attn_scalar),
            "sliding_window": self.sliding_window,
            "layer_types": list(self.attention_types),
            "rope_parameters": {
                FULL_ATTENTION: {"rope_type": "default", "rope_theta": self.rope_theta},
                SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": local}},
            "attention_bias": False,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "torch_dtype": self.dtype,
        }


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's layer kinds: every `pattern`-th layer full attention, the others
    sliding (transformers' `Gemma3TextConfig`, llama.cpp's `set_swa_pattern(6)`)."""
    return tuple(SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
                 for i in range(num_layers))


def _gemma3_from_hf(cls, hf: Mapping[str, Any], dtype: str | None) -> ModelConfig:
    """`ModelConfig.from_hf_config` for Gemma3ForCausalLM (`Gemma3TextConfig`, its
    defaults; RoPE bases from `rope_parameters` per layer type (transformers 5) or
    `rope_theta` + `rope_local_base_freq` (4.x))."""
    arch = "Gemma3ForCausalLM"

    def need(key):
        if key not in hf:
            raise ValueError(f"HF config for {arch} lacks {key!r}")
        return hf[key]

    def number(key, default):
        v = hf.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"HF config for {arch}: {key} must be a number, got {v!r}")
        return v

    act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in ("gelu_pytorch_tanh",):
        raise ValueError(f"{arch}: hidden_activation {act!r} not supported (only "
                         "'gelu_pytorch_tanh')")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise ValueError(f"{arch}: {key}={hf[key]!r} not supported (Gemma 3 has none)")
    if hf.get("attention_bias", False):
        raise ValueError(f"{arch}: attention_bias=True not supported")
    if hf.get("use_bidirectional_attention", False):
        raise ValueError(f"{arch}: use_bidirectional_attention=True not supported")
    num_layers = need("num_hidden_layers")
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"{arch}: sliding_window_pattern must be a positive int, got "
                             f"{pattern!r}")
        if isinstance(num_layers, int) and not isinstance(num_layers, bool):
            types = gemma3_layer_types(num_layers, pattern)
    elif isinstance(types, str) or not isinstance(types, (list, tuple)):
        raise ValueError(f"{arch}: layer_types must be a list of {ATTENTION_TYPES}, got "
                         f"{types!r}")
    window = hf.get("sliding_window", 4096)
    if types is not None and SLIDING_ATTENTION not in types:
        window = None
    rope = hf.get("rope_parameters")
    if isinstance(rope, Mapping) and FULL_ATTENTION in rope:
        params = {t: dict(rope.get(t) or {}) for t in ATTENTION_TYPES}
    else:
        scaling = hf.get("rope_scaling") or {}
        if not isinstance(scaling, Mapping):
            raise ValueError(f"{arch}: rope_scaling must be a mapping or null, got "
                             f"{scaling!r}")
        params = {FULL_ATTENTION: {**scaling, "rope_theta": number("rope_theta", 1000000.0)},
                  SLIDING_ATTENTION: {"rope_theta": number("rope_local_base_freq", 10000.0)}}
    for t, p in params.items():
        kind = p.get("rope_type", p.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{arch}: {t} RoPE type {kind!r} not supported (only "
                             "'default')")
        if "rope_theta" not in p:
            raise ValueError(f"{arch}: rope_parameters[{t!r}] lacks 'rope_theta'")
    if dtype is None:
        torch_dtype = str(hf.get("torch_dtype", hf.get("dtype", "float32")))
        dtype = "bfloat16" if torch_dtype in ("bfloat16", "float16") else "float32"
    return cls(
        vocab_size=need("vocab_size"), d_model=need("hidden_size"), num_layers=num_layers,
        num_heads=need("num_attention_heads"),
        num_kv_heads=hf.get("num_key_value_heads") or need("num_attention_heads"),
        head_dim=hf.get("head_dim", 256), mlp_dim=need("intermediate_size"),
        rms_norm_eps=float(number("rms_norm_eps", 1e-6)),
        rope_theta=float(params[FULL_ATTENTION]["rope_theta"]),
        rope_local_theta=float(params[SLIDING_ATTENTION]["rope_theta"]),
        max_position_embeddings=hf.get("max_position_embeddings", 131072),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), dtype=dtype,
        architecture=arch, hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=float(number("query_pre_attn_scalar", 256)),
        sliding_window=window, layer_types=None if types is None else tuple(types))


def _hf_layer_types(hf: Mapping[str, Any], arch: str, flavour: str
                    ) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) of an HF config, by transformers' rules per flavour.

    Qwen2 (`Qwen2Config.__post_init__`): the window is `sliding_window` (default 4096) if
    `use_sliding_window` else None; `layer_types`, when absent, is "sliding_attention" for
    layer i iff the window is set and `i >= max_window_layers` (default 28). Mistral: the
    window `sliding_window` (default 4096, null = full attention) on every layer. Llama has
    no sliding window.
    """
    def window(v):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{arch}: sliding_window must be a positive int or null, got "
                             f"{v!r}")
        return v

    types = hf.get("layer_types")
    if types is not None and (isinstance(types, str) or not isinstance(types, (list, tuple))):
        raise ValueError(f"{arch}: layer_types must be a list of {ATTENTION_TYPES}, got "
                         f"{types!r}")
    if flavour == "llama":
        if hf.get("use_sliding_window") or hf.get("sliding_window") is not None or (
                types is not None and SLIDING_ATTENTION in types):
            raise ValueError(f"{arch} has no sliding-window attention (sliding_window="
                             f"{hf.get('sliding_window')!r}, use_sliding_window="
                             f"{hf.get('use_sliding_window')!r}); a sliding-window Llama-"
                             "style model is MistralForCausalLM or Qwen2ForCausalLM")
        return None, None
    if flavour == "mistral":
        if types is not None:
            raise ValueError(f"{arch}: layer_types not supported (transformers' Mistral "
                             "applies sliding_window to every layer and ignores it)")
        return window(hf.get("sliding_window", 4096)), None
    # qwen2
    use = hf.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise ValueError(f"{arch}: use_sliding_window must be a bool, got {use!r}")
    w = window(hf.get("sliding_window", 4096)) if use else None
    num_layers = hf.get("num_hidden_layers")
    if types is None:
        if w is None:
            return None, None
        m = hf.get("max_window_layers", 28)
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"{arch}: max_window_layers must be an int >= 0, got {m!r}")
        if not isinstance(num_layers, int):
            return w, None  # ModelConfig names the bad num_hidden_layers
        types = [SLIDING_ATTENTION if i >= m else FULL_ATTENTION for i in range(num_layers)]
    types = tuple(types)
    if w is None:
        if SLIDING_ATTENTION in types:
            raise ValueError(f"{arch}: layer_types has sliding_attention layers but "
                             "use_sliding_window is false (no window is set)")
        types = None
    elif SLIDING_ATTENTION not in types and len(types) == num_layers and all(
            t in ATTENTION_TYPES for t in types):
        # NOTE: use_sliding_window with no layer past max_window_layers (Qwen2.5's
        # configs): every layer attends fully; the model is a plain one.
        return None, None
    return w, types
