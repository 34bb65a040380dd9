"""Paged-attention kernels (pure JAX; never imports prefixcache).

Modules: `api` (`paged_attention`, backend selection, the built-in `KERNEL_BACKENDS`),
`registry` (`KernelBackend` records, `AttentionQuery`, `register_backend`), `common`
(the shared input contract and static checks), one file per kernel with its tiles:
`reference` (plain jnp), `pallas_tpu`, `pallas_gpu` (Triton, split-K); `write_kv` (the
KV page writer), `quant` (fp8 / int8 pages and their scales).

Public API:
- `paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
  sliding_window=None, soft_cap=None, backend="auto", interpret=False, block_sizes=None,
  kv_scales=None, num_blocks=None, backends=KERNEL_BACKENDS)`: kv_pages float32 / bfloat16, or
  float8_e4m3fn / int8 with `kv_scales f32[num_pages, 2*num_kv_heads]` (per-(page, kv
  head) K and V scales, `kernels.quant`), dequantized in-kernel by every backend.
  `backend`: "auto", a registered name or a `KernelBackend` record.
- Backends by registration: `KERNEL_BACKENDS` (read-only: reference, pallas_tpu,
  pallas_gpu), `BACKENDS` (its names with "auto"), `KernelBackend(name, attention, *,
  platforms, interpretable, block_sizes, check, auto)`, `register_backend(record,
  registry=KERNEL_BACKENDS) -> new registry`, `get_backend` / `resolve_backend(backend,
  interpret, platform, backends)`.
- `ragged_paged_attention_reference(...)`: the same minus backend/interpret.
- `write_kv(kv_pages, k, v, slot_mapping, kv_scales=None, *, num_blocks=None) ->
  kv_pages` (slots outside `[0, num_pages * page_size)`, negative ones included, are
  dropped); quantized pages: `-> (kv_pages, kv_scales)`, quantizing (and requantizing a
  page whose scale rises).
- `write_kv_and_attend(q, k, v, kv_pages, slot_mapping, kv_lens, page_indices, cu_q_lens,
  num_seqs, *, sm_scale, num_blocks=None, ...) -> (out, kv_pages)`: one layer's paged
  step, the shape of jax's ragged paged attention v3 (writes this step's K/V, then
  attends); `num_blocks` checks the padding page (`num_pages == num_blocks + 1`).
- Limits: the reference takes any head_dim and page size >= 1; the Pallas kernels need
  head_dim 64/128/256 and page sizes 8..128 (powers of two on GPU): the table in
  `check_backend_config`'s docstring. An argument that is not an array (`num_seqs=1`)
  raises `common.ArgumentTypeError` (a TypeError and a ValueError).
- `check_backend_config(backend, *, interpret, page_size, head_dim, num_q_heads,
  num_kv_heads, q_dtype, kv_dtype, platform=None, compute_capability=None,
  backends=KERNEL_BACKENDS)`: the static checks of a call, before any array (the shared
  ones, then the record's `check`).
- `ragged_paged_attention_tpu(..., block_sizes=TPUBlockSizes(), interpret=False)`: Pallas
  TPU kernel (also runs under `pltpu.force_tpu_interpret_mode()`).
- `ragged_paged_attention_gpu(..., block_sizes=GPUBlockSizes(), interpret=False)`: Pallas
  Triton kernel with split-K (flash-decoding) merge.
"""
from prefixcache_kernels.api import (
    BACKENDS,
    KERNEL_BACKENDS,
    check_backend_config,
    get_backend,
    paged_attention,
    register_backend,
    resolve_backend,
    write_kv_and_attend,
)
from prefixcache_kernels.pallas_gpu import GPUBlockSizes, ragged_paged_attention_gpu
from prefixcache_kernels.pallas_tpu import TPUBlockSizes, ragged_paged_attention_tpu
from prefixcache_kernels.reference import ragged_paged_attention_reference
from prefixcache_kernels.registry import AttentionQuery, KernelBackend
from prefixcache_kernels.write_kv import write_kv

__all__ = [
    "AttentionQuery", "BACKENDS", "GPUBlockSizes", "KERNEL_BACKENDS", "KernelBackend",
    "check_backend_config", "TPUBlockSizes", "get_backend", "paged_attention",
    "ragged_paged_attention_gpu", "ragged_paged_attention_reference",
    "ragged_paged_attention_tpu", "register_backend", "resolve_backend", "write_kv",
    "write_kv_and_attend",
]
