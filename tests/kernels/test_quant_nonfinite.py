"""One non-finite element written into a quantized page stays in its slot (issue 25).

Before: `write_kv` took the page amax over every element, so one inf/NaN made the
page's scale inf/NaN and every earlier token of the page dequantized to NaN (or 0).
Now the scale is the amax of the finite values; +-inf saturates, NaN stays NaN in fp8
(0 in int8, which has no NaN). Attention over the page's live keys -- with the bad
slot masked (past kv_len) and NaN scales on the unused pages -- is unchanged, bit for
bit, on all three backends (interpret mode).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

import prefixcache_kernels as kernels
from kernel_cases import make_case
from test_kernels_quant import quantized_case

SCALE = 1.0 / math.sqrt(64)
QDTYPES = [jnp.int8, jnp.float8_e4m3fn]
BACKENDS = [("reference", False), ("pallas_tpu", True), ("pallas_gpu", True)]


@pytest.mark.parametrize("dtype", QDTYPES, ids=lambda d: jnp.dtype(d).name)
def test_non_finite_elements_are_confined_to_their_slots(dtype):
  case = make_case(4, [(1, 6), (2, 13)], num_kv_heads=2, group=2, page_size=8)
  pages, scales = quantized_case(case, dtype)  # unused pages: NaN scales
  page = int(case.page_indices[0, 0])
  # Slots 6 and 7 of sequence 0's page, past its last key (kv_len 6): masked.
  slots = [page * 8 + 6, page * 8 + 7]
  k = np.zeros((2, 2, 64), np.float32)
  k[0, 1, 5], k[0, 1, 9] = np.inf, -np.inf
  k[1, 0, 3] = np.nan
  v = np.full((2, 2, 64), 1e-3, np.float32)
  v[1, 1, 0] = np.nan
  args = list(case.args())
  outs = {}
  for b, interpret in BACKENDS:
    args[1] = pages
    outs[b] = np.asarray(kernels.paged_attention(*args, sm_scale=SCALE, backend=b,
                                                 interpret=interpret, kv_scales=scales))
    assert np.all(np.isfinite(outs[b][:3]))
  before_pages = np.asarray(pages.astype(jnp.float32))
  before_scales = np.asarray(scales)
  pages2, scales2 = kernels.write_kv(pages, jnp.asarray(k), jnp.asarray(v),
                                     jnp.asarray(slots, jnp.int32), kv_scales=scales)
  s2 = np.asarray(scales2)
  assert np.all(np.isfinite(s2[page])), s2[page]
  np.testing.assert_array_equal(s2[page], before_scales[page])  # 0 / 1e-3 do not raise it
  after = np.asarray(pages2.astype(jnp.float32))
  keep = np.ones(after.shape[:2], bool)
  keep[page, 6:8] = False
  np.testing.assert_array_equal(after[keep], before_pages[keep])  # every other slot
  # +-inf saturates (K of kv head 1 = combined slot 2).
  want = {jnp.int8: (127.0, -128.0), jnp.float8_e4m3fn: (448.0, -448.0)}[dtype]
  assert (after[page, 6, 2, 5], after[page, 6, 2, 9]) == want
  # NaN: NaN in fp8, 0 in int8 (K of kv head 0 = slot 0, V of kv head 1 = slot 3).
  for x in (after[page, 7, 0, 3], after[page, 7, 3, 0]):
    assert (np.isnan(x) if dtype == jnp.float8_e4m3fn else x == 0.0), x
  for b, interpret in BACKENDS:
    args[1] = pages2
    out = np.asarray(kernels.paged_attention(*args, sm_scale=SCALE, backend=b,
                                             interpret=interpret, kv_scales=scales2))
    np.testing.assert_array_equal(out, outs[b])
