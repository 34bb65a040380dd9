"""Scatter of this step's new K/V into the paged cache."""
from __future__ import annotations

import jax.numpy as jnp


def write_kv(kv_pages, k, v, slot_mapping):
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

  Returns:
    The updated kv_pages, same shape and dtype.

  Raises:
    ValueError: on shape or dtype mismatch.
  """
  if kv_pages.ndim != 4:
    raise ValueError(
        "kv_pages must be [num_pages, page_size, 2*num_kv_heads, head_dim], got shape "
        f"{kv_pages.shape}")
  num_pages, page_size, num_combined, head_dim = kv_pages.shape
  if num_combined % 2:
    raise ValueError(f"kv_pages.shape[2] = {num_combined} must be 2*num_kv_heads")
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
  # [T, num_kv_heads, 2, head_dim] -> [T, 2*num_kv_heads, head_dim]: K at 2h, V at 2h+1.
  kv_new = jnp.stack([k, v], axis=2).reshape(k.shape[0], num_combined, head_dim)
  flat = kv_pages.reshape(num_pages * page_size, num_combined, head_dim)
  # NOTE: mode="drop" makes an out-of-range slot a no-op instead of clamping it onto a
  # live page; the host-side builder checks slots, this is the device-side backstop.
  # jax normalises negative indices (numpy style: -1 is the last slot) BEFORE the drop
  # mode applies, so a negative slot would wrap around onto a live page: map it past
  # the end first.
  num_slots = num_pages * page_size
  slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)
  flat = flat.at[slots].set(kv_new.astype(kv_pages.dtype), mode="drop")
  return flat.reshape(kv_pages.shape)
