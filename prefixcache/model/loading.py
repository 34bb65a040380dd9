"""Hugging Face checkpoints (config.json + *.safetensors) <-> `Transformer`.

Weight names and layouts are those of `LlamaForCausalLM` / `Qwen2ForCausalLM` /
`MistralForCausalLM` (torch `nn.Linear` weights are [out_features, in_features]):

  model.embed_tokens.weight                       [V, D]      -> embedding [V, D]
  model.layers.i.self_attn.q_proj.weight          [N*H, D]    -> q_proj [D, N, H]
  model.layers.i.self_attn.{k,v}_proj.weight      [K*H, D]    -> {k,v}_proj [D, K, H]
  model.layers.i.self_attn.o_proj.weight          [D, N*H]    -> o_proj [N, H, D]
  model.layers.i.self_attn.{q,k,v}_proj.bias      [N*H|K*H]   -> {q,k,v}_bias [N|K, H]
  model.layers.i.self_attn.o_proj.bias            [D]         -> o_bias [D] (Llama attention_bias)
  model.layers.i.mlp.{gate,up}_proj.weight        [F, D]      -> {gate,up}_proj [D, F]
  model.layers.i.mlp.down_proj.weight             [D, F]      -> down_proj [F, D]
  model.layers.i.input_layernorm.weight           [D]         -> input_norm.scale
  model.layers.i.post_attention_layernorm.weight  [D]         -> post_attn_norm.scale
  model.norm.weight                               [D]         -> final_norm.scale
  lm_head.weight                                  [V, D]      -> lm_head (untied only)

Gemma3ForCausalLM (`config.gemma`) names its norms otherwise and has two more per layer
(HF stores Gemma's norm weights w of `x_normed * (1 + w)`, and so do we):

  model.layers.i.input_layernorm.weight           [D]         -> input_norm.scale
  model.layers.i.post_attention_layernorm.weight  [D]         -> attn_out_norm.scale
  model.layers.i.pre_feedforward_layernorm.weight [D]         -> post_attn_norm.scale
  model.layers.i.post_feedforward_layernorm.weight [D]        -> mlp_out_norm.scale
  model.layers.i.self_attn.{q,k}_norm.weight      [H]         -> attn.{q,k}_norm.scale

HF's q/k weights are already in the rotate-half RoPE layout our `apply_rope` uses, so no
permutation is applied.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from prefixcache.model.config import ModelConfig
from prefixcache.model.llama import Transformer, abstract_transformer
from prefixcache.model.safetensors_io import read_safetensors

__all__ = ["build_transformer", "hf_param_map", "load_hf_checkpoint", "read_safetensors",
           "save_hf_checkpoint"]

# Tensors HF checkpoints may carry that the model does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

def hf_param_map(config: ModelConfig) -> dict[tuple, tuple[str, tuple, Callable, Callable]]:
    """Our param path -> (HF name, HF shape, hf_to_ours, ours_to_hf) for every param."""
    D, N, K, H, F, V = (config.d_model, config.num_heads, config.num_kv_heads,
                        config.head_dim, config.mlp_dim, config.vocab_size)
    ident = lambda a: a  # noqa: E731
    t = lambda a: a.T  # noqa: E731

    def proj_in(heads):
        return (lambda a: a.T.reshape(D, heads, H), lambda a: a.reshape(D, heads * H).T)

    out = {
        ("embedding",): ("model.embed_tokens.weight", (V, D), ident, ident),
        ("final_norm", "scale"): ("model.norm.weight", (D,), ident, ident),
    }
    if not config.tie_embeddings:
        out[("lm_head",)] = ("lm_head.weight", (V, D), ident, ident)
    for i in range(config.num_layers):
        pre = f"model.layers.{i}."
        out[("layers", i, "input_norm", "scale")] = (pre + "input_layernorm.weight", (D,),
                                                     ident, ident)
        if config.gemma:
            for ours, hf in (("post_attn_norm", "pre_feedforward_layernorm"),
                             ("attn_out_norm", "post_attention_layernorm"),
                             ("mlp_out_norm", "post_feedforward_layernorm")):
                out[("layers", i, ours, "scale")] = (pre + hf + ".weight", (D,), ident, ident)
            for proj in ("q", "k"):
                out[("layers", i, "attn", f"{proj}_norm", "scale")] = (
                    pre + f"self_attn.{proj}_norm.weight", (H,), ident, ident)
        else:
            out[("layers", i, "post_attn_norm", "scale")] = (
                pre + "post_attention_layernorm.weight", (D,), ident, ident)
        for proj, heads in (("q", N), ("k", K), ("v", K)):
            out[("layers", i, "attn", f"{proj}_proj")] = (
                pre + f"self_attn.{proj}_proj.weight", (heads * H, D), *proj_in(heads))
            if config.qkv_bias:
                out[("layers", i, "attn", f"{proj}_bias")] = (
                    pre + f"self_attn.{proj}_proj.bias", (heads * H,),
                    lambda a, h=heads: a.reshape(h, H), lambda a, h=heads: a.reshape(h * H))
        out[("layers", i, "attn", "o_proj")] = (
            pre + "self_attn.o_proj.weight", (D, N * H),
            lambda a: a.T.reshape(N, H, D), lambda a: a.reshape(N * H, D).T)
        if config.o_bias:  # Llama attention_bias=True
            out[("layers", i, "attn", "o_bias")] = (pre + "self_attn.o_proj.bias", (D,),
                                                    ident, ident)
        out[("layers", i, "mlp", "gate_proj")] = (pre + "mlp.gate_proj.weight", (F, D), t, t)
        out[("layers", i, "mlp", "up_proj")] = (pre + "mlp.up_proj.weight", (F, D), t, t)
        out[("layers", i, "mlp", "down_proj")] = (pre + "mlp.down_proj.weight", (D, F), t, t)
    return out


def _path_key(path) -> tuple:
    keys = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            keys.append(k.key)
        elif isinstance(k, jax.tree_util.SequenceKey):
            keys.append(k.idx)
    return tuple(keys)


def _checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map'")
        files = sorted(set(weight_map.values()))
        missing = [fn for fn in files if not os.path.exists(os.path.join(path, fn))]
        if missing:
            raise ValueError(f"{index} names missing shard files {missing}")
        return [os.path.join(path, fn) for fn in files]
    files = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    return [os.path.join(path, fn) for fn in files]


def load_hf_checkpoint(path: str, dtype: str | None = None, *,
                       stacked: bool = True) -> tuple[ModelConfig, Transformer]:
    """Loads a Llama / Qwen2 / Mistral / Gemma 3 (text) checkpoint directory.

    Args:
      path: a directory with config.json and *.safetensors (one file, or shards listed in
        model.safetensors.index.json).
      dtype: "float32" / "bfloat16" override of the checkpoint dtype.
      stacked: the layers' params in the stacked layout (`Transformer.stacked`: held
        once, as the scanned step reads them; the default), or False: per layer.

    Returns:
      (config, model) with the checkpoint's weights (cast to `config.dtype`).

    Raises:
      ValueError: no config.json, unknown architecture, missing or unexpected tensors,
        or a tensor of the wrong shape (all named).
    """
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"{path}: no config.json")
    with open(cfg_file) as f:
        config = ModelConfig.from_hf_config(json.load(f), dtype=dtype)
    tensors: dict[str, np.ndarray] = {}
    for fn in _checkpoint_files(path):
        tensors.update(read_safetensors(fn))
    mapping = hf_param_map(config)
    wanted = {hf_name for hf_name, *_ in mapping.values()}
    missing = sorted(wanted - tensors.keys())
    if missing:
        raise ValueError(f"{path}: checkpoint lacks tensors {missing}")
    extra = sorted(k for k in tensors.keys() - wanted
                   if not k.endswith(_IGNORED_SUFFIXES)
                   and not (k == "lm_head.weight" and config.tie_embeddings))
    if extra:
        raise ValueError(f"{path}: unexpected tensors for {config.architecture} {extra}")
    bad = [f"{hf_name}: {tuple(tensors[hf_name].shape)} != expected {shape}"
           for hf_name, shape, *_ in mapping.values()
           if tuple(tensors[hf_name].shape) != shape]
    if bad:
        raise ValueError(f"{path}: shape mismatch: " + "; ".join(bad))

    return config, build_transformer(config, lambda name: tensors[name], stacked=stacked)


def build_transformer(config: ModelConfig, get: Callable[[str], np.ndarray], *,
                      progress: bool = False, desc: str = "load",
                      stacked: bool = True) -> Transformer:
    """A `Transformer` whose params are `get(hf_name)` (HF layout, `hf_param_map`), cast
    to `config.dtype`. The caller checks names and shapes first; `get` is called once
    per param, so a loader may convert (e.g. dequantize) lazily, one tensor at a time.

    `stacked` (default): the layers' params go straight into the stacked layout
    (`Transformer.stacked`: one [L, ...] array per param, filled layer by layer in one
    host buffer), so the weights are held once, in the layout of the scanned step;
    False: one array per layer and param (the per-layer model).

    Raises:
      ValueError: a converted tensor whose shape is not the param's (named).
    """
    from prefixcache.model.llama import set_layer_stack  # noqa: PLC0415

    mapping = hf_param_map(config)
    abstract = abstract_transformer(config)
    dt = jnp.dtype(config.dtype)
    bar = None
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        bar = tqdm(total=len(mapping), desc=desc, unit="tensor")

    def convert(key, shape, out=None):
        if key not in mapping:
            raise ValueError(f"model param {key} has no checkpoint mapping")
        hf_name, _, to_ours, _ = mapping[key]
        arr = to_ours(np.asarray(get(hf_name)).astype(np.float32))
        if arr.shape != tuple(shape):
            raise ValueError(f"{hf_name}: converted shape {arr.shape} != param {tuple(shape)}")
        if bar is not None:
            bar.update(1)
        if out is None:
            return jnp.asarray(arr, dtype=dt)
        out[...] = arr  # (cast to the buffer's dtype)
        return None

    def fill(p, leaf):
        return convert(_path_key(p), leaf.shape)

    def fill_stacked(p, leaf):
        # NOTE: one host buffer [L, ...] in the param's dtype (ml_dtypes' bfloat16), each
        # layer converted into its row, then one transfer: the layer tensors are never
        # held as separate device arrays next to their stack.
        key = _path_key(p)
        buf = np.empty((config.num_layers, *leaf.shape), dt)
        for i in range(config.num_layers):
            convert(("layers", i, *key), leaf.shape, buf[i])
        return jnp.asarray(buf)

    try:
        if not stacked:
            graphdef, abs_state = nnx.split(abstract)
            return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, abs_state))
        rest = nnx.state(abstract, nnx.Not(nnx.PathContains("layers")))
        nnx.update(abstract, jax.tree_util.tree_map_with_path(fill, rest))
        layer = nnx.state(abstract.layers[0])
        return set_layer_stack(abstract, jax.tree_util.tree_map_with_path(fill_stacked, layer))
    finally:
        if bar is not None:
            bar.close()


def save_hf_checkpoint(model: Transformer, path: str, *,
                       max_shard_bytes: int | None = None) -> list[str]:
    """Writes `model` as a HF checkpoint directory (config.json + safetensors).

    NOTE: tensors are written as float32 (safetensors.numpy cannot write bfloat16; bf16
    values are exact in f32); config.json keeps `config.dtype` as torch_dtype, so
    `load_hf_checkpoint` restores the same config and, for bf16, the same values.

    Args:
      model: the Transformer (per-layer or stacked).
      path: the directory (created if needed).
      max_shard_bytes: split into model-0000i-of-0000n.safetensors files of at most about
        this size plus model.safetensors.index.json; None: one model.safetensors.

    Returns:
      The safetensors file names written.
    """
    from prefixcache.model.llama import unstack_layers  # noqa: PLC0415

    config = model.config
    os.makedirs(path, exist_ok=True)
    mapping = hf_param_map(config)
    state = nnx.state(unstack_layers(model))
    tensors: dict[str, np.ndarray] = {}

    def grab(p, leaf):
        hf_name, _, _, to_hf = mapping[_path_key(p)]
        tensors[hf_name] = np.ascontiguousarray(to_hf(np.asarray(leaf, np.float32)))
        return leaf

    jax.tree_util.tree_map_with_path(grab, state)
    hf_cfg = config.to_hf_config()  # torch_dtype = config.dtype: loading casts back to it
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    if max_shard_bytes is None:
        safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"))
        return ["model.safetensors"]
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += tensors[name].nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fn, shard in zip(names, shards):
        safetensors.numpy.save_file(shard, os.path.join(path, fn))
        weight_map.update({k: fn for k in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                   "weight_map": weight_map}, f, indent=2)
    return names
