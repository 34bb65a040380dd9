"""`paged_attention`: one entry point over the registered kernel backends.

The backends are records (`registry.KernelBackend`) in the read-only `KERNEL_BACKENDS`;
selection ("auto" and by name), the errors and the supported-feature refusals below read
only the records. A new backend: one file with its function, one record in
`KERNEL_BACKENDS` -- or, from a user's own package, `register_backend(record)` (a new
registry to pass as `backends=`) or the record itself as `backend=`.
"""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import jax
import jax.numpy as jnp

from prefixcache_kernels.common import (check_arrays, check_attention_config,
                                        check_padding_page, pallas_limits, validate_inputs)
from prefixcache_kernels.pallas_gpu import GPUBlockSizes, ragged_paged_attention_gpu
from prefixcache_kernels.pallas_tpu import TPUBlockSizes, ragged_paged_attention_tpu
from prefixcache_kernels.reference import ragged_paged_attention_reference
from prefixcache_kernels.registry import AUTO, AttentionQuery, KernelBackend
from prefixcache_kernels.registry import register_backend as _register
from prefixcache_kernels.write_kv import write_kv


def _check_pallas_tpu(query: AttentionQuery) -> str | None:
  """pallas_tpu: its tiling limits (`common.pallas_limits`)."""
  return pallas_limits("tpu", page_size=query.page_size, head_dim=query.head_dim)


def _check_pallas_gpu(query: AttentionQuery) -> str | None:
  """pallas_gpu: its tiling limits (`common.pallas_limits`: a power-of-two page size);
  compiled, float8_e4m3fn pages only on sm_89+ (Triton's e4m3 conversions), the GPU's
  compute capability read from the first GPU unless the query carries one (checks made
  off the machine)."""
  reason = pallas_limits("gpu", page_size=query.page_size, head_dim=query.head_dim)
  if reason is not None:
    return reason
  if not query.interpret and jnp.dtype(query.kv_dtype) == jnp.dtype(jnp.float8_e4m3fn):
    capability = query.compute_capability
    if capability is None:
      capability = getattr(jax.devices("gpu")[0], "compute_capability", "0.0")
    major, minor = (int(x) for x in str(capability).split(".")[:2])
    if (major, minor) < (8, 9):
      return (f"the Pallas gpu backend needs compute capability 8.9+ (sm_89, Ada/Hopper) "
              f"to read float8_e4m3fn KV pages compiled (Triton's e4m3), this GPU has "
              f"{capability}; use kv_dtype='int8' or 'bfloat16' there")
  return None


REFERENCE = KernelBackend("reference", ragged_paged_attention_reference)
PALLAS_TPU = KernelBackend("pallas_tpu", ragged_paged_attention_tpu, platforms=("tpu",),
                           interpretable=True, block_sizes=TPUBlockSizes,
                           check=_check_pallas_tpu)
PALLAS_GPU = KernelBackend("pallas_gpu", ragged_paged_attention_gpu, platforms=("gpu",),
                           interpretable=True, block_sizes=GPUBlockSizes,
                           check=_check_pallas_gpu)


def _registry(*records: KernelBackend) -> MappingProxyType:
  registry = MappingProxyType({})
  for record in records:
    registry = _register(record, registry)
  return registry


# NOTE: registered through `register_backend`, as a user's own backend is. Order
# matters for "auto": the first record whose platforms hold the current platform, else
# the first that runs everywhere (the reference).
KERNEL_BACKENDS = _registry(REFERENCE, PALLAS_TPU, PALLAS_GPU)
# The names `backend=` takes with the built-in registry ("auto" first).
BACKENDS = (AUTO, *KERNEL_BACKENDS)


def register_backend(backend: KernelBackend,
                     registry: Mapping[str, KernelBackend] = KERNEL_BACKENDS) -> MappingProxyType:
  """A new read-only registry: `registry` (the built-in one by default) plus `backend`.

  Pass it as `backends=` to `resolve_backend`, `check_backend_config` and
  `paged_attention`; the built-in registry is unchanged.
  """
  return _register(backend, registry)


