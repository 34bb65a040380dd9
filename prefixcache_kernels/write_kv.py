"""Scatter of this step's new K/V into the paged cache."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from prefixcache_kernels.common import check_arrays, check_padding_page
from prefixcache_kernels.quant import check_kv_scales, page_scale, quantize


def write_kv(kv_pages, k, v, slot_mapping, kv_scales=None, *, num_blocks=None):
  """Writes each token's K/V into its slot `page * page_size + offset`.

  Pure functional update (`.at[].set`): jit the caller with `donate_argnums` on
  `kv_pages` and XLA updates the cache in place.

  Args:
    kv_pages: [num_pages, page_size, 2*num_kv_heads, head_dim]; K of kv-head h at slot
      2h, V at 2h+1.
    k: [num_tokens, num_kv_heads, head_dim], cast to kv_pages' dtype.
    v: [num_tokens, num_kv_heads, head_dim], cast to kv_pages' dtype.
    slot_mapping: i32[num_tokens], in [0, num_pages * page_size). Padding tokens point
      into the padding page (the last page by convention); several padding tokens may
      share a slot, whose content is then unspecified. A slot outside that range --
      negative ones included -- writes nothing (values cannot raise inside jit; the
      host-side MetadataBuilder rejects block ids outside the pool before a step).

    kv_scales: None for float32 / bfloat16 pages (the write casts). For float8_e4m3fn
      / int8 pages, their f32[num_pages, 2*num_kv_heads] scales (`kernels.quant`):
      the write quantizes, and a page's scales become max(old, page_scale(amax of the
      finite values this step writes into it)) per K/V of a kv head (powers of two,
      `kernels.quant.page_scale`). A page whose scale rises has its existing entries
      requantized to the new scale in the same call (only when some page's scale
      rises: a `lax.cond`). The rescale is exact for both dtypes (`kernels.quant`'s
      notes), so a page's bytes and scales depend only on its final contents, not on
      how its tokens were split over calls: a page written token by token holds the
      same bytes as one written at once, and prefix caching on or off stores the same
      pages. A non-finite element does not reach the scale: +-inf saturates, NaN is
      stored as NaN (fp8) or 0 (int8), and the page's other slots are unchanged. A page
      whose first slot (offset 0) is written starts over: its old scale is dropped,
      since the allocator only writes offset 0 of a page that holds a new block.

    num_blocks: static int or None; when given, `kv_pages` must have `num_blocks + 1`
      pages (the allocatable blocks and the padding page; `MetadataBuilder.num_pages`).

  Returns:
    The updated kv_pages, same shape and dtype; with kv_scales, the pair
    (kv_pages, kv_scales).

  Raises:
    ArgumentTypeError: (a TypeError and a ValueError) an argument that is not an array.
    ValueError: on shape or dtype mismatch, or a missing padding page.
  """
  check_arrays(kv_pages=kv_pages, k=k, v=v, slot_mapping=slot_mapping)
  if kv_pages.ndim != 4:
    raise ValueError(
        "kv_pages must be [num_pages, page_size, 2*num_kv_heads, head_dim], got shape "
        f"{kv_pages.shape}")
  num_pages, page_size, num_combined, head_dim = kv_pages.shape
  if num_combined % 2:
    raise ValueError(f"kv_pages.shape[2] = {num_combined} must be 2*num_kv_heads")
  check_padding_page(kv_pages, num_blocks)
  num_kv_heads = num_combined // 2
  if k.ndim != 3 or k.shape[1:] != (num_kv_heads, head_dim):
    raise ValueError(
        f"k shape {k.shape} must be [num_tokens, {num_kv_heads}, {head_dim}] to match "
        f"kv_pages {kv_pages.shape}")
  if v.shape != k.shape:
    raise ValueError(f"v shape {v.shape} must equal k shape {k.shape}")
  if slot_mapping.shape != (k.shape[0],):
    raise ValueError(
        f"slot_mapping shape {slot_mapping.shape} must be ({k.shape[0]},) = num_tokens")
  if jnp.dtype(slot_mapping.dtype) != jnp.int32:
    raise ValueError(f"slot_mapping dtype must be int32, got {slot_mapping.dtype}")
  for name, x in (("k", k), ("v", v)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} dtype must be floating, got {x.dtype}")
  check_kv_scales(kv_pages, kv_scales)
  if kv_scales is not None:
    return _write_quantized(kv_pages, kv_scales, k, v, slot_mapping)
  # [T, num_kv_heads, 2, head_dim] -> [T, 2*num_kv_heads, head_dim]: K at 2h, V at 2h+1.
  kv_new = jnp.stack([k, v], axis=2).reshape(k.shape[0], num_combined, head_dim)
  flat = kv_pages.reshape(num_pages * page_size, num_combined, head_dim)
  flat = _set_rows(flat, slot_mapping, kv_new.astype(kv_pages.dtype))
  return flat.reshape(kv_pages.shape)


def _set_rows(rows, index, values):
  """`rows` with row `index[t]` set to `values[t]`; an index outside [0, len(rows))
  (negative ones included) writes nothing.

  Args:
    rows: [R, ...] the buffer (donated by the caller's jit: updated in place).
    index: i32[T] row per value.
    values: [T, ...] in rows' dtype.

  NOTE: XLA rewrites a scatter of one row (T = 1: a batch-1 decode step) into a
  `dynamic_update_slice`, which its fusion pass then duplicates into each consumer of
  the updated buffer (the attention's page gather and the returned cache); each copy
  needs a copy of the whole buffer first: for the scanned step four copies of the KV
  pool per layer, a step 10x slower. One row is therefore written as two identical
  rows (the same index and value twice: a well-defined scatter XLA keeps as one, in
  place).
  """
  num_rows = rows.shape[0]
  if index.shape[0] == 1:
    index = jnp.concatenate([index, index])
    values = jnp.concatenate([values, values])
  # NOTE: mode="drop" makes an out-of-range slot a no-op instead of clamping it onto a
  # live page; the host-side builder checks slots, this is the device-side backstop.
  # jax normalises negative indices (numpy style: -1 is the last slot) BEFORE the drop
  # mode applies, so a negative slot would wrap around onto a live page: map it past
  # the end first.
  index = jnp.where(index < 0, num_rows, index)
  return rows.at[index].set(values, mode="drop")


def _write_quantized(kv_pages, kv_scales, k, v, slot_mapping):
  """`write_kv` into quantized pages; returns (kv_pages, kv_scales)."""
  num_pages, page_size, num_combined, head_dim = kv_pages.shape
  num_tokens = k.shape[0]
  f32 = jnp.float32
  kv_new = jnp.stack([k.astype(f32), v.astype(f32)], axis=2).reshape(
      num_tokens, num_combined, head_dim)
  num_slots = num_pages * page_size
  valid = (slot_mapping >= 0) & (slot_mapping < num_slots)
  page = jnp.where(valid, slot_mapping // page_size, num_pages)  # num_pages: dropped
  first = valid & (slot_mapping % page_size == 0)
  fresh = jnp.zeros((num_pages,), jnp.int32).at[page].max(first.astype(jnp.int32),
                                                            mode="drop") > 0
  old = jnp.where(fresh[:, None], 0.0, kv_scales)
  # NOTE: the amax of the finite values only: one inf/NaN element must not make the
  # page's scale non-finite (that would turn every other slot of the page into NaN).
  tok_amax = jnp.max(jnp.where(jnp.isfinite(kv_new), jnp.abs(kv_new), 0.0), axis=-1)  # [T, C]
  page_amax = jnp.zeros_like(kv_scales).at[page].max(tok_amax, mode="drop")
  new = jnp.maximum(old, page_scale(page_amax, kv_pages.dtype))
  page_c = jnp.minimum(page, num_pages - 1)

  def requantize(pages):
    # NOTE: every page this step touches is rewritten (duplicates write identical
    # values); a page whose scale did not change maps q -> q exactly (factor 1), a
    # fresh page (old scale 0) to zeros. factor is a power of two (both scales are),
    # and `quantize` at scale 1 re-rounds exactly as a one-shot write would.
    factor = jnp.where(new > 0, old / jnp.where(new > 0, new, 1.0), 0.0)[page_c]  # [T, C]
    vals = pages[page_c].astype(f32) * factor[:, None, :, None]
    vals = quantize(vals, jnp.ones((), f32), pages.dtype)
    return _set_rows(pages, page, vals)

  rises = jnp.any((new > old) & (old > 0))
  kv_pages = lax.cond(rises, requantize, lambda pages: pages, kv_pages)
  q_new = quantize(kv_new, new[page_c][:, :, None], kv_pages.dtype)
  flat = kv_pages.reshape(num_slots, num_combined, head_dim)
  flat = _set_rows(flat, jnp.where(valid, slot_mapping, num_slots), q_new)
  return flat.reshape(kv_pages.shape), new
