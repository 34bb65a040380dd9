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

from prefixcache_kernels.common import check_attention_config, validate_inputs
from prefixcache_kernels.pallas_gpu import GPUBlockSizes, ragged_paged_attention_gpu
from prefixcache_kernels.pallas_tpu import TPUBlockSizes, ragged_paged_attention_tpu
from prefixcache_kernels.reference import ragged_paged_attention_reference
from prefixcache_kernels.registry import AUTO, AttentionQuery, KernelBackend
from prefixcache_kernels.registry import register_backend as _register


def _check_pallas_gpu(query: AttentionQuery) -> str | None:
  """pallas_gpu: a power-of-two page size; compiled, float8_e4m3fn pages only on sm_89+
  (Triton's e4m3 conversions), the GPU's compute capability read from the first GPU
  unless the query carries one (checks made off the machine)."""
  if query.page_size & (query.page_size - 1):
    return f"pallas_gpu needs a power-of-two page_size, got {query.page_size}"
  if not query.interpret and jnp.dtype(query.kv_dtype) == jnp.dtype(jnp.float8_e4m3fn):
    capability = query.compute_capability
    if capability is None:
      capability = getattr(jax.devices("gpu")[0], "compute_capability", "0.0")
    major, minor = (int(x) for x in str(capability).split(".")[:2])
    if (major, minor) < (8, 9):
      return (f"pallas_gpu cannot read float8_e4m3fn KV pages on a GPU of compute "
              f"capability {capability} (Triton's e4m3 needs sm_89+, Ada/Hopper); use "
              "kv_dtype='int8' or 'bfloat16' there")
  return None


REFERENCE = KernelBackend("reference", ragged_paged_attention_reference)
PALLAS_TPU = KernelBackend("pallas_tpu", ragged_paged_attention_tpu, platforms=("tpu",),
                           interpretable=True, block_sizes=TPUBlockSizes)
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

  Everything `paged_attention` would reject at its first call for a static reason:
  an unknown or unavailable backend, an unsupported page size, head size, head
  grouping or dtype pair (`common.check_attention_config`), and the backend's own
  limits (its record's `check`; pallas_gpu: a power-of-two page size, and compiled
  float8_e4m3fn pages only on sm_89 or newer -- `compute_capability` ("8.0", ...)
  overrides the first GPU's, for checks made off the machine).

  Quantized caches (kv_dtype float8_e4m3fn / int8, with `kv_scales`) run on every
  built-in backend otherwise: the reference and both Pallas kernels dequantize in-kernel
  (the interpret modes on any platform; compiled pallas_tpu is not yet run on hardware).

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
    backends: the registry (`KERNEL_BACKENDS`, or one from `register_backend`).

  Returns:
    [num_tokens, num_q_heads, head_dim] in q's dtype.

  Raises:
    ValueError: unknown/unavailable backend, bad shapes/dtypes, or block sizes of
      another backend.
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
  kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
  if kv_scales is not None:
    kw["kv_scales"] = kv_scales
  if block_sizes is not None:
    kw["block_sizes"] = block_sizes
  if record.interpretable:
    kw["interpret"] = interpret
  return record.attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kw)