def get_backend(backend: str | KernelBackend = AUTO, interpret: bool = False,
                platform: str | None = None,
                backends: Mapping[str, KernelBackend] = KERNEL_BACKENDS) -> KernelBackend:
  """The record of the backend a call runs on (see `resolve_backend`)."""
  platform = jax.default_backend() if platform is None else platform
  if isinstance(backend, KernelBackend):
    record = backend
  elif backend == AUTO:
    records = [r for r in backends.values() if r.auto]
    record = next((r for r in records if platform in r.platforms), None)
    if record is None:
      record = next((r for r in records if not r.platforms), None)
    if record is None:
      raise ValueError(f"no kernel backend runs on platform {platform!r}; registered: "
                       f"{tuple(backends)}")
    return record
  elif isinstance(backend, str) and backend in backends:
    record = backends[backend]
  else:
    raise ValueError(f"unknown backend {backend!r}; expected one of {(AUTO, *backends)}")
  if not record.runs_on(platform, interpret):
    hint = "; pass interpret=True to run it in interpret mode" if record.interpretable else ""
    raise ValueError(
        f"backend {record.name!r} needs a {' or '.join(record.platforms)} device but the "
        f"platform is {platform!r}{hint}")
  return record


def resolve_backend(backend: str | KernelBackend = AUTO, interpret: bool = False,
                    platform: str | None = None,
                    backends: Mapping[str, KernelBackend] = KERNEL_BACKENDS) -> str:
  """The concrete backend a call runs on.

  Args:
    backend: "auto", a name in `backends`, or a `KernelBackend` record.
    interpret: interpretable (Pallas) backends may run in interpret mode on any platform.
    platform: `jax.default_backend()` unless given.
    backends: the registry (`KERNEL_BACKENDS`, or one from `register_backend`).

  Returns:
    The backend's name. "auto" picks the first registered backend compiled for the
    platform (pallas_tpu on TPU, pallas_gpu on GPU) and the reference elsewhere.

  Raises:
    ValueError: unknown backend, or a backend on a platform it does not run on (and
      interpret=False, or it cannot interpret).
  """
  return get_backend(backend, interpret, platform, backends).name


def check_backend_config(backend: str | KernelBackend = AUTO, *, interpret: bool = False,
                         page_size, head_dim, num_q_heads, num_kv_heads, q_dtype, kv_dtype,
                         platform: str | None = None,
                         compute_capability: str | None = None,
                         backends: Mapping[str, KernelBackend] = KERNEL_BACKENDS) -> str:
  """Checks, before any array exists, that `backend` can run this configuration.

  Everything `paged_attention` would reject at its first call for a static reason: an
  unknown or unavailable backend, a non-positive size, a head grouping or dtype pair no
  backend runs (`common.check_attention_config`), then the backend's own limits (its
  record's `check`). The limits of the built-in backends:

  | backend      | runs on                       | head_dim          | page_size                  |
  |--------------|-------------------------------|-------------------|----------------------------|
  | `reference`  | every platform (plain jnp)    | any >= 1          | any >= 1                   |
  | `pallas_tpu` | TPU; anywhere with interpret  | 64, 128 or 256    | 8 to 128                   |
  | `pallas_gpu` | GPU; anywhere with interpret  | 64, 128 or 256    | 8, 16, 32, 64 or 128       |

  Shared by all three: `num_q_heads` a multiple of `num_kv_heads`; `q_dtype` float32
  or bfloat16; `kv_dtype` float32, bfloat16, or float8_e4m3fn / int8 (quantized pages
  with `kv_scales`, dequantized in-kernel by every backend; compiled pallas_tpu has not
  yet run on TPU hardware, its interpret mode runs everywhere); bfloat16 q over a float32
  cache is refused (cast q, or store the cache in bfloat16). pallas_gpu compiled (not
  interpret) reads float8_e4m3fn pages only on compute capability 8.9+ (sm_89;
  `compute_capability` ("8.0", ...) overrides the first GPU's, for checks made off the
  machine). The Pallas errors say "the Pallas tpu backend needs ..." / "the Pallas gpu
  backend needs ..." and name the setting (`page_size` is an engine's `block_size`).

  Args:
    backend: "auto", a name in `backends`, or a `KernelBackend` record.
    interpret: the Pallas backends in interpret mode (any platform).
    page_size: tokens per KV page (an engine's or manager's `block_size`).
    head_dim, num_q_heads, num_kv_heads: the model's attention shape.
    q_dtype, kv_dtype: dtypes of the queries and of the KV pages.
    platform: `jax.default_backend()` unless given ("cpu", "gpu", "tpu").
    compute_capability: the GPU's, for the fp8 check above (None: the first GPU's).
    backends: the registry (`KERNEL_BACKENDS`, or one from `register_backend`).

  Returns:
    The resolved backend name (as `resolve_backend`).

  Raises:
    ValueError: naming the unsupported value.
  """
  platform = jax.default_backend() if platform is None else platform
  record = get_backend(backend, interpret, platform, backends)
  check_attention_config(page_size=page_size, head_dim=head_dim, num_q_heads=num_q_heads,
                         num_kv_heads=num_kv_heads, q_dtype=q_dtype, kv_dtype=kv_dtype)
  if record.check is not None:
    reason = record.check(AttentionQuery(
        page_size=page_size, head_dim=head_dim, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, q_dtype=q_dtype, kv_dtype=kv_dtype,
        interpret=bool(interpret), platform=platform, compute_capability=compute_capability))
    if reason is not None:
      raise ValueError(reason)
  return record.name


def paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                    sm_scale, sliding_window=None, soft_cap=None, backend=AUTO,
                    interpret=False, block_sizes=None, kv_scales=None,
                    num_blocks: int | None = None,
                    backends: Mapping[str, KernelBackend] = KERNEL_BACKENDS):
  """Ragged paged attention (see `ragged_paged_attention_reference` for semantics).

  Args:
    q: [num_tokens, num_q_heads, head_dim], f32 or bf16.
    kv_pages: [num_pages, page_size, 2*num_kv_heads, head_dim], f32 or bf16.
    kv_lens: i32[max_num_seqs].
    page_indices: i32[max_num_seqs, pages_per_seq].
    cu_q_lens: i32[max_num_seqs + 1].
    num_seqs: i32[1].
    sm_scale, sliding_window, soft_cap: static scalars.
    backend: "auto", a name in `backends` ("reference" | "pallas_tpu" | "pallas_gpu"
      built in) or a `KernelBackend` record.
    interpret: run an interpretable (Pallas) backend in interpret mode (any platform).
    block_sizes: tiles of the backend that runs: its record's `block_sizes` type (a
      `TPUBlockSizes` for pallas_tpu, a `GPUBlockSizes` for pallas_gpu), None for its
      defaults. The reference takes none.
    kv_scales: None for float32 / bfloat16 pages; the f32[num_pages, 2*num_kv_heads]
      scales of float8_e4m3fn / int8 pages (`kernels.quant`), which every backend
      dequantizes as it loads a page.
    num_blocks: static; when given, `kv_pages` must have `num_blocks + 1` pages (the
      allocatable blocks and the padding page the metadata's padding points at).
    backends: the registry (`KERNEL_BACKENDS`, or one from `register_backend`).

  Returns:
    [num_tokens, num_q_heads, head_dim] in q's dtype.

  Raises:
    ArgumentTypeError: (a TypeError and a ValueError) an argument that is not an array,
      e.g. `num_seqs=1` for `np.array([1], np.int32)`.
    ValueError: unknown/unavailable backend, bad shapes/dtypes, a head_dim or page size
      the backend cannot tile, a missing padding page, or block sizes of another
      backend.
  """
  record = get_backend(backend, interpret, None, backends)
  if block_sizes is not None:
    want = record.block_sizes
    if want is None or not isinstance(block_sizes, want):
      raise ValueError(
          f"block_sizes {block_sizes!r} do not fit backend {record.name!r} (resolved from "
          f"{getattr(backend, 'name', backend)!r}); expected "
          + (f"a {want.__name__} or None" if want else "None"))
  validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                  sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  kv_scales=kv_scales)
  check_padding_page(kv_pages, num_blocks)
  kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
  if kv_scales is not None:
    kw["kv_scales"] = kv_scales
  if block_sizes is not None:
    kw["block_sizes"] = block_sizes
  if record.interpretable:
    kw["interpret"] = interpret
  return record.attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kw)


