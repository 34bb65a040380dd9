"""`paged_attention`: one entry point over the reference and Pallas backends."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from prefixcache_kernels.common import check_attention_config, validate_inputs
from prefixcache_kernels.pallas_gpu import GPUBlockSizes, ragged_paged_attention_gpu
from prefixcache_kernels.pallas_tpu import TPUBlockSizes, ragged_paged_attention_tpu
from prefixcache_kernels.reference import ragged_paged_attention_reference

BACKENDS = ("auto", "reference", "pallas_tpu", "pallas_gpu")
_PLATFORM_OF = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}
_TILES_OF = {"pallas_tpu": TPUBlockSizes, "pallas_gpu": GPUBlockSizes}


def resolve_backend(backend: str, interpret: bool = False, platform: str | None = None) -> str:
  """The concrete backend a call runs on.

  Args:
    backend: one of `BACKENDS`.
    interpret: Pallas backends may run in interpret mode on any platform.
    platform: `jax.default_backend()` unless given.

  Returns:
    "reference", "pallas_tpu" or "pallas_gpu". "auto" picks pallas_tpu on TPU,
    pallas_gpu on GPU and the reference elsewhere.

  Raises:
    ValueError: unknown backend, or a Pallas backend on a platform without its
      hardware and interpret=False.
  """
  if backend not in BACKENDS:
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
  platform = jax.default_backend() if platform is None else platform
  if backend == "auto":
    return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(platform, "reference")
  if backend in _PLATFORM_OF and platform != _PLATFORM_OF[backend] and not interpret:
    raise ValueError(
        f"backend {backend!r} needs a {_PLATFORM_OF[backend]} device but the platform is "
        f"{platform!r}; pass interpret=True to run it in interpret mode")
  return backend


def check_backend_config(backend: str = "auto", *, interpret: bool = False, page_size,
                         head_dim, num_q_heads, num_kv_heads, q_dtype, kv_dtype,
                         platform: str | None = None,
                         compute_capability: str | None = None) -> str:
  """Checks, before any array exists, that `backend` can run this configuration.

  Everything `paged_attention` would reject at its first call for a static reason:
  an unknown or unavailable backend, an unsupported page size, head size, head
  grouping or dtype pair, and the backend's own limits (pallas_gpu: a power-of-two
  page size; compiled pallas_gpu reads float8_e4m3fn pages only on sm_89 or newer,
  where Triton has e4m3 conversions -- `compute_capability` ("8.0", ...) overrides
  the first GPU's, for checks made off the machine).

  Quantized caches (kv_dtype float8_e4m3fn / int8, with `kv_scales`) run on every
  backend otherwise: the reference and both Pallas kernels dequantize in-kernel (the
  interpret modes on any platform; compiled pallas_tpu is not yet run on hardware).

  Returns:
    The resolved backend name (as `resolve_backend`).

  Raises:
    ValueError: naming the unsupported value.
  """
  name = resolve_backend(backend, interpret, platform)
  check_attention_config(page_size=page_size, head_dim=head_dim, num_q_heads=num_q_heads,
                         num_kv_heads=num_kv_heads, q_dtype=q_dtype, kv_dtype=kv_dtype)
  if name == "pallas_gpu" and page_size & (page_size - 1):
    raise ValueError(f"pallas_gpu needs a power-of-two page_size, got {page_size}")
  if (name == "pallas_gpu" and not interpret
      and jnp.dtype(kv_dtype) == jnp.dtype(jnp.float8_e4m3fn)):
    if compute_capability is None:
      compute_capability = getattr(jax.devices("gpu")[0], "compute_capability", "0.0")
    major, minor = (int(x) for x in str(compute_capability).split(".")[:2])
    if (major, minor) < (8, 9):
      raise ValueError(
          f"pallas_gpu cannot read float8_e4m3fn KV pages on a GPU of compute capability "
          f"{compute_capability} (Triton's e4m3 needs sm_89+, Ada/Hopper); use "
          "kv_dtype='int8' or 'bfloat16' there")
  return name


def paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                    sm_scale, sliding_window=None, soft_cap=None, backend="auto",
                    interpret=False, block_sizes=None, kv_scales=None):
  """Ragged paged attention (see `ragged_paged_attention_reference` for semantics).

  Args:
    q: [num_tokens, num_q_heads, head_dim], f32 or bf16.
    kv_pages: [num_pages, page_size, 2*num_kv_heads, head_dim], f32 or bf16.
    kv_lens: i32[max_num_seqs].
    page_indices: i32[max_num_seqs, pages_per_seq].
    cu_q_lens: i32[max_num_seqs + 1].
    num_seqs: i32[1].
    sm_scale, sliding_window, soft_cap: static scalars.
    backend: "auto" | "reference" | "pallas_tpu" | "pallas_gpu".
    interpret: run a Pallas backend in interpret mode (any platform).
    block_sizes: tiles of the Pallas backend that runs: a `TPUBlockSizes` for
      pallas_tpu, a `GPUBlockSizes` for pallas_gpu, None for its defaults. The reference
      takes none.
    kv_scales: None for float32 / bfloat16 pages; the f32[num_pages, 2*num_kv_heads]
      scales of float8_e4m3fn / int8 pages (`kernels.quant`), which every backend
      dequantizes as it loads a page.

  Returns:
    [num_tokens, num_q_heads, head_dim] in q's dtype.

  Raises:
    ValueError: unknown/unavailable backend, bad shapes/dtypes, or block sizes of
      another backend.
  """
  name = resolve_backend(backend, interpret)
  if block_sizes is not None:
    want = _TILES_OF.get(name)
    if want is None or not isinstance(block_sizes, want):
      raise ValueError(
          f"block_sizes {block_sizes!r} do not fit backend {name!r} (resolved from "
          f"{backend!r}); expected " + (f"a {want.__name__} or None" if want else "None"))
  validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                  sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  kv_scales=kv_scales)
  kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
  if kv_scales is not None:
    kw["kv_scales"] = kv_scales
  args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
  if block_sizes is not None:
    kw["block_sizes"] = block_sizes
  if name == "pallas_tpu":
    return ragged_paged_attention_tpu(*args, interpret=interpret, **kw)
  if name == "pallas_gpu":
    return ragged_paged_attention_gpu(*args, interpret=interpret, **kw)
  return ragged_paged_attention_reference(*args, **kw)
