"""Shared input validation and constants for the paged-attention kernels.

All kernels in this package take the same arguments (the index-array contract of
docs/DESIGN.md in the repository):

- `q: [num_tokens, num_q_heads, head_dim]` (f32 or bf16), ragged over sequences.
- `kv_pages: [num_pages, page_size, 2 * num_kv_heads, head_dim]`, K of kv-head h at slot
  2h, V at slot 2h+1.
- `kv_lens: i32[max_num_seqs]`: KV tokens each sequence attends to after this step.
- `page_indices: i32[max_num_seqs, pages_per_seq]`: the block table.
- `cu_q_lens: i32[max_num_seqs + 1]`: cumulative query lengths.
- `num_seqs: i32[1]`: live rows of the tables.

Masked slots: a kernel reads whole pages, so it also reads slots no query row of a
sequence can see -- past kv_len in its last page, table entries past its pages, and
with `sliding_window` the keys before the window of its first row (an engine points
released out-of-window blocks at the padding page, or they hold another request's
data) -- and, for quantized pages, their scales. These may hold anything, NaN and inf
included: every backend zeroes their K and V before the products (a softmax weight of
0 times NaN would still be NaN), so they never reach the output. Keys some row of the
sequence sees must be finite (a kernel zeroes V per key, not per row).

Validation here is static (shapes, dtypes, static scalars) so it runs at trace time and
never forces a device->host transfer.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from prefixcache_kernels.quant import QUANTIZED_KV_DTYPES, check_kv_scales

# NOTE: masked logits in the online-softmax kernels: a large finite negative number
# rather than -inf keeps the running max finite (no inf - inf = NaN) while a row has
# seen no visible key yet. The kernels also zero the weights of masked keys, so such a
# row keeps l = 0 and its output is 0.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# The Pallas kernels' tilings (the reference takes any head_dim and page size >= 1):
# head_dim is the lane axis of their tiles, a page the sublane / Triton block axis.
PALLAS_HEAD_DIMS = (64, 128, 256)
PALLAS_MIN_PAGE_SIZE = 8
PALLAS_MAX_PAGE_SIZE = 128
SUPPORTED_KV_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Cache dtypes: the float ones above, or quantized pages with `kv_scales` (kernels.quant).
SUPPORTED_CACHE_DTYPES = SUPPORTED_KV_DTYPES + QUANTIZED_KV_DTYPES


class ArgumentTypeError(TypeError, ValueError):
  """An argument of the wrong type (a Python int where an array is expected, ...): both
  a TypeError and a ValueError, so callers written against either see it."""


def _is_int(value) -> bool:
  """A Python or numpy int, not a bool (kernels never import prefixcache: own helper)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_arrays(**arrays) -> None:
  """Raises `ArgumentTypeError` naming the first argument that is not an array (a
  Python int, a list, None): each needs `.shape` and `.dtype` (numpy, jax, tracer).

  Example: `num_seqs=1` -> "num_seqs must be an array (i32[1]), got int 1".
  """
  for name, x in arrays.items():
    if not (hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "ndim")):
      hint = " (i32[1], e.g. np.array([n], np.int32))" if name == "num_seqs" else ""
      raise ArgumentTypeError(
          f"{name} must be an array{hint}, got {type(x).__name__} {x!r}"[:300])


def check_padding_page(kv_pages, num_blocks) -> None:
  """Raises ValueError unless `kv_pages` has `num_blocks + 1` pages: blocks
  `0..num_blocks-1` and the padding page `num_blocks` that every padding entry of the
  index arrays points at. `num_blocks` None: no check (the kernels cannot see it)."""
  if num_blocks is None:
    return
  if not _is_int(num_blocks) or num_blocks < 1:
    raise ValueError(f"num_blocks must be a positive int or None, got {num_blocks!r}")
  if kv_pages.shape[0] != num_blocks + 1:
    raise ValueError(
        f"kv_pages has {kv_pages.shape[0]} pages but num_blocks={num_blocks} needs "
        f"num_blocks + 1 = {num_blocks + 1}: blocks 0..{num_blocks - 1} and the padding page "
        f"{num_blocks} that padding page indices and slots point at (allocate "
        "MetadataBuilder.num_pages pages)")


