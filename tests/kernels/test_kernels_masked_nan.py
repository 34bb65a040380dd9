"""Masked KV slots never reach the output, whatever bits they hold.

Every backend reads more KV than a row attends to: (a) the tail of a sequence's last
page past kv_len, (b) keys before a sliding window -- in the engine the block-table
entries a hybrid model released point at the padding page, or at blocks reused by
other requests --, (c) block-table entries past a sequence's pages, and (d) on
quantized caches the scales of pages no live key is in. A softmax weight of 0 times
NaN is still NaN, so here every such slot holds NaN, +inf or -inf (and every such
scale), and the output must be finite and equal, bit for bit, to the run with those
slots (and scales) zeroed, and close to the float64 oracle.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

import prefixcache_kernels as kernels
from kernel_cases import make_case, oracle
from test_kernels_quant import REL_ERROR_BOUND, quantized_case

SCALE = 1.0 / math.sqrt(64)
WINDOW = 6
# Window 6, pages of 8 keys, after `masked_table`:
#   (1, 46): the decode row (position 45) sees keys 40..45; pages 0..4 lie wholly before
#     the window (-> padding page) and page 4 shares a 2-page KV block with page 5.
#   (5, 19): rows at 14..18 see keys from 9 on: page 0 -> padding page, slot 8 masked.
#   (0, 7): a row scheduled nothing this step.
#   (3, 11): rows at 8..10 see keys from 3 on: slots 0..2 of page 0 masked.
#   (1, 3): all of its keys in the window.
SEQS = [(1, 46), (5, 19), (0, 7), (3, 11), (1, 3)]
# Small tiles: several query blocks, KV blocks of 2 pages, 2 KV splits.
TILES = {"reference": {},
         "pallas_tpu": dict(interpret=True, block_sizes=kernels.TPUBlockSizes(
             num_q_per_block=8, num_kv_pages_per_block=2)),
         "pallas_gpu": dict(interpret=True, block_sizes=kernels.GPUBlockSizes(
             num_q_per_block=4, num_kv_pages_per_block=2, k_splits=2))}
BACKENDS = list(TILES)


def masked_table(case, window):
  """(page_indices, visible) for the case with every masked slot made explicit.

  Blocks wholly before a sequence's window point at the padding page (the last page);
  entries past a sequence's pages cycle through the pages no live key is in (the
  padding page, the spare pages and the released ones). `visible` is bool[num_pages *
  page_size]: the slots holding a key some query row of its sequence can see.
  """
  num_pages, page_size = case.kv_pages.shape[:2]
  table = case.page_indices.copy()
  spans = []
  for s, (q_len, kv_len) in enumerate(case.seqs):
    lo = 0 if window is None else max(0, kv_len - q_len - window + 1)
    table[s, :lo // page_size] = num_pages - 1
    spans.append((lo, kv_len))
  held = {int(table[s, t // page_size]) for s, (lo, hi) in enumerate(spans)
          for t in range(lo, hi)}
  spare = [p for p in range(num_pages) if p not in held]
  assert num_pages - 1 in spare and len(spare) >= 3
  for s, (_, kv_len) in enumerate(case.seqs):
    for i, col in enumerate(range(-(-kv_len // page_size), table.shape[1])):
      table[s, col] = spare[(s + i) % len(spare)]
  visible = np.zeros(num_pages * page_size, bool)
  for s, (lo, hi) in enumerate(spans):
    for t in range(lo, hi):
      visible[table[s, t // page_size] * page_size + t % page_size] = True
  return table, visible


def nonfinite(shape):
  """f32 array of `shape` [..., n, d]: NaN, +inf, -inf cycling over the leading axes."""
  idx = np.indices(shape[:-1]).sum(axis=0)
  return np.broadcast_to(np.array([np.nan, np.inf, -np.inf], np.float32)[idx % 3][..., None],
                         shape)


def planted_pages(pages, visible, fill):
  """Copy of `pages` with every slot outside `visible` set to `fill`: "zero", or
  "nonfinite" (NaN / +inf / -inf; int8, which has none of them: +127 / -127)."""
  flat = np.array(jnp.asarray(pages).astype(jnp.float32)).reshape(
      visible.size, *pages.shape[2:])
  bad = nonfinite(flat[~visible].shape) if fill == "nonfinite" else 0.0
  if fill == "nonfinite" and jnp.dtype(pages.dtype) == jnp.int8:
    bad = np.where(np.isnan(bad) | (bad > 0), 127.0, -127.0)
  flat[~visible] = bad
  return jnp.asarray(flat.reshape(pages.shape)).astype(pages.dtype)


def run(case, table, pages, backend, window, kv_scales=None):
  args = list(case.args())
  args[1], args[3] = pages, jnp.asarray(table)
  out = kernels.paged_attention(*args, sm_scale=SCALE, sliding_window=window,
                                backend=backend, kv_scales=kv_scales, **TILES[backend])
  return np.asarray(jnp.asarray(out).astype(jnp.float32))


def check_against_zeroed(case, poisoned, zeroed, window):
  """Finite, bit-equal to the zeroed run, padding rows 0; returns (live out, oracle)."""
  assert np.all(np.isfinite(poisoned)), "a masked NaN / inf slot reached the output"
  np.testing.assert_array_equal(poisoned, zeroed)
  live = case.num_live_tokens
  np.testing.assert_array_equal(poisoned[live:], 0.0)
  return poisoned[:live], oracle(case, sm_scale=SCALE, sliding_window=window)[:live]


@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "window"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_slots_with_nan_and_inf_never_contribute(backend, window):
  case = make_case(11, SEQS, num_kv_heads=2, group=2, extra_pages=2)
  table, visible = masked_table(case, window)
  if window is not None:  # whole pages before the window really point at the padding page
    assert (table[0, :5] == case.kv_pages.shape[0] - 1).all()
  outs = {fill: run(case, table, planted_pages(case.kv_pages, visible, fill), backend, window)
          for fill in ("nonfinite", "zero")}
  out, ref = check_against_zeroed(case, outs["nonfinite"], outs["zero"], window)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_masked_slots_and_scales_never_contribute(backend, dtype):
  # Live keys quantized as write_kv stores them; then every masked slot (fp8: NaN /
  # inf; int8 has neither: +-127) and the scales of every page no visible key is in
  # (NaN / inf) are planted, against the same with zeros.
  case = make_case(12, SEQS, num_kv_heads=2, group=2, extra_pages=2)
  table, visible = masked_table(case, WINDOW)
  pages, scales = quantized_case(case, dtype, poison=False)
  unseen = ~visible.reshape(pages.shape[:2]).any(axis=1)
  assert unseen.sum() >= 3  # the padding page, spare and released pages
  outs = {}
  for fill in ("nonfinite", "zero"):
    s = np.array(scales)
    s[unseen] = nonfinite(s[unseen].shape + (1,))[..., 0] if fill == "nonfinite" else 0.0
    outs[fill] = run(case, table, planted_pages(pages, visible, fill), backend, WINDOW,
                     kv_scales=jnp.asarray(s))
  out, ref = check_against_zeroed(case, outs["nonfinite"], outs["zero"], WINDOW)
  assert np.abs(out - ref).max() / np.abs(ref).max() <= REL_ERROR_BOUND[jnp.dtype(dtype)]
