"""Llama-style decoder in Flax NNX over a paged KV cache.

Axis letters in einsum strings: t tokens, s sequences (logit rows), d d_model, n query
heads, k kv heads, h head_dim, f mlp_dim, v vocab.

Conventions match Hugging Face `LlamaForCausalLM` / `Qwen2ForCausalLM` exactly:
RMSNorm in float32 (`x * rsqrt(mean(x^2) + eps) * scale`), RoPE in the rotate-half layout
(the two halves of each head are the (real, imaginary) parts; no interleaving), query head
i reads kv head `i // (num_heads // num_kv_heads)`, SwiGLU `down(silu(gate(x)) * up(x))`,
attention scale `head_dim ** -0.5`.

`Gemma3ForCausalLM` (`config.gemma`) as transformers' `Gemma3TextModel`: embeddings times
`sqrt(d_model)`, RMSNorm `x_normed * (1 + w)` in float32 then cast, q/k RMSNorm per head
before RoPE, `x += norm(attn(norm(x))); x += norm(mlp(norm(x)))`, GeGLU
`down(gelu_tanh(gate(x)) * up(x))`, scale `query_pre_attn_scalar ** -0.5`, RoPE base
`rope_local_theta` on the sliding-window layers and `rope_theta` on the full ones.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import prefixcache_kernels as kernels
from prefixcache.metadata import AttentionMetadata
from prefixcache.model.config import ModelConfig
from prefixcache.model.lora import LoRABatch, lora_delta

__all__ = [
    "Attention",
    "Block",
    "MLP",
    "RMSNorm",
    "Transformer",
    "abstract_transformer",
    "apply_rope",
    "is_stacked",
    "layer_period",
    "rope_inv_freq",
    "set_layer_stack",
    "stack_layer_params",
    "stack_layers",
    "unstack_layers",
]


# NOTE: params are drawn as fixed-size chunks of normals (two compiled programs in all)
# and cut to shape, instead of one `random.normal` per param shape: on CPU each distinct
# shape would cost an XLA compile (~1 s), i.e. seconds of first-use latency per process.
_SMALL_CHUNK = 1 << 16
_LARGE_CHUNK = 1 << 22


@functools.partial(jax.jit, static_argnames="size")
def _normal_chunk(key, i, *, size: int) -> jax.Array:
    return jax.random.normal(jax.random.fold_in(key, i), (size,), jnp.float32)


class _AbstractRngs:
    """Stands in for `nnx.Rngs` in `abstract_transformer`: every param is a
    `jax.ShapeDtypeStruct`, nothing is drawn or traced."""


def _init(rngs: nnx.Rngs, shape: Sequence[int], fan_in: int, dtype,
          scale: float = 1.0) -> jax.Array:
    """Normal init with std `scale / sqrt(fan_in)`, drawn in float32 then cast.

    Eagerly and under tracing (`nnx.eval_shape` / `nnx.jit`) one key gives the same draws
    (to float rounding: XLA may fuse the scaling into the sampler).
    """
    shape = tuple(int(d) for d in shape)
    if isinstance(rngs, _AbstractRngs):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    key = rngs.params()
    n = math.prod(shape)
    size = _SMALL_CHUNK if n <= 16 * _SMALL_CHUNK else _LARGE_CHUNK
    chunks = [_normal_chunk(key, i, size=size) for i in range(-(-n // size))]
    std = np.float32(scale / math.sqrt(fan_in))
    if isinstance(key, jax.core.Tracer):
        return (jnp.concatenate(chunks)[:n].reshape(shape) * std).astype(dtype)
    flat = np.concatenate([np.asarray(c) for c in chunks])[:n]
    return jnp.asarray((flat.reshape(shape) * std).astype(jnp.dtype(dtype)))


def rope_inv_freq(config: ModelConfig, theta: float | None = None) -> np.ndarray:
    """RoPE inverse frequencies f32[head_dim // 2], HF conventions (Llama-3 scaling too).

    `theta`: the base (default `config.rope_theta`; Gemma's sliding layers pass
    `config.rope_local_theta`, unscaled).

    NOTE: computed in float32 like HF (`1 / theta ** (arange(0, H, 2) / H)`), so positions
    rotate by the same angles as the reference implementation.
    """
    H = config.head_dim
    exponent = np.arange(0, H, 2, dtype=np.int64).astype(np.float32) / np.float32(H)
    base = config.rope_theta if theta is None else theta
    inv_freq = (np.float32(1.0) / (np.float32(base) ** exponent)).astype(np.float32)
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    old_len = rs.original_max_position_embeddings
    low_wavelen = old_len / rs.low_freq_factor
    high_wavelen = old_len / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor
                                                           - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE.

    Args:
      x: [T, heads, H].
      cos, sin: f32[T, H // 2] of `positions * inv_freq`.

    Returns:
      [T, heads, H] in x's dtype: `(x1 cos - x2 sin, x2 cos + x1 sin)` for halves x1, x2.
    """
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with a learned scale (HF: computed in float32, scaled in float32, cast back).

    `plus_one` (Gemma): the output is `x_normed * (1 + scale)`, all in float32, then cast
    (transformers' `Gemma3RMSNorm`); the scale starts at 0 (identity), as HF stores it.
    """

    def __init__(self, dim: int, *, eps: float, dtype, rngs: nnx.Rngs, plus_one: bool = False):
        self.eps = eps
        self.plus_one = plus_one
        if isinstance(rngs, _AbstractRngs):
            self.scale = nnx.Param(jax.ShapeDtypeStruct((dim,), jnp.dtype(dtype)))
        else:
            self.scale = nnx.Param((jnp.zeros if plus_one else jnp.ones)((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., D] -> [..., D] in x's dtype."""
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (xf * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        # HF casts the normalized activations to the input dtype before the weight multiply.
        return self.scale[...] * xf.astype(x.dtype)


class MLP(nnx.Module):
    """Gated MLP: SwiGLU `down(silu(gate(x)) * up(x))`, or GeGLU with the tanh GELU
    (`config.hidden_act="gelu_pytorch_tanh"`, Gemma)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        D, F, dt = config.d_model, config.mlp_dim, jnp.dtype(config.dtype)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.gate_proj = nnx.Param(_init(rngs, (D, F), D, dt))  # [d, f]
        self.up_proj = nnx.Param(_init(rngs, (D, F), D, dt))  # [d, f]
        self.down_proj = nnx.Param(_init(rngs, (F, D), F, dt))  # [f, d]

    def __call__(self, x: jax.Array, lora: LoRABatch | None = None) -> jax.Array:
        """x: [T, D] -> [T, D]; lora: this layer's adapters (`LoRABatch.layer`) or None."""
        gate = jnp.einsum("td,df->tf", x, self.gate_proj[...])
        up = jnp.einsum("td,df->tf", x, self.up_proj[...])
        if lora is not None:
            gate = gate + lora_delta(x, lora, "gate_proj")
            up = up + lora_delta(x, lora, "up_proj")
        h = (jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)) * up
        out = jnp.einsum("tf,fd->td", h, self.down_proj[...])
        return out if lora is None else out + lora_delta(h, lora, "down_proj")


class Attention(nnx.Module):
    """Grouped-query attention over the paged KV cache (write new K/V, then attend).

    With `sliding_window=W` a query at position p attends to the keys at (p - W, p], as
    HF's sliding-window layers (`kernels.paged_attention(sliding_window=W)`).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, sliding_window: int | None = None):
        D, N, K, H = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
        dt = jnp.dtype(config.dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = N, K, H
        self.q_proj = nnx.Param(_init(rngs, (D, N, H), D, dt))  # [d, n, h]
        self.k_proj = nnx.Param(_init(rngs, (D, K, H), D, dt))  # [d, k, h]
        self.v_proj = nnx.Param(_init(rngs, (D, K, H), D, dt))  # [d, k, h]
        self.o_proj = nnx.Param(_init(rngs, (N, H, D), N * H, dt))  # [n, h, d]
        self.qkv_bias = config.qkv_bias
        self.sliding_window = sliding_window
        if config.qkv_bias:
            self.q_bias = nnx.Param(_init(rngs, (N, H), 1, dt, scale=0.1))  # [n, h]
            self.k_bias = nnx.Param(_init(rngs, (K, H), 1, dt, scale=0.1))  # [k, h]
            self.v_bias = nnx.Param(_init(rngs, (K, H), 1, dt, scale=0.1))  # [k, h]
        self.o_bias_on = config.o_bias
        if config.o_bias:  # Llama attention_bias=True: o_proj has a bias too
            self.o_bias = nnx.Param(_init(rngs, (D,), 1, dt, scale=0.1))  # [d]
        self.qk_norm = config.gemma
        if config.gemma:  # per-head RMSNorm of q and k before RoPE
            self.q_norm = RMSNorm(H, eps=config.rms_norm_eps, dtype=dt, rngs=rngs,
                                  plus_one=True)
            self.k_norm = RMSNorm(H, eps=config.rms_norm_eps, dtype=dt, rngs=rngs,
                                  plus_one=True)

    def __call__(self, x, kv_cache, metadata: AttentionMetadata, cos, sin, attend,
                 lora: LoRABatch | None = None):
        """One layer's attention.

        Args:
          x: [T, D] normed activations.
          kv_cache: [num_pages, page_size, 2K, H] this layer's paged KV.
          metadata: the step's index arrays (device arrays).
          cos, sin: f32[T, H // 2] RoPE tables of the step's positions.
          attend: `(q, k, v, kv_cache, metadata) -> (out [T, N, H], kv_cache)`, which
            writes k/v at `metadata.slot_mapping` and attends (maybe under shard_map);
            a sliding-window layer calls it with `sliding_window=W` as well.
          lora: this layer's adapters (`LoRABatch.layer`) or None.

        Returns:
          ([T, D], updated kv_cache).
        """
        q = jnp.einsum("td,dnh->tnh", x, self.q_proj[...])
        k = jnp.einsum("td,dkh->tkh", x, self.k_proj[...])
        v = jnp.einsum("td,dkh->tkh", x, self.v_proj[...])
        if lora is not None:
            q = q + lora_delta(x, lora, "q_proj").reshape(q.shape)
            k = k + lora_delta(x, lora, "k_proj").reshape(k.shape)
            v = v + lora_delta(x, lora, "v_proj").reshape(v.shape)
        if self.qkv_bias:
            q = q + self.q_bias[...]
            k = k + self.k_bias[...]
            v = v + self.v_bias[...]
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if self.sliding_window is None:
            out, kv_cache = attend(q, k, v, kv_cache, metadata)
        else:
            out, kv_cache = attend(q, k, v, kv_cache, metadata,
                                   sliding_window=self.sliding_window)
        out = out.astype(x.dtype)
        y = jnp.einsum("tnh,nhd->td", out, self.o_proj[...])
        if lora is not None:
            y = y + lora_delta(out.reshape(out.shape[0], -1), lora, "o_proj")
        if self.o_bias_on:
            y = y + self.o_bias[...]
        return y, kv_cache


class Block(nnx.Module):
    """Pre-norm decoder layer: `x += attn(norm(x)); x += mlp(norm(x))`; Gemma also norms
    each branch's output (`attn_out_norm`, `mlp_out_norm`) before the add.

    `post_attn_norm` is the norm before the MLP (HF `post_attention_layernorm` in Llama,
    `pre_feedforward_layernorm` in Gemma 3)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, sliding_window: int | None = None):
        dt = jnp.dtype(config.dtype)
        norm = functools.partial(RMSNorm, config.d_model, eps=config.rms_norm_eps, dtype=dt,
                                 rngs=rngs, plus_one=config.gemma)
        self.input_norm = norm()
        self.attn = Attention(config, rngs=rngs, sliding_window=sliding_window)
        self.post_attn_norm = norm()
        self.mlp = MLP(config, rngs=rngs)
        self.sandwich = config.gemma
        if config.gemma:
            self.attn_out_norm = norm()
            self.mlp_out_norm = norm()

    def __call__(self, x, kv_cache, metadata, cos, sin, attend, lora=None):
        h, kv_cache = self.attn(self.input_norm(x), kv_cache, metadata, cos, sin, attend,
                                lora)
        x = x + (self.attn_out_norm(h) if self.sandwich else h)
        h = self.mlp(self.post_attn_norm(x), lora)
        x = x + (self.mlp_out_norm(h) if self.sandwich else h)
        return x, kv_cache


def _local_attend(q, k, v, kv_cache, metadata: AttentionMetadata, *, sm_scale, backend,
                  interpret, sliding_window=None):
    """write_kv then paged attention on one device (or one shard's heads).

    `kv_cache` is a layer's pages, or for a quantized cache (float8_e4m3fn / int8) the
    pair (pages, scales f32[num_pages, 2K]) (`make_kv_caches(kv_dtype=...)`).
    """
    if isinstance(kv_cache, tuple):
        pages, scales = kernels.write_kv(kv_cache[0], k, v, metadata.slot_mapping,
                                         kv_scales=kv_cache[1])
        out = kernels.paged_attention(
            q, pages, metadata.kv_lens, metadata.page_indices, metadata.cu_q_lens,
            metadata.num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
            backend=backend, interpret=interpret, kv_scales=scales)
        return out, (pages, scales)
    kv_cache = kernels.write_kv(kv_cache, k, v, metadata.slot_mapping)
    out = kernels.paged_attention(
        q, kv_cache, metadata.kv_lens, metadata.page_indices, metadata.cu_q_lens,
        metadata.num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
        backend=backend, interpret=interpret)
    return out, kv_cache


class Transformer(nnx.Module):
    """The decoder. Params (HF name in brackets):

      embedding [V, D] (model.embed_tokens.weight)
      layers[i].input_norm.scale [D], .post_attn_norm.scale [D]
      layers[i].attn.{q,k,v}_proj [D, N|K, H], .o_proj [N, H, D], .{q,k,v}_bias [N|K, H],
        .o_bias [D] (with config.o_bias)
      layers[i].attn.{q,k}_norm.scale [H], layers[i].{attn,mlp}_out_norm.scale [D] (Gemma)
      layers[i].mlp.gate_proj [D, F], .up_proj [D, F], .down_proj [F, D]
      final_norm.scale [D] (model.norm.weight)
      lm_head [V, D] (lm_head.weight; absent when `tie_embeddings`)

    Two layouts of the layers' params (`stacked`):
      per layer (a model built by `Transformer(...)`): `layers[i]` holds layer i's params
        and `layer_stack` is None;
      stacked (the checkpoint loaders' default, `stack_layers`): `layer_stack` is one
        `Block` whose every param has a leading layer axis [L, ...] (layer i at index
        i), and `layers[i]`'s params are shapes only (`jax.ShapeDtypeStruct`): the
        modules still say each layer's kind (its sliding window), the weights live once,
        in the stack. `unstack_layers` gives a per-layer copy.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        dt = jnp.dtype(config.dtype)
        # NOTE: std 1/sqrt(D) keeps tied-head logits O(1) at random init (useful for sampling
        # tests); RMSNorm makes the input side scale-free anyway.
        self.embedding = nnx.Param(
            _init(rngs, (config.vocab_size, config.d_model), config.d_model, dt))
        self.layers = nnx.List([Block(config, rngs=rngs, sliding_window=w)
                                for w in config.layer_windows])
        self.final_norm = RMSNorm(config.d_model, eps=config.rms_norm_eps, dtype=dt, rngs=rngs,
                                  plus_one=config.gemma)
        if not config.tie_embeddings:
            self.lm_head = nnx.Param(
                _init(rngs, (config.vocab_size, config.d_model), config.d_model, dt))
        self.layer_stack = nnx.data(None)

    @property
    def stacked(self) -> bool:
        """Whether the layers' params live in `layer_stack` (see the class doc)."""
        return self.layer_stack is not None

    def __call__(self, kv_caches: Sequence[jax.Array], input_ids: jax.Array,
                 metadata: AttentionMetadata, logits_indices: jax.Array,
                 mm_embeds: jax.Array | None = None, mm_mask: jax.Array | None = None, *,
                 attend=None, lora: LoRABatch | None = None, layer_params=None):
        """One step over ragged tokens.

        Args:
          kv_caches: `config.kv_group_size` arrays [num_pages, page_size, 2K, H], layer i
            using array `config.layer_kv_slots[i]` (`make_kv_caches`; a model with one
            attention kind: one per layer), or one per layer (`per_layer=True`);
            quantized caches: pairs (pages, scales), see `_local_attend`.
          input_ids: i32[T].
          metadata: `AttentionMetadata` of device arrays (positions i32[T] etc.), or a
            tuple of them, one per KV group (`config.kv_groups`; hybrid models): layer i
            then reads the block table and slot mapping of its group's entry,
            `metadata[config.layer_kv_groups[i]]` (the entries differ only in
            `page_indices` and `slot_mapping`). With per-layer caches one AttentionMetadata
            serves every layer (sliding-window layers mask the window over the full
            table); shared arrays of several groups need the tuple.
          logits_indices: i32[S] token rows whose logits are returned.
          mm_embeds: [T, D] rows injected where `mm_mask` is set, or None.
          mm_mask: bool[T], or None (both or neither).
          attend: the attention callable (see `Attention.__call__`); default: write_kv +
            `kernels.paged_attention(backend="auto")` on one device.
          lora: `prefixcache.model.lora.LoRABatch` (slots i32[T] + stacked adapter
            weights): each token's adapter is added to the targeted projections; None: none.
          layer_params: the layers' params stacked (`stack_layer_params`), or None (a
            stacked model: its own `layer_stack`). Given, the layers run under one
            `lax.scan` (compile time independent of depth; the per-layer params in the
            module are not read); `kv_caches` then best comes in the stacked layout
            (`make_kv_caches(stacked=True)`): one array [A, num_pages, page_size, 2K, H]
            for A = `config.kv_group_size` (quantized: the pair (pages, scales f32[A,
            num_pages, 2K])); a list is stacked first and returned as a list (a copy of
            the caches each call).

        Returns:
          (logits f32[S, V], the updated kv caches in the layout they came in).
        """
        cfg = self.config
        if attend is None:
            attend = functools.partial(_local_attend, sm_scale=cfg.attention_scale,
                                       backend="auto", interpret=False)
        emb = self.embedding[...]
        x = jnp.take(emb, input_ids, axis=0)  # [T, D]
        if cfg.embedding_scale is not None:
            # (HF: the scale cast to the weights' dtype first, Gemma3TextScaledWordEmbedding)
            x = x * jnp.asarray(cfg.embedding_scale, x.dtype)
        if mm_embeds is not None:
            # NOTE: multimodal rows replace the placeholder tokens' embeddings, so two
            # different images behind identical placeholder ids give different K/V.
            x = jnp.where(mm_mask[:, None], mm_embeds.astype(x.dtype), x)
        per_group = not isinstance(metadata, AttentionMetadata)
        group_of = cfg.layer_kv_groups
        positions = (metadata[0] if per_group else metadata).positions
        tables = {}  # RoPE base -> (cos, sin) f32[T, H // 2]
        for theta in sorted(set(cfg.layer_rope_thetas)):
            inv_freq = jnp.asarray(rope_inv_freq(cfg, theta))  # f32[H // 2], host constant
            freqs = positions.astype(jnp.float32)[:, None] * inv_freq
            tables[theta] = (jnp.cos(freqs), jnp.sin(freqs))
        if layer_params is None and self.layer_stack is not None:
            layer_params = nnx.state(self.layer_stack)
        if layer_params is not None:
            listed = not is_stacked(kv_caches)
            if listed:
                kv_caches = _stack_kv(kv_caches)
            x, new_caches = self._scan_layers(layer_params, kv_caches, x, metadata, tables,
                                              attend, lora)
            if listed:
                new_caches = _unstack_kv(new_caches)
        else:
            # vLLM's layout: layer i reads and writes array `layer_kv_slots[i]` (shared by
            # the i-th layer of every KV group, each with its own block ids); per-layer
            # caches (one array per layer) keep array i.
            slot_of = (range(cfg.num_layers) if len(kv_caches) == cfg.num_layers
                       else cfg.layer_kv_slots)
            new_caches = list(kv_caches)
            for i, layer in enumerate(self.layers):
                md = metadata[group_of[i]] if per_group else metadata
                cos, sin = tables[cfg.layer_rope_thetas[i]]
                x, new_caches[slot_of[i]] = layer(x, new_caches[slot_of[i]], md, cos, sin,
                                                  attend,
                                                  None if lora is None else lora.layer(i))
        x = self.final_norm(jnp.take(x, logits_indices, axis=0))  # [S, D]
        head = emb if cfg.tie_embeddings else self.lm_head[...]
        logits = jnp.einsum("sd,vd->sv", x, head, preferred_element_type=jnp.float32)
        return logits.astype(jnp.float32), new_caches

    def _scan_layers(self, layer_params, kv_stack, x, metadata, tables, attend, lora):
        """The layers under `lax.scan` over units of `layer_period` layers.

        NOTE: the caches stay one buffer: the A arrays [A, P, page, 2K, H] are viewed as
        one pool [A * P, page, 2K, H] (a free reshape), and layer i reads and writes its
        array through its block ids shifted by `slot * P` (its slots by `slot * P *
        page`), so the kernels run unchanged and the scan updates the carried pool in
        place. A slot outside [0, P * page) still writes nothing (it becomes -1) and
        page ids are clipped to [0, P) first, as the kernels' own `mode="clip"` does.
        """
        cfg = self.config
        quantized = isinstance(kv_stack, tuple)
        pages = kv_stack[0] if quantized else kv_stack
        num_arrays, num_pages, page_size = pages.shape[:3]
        flat = pages.reshape(num_arrays * num_pages, *pages.shape[2:])
        cache = (flat, kv_stack[1].reshape(num_arrays * num_pages, -1)) if quantized else flat
        per_group = not isinstance(metadata, AttentionMetadata)
        slot_of = (tuple(range(cfg.num_layers)) if num_arrays == cfg.num_layers
                   else cfg.layer_kv_slots)
        period = layer_period(cfg, per_group=per_group)
        num_units, num_tail = divmod(cfg.num_layers, period)
        graphdefs = [nnx.graphdef(self.layers[j]) for j in range(period)]
        slots = jnp.asarray(np.asarray(slot_of[:num_units * period], np.int32)
                            .reshape(num_units, period))  # host constant i32[U, period]

        def run(j, layer_index, x, cache, slot, params):
            """Layer `layer_index` (position j of its unit) over the pool."""
            md = metadata[cfg.layer_kv_groups[j]] if per_group else metadata
            page0 = slot * num_pages
            limit = num_pages * page_size
            md = md._replace(
                page_indices=jnp.clip(md.page_indices, 0, num_pages - 1) + page0,
                slot_mapping=jnp.where((md.slot_mapping >= 0) & (md.slot_mapping < limit),
                                       md.slot_mapping + page0 * page_size, -1))
            cos, sin = tables[cfg.layer_rope_thetas[j]]
            block = nnx.merge(graphdefs[j], params)
            return block(x, cache, md, cos, sin, attend,
                         None if lora is None else lora.layer(layer_index))

        def body(carry, unit):
            x, cache = carry
            for j in range(period):
                i = unit * period + j
                params = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False),
                                      layer_params)
                x, cache = run(j, i, x, cache, slots[unit, j], params)
            return (x, cache), None

        (x, cache), _ = jax.lax.scan(body, (x, cache), jnp.arange(num_units, dtype=jnp.int32))
        for i in range(num_units * period, cfg.num_layers):  # the last, partial unit
            params = jax.tree.map(lambda a: a[i], layer_params)
            x, cache = run(i % period, i, x, cache, slot_of[i], params)
        if quantized:
            return x, (cache[0].reshape(pages.shape), cache[1].reshape(kv_stack[1].shape))
        return x, cache.reshape(pages.shape)


