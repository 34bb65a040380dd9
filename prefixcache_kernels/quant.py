"""Quantized KV pages: dtypes, scales, quantize / dequantize.

A quantized cache stores K and V as `float8_e4m3fn` or `int8` in the usual
`kv_pages [num_pages, page_size, 2*num_kv_heads, head_dim]` layout, plus one float32
scale per (page, combined slot): `kv_scales f32[num_pages, 2*num_kv_heads]`, column 2h
the K scale of kv head h, 2h+1 its V scale (the same interleaving as the pages). Both
dtypes use power-of-two page scales derived from the largest finite magnitude (amax)
of what the page holds (`page_scale`):

- float8_e4m3fn: an element is `stored * scale`; stored = x / scale rounded to nearest
  (ties to even) on e4m3's normal grid, saturated to +-448, and flushed to zero below
  e4m3's smallest normal (2^-6) -- see `quantize`.
- int8 (mid-rise): an element is `(stored + 0.5) * scale`; stored = floor(x / scale)
  in [-128, 127] (the scale is the smallest power of two with amax < 128 * scale).

NOTE: why per-(page, kv head) scales rather than per-head static ones: a static scale
needs a calibration pass per model and clips outliers of tokens it has not seen,
whereas a page scale follows its own 16-ish tokens (the amax of a page is what it
holds, so nothing saturates); the price is 2 * num_kv_heads * 4 bytes per page per
layer (0.8% of an fp8 page of 16 tokens x head_dim 64) and a requantization when a
write raises a page's amax (see `write_kv`). Pages are the unit the prefix cache shares:
a full page is never written again, so its values and scale are bit-stable while it is
shared, and its scale depends only on its own tokens (a page's scale is reset when its
first slot is written, so a reused page keeps nothing of its previous content).

NOTE: history independence (prefix caching must not change the output). A page is
written in pieces whose split depends on the schedule (chunk boundaries, cache hits);
its bytes must depend only on its final contents. Both rounding rules compose exactly
under a power-of-two rescale: floor(floor(y) / 2^k) == floor(y / 2^k) for int8, and
for e4m3 rounding to 4 significant bits commutes with scaling by 2^-k while the flush
threshold is a fixed grid point, so requantizing to a larger scale (`write_kv`) gives
the bytes a one-shot write at that scale gives. Round-to-nearest int8 with amax/127
scales (the previous scheme) rounds again on each rise and broke this (greedy tokens
differed cache on/off at block 8 with chunks ending inside pages). Cost, measured by
`experiments.kv_quant`: see WORKSPACE_NOTES (int8's step is 1x-2x amax/128 instead
of amax/127, i.e. up to one bit).

Non-finite inputs: the scale ignores them (amax of the finite values), +-inf saturates
to the dtype's extremes, NaN is stored as NaN in fp8 and as 0 in int8 (no NaN code),
so one bad element never poisons the other slots of its page.
"""
from __future__ import annotations

import jax.numpy as jnp

# Largest finite magnitude of each quantized dtype's stored values.
QMAX = {jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.int8): 127.0}
QUANTIZED_KV_DTYPES = tuple(QMAX)


def is_quantized(dtype) -> bool:
  """Whether pages of this dtype need `kv_scales`."""
  return jnp.dtype(dtype) in QMAX


def page_scale(amax, dtype):
  """The power-of-two scale of a page whose largest finite magnitude is `amax` (f32).

  float8_e4m3fn: amax / 448 rounded up to a power of two (amax <= 448 * scale).
  int8: the smallest power of two with amax < 128 * scale, so floor(x / scale) lies in
  [-128, 127] for |x| <= amax. 0 where amax is 0. NOTE: a floating-point format has
  the same relative precision across its normal range, so a power-of-two scale costs
  e4m3 nothing but the top half binade it leaves unused; int8 loses up to one bit
  (its step is in (amax/128, amax/64]) for exact rescaling (see the module notes).
  """
  dtype = jnp.dtype(dtype)
  one = jnp.float32(1)
  if dtype == jnp.int8:
    s = amax.astype(jnp.float32) / 128.0
    _, exp = jnp.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1): 2^exp > s >= 2^(exp-1)
    return jnp.where(s > 0, jnp.ldexp(one, exp), 0.0).astype(jnp.float32)
  s = amax.astype(jnp.float32) / QMAX[dtype]
  mant, exp = jnp.frexp(s)
  return jnp.where(s > 0, jnp.where(mant == 0.5, s, jnp.ldexp(one, exp)), s)


# Smallest normal magnitude of float8_e4m3fn; `quantize` flushes below it.
E4M3_MIN_NORMAL = 2.0 ** -6


def quantize(x, scale, dtype):
  """`x / scale` quantized to `dtype`, saturated (see the module notes).

  int8: floor, clipped to [-128, 127] (read back as `(q + 0.5) * scale`).
  float8_e4m3fn: rounded to nearest (ties to even) to 4 significant bits, clipped to
  +-448, flushed to zero below 2^-6 (so no subnormal is produced: rounding twice
  across a power-of-two rescale then equals rounding once).
  NaN: 0 in int8, NaN in fp8; +-inf: the dtype's extremes.

  Args:
    x: float array.
    scale: f32 array broadcasting against x; where it is 0 (a page holding zeros)
      the result is the quantization of x itself (0 for a zero x).
    dtype: a quantized dtype.
  """
  dtype = jnp.dtype(dtype)
  y = x.astype(jnp.float32) / jnp.where(scale > 0, scale, 1.0)
  if dtype == jnp.int8:
    y = jnp.clip(jnp.floor(y), -128.0, 127.0)
    return jnp.where(jnp.isnan(y), 0.0, y).astype(dtype)
  y = jnp.clip(y, -QMAX[dtype], QMAX[dtype])  # NOTE: saturate; e4m3fn has no inf
  mant, exp = jnp.frexp(y)  # |mant| in [0.5, 1)
  r = jnp.ldexp(jnp.round(mant * 16.0), exp - 4)  # 4 significant bits, ties to even
  r = jnp.where(jnp.isnan(y), y, r)
  r = jnp.where(jnp.abs(r) < E4M3_MIN_NORMAL, 0.0, r)
  return r.astype(dtype)


def dequantize(q, scale):
  """The f32 value of stored `q` at `scale`: `q * scale` (fp8), `(q + 0.5) * scale` (int8)."""
  if jnp.dtype(q.dtype) == jnp.int8:
    return (q.astype(jnp.float32) + 0.5) * scale
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