def write_kv_and_attend(q, k, v, kv_pages, slot_mapping, kv_lens, page_indices, cu_q_lens,
                        num_seqs, *, sm_scale, num_blocks=None, sliding_window=None,
                        soft_cap=None, backend=AUTO, interpret=False, block_sizes=None,
                        kv_scales=None,
                        backends: Mapping[str, KernelBackend] = KERNEL_BACKENDS):
  """One attention layer's paged step: writes this step's K/V, then attends.

  `write_kv` followed by `paged_attention` over the updated pages, returning
  `(out, kv_pages)` as jax's ragged paged attention (v3) does. Pure and jittable: jit
  the caller with the keyword arguments static (`sm_scale`, `num_blocks`,
  `sliding_window`, `soft_cap`, `backend`, `interpret`, `block_sizes`, `backends`) and
  `donate_argnums` on `kv_pages` so XLA updates the cache in place.

  The index arrays are one step's `prefixcache.metadata.AttentionMetadata` (numpy or
  device arrays); T is the step's token bucket, S its sequence bucket, P its page bucket.

  Args:
    q: [T, num_q_heads, head_dim], float32 or bfloat16: this step's queries, rows in the
      metadata's token order.
    k: [T, num_kv_heads, head_dim], floating (cast to the pages' dtype): this step's keys.
    v: [T, num_kv_heads, head_dim], floating, k's shape: this step's values.
    kv_pages: [num_pages, page_size, 2 * num_kv_heads, head_dim], float32 / bfloat16
      (or float8_e4m3fn / int8 with `kv_scales`); K of kv head h at slot 2h, V at 2h+1.
      `num_pages = num_blocks + 1`: the last page is the padding page.
    slot_mapping: i32[T], `page * page_size + offset` of each token's K/V (padding
      tokens: the padding page's slots).
    kv_lens: i32[S], KV tokens each sequence attends to after this step (this step's
      included).
    page_indices: i32[S, P], the block table per sequence row.
    cu_q_lens: i32[S + 1], cumulative query lengths.
    num_seqs: i32[1], live rows (an array, not a Python int).
    sm_scale: static float multiplying q.k (usually head_dim ** -0.5).
    num_blocks: static int or None; when given, `kv_pages` must have `num_blocks + 1`
      pages (`MetadataBuilder.num_pages`), checked at trace time.
    sliding_window, soft_cap, backend, interpret, block_sizes, backends: as
      `paged_attention`.
    kv_scales: None, or f32[num_pages, 2 * num_kv_heads] scales of quantized pages
      (`write_kv` updates them).

  Returns:
    `(out, kv_pages)`: out [T, num_q_heads, head_dim] in q's dtype (padding rows 0) and
    the updated kv_pages (same shape and dtype). With `kv_scales`:
    `(out, kv_pages, kv_scales)`.

  Raises:
    ArgumentTypeError: (a TypeError and a ValueError) an argument that is not an array.
    ValueError: as `write_kv` and `paged_attention` (shapes, dtypes, a missing padding
      page, a head_dim or page size the backend cannot tile).
  """
  check_arrays(q=q, k=k, v=v, kv_pages=kv_pages, slot_mapping=slot_mapping, kv_lens=kv_lens,
               page_indices=page_indices, cu_q_lens=cu_q_lens, num_seqs=num_seqs)
  attend = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                backend=backend, interpret=interpret, block_sizes=block_sizes,
                num_blocks=num_blocks, backends=backends)
  # Static checks of the attention first, so a bad configuration fails before the write.
  validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                  sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  kv_scales=kv_scales)
  check_padding_page(kv_pages, num_blocks)
  if k.ndim != 3 or k.shape[0] != q.shape[0]:
    raise ValueError(f"k shape {k.shape} must be [{q.shape[0]}, num_kv_heads, head_dim]: one "
                     f"key per query token (q shape {q.shape})")
  if kv_scales is None:
    kv_pages = write_kv(kv_pages, k, v, slot_mapping)
    out = paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **attend)
    return out, kv_pages
  kv_pages, kv_scales = write_kv(kv_pages, k, v, slot_mapping, kv_scales)
  out = paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                        kv_scales=kv_scales, **attend)
  return out, kv_pages, kv_scales