def check_attention_config(*, page_size, head_dim, num_q_heads, num_kv_heads, q_dtype,
                           kv_dtype) -> None:
  """Checks the static configuration every paged-attention backend needs.

  The same checks `validate_inputs` runs on arrays, callable before any array exists
  (an engine checks its model and pool with it at construction). Any head_dim and any
  page_size >= 1 pass here: the Pallas kernels' tiling limits are their own
  (`pallas_limits`, run by their backend records and wrappers).

  Raises:
    ValueError: naming the unsupported value and what is supported.
  """
  for name, v in (("page_size", page_size), ("head_dim", head_dim),
                  ("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)):
    if not _is_int(v) or v < 1:
      raise ValueError(f"{name} must be a positive int, got {v!r}")
  if num_q_heads % num_kv_heads != 0:
    raise ValueError(
        f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
  try:
    q_dtype, kv_dtype = jnp.dtype(q_dtype), jnp.dtype(kv_dtype)
  except TypeError as e:
    raise ArgumentTypeError(f"q_dtype / kv_dtype must be dtypes: {e}") from None
  if kv_dtype not in SUPPORTED_CACHE_DTYPES:
    raise ValueError(f"kv_pages dtype {kv_dtype} not supported; expected float32, bfloat16, "
                     "or float8_e4m3fn / int8 (quantized, with kv_scales)")
  if q_dtype not in SUPPORTED_KV_DTYPES:
    raise ValueError(f"q dtype {q_dtype} not supported; expected float32 or bfloat16")
  # NOTE: bf16 q with f32 KV would silently upcast the cache reads; the only mixed
  # combination allowed is f32 q over a bf16 cache (KV upcast inside the kernel).
  if q_dtype == jnp.bfloat16 and kv_dtype == jnp.float32:
    raise ValueError("q dtype bfloat16 with kv_pages dtype float32 is not supported; "
                     "cast q to float32 or store the cache in bfloat16")


def pallas_limits(platform: str, *, page_size: int, head_dim: int) -> str | None:
  """Why the Pallas `platform` ("tpu" or "gpu") kernel cannot tile this head_dim and
  page size, or None when it can (the reference backend takes any).

  pallas_tpu: head_dim in `PALLAS_HEAD_DIMS`, page_size in [8, 128]. pallas_gpu: the
  same, with page_size a power of two (Triton blocks).
  """
  if head_dim not in PALLAS_HEAD_DIMS:
    return (f"the Pallas {platform} backend needs head_dim in {PALLAS_HEAD_DIMS}, got "
            f"{head_dim} (the reference backend takes any head_dim)")
  if not PALLAS_MIN_PAGE_SIZE <= page_size <= PALLAS_MAX_PAGE_SIZE:
    return (f"the Pallas {platform} backend needs page_size in [{PALLAS_MIN_PAGE_SIZE}, "
            f"{PALLAS_MAX_PAGE_SIZE}], got {page_size} (the reference backend takes any "
            "page_size >= 1)")
  if platform == "gpu" and page_size & (page_size - 1):
    return (f"the Pallas gpu backend needs a power-of-two page_size, got {page_size} (the "
            "reference backend takes any page_size >= 1)")
  return None


def validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                    sm_scale, sliding_window=None, soft_cap=None, kv_scales=None) -> None:
  """Checks shapes, dtypes and static scalars of a paged-attention call.

  Args: as `ragged_paged_attention_reference`.

  Raises:
    ArgumentTypeError: (a TypeError and a ValueError) an argument that is not an array.
    ValueError: naming the offending argument and its shape/dtype/value.
  """
  check_arrays(q=q, kv_pages=kv_pages, kv_lens=kv_lens, page_indices=page_indices,
               cu_q_lens=cu_q_lens, num_seqs=num_seqs)
  if q.ndim != 3:
    raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
  if kv_pages.ndim != 4:
    raise ValueError(
        "kv_pages must be [num_pages, page_size, 2*num_kv_heads, head_dim], got shape "
        f"{kv_pages.shape}")
  _, num_q_heads, head_dim = q.shape
  num_pages, page_size, num_combined, head_dim_kv = kv_pages.shape
  if num_combined % 2 != 0 or num_combined == 0:
    raise ValueError(
        f"kv_pages.shape[2] = {num_combined} must be 2*num_kv_heads (K and V interleaved)")
  num_kv_heads = num_combined // 2
  if head_dim != head_dim_kv:
    raise ValueError(f"head_dim mismatch: q has {head_dim}, kv_pages has {head_dim_kv}")
  if num_pages < 1:
    raise ValueError(f"kv_pages has no pages (shape {kv_pages.shape})")
  check_attention_config(page_size=page_size, head_dim=head_dim, num_q_heads=num_q_heads,
                         num_kv_heads=num_kv_heads, q_dtype=q.dtype, kv_dtype=kv_pages.dtype)
  check_kv_scales(kv_pages, kv_scales)
  if page_indices.ndim != 2:
    raise ValueError(
        f"page_indices must be i32[max_num_seqs, pages_per_seq], got shape {page_indices.shape}")
  max_num_seqs = page_indices.shape[0]
  if page_indices.shape[1] < 1:
    raise ValueError(f"page_indices has no columns (shape {page_indices.shape})")
  if kv_lens.shape != (max_num_seqs,):
    raise ValueError(
        f"kv_lens shape {kv_lens.shape} must be ({max_num_seqs},) = page_indices.shape[:1]")
  if cu_q_lens.shape != (max_num_seqs + 1,):
    raise ValueError(
        f"cu_q_lens shape {cu_q_lens.shape} must be ({max_num_seqs + 1},) = max_num_seqs + 1")
  if num_seqs.shape != (1,):
    raise ValueError(f"num_seqs shape {num_seqs.shape} must be (1,)")
  for name, arr in (("kv_lens", kv_lens), ("page_indices", page_indices),
                    ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
    if jnp.dtype(arr.dtype) != jnp.int32:
      raise ValueError(f"{name} dtype must be int32, got {arr.dtype}")
  if not isinstance(sm_scale, (int, float)) or isinstance(sm_scale, bool):
    raise ValueError(f"sm_scale must be a Python float, got {sm_scale!r}")
  if sliding_window is not None:
    if (not isinstance(sliding_window, (int, np.integer)) or isinstance(sliding_window, bool)
        or sliding_window <= 0):
      raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
  if soft_cap is not None:
    if not isinstance(soft_cap, (int, float)) or isinstance(soft_cap, bool) or soft_cap <= 0:
      raise ValueError(f"soft_cap must be a positive float or None, got {soft_cap!r}")