def abstract_transformer(config: ModelConfig) -> Transformer:
    """A `Transformer` whose params are `jax.ShapeDtypeStruct`s (shapes and dtypes only),
    built eagerly: a loader fills it (`loading.build_transformer`).

    NOTE: the same tree as `nnx.eval_shape(lambda: Transformer(config, rngs=...))`
    without tracing the initializers: under tracing every `rngs.params()` call costs
    flax/jax ~40 ms of bookkeeping, about 8 CPU seconds for SmolLM2's 211 params, half
    of its load time.
    """
    return Transformer(config, rngs=_AbstractRngs())


def layer_period(config: ModelConfig, *, per_group: bool = True) -> int:
    """The fewest layers p such that layer i has the same kind as layer i % p: sliding
    window, RoPE base and (with one metadata per KV group) KV group. 1 for a model with
    one attention kind; 6 for Gemma 3 (five sliding-window layers, one full). The
    scanned step (`Transformer(layer_params=...)`) unrolls one such unit per iteration.
    """
    kinds = list(zip(config.layer_windows, config.layer_rope_thetas,
                     config.layer_kv_groups if per_group else [0] * config.num_layers))
    for p in range(1, config.num_layers + 1):
        if all(kinds[i] == kinds[i % p] for i in range(config.num_layers)):
            return p
    return config.num_layers


