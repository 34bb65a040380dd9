"""Quantized KV pages (float8_e4m3fn / int8 with per-(page, kv head) scales).

Accuracy is measured against the float64 oracle of `kernel_cases` on the unquantized
K/V, as `max |out - oracle| / max |oracle|` over live rows (error relative to the
output scale). Documented bounds (`REL_ERROR_BOUND`), with what was measured on these
cases (standard-normal q, K, V; head_dim 64; CPU, reference and interpret modes):

  bfloat16       bound 1.5e-2   measured ~5e-3
  int8           bound 2.5e-2   measured ~1e-2   (64-128 steps per page amax: power-of-two
                                                  scales, floor + half-step read-back)
  float8_e4m3fn  bound 8e-2     measured ~3e-2   (3 mantissa bits: ~2^-4 relative)
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import prefixcache_kernels as kernels
from kernel_cases import make_case, oracle
from prefixcache_kernels.quant import QMAX, dequantize, page_scale

SCALE = 1.0 / math.sqrt(64)
QDTYPES = [jnp.int8, jnp.float8_e4m3fn]
REL_ERROR_BOUND = {jnp.dtype(jnp.bfloat16): 1.5e-2, jnp.dtype(jnp.int8): 2.5e-2,
                   jnp.dtype(jnp.float8_e4m3fn): 8e-2}
SEQS = [(1, 21), (9, 9), (4, 30), (1, 3)]  # decode, fresh prefill, chunk over a prefix


def live_slots(case):
  """(slots i32[N], k f32[N, Hkv, D], v) of every live token of the case, in order."""
  page_size = case.kv_pages.shape[1]
  slots, ks, vs = [], [], []
  for s, (_, kv_len) in enumerate(case.seqs):
    for t in range(kv_len):
      slots.append(case.page_indices[s, t // page_size] * page_size + t % page_size)
      ks.append(case.k_seq[s][t])
      vs.append(case.v_seq[s][t])
  return (np.asarray(slots, np.int32), np.stack(ks).astype(np.float32),
          np.stack(vs).astype(np.float32))


def quantized_case(case, dtype, *, poison=True):
  """(kv_pages, kv_scales) holding the case's live K/V, written in one write_kv call.

  With `poison`, every slot no live token holds is NaN (fp8 has NaN; int8 does not,
  its unused slots keep 127s) and so is every scale of an unused page.
  """
  num_pages, page_size, combined, head_dim = case.kv_pages.shape
  slots, k, v = live_slots(case)
  pages = jnp.zeros(case.kv_pages.shape, dtype)
  scales = jnp.zeros((num_pages, combined), jnp.float32)
  pages, scales = kernels.write_kv(pages, jnp.asarray(k), jnp.asarray(v),
                                   jnp.asarray(slots), kv_scales=scales)
  if not poison:
    return pages, scales
  used = np.zeros(num_pages * page_size, bool)
  used[slots] = True
  fill = np.nan if jnp.dtype(dtype) == jnp.float8_e4m3fn else 127
  pages = np.array(pages.astype(jnp.float32)).reshape(num_pages * page_size, combined, head_dim)
  pages[~used] = fill
  pages = jnp.asarray(pages.reshape(case.kv_pages.shape)).astype(dtype)
  scales = np.array(scales)
  scales[~used.reshape(num_pages, page_size).any(axis=1)] = np.nan
  return pages, jnp.asarray(scales)


def rel_error(case, out):
  ref = oracle(case, sm_scale=SCALE)
  live = case.num_live_tokens
  out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
  assert np.all(np.isfinite(out)), "non-finite output (an unused slot or scale leaked)"
  np.testing.assert_array_equal(out[live:], 0.0)
  return np.abs(out[:live] - ref[:live]).max() / np.abs(ref[:live]).max()


BACKENDS = [("reference", False), ("pallas_tpu", True), ("pallas_gpu", True)]


@pytest.mark.parametrize("dtype", QDTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("backend,interpret", BACKENDS, ids=[b for b, _ in BACKENDS])
def test_quantized_attention_within_documented_bound_of_float64_oracle(backend, interpret,
                                                                       dtype):
  case = make_case(1, SEQS, num_kv_heads=2, group=2, page_size=8)
  pages, scales = quantized_case(case, dtype)
  args = list(case.args())
  args[1] = pages
  out = kernels.paged_attention(*args, sm_scale=SCALE, backend=backend,
                                interpret=interpret, kv_scales=scales)
  assert out.dtype == case.q.dtype
  err = rel_error(case, out)
  assert err <= REL_ERROR_BOUND[jnp.dtype(dtype)], err
  # Quantization, not the kernel, is the error: every backend equals the reference
  # over the same pages to f32 rounding.
  if backend != "reference":
    ref = kernels.paged_attention(*args, sm_scale=SCALE, backend="reference", kv_scales=scales)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_error_ordering_and_bf16_baseline():
  """bf16 < int8 < fp8 on the same case, each within its bound (the documented table)."""
  case = make_case(2, SEQS, num_kv_heads=2, group=2, page_size=8)
  errs = {}
  for dtype in QDTYPES:
    pages, scales = quantized_case(case, dtype)
    args = list(case.args())
    args[1] = pages
    errs[jnp.dtype(dtype)] = rel_error(case, kernels.paged_attention(
        *args, sm_scale=SCALE, backend="reference", kv_scales=scales))
  args = list(case.args())
  args[1] = jnp.asarray(case.kv_pages).astype(jnp.bfloat16)
  errs[jnp.dtype(jnp.bfloat16)] = rel_error(case, kernels.paged_attention(
      *args, sm_scale=SCALE, backend="reference"))
  for dtype, err in errs.items():
    assert err <= REL_ERROR_BOUND[dtype], (dtype, err)
  bf16, i8, f8 = (errs[jnp.dtype(d)] for d in (jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn))
  assert bf16 < i8 < f8, errs


@pytest.mark.parametrize("dtype", QDTYPES, ids=lambda d: jnp.dtype(d).name)
def test_write_kv_quantizes_with_power_of_two_page_scales(dtype):
  rng = np.random.default_rng(0)
  num_pages, page_size, kv_heads, head_dim = 3, 8, 2, 64
  k = rng.standard_normal((page_size, kv_heads, head_dim)).astype(np.float32) * 3
  v = rng.standard_normal((page_size, kv_heads, head_dim)).astype(np.float32)
  pages = jnp.zeros((num_pages, page_size, 2 * kv_heads, head_dim), dtype)
  scales = jnp.zeros((num_pages, 2 * kv_heads), jnp.float32)
  slots = jnp.arange(page_size, 2 * page_size, dtype=jnp.int32)  # page 1
  pages, scales = kernels.write_kv(pages, jnp.asarray(k), jnp.asarray(v), slots,
                                   kv_scales=scales)
  qmax = QMAX[jnp.dtype(dtype)]
  want = np.stack([np.abs(k).max(axis=(0, 2)), np.abs(v).max(axis=(0, 2))], 1).reshape(-1)
  if jnp.dtype(dtype) == jnp.float8_e4m3fn:  # amax / 448 rounded up to a power of two
    want = 2.0 ** np.ceil(np.log2(want / qmax))
  else:  # the smallest power of two with amax < 128 * scale
    want = 2.0 ** (np.floor(np.log2(want / 128)) + 1)
  np.testing.assert_allclose(np.asarray(scales[1]), want, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(scales)[[0, 2]], 0.0)
  stored = np.asarray(pages[1].astype(jnp.float32))
  assert np.abs(stored).max() <= (128 if jnp.dtype(dtype) == jnp.int8 else qmax)
  deq = np.asarray(dequantize(pages[1], scales[1][None, :, None]))
  x = np.stack([k, v], 2).reshape(page_size, 2 * kv_heads, head_dim)
  s = np.asarray(scales[1])[None, :, None]
  if jnp.dtype(dtype) == jnp.int8:
    np.testing.assert_array_equal(stored, np.floor(x / s))  # mid-rise: read (q + .5) s
    assert np.all(np.abs(deq - x) <= 0.5 * s * (1 + 1e-6))
  else:  # e4m3: 3 mantissa bits, half an ulp relative; below 2^-6 s flushed to zero
    assert np.all(np.abs(deq - x) <= np.maximum(np.abs(x) / 16, s * 2.0 ** -6) * (1 + 1e-6))


@pytest.mark.parametrize("dtype", QDTYPES, ids=lambda d: jnp.dtype(d).name)
def test_incremental_writes_requantize_and_full_pages_stay_bit_stable(dtype):
  """Decode-style writes (one token a step, growing amax) requantize the page, and the
  result equals a one-shot write byte for byte (both dtypes: power-of-two rescales are
  exact); a full page that is not written again never changes while other pages are."""
  rng = np.random.default_rng(3)
  page_size, kv_heads, head_dim = 8, 1, 64
  pages = jnp.zeros((4, page_size, 2 * kv_heads, head_dim), dtype)
  scales = jnp.zeros((4, 2 * kv_heads), jnp.float32)
  # Page 0 full, written in one call; then page 2 token by token with a rising amax.
  full = rng.standard_normal((page_size, kv_heads, head_dim)).astype(np.float32)
  pages, scales = kernels.write_kv(pages, jnp.asarray(full), jnp.asarray(-full),
                                   jnp.arange(page_size, dtype=jnp.int32), kv_scales=scales)
  page0, scale0 = np.asarray(pages[0].astype(jnp.float32)), np.asarray(scales[0])
  write = jax.jit(kernels.write_kv)
  toks = rng.standard_normal((page_size, kv_heads, head_dim)).astype(np.float32)
  toks *= np.linspace(0.2, 3.0, page_size)[:, None, None]  # amax rises most steps
  rises = np.zeros(2 * kv_heads, int)
  for t in range(page_size):
    before = np.asarray(scales[2])
    pages, scales = write(pages, jnp.asarray(toks[t:t + 1]), jnp.asarray(toks[t:t + 1]),
                          jnp.asarray([2 * page_size + t], jnp.int32), kv_scales=scales)
    rises += (np.asarray(scales[2]) > before) & (before > 0)
    np.testing.assert_array_equal(np.asarray(pages[0].astype(jnp.float32)), page0)
    np.testing.assert_array_equal(np.asarray(scales[0]), scale0)
  assert rises.min() >= 3  # the requantization path really ran
  s = np.asarray(scales[2])
  deq = np.asarray(dequantize(pages[2], scales[2][None, :, None]))
  x = np.concatenate([toks, toks], axis=1)
  err = np.abs(deq - x).max(axis=(0, 2))
  p1, s1 = kernels.write_kv(jnp.zeros_like(pages), jnp.asarray(toks), jnp.asarray(toks),
                            jnp.arange(page_size, dtype=jnp.int32),
                            kv_scales=jnp.zeros_like(scales))
  np.testing.assert_allclose(np.asarray(s1[0]), s, rtol=1e-6)  # same final scale
  one = np.asarray(p1[0].astype(jnp.float32))
  inc = np.asarray(pages[2].astype(jnp.float32))
  np.testing.assert_array_equal(inc, one)  # history-independent bytes
  if jnp.dtype(dtype) == jnp.int8:
    assert np.all(err <= 0.5 * s * (1 + 1e-6)), (err, s)
  else:
    assert np.all(err <= np.abs(x).max() / 16), err


def test_page_scales_are_powers_of_two():
  amax = jnp.asarray([0.0, 448.0, 449.0, 1.0, 896.0, 3e-3], jnp.float32)
  got = np.asarray(page_scale(amax, jnp.float8_e4m3fn))
  np.testing.assert_array_equal(got, [0.0, 1.0, 2.0, 2.0 ** -8, 2.0, 2.0 ** -17])
  # int8: amax < 128 * scale strictly (448 / 128 = 3.5 -> 4; 1 / 128 = 2^-7 -> 2^-6).
  np.testing.assert_array_equal(np.asarray(page_scale(amax, jnp.int8)),
                                [0.0, 4.0, 4.0, 2.0 ** -6, 8.0, 2.0 ** -15])


def test_first_slot_write_resets_a_reused_page_scale():
  big = jnp.full((8, 1, 64), 50.0)
  small = jnp.full((1, 1, 64), 0.5)
  pages = jnp.zeros((2, 8, 2, 64), jnp.int8)
  scales = jnp.zeros((2, 2), jnp.float32)
  pages, scales = kernels.write_kv(pages, big, big, jnp.arange(8, dtype=jnp.int32),
                                   kv_scales=scales)
  # The page is freed and holds a new block: its offset 0 is written again.
  pages, scales = kernels.write_kv(pages, small, small, jnp.asarray([0], jnp.int32),
                                   kv_scales=scales)
  np.testing.assert_array_equal(np.asarray(scales[0]), 2.0 ** -7)  # 0.5 < 128 * 2^-7
  assert int(pages[0, 0, 0, 0]) == 64
  # A write at a later offset keeps the page's scale (and its entries).
  pages, scales = kernels.write_kv(pages, small / 2, small / 2, jnp.asarray([1], jnp.int32),
                                   kv_scales=scales)
  np.testing.assert_array_equal(np.asarray(scales[0]), 2.0 ** -7)
  assert int(pages[0, 0, 0, 0]) == 64 and int(pages[0, 1, 0, 0]) == 32


def test_quantized_bad_inputs():
  case = make_case(0, [(1, 5)], page_size=8)
  args = list(case.args())
  args[1] = jnp.zeros(case.kv_pages.shape, jnp.int8)
  with pytest.raises(ValueError, match="need kv_scales"):
    kernels.paged_attention(*args, sm_scale=SCALE, backend="reference")
  with pytest.raises(ValueError, match=r"kv_scales shape \(3, 2\) must be"):
    kernels.paged_attention(*args, sm_scale=SCALE, backend="reference",
                            kv_scales=jnp.zeros((3, 2), jnp.float32))
  with pytest.raises(ValueError, match="kv_scales dtype must be float32"):
    kernels.paged_attention(*args, sm_scale=SCALE, backend="reference",
                            kv_scales=jnp.zeros(args[1].shape[::2][:2], jnp.bfloat16))
  args[1] = jnp.asarray(case.kv_pages)
  with pytest.raises(ValueError, match="only float8_e4m3fn and int8 pages carry scales"):
    kernels.paged_attention(*args, sm_scale=SCALE, backend="reference",
                            kv_scales=jnp.zeros((case.kv_pages.shape[0], 2), jnp.float32))
  k = jnp.zeros((1, 1, 64))
  with pytest.raises(ValueError, match="need kv_scales"):
    kernels.write_kv(jnp.zeros((2, 8, 2, 64), jnp.float8_e4m3fn), k, k,
                     jnp.asarray([0], jnp.int32))
  with pytest.raises(ValueError, match="kv_pages dtype float16 not supported"):
    kernels.paged_attention(q=args[0], kv_pages=args[1].astype(jnp.float16), kv_lens=args[2],
                            page_indices=args[3], cu_q_lens=args[4], num_seqs=args[5],
                            sm_scale=SCALE, backend="reference")


def test_check_backend_config_quantized():
  kw = dict(page_size=16, head_dim=64, num_q_heads=4, num_kv_heads=2, q_dtype=jnp.float32)
  # fp8 pages: compiled pallas_gpu needs sm_89+ (Triton's e4m3).
  with pytest.raises(ValueError, match=(r"the Pallas gpu backend needs compute capability "
                                        r"8\.9.*float8_e4m3fn.*8\.0")):
    kernels.check_backend_config("pallas_gpu", platform="gpu", compute_capability="8.0",
                                 kv_dtype=jnp.float8_e4m3fn, **kw)
  assert kernels.check_backend_config("pallas_gpu", platform="gpu", compute_capability="9.0",
                                      kv_dtype=jnp.float8_e4m3fn, **kw) == "pallas_gpu"
  assert kernels.check_backend_config("pallas_gpu", platform="gpu", compute_capability="8.0",
                                      kv_dtype=jnp.int8, **kw) == "pallas_gpu"
  assert kernels.check_backend_config("pallas_gpu", interpret=True, platform="cpu",
                                      kv_dtype=jnp.float8_e4m3fn, **kw) == "pallas_gpu"
  for dtype in (jnp.int8, jnp.float8_e4m3fn):
    assert kernels.check_backend_config("reference", kv_dtype=dtype, **kw) == "reference"
    assert kernels.check_backend_config("pallas_tpu", interpret=True, kv_dtype=dtype,
                                        **kw) == "pallas_tpu"
  with pytest.raises(ValueError, match="kv_pages dtype int4 not supported"):
    kernels.check_backend_config("reference", kv_dtype=jnp.int4, **kw)
