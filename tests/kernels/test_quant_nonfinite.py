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

import kernels
from kernel_cases import make_case
from test_kernels_quant import quantized_case

SCALE = 1.0 / math.sqrt(64)
QDTYPES = [jnp.int8, jnp.float8_e4m3fn]
BACKENDS = [("reference", False), ("pallas_tpu", True), ("pallas_gpu", True)]


@pytest.mark.parametrize("bad", [np.inf, np.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("dtype", QDTYPES, ids=lambda d: jnp.dtype(d).name)
def test_non_finite_element_is_confined_to_its_slot(dtype, bad):
  case = make_case(4, [(1, 6), (2, 13)], num_kv_heads=2, group=2, page_size=8)
  pages, scales = quantized_case(case, dtype)  # unused pages: NaN scales
  page = int(case.page_indices[0, 0])
  slot = page * 8 + 6  # right after sequence 0's last key: masked (kv_len 6)
  k = np.zeros((1, 2, 64), np.float32)
  k[0, 1, 5] = bad
  k[0, 1, 9] = -bad  # -inf (NaN: NaN again)
  v = np.full((1, 2, 64), 1e-3, np.float32)
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
                                     jnp.asarray([slot], jnp.int32), kv_scales=scales)
  s2 = np.asarray(scales2)
  assert np.all(np.isfinite(s2[page])), s2[page]
  np.testing.assert_array_equal(s2[page], before_scales[page])  # 0 / 1e-3 do not raise it
  after = np.asarray(pages2.astype(jnp.float32))
  keep = np.ones(after.shape[:2], bool)
  keep[page, 6] = False
  np.testing.assert_array_equal(after[keep], before_pages[keep])  # every other slot
  stored = after[page, 6, 2, 5]  # K of kv head 1, element 5
  if np.isnan(bad):
    assert (np.isnan(stored) if dtype == jnp.float8_e4m3fn else stored == 0.0), stored
  else:
    want = {jnp.int8: (127.0, -128.0), jnp.float8_e4m3fn: (448.0, -448.0)}[dtype]
    assert (stored, after[page, 6, 2, 9]) == want  # saturated
  for b, interpret in BACKENDS:
    args[1] = pages2
    out = np.asarray(kernels.paged_attention(*args, sm_scale=SCALE, backend=b,
                                             interpret=interpret, kv_scales=scales2))
    np.testing.assert_array_equal(out, outs[b])