def is_stacked(kv_caches) -> bool:
    """Whether `kv_caches` is in the stacked layout (`make_kv_caches(stacked=True)`): one
    array [A, num_pages, page_size, 2K, H], or one pair (pages, scales [A, num_pages, 2K])."""
    if isinstance(kv_caches, tuple) and len(kv_caches) == 2 and hasattr(kv_caches[0], "ndim"):
        return kv_caches[0].ndim == 5 and kv_caches[1].ndim == 3
    return hasattr(kv_caches, "ndim") and kv_caches.ndim == 5


def _stack_kv(kv_caches):
    """A list of per-array caches (or (pages, scales) pairs) -> the stacked layout."""
    if isinstance(kv_caches[0], tuple):
        return (jnp.stack([c[0] for c in kv_caches]), jnp.stack([c[1] for c in kv_caches]))
    return jnp.stack(list(kv_caches))


def _unstack_kv(kv_stack) -> list:
    """Inverse of `_stack_kv`."""
    if isinstance(kv_stack, tuple):
        return [(kv_stack[0][i], kv_stack[1][i]) for i in range(kv_stack[0].shape[0])]
    return [kv_stack[i] for i in range(kv_stack.shape[0])]


def stack_layer_params(model: Transformer) -> nnx.State:
    """The layers' params stacked on a new leading axis: each leaf [L, ...] (layer i at
    index i), the `layer_params` of `Transformer.__call__`. A stacked model's own
    `layer_stack` state (no copy); else a new stacked copy.

    Raises:
      ValueError: layers whose params differ in structure (they cannot share a scan).
    """
    if model.stacked:
        return nnx.state(model.layer_stack)
    states = [nnx.state(layer) for layer in model.layers]
    structure = jax.tree.structure(states[0])
    for i, s in enumerate(states):
        if jax.tree.structure(s) != structure:
            raise ValueError(f"layer {i}'s params differ in structure from layer 0's; "
                             "the layers cannot be stacked")
    # (one jitted program for all leaves: eager `jnp.stack` would compile one per shape)
    return jax.jit(lambda states: jax.tree.map(lambda *leaves: jnp.stack(leaves), *states))(
        states)


