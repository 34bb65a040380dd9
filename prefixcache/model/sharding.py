"""Tensor parallelism over kv heads on a `jax.sharding.Mesh` axis named "model".

Layout (m = mesh.shape["model"]):
  q_proj [D, N, H], k_proj/v_proj [D, K, H]  -> heads axis split m ways
  o_proj [N, H, D]                            -> heads axis split (all-reduce after)
  q/k/v bias [N|K, H]                         -> heads axis split
  gate_proj/up_proj [D, F]                    -> F split; down_proj [F, D] -> F split
  embedding, lm_head, norms                   -> replicated
  KV pages [num_pages, page_size, 2K, H]      -> axis 2 split: device j holds kv heads
    [j K/m, (j+1) K/m), i.e. slots [2 j K/m, 2 (j+1) K/m): every K/V pair stays together.
  A stacked model's `layer_stack` params [L, ...] and the stacked KV [A, num_pages, ...]
  keep the same split one axis further right (the layer axis is not split).
Query head i uses kv head i // (N/K), so the contiguous split of N keeps each query head on
the device that holds its kv head. Attention (write_kv + paged attention) runs per device
under `jax.shard_map`; XLA inserts the all-reduces after o_proj and down_proj.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from prefixcache.model.config import ModelConfig

__all__ = [
    "MODEL_AXIS",
    "kv_cache_sharding",
    "model_axis_size",
    "param_partition_spec",
    "shard_layer_stack",
    "shard_model",
    "validate_mesh",
]

MODEL_AXIS = "model"

_SPECS = {
    "q_proj": P(None, MODEL_AXIS, None),
    "k_proj": P(None, MODEL_AXIS, None),
    "v_proj": P(None, MODEL_AXIS, None),
    "o_proj": P(MODEL_AXIS, None, None),
    "q_bias": P(MODEL_AXIS, None),
    "k_bias": P(MODEL_AXIS, None),
    "v_bias": P(MODEL_AXIS, None),
    "gate_proj": P(None, MODEL_AXIS),
    "up_proj": P(None, MODEL_AXIS),
    "down_proj": P(MODEL_AXIS, None),
}


def model_axis_size(mesh: Mesh) -> int:
    """Devices along the "model" axis."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if MODEL_AXIS not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} lack the {MODEL_AXIS!r} axis")
    return int(mesh.shape[MODEL_AXIS])


def validate_mesh(config: ModelConfig, mesh: Mesh) -> int:
    """Checks that the "model" axis divides kv heads and mlp_dim; returns its size."""
    m = model_axis_size(mesh)
    if config.num_kv_heads % m:
        raise ValueError(
            f"num_kv_heads ({config.num_kv_heads}) is not divisible by the mesh's "
            f"{MODEL_AXIS!r} axis size {m}"
        )
    if config.mlp_dim % m:
        raise ValueError(
            f"mlp_dim ({config.mlp_dim}) is not divisible by the mesh's {MODEL_AXIS!r} "
            f"axis size {m}"
        )
    return m


def param_partition_spec(name: str) -> P:
    """PartitionSpec of a Transformer param by its attribute name (replicated if unknown)."""
    return _SPECS.get(name, P())


def _leaf_path(path) -> tuple:
    """The str / int keys of a state leaf's path (("layers", 3, "attn", "q_proj"))."""
    out = []
    for k in path:
        k = getattr(k, "key", getattr(k, "idx", None))
        if isinstance(k, (str, int)) and k != "value":
            out.append(k)
    return tuple(out)


def _leaf_name(path) -> str:
    names = [getattr(k, "key", None) for k in path]
    names = [n for n in names if isinstance(n, str)]
    return names[-1] if names else ""


def _is_stacked_path(path) -> bool:
    return any(getattr(k, "key", None) == "layer_stack" for k in path)


def param_shardings(state, mesh: Mesh, *, stacked: bool = False):
    """A pytree of NamedShardings matching an `nnx.State` of a Transformer (params under
    `layer_stack`, or all of them with `stacked`, have a leading layer axis)."""
    def spec(path, _):
        s = param_partition_spec(_leaf_name(path))
        if stacked or _is_stacked_path(path):
            s = P(None, *s)
        return NamedSharding(mesh, s)

    return jax.tree_util.tree_map_with_path(spec, state)


def shard_layer_stack(state, mesh: Mesh):
    """A layer's param tree stacked [L, ...] (`stack_layer_params`) laid out over `mesh`."""
    return jax.device_put(state, param_shardings(state, mesh, stacked=True))


def kv_cache_sharding(mesh: Mesh, kv_dtype=None, *, stacked: bool = False):
    """Sharding of one layer's KV pages: axis 2 (2 * num_kv_heads) over "model".

    For a quantized `kv_dtype` (float8_e4m3fn / int8) the layer's cache is the pair
    (pages, scales [num_pages, 2K]) and so is its sharding (scales: axis 1 over "model").
    `stacked`: of the stacked layout (`make_kv_caches(stacked=True)`, a leading array
    axis): pages [A, num_pages, page_size, 2K, H] axis 3, scales [A, num_pages, 2K] axis 2.
    """
    from prefixcache.kv_dtypes import QUANTIZED_KV_DTYPES

    model_axis_size(mesh)
    lead = (None,) if stacked else ()
    pages = NamedSharding(mesh, P(*lead, None, None, MODEL_AXIS, None))
    if kv_dtype is not None and jnp.dtype(kv_dtype).name in QUANTIZED_KV_DTYPES:
        return pages, NamedSharding(mesh, P(*lead, None, MODEL_AXIS))
    return pages


def shard_model(model, mesh: Mesh):
    """Lays a `Transformer`'s params out over `mesh` (in place); returns the model.
    (A stacked model's per-layer shapes stay shapes; its `layer_stack` is laid out.)

    Raises:
      ValueError: the mesh has no "model" axis, or it does not divide num_kv_heads / mlp_dim.
    """
    validate_mesh(model.config, mesh)
    state = nnx.state(model, nnx.Not(nnx.PathContains("layers")) if model.stacked else ...)
    nnx.update(model, jax.device_put(state, param_shardings(state, mesh)))
    return model
