"""Quantized KV pages: dtypes, scales, quantize / dequantize.

A quantized cache stores K and V as `float8_e4m3fn` or `int8` in the usual
`kv_pages [num_pages, page_size, 2*num_kv_heads, head_dim]` layout, plus one float32
scale per (page, combined slot): `kv_scales f32[num_pages, 2*num_kv_heads]`, column 2h
the K scale of kv head h, 2h+1 its V scale (the same interleaving as the pages). An
element is `stored * scale` (symmetric; quantized as `round(x / scale)` saturated to
+-QMAX: 448 for e4m3fn, 127 for int8; scale = amax / QMAX of what the page holds).

NOTE: why per-(page, kv head) scales rather than per-head static ones: a static scale
needs a calibration pass per model and clips outliers of tokens it has not seen,
whereas a page scale follows its own 16-ish tokens (the amax of a page is what it
holds, so nothing saturates; fp8 page scales are powers of two, see `page_scale`);
the price is 2 * num_kv_heads * 4 bytes per page per
layer (0.8% of an fp8 page of 16 tokens x head_dim 64) and a requantization when a
write raises a page's amax (see `write_kv`). Pages are the unit the prefix cache shares:
a full page is never written again, so its values and scale are bit-stable while it is
shared, and its scale depends only on its own tokens (a page's scale is reset when its
first slot is written, so a reused page keeps nothing of its previous content).
"""
from __future__ import annotations

import jax.numpy as jnp

# Largest finite magnitude of each quantized dtype (symmetric ranges).
QMAX = {jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.int8): 127.0}
QUANTIZED_KV_DTYPES = tuple(QMAX)


def is_quantized(dtype) -> bool:
  """Whether pages of this dtype need `kv_scales`."""
  return jnp.dtype(dtype) in QMAX


def page_scale(amax, dtype):
  """The scale of a page whose largest magnitude is `amax` (f32 array).

  int8: amax / 127. float8_e4m3fn: amax / 448 rounded up to a power of two (exact,
  via frexp). NOTE: a floating-point format has the same relative precision across
  its normal range, so a power-of-two scale costs e4m3 nothing but the top half
  binade it leaves unused, and it makes rescaling exact: requantizing a page to a
  larger power-of-two scale only shifts exponents, so a page written token by token
  (decode) holds the same bytes as the same page written at once (prefill), and
  prefix caching on or off stores the same pages. int8 keeps amax / 127: a power of
  two would cost up to one of its 8 bits and its rescale rounds anyway.
  """
  dtype = jnp.dtype(dtype)
  s = amax.astype(jnp.float32) / QMAX[dtype]
  if dtype == jnp.int8:
    return s
  mant, exp = jnp.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1)
  return jnp.where(s > 0, jnp.where(mant == 0.5, s, jnp.ldexp(jnp.float32(1), exp)), s)


def quantize(x, scale, dtype):
  """`x / scale` rounded to nearest (ties to even) and saturated, as `dtype`.

  Args:
    x: float array.
    scale: f32 array broadcasting against x; where it is 0 (a page holding zeros)
      the result is 0.
    dtype: a quantized dtype.
  """
  dtype = jnp.dtype(dtype)
  qmax = QMAX[dtype]
  y = x.astype(jnp.float32) / jnp.where(scale > 0, scale, 1.0)
  y = jnp.clip(y, -qmax, qmax)  # NOTE: saturate; e4m3fn has no inf, NaN past 448
  if dtype == jnp.int8:
    y = jnp.round(y)
  return y.astype(dtype)


def dequantize(q, scale):
  """`q * scale` in float32."""
  return q.astype(jnp.float32) * scale


def check_kv_scales(kv_pages, kv_scales) -> None:
  """`kv_scales` goes with a quantized cache and only with one; shape and dtype.

  Raises:
    ValueError: naming the mismatch.
  """
  quantized = is_quantized(kv_pages.dtype)
  if kv_scales is None:
    if quantized:
      raise ValueError(f"kv_pages of dtype {jnp.dtype(kv_pages.dtype).name} are quantized "
                       "and need kv_scales f32[num_pages, 2*num_kv_heads]")
    return
  if not quantized:
    raise ValueError(f"kv_scales given for kv_pages of dtype {jnp.dtype(kv_pages.dtype).name}; "
                     "only float8_e4m3fn and int8 pages carry scales")
  if not (hasattr(kv_scales, "shape") and hasattr(kv_scales, "dtype")):
    raise TypeError(f"kv_scales must be an f32[num_pages, 2*num_kv_heads] array, got "
                    f"{type(kv_scales).__name__}")
  want = (kv_pages.shape[0], kv_pages.shape[2])
  if tuple(kv_scales.shape) != want:
    raise ValueError(f"kv_scales shape {tuple(kv_scales.shape)} must be {want} = "
                     "[num_pages, 2*num_kv_heads] of kv_pages")
  if jnp.dtype(kv_scales.dtype) != jnp.float32:
    raise ValueError(f"kv_scales dtype must be float32, got {kv_scales.dtype}")