def set_layer_stack(model: Transformer, stacked_state: nnx.State) -> Transformer:
    """Puts `stacked_state` (a layer's param tree, each leaf [L, ...]) into `model` as its
    `layer_stack` and turns the per-layer params into shapes (in place); returns the model.

    Raises:
      ValueError: a stacked state whose tree or shapes are not the layers' (named).
    """
    L = model.config.num_layers
    want = nnx.state(model.layers[0])
    if jax.tree.structure(want) != jax.tree.structure(stacked_state):
        raise ValueError("the stacked layer params' tree is not a layer's")
    for (path, w), got in zip(jax.tree_util.tree_leaves_with_path(want),
                              jax.tree.leaves(stacked_state)):
        if tuple(got.shape) != (L, *w.shape) or jnp.dtype(got.dtype) != jnp.dtype(w.dtype):
            raise ValueError(f"stacked layer param {jax.tree_util.keystr(path)}: "
                             f"{got.dtype}{tuple(got.shape)}, expected "
                             f"{jnp.dtype(w.dtype)}{(L, *w.shape)}")
    block = Block(model.config, rngs=_AbstractRngs())
    nnx.update(block, stacked_state)
    # NOTE: new modules, not the old ones updated in place: a step built before from the
    # per-layer params holds their variables, which keep their arrays.
    model.layers = nnx.List([Block(model.config, rngs=_AbstractRngs(), sliding_window=w)
                             for w in model.config.layer_windows])
    model.layer_stack = block
    return model


def stack_layers(model: Transformer) -> Transformer:
    """Moves `model`'s layer params into the stacked layout (in place; see
    `Transformer`): one copy of the weights afterwards (two while stacking). A stacked
    model is returned as is."""
    if model.stacked:
        return model
    return set_layer_stack(model, stack_layer_params(model))


def unstack_layers(model: Transformer) -> Transformer:
    """A per-layer `Transformer` with `model`'s weights: `model` itself when it is not
    stacked, else a new model holding a per-layer copy of the stack (the
    `scan_layers=False` step and `save_hf_checkpoint` read it)."""
    if not model.stacked:
        return model
    stack = nnx.state(model.layer_stack)
    out = abstract_transformer(model.config)
    # (one jitted program for all leaves: eager slicing would dispatch one op per slice)
    per_layer = jax.jit(lambda s: [jax.tree.map(lambda a, i=i: a[i], s)
                                   for i in range(model.config.num_layers)])(stack)
    for layer, state in zip(out.layers, per_layer):
        nnx.update(layer, state)
    nnx.update(out, nnx.state(model, nnx.All(nnx.Not(nnx.PathContains("layers")),
                                             nnx.Not(nnx.PathContains("layer_stack")))))
    return out
