"""Decode results agree with jax's own Pallas paged-attention kernels (interpret mode).

jax's kernels take K and V as separate `[num_kv_heads, num_pages, page_size, head_dim]`
arrays, have no sm_scale (q is pre-scaled here) and no causal offset (decode only).
They are not NaN-safe (masked weights multiply V), so unused slots are zeros here; the
NaN-poisoned cases live in test_kernels_attention.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.gpu import paged_attention as jax_gpu_paged
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as jax_tpu_paged

import prefixcache_kernels as kernels
from kernel_cases import make_case

SCALE = 0.125
# Four decode rows, lengths not page multiples; pages_per_seq = 4 (divisible by the
# jax kernels' compute block and split counts below).
SEQS = [(1, 13), (1, 8), (1, 1), (1, 30)]


@functools.lru_cache(maxsize=None)
def _decode_case():
  case = make_case(30, SEQS, num_kv_heads=2, group=4, page_size=8, max_num_seqs=4,
                   pages_per_seq=4, num_tokens=4, garbage_padding_rows=False)
  case.kv_pages = np.nan_to_num(case.kv_pages, nan=0.0)
  return case


def _split_layout(case):
  """[pages, page_size, 2*Hkv, D] -> K, V as [Hkv, pages, page_size, D]."""
  kv = jnp.asarray(case.kv_pages)
  return kv[:, :, 0::2].transpose(2, 0, 1, 3), kv[:, :, 1::2].transpose(2, 0, 1, 3)


def _ours(case, backend):
  return np.asarray(kernels.paged_attention(*case.args(), sm_scale=SCALE, backend=backend,
                                            interpret=True))


@functools.lru_cache(maxsize=None)
def _jax_tpu():
  case = _decode_case()
  k_pages, v_pages = _split_layout(case)
  with pltpu.force_tpu_interpret_mode():
    out = jax_tpu_paged(jnp.asarray(case.q) * SCALE, k_pages, v_pages,
                        jnp.asarray(case.kv_lens), jnp.asarray(case.page_indices),
                        pages_per_compute_block=2)
  return np.asarray(out)


@functools.lru_cache(maxsize=None)
def _jax_gpu():
  case = _decode_case()
  k_pages, v_pages = _split_layout(case)
  # Its dots take the default precision: TF32 on a GPU (interpret mode runs there too).
  with jax.default_matmul_precision("highest"):
    out = jax_gpu_paged.paged_attention(
        jnp.asarray(case.q) * SCALE, k_pages, v_pages, jnp.asarray(case.page_indices),
        jnp.asarray(case.kv_lens), block_h=16, pages_per_compute_block=1, k_splits=2,
        interpret=True)
  return np.asarray(out)


# jax's TPU kernel rounds K/V to bf16 internally: bf16 tolerance against it.
TPU_TOL = dict(rtol=2e-2, atol=2e-2)
GPU_TOL = dict(rtol=1e-4, atol=1e-4)


def test_reference_decode_matches_both_jax_kernels():
  ours = _ours(_decode_case(), "reference")
  np.testing.assert_allclose(ours, _jax_tpu(), **TPU_TOL)
  np.testing.assert_allclose(ours, _jax_gpu(), **GPU_TOL)


def test_pallas_tpu_decode_matches_jax_tpu_paged_attention():
  np.testing.assert_allclose(_ours(_decode_case(), "pallas_tpu"), _jax_tpu(), **TPU_TOL)


def test_pallas_gpu_decode_matches_jax_gpu_paged_attention():
  np.testing.assert_allclose(_ours(_decode_case(), "pallas_gpu"), _jax_gpu(), **GPU_TOL)
