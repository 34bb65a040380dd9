"""Ragged paged attention: every backend against a float64 numpy oracle.

Each backend gets one test class; Pallas backends run compiled where their hardware
exists and as an interpret-mode subclass everywhere. Shapes are tiny (head_dim 64,
page_size 8) because Pallas interpret mode is slow on CPU.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import prefixcache_kernels as kernels
from kernel_cases import make_case, oracle, tolerance

SCALE = 1.0 / math.sqrt(64)
ON_TPU = jax.default_backend() == "tpu"
ON_GPU = jax.default_backend() == "gpu"


class AttentionChecks:
  """Checks shared by every backend; subclasses override `call`."""

  def call(self, case, **kw):
    raise NotImplementedError

  def check(self, case, *, sm_scale=SCALE, sliding_window=None, soft_cap=None):
    out = self.call(case, sm_scale=sm_scale, sliding_window=sliding_window,
                    soft_cap=soft_cap)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    # NaN sits in every unused page, slot and padding token: nothing may leak.
    assert np.all(np.isfinite(out)), "non-finite output (padding leaked)"
    ref = oracle(case, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    live = case.num_live_tokens
    rtol, atol = tolerance(case.q.dtype)
    np.testing.assert_allclose(out[:live], ref[:live], rtol=rtol, atol=atol)
    np.testing.assert_array_equal(out[live:], 0.0)

  def test_hand_computed(self):
    # One sequence, kv_len 2, q_len 2, one head, head_dim 64, sm_scale 1.
    # q0 = q1 = e0; k0 = 0, k1 = e0 * ln(3); v0 = 1*e0, v1 = 5*e0.
    # Row 0 (position 0) sees only key 0 -> out = v0 = [1, 0, ...].
    # Row 1 (position 1): logits [0, ln 3] -> weights [1/4, 3/4]
    #   -> out = 1/4 * 1 + 3/4 * 5 = 4 in dim 0.
    case = make_case(0, [(2, 2)], head_dim=64, extra_pages=0)
    e0 = np.zeros(64, np.float32)
    e0[0] = 1.0
    case.q[:2, 0] = e0
    k = np.stack([0 * e0, e0 * np.log(3.0)])
    v = np.stack([1 * e0, 5 * e0])
    page = case.page_indices[0, 0]
    case.kv_pages[page, :2, 0] = k
    case.kv_pages[page, :2, 1] = v
    out = np.asarray(self.call(case, sm_scale=1.0))
    expected = np.stack([e0, 4 * e0])
    np.testing.assert_allclose(out[:2, 0], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[2:], 0.0)

  def test_decode_only_then_no_live_rows(self):
    # Lengths not page multiples, pages in permuted order, a padding row.
    case = make_case(1, [(1, 13), (1, 8), (1, 1), (1, 30)], num_kv_heads=2, group=2)
    self.check(case)
    # Same shapes (same compiled program), num_seqs = 0: every row is padding.
    case.num_seqs = np.array([0], np.int32)
    np.testing.assert_array_equal(np.asarray(self.call(case, sm_scale=SCALE)), 0.0)

  def test_prefill_fresh_and_over_cached_prefix(self):
    # Two fresh prompts (11 and 5 tokens) and 7 new tokens over 19 cached ones
    # (2 full pages + 3).
    self.check(make_case(2, [(11, 11), (5, 5), (7, 26)], num_kv_heads=1, group=4))

  def test_chunked_prefill_and_mixed_batch(self):
    # Decodes first, then a chunk in the middle of a prompt, a fresh prefill, and a
    # zero-length row (scheduled nothing this step) between live rows. MHA (ratio 1).
    seqs = [(1, 17), (1, 9), (6, 22), (0, 5), (9, 9)]
    self.check(make_case(4, seqs, num_kv_heads=2, group=1, num_tokens=24))

  def test_gqa_8_mqa(self):
    # Ratios 1, 2, 4 are covered above (mixed, decode, prefill); here 8 q heads on a
    # single kv head (MQA).
    self.check(make_case(18, [(1, 12), (4, 10)], num_kv_heads=1, group=8))

  def test_sliding_window_and_soft_cap(self):
    # Decode at position 39 sees keys 34..39 only: earlier KV blocks are skipped.
    seqs = [(1, 40), (5, 19)]
    case = make_case(5, seqs, num_kv_heads=1, group=2)
    case.q *= 4.0  # large logits so the cap matters
    self.check(case, sliding_window=6, soft_cap=3.0, sm_scale=0.5)

  def test_bf16(self):
    case = make_case(6, [(1, 20), (6, 14)], num_kv_heads=2, group=2, dtype=jnp.bfloat16)
    self.check(case)


class TestReference(AttentionChecks):

  def call(self, case, **kw):
    return kernels.paged_attention(*case.args(), backend="reference", **kw)

  def test_multi_pass_query_blocks(self, monkeypatch):
    # Blocks of 1 and 4 rows: the 11- and 9-row sequences run as 3 passes of 4 rows,
    # the last pass of the last sequence clamped at the end of the token axis.
    monkeypatch.setattr(kernels.reference, "_Q_BLOCK_BUCKETS", (1, 4))
    case = make_case(9, [(1, 10), (11, 11), (9, 20)], num_kv_heads=1, group=2,
                     num_tokens=22)
    fn = jax.jit(functools.partial(kernels.ragged_paged_attention_reference.__wrapped__,
                                   sm_scale=SCALE))
    out = np.asarray(fn(*case.args()))
    ref = oracle(case, sm_scale=SCALE)
    np.testing.assert_allclose(out[:21], ref[:21], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[21:], 0.0)

  def test_traced_num_seqs_reuses_one_program(self):
    # num_seqs is data: the same compiled program serves 1 and 2 live rows.
    case = make_case(8, [(3, 9), (2, 12)], num_kv_heads=1, group=2)
    fn = jax.jit(lambda *a: kernels.ragged_paged_attention_reference(*a, sm_scale=SCALE))
    args = list(jax.device_put(case.args()))
    one_seq = jax.device_put(jnp.array([1], jnp.int32))
    with jax.transfer_guard("disallow"):  # no hidden host<->device traffic
      full = fn(*args)
      args[5] = one_seq
      one = fn(*args)
    full, one = np.asarray(full), np.asarray(one)
    np.testing.assert_array_equal(one[:3], full[:3])
    np.testing.assert_array_equal(one[3:], 0.0)
    assert fn._cache_size() == 1


# Small tiles so the tiny cases still cross query blocks, sequences inside a block,
# several KV blocks per sequence (double buffering) and several KV splits.
TPU_TILES = kernels.TPUBlockSizes(num_q_per_block=8, num_kv_pages_per_block=2,
                                  num_kv_heads_per_block=1)
GPU_TILES = kernels.GPUBlockSizes(num_q_per_block=4, num_kv_pages_per_block=1, k_splits=2)


class _PallasTPUChecks(AttentionChecks):
  interpret = False

  def call(self, case, **kw):
    return kernels.ragged_paged_attention_tpu(*case.args(), block_sizes=TPU_TILES,
                                              interpret=self.interpret, **kw)


@pytest.mark.skipif(not ON_TPU, reason="compiled Pallas TPU kernel needs a TPU")
class TestPallasTPU(_PallasTPUChecks):
  interpret = False


class TestPallasTPUInterpret(_PallasTPUChecks):
  """The kernel as written (interpret=False) under `force_tpu_interpret_mode()`."""

  def call(self, case, **kw):
    with pltpu.force_tpu_interpret_mode():
      return kernels.ragged_paged_attention_tpu(*case.args(), block_sizes=TPU_TILES, **kw)


class _PallasGPUChecks(AttentionChecks):
  interpret = False

  def call(self, case, **kw):
    return kernels.ragged_paged_attention_gpu(*case.args(), block_sizes=GPU_TILES,
                                              interpret=self.interpret, **kw)


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas GPU kernel needs a GPU")
class TestPallasGPU(_PallasGPUChecks):
  interpret = False


class TestPallasGPUInterpret(_PallasGPUChecks):
  interpret = True


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_paged_attention_routes_to_pallas_backends(backend):
  # Default tiles through the public entry point.
  case = make_case(21, [(1, 9), (4, 12)], num_kv_heads=1, group=2)
  out = kernels.paged_attention(*case.args(), sm_scale=SCALE, backend=backend,
                                interpret=True)
  ref = oracle(case, sm_scale=SCALE)
  live = case.num_live_tokens
  np.testing.assert_allclose(np.asarray(out)[:live], ref[:live], rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(out)[live:] == 0.0)


def test_backend_resolution():
  assert kernels.resolve_backend("auto", platform="cpu") == "reference"
  assert kernels.resolve_backend("auto", platform="tpu") == "pallas_tpu"
  assert kernels.resolve_backend("auto", platform="gpu") == "pallas_gpu"
  assert kernels.resolve_backend("pallas_gpu", interpret=True, platform="cpu") == "pallas_gpu"
  with pytest.raises(ValueError, match="'pallas_tpu' needs a tpu"):
    kernels.resolve_backend("pallas_tpu", platform="cpu")
  with pytest.raises(ValueError, match="'pallas_gpu' needs a gpu"):
    kernels.resolve_backend("pallas_gpu", platform="tpu")
  with pytest.raises(ValueError, match="unknown backend 'triton'"):
    kernels.resolve_backend("triton")


@pytest.mark.parametrize("make", [
    lambda: kernels.TPUBlockSizes(num_q_per_block=12),
    lambda: kernels.TPUBlockSizes(num_kv_pages_per_block=0),
    lambda: kernels.TPUBlockSizes(num_kv_heads_per_block=1.5),
    lambda: kernels.GPUBlockSizes(num_q_per_block=6),
    lambda: kernels.GPUBlockSizes(k_splits=0),
])
def test_block_sizes_validated(make):
  with pytest.raises(ValueError, match="BlockSizes"):
    make()


def test_paged_attention_passes_block_sizes():
  case = make_case(22, [(1, 9), (4, 12)], num_kv_heads=1, group=2)
  tiles = kernels.GPUBlockSizes(num_q_per_block=4, num_kv_pages_per_block=2, k_splits=2)
  seen = {}
  real = kernels.KERNEL_BACKENDS["pallas_gpu"]

  def spy(*args, **kw):
    seen.update(kw)
    return real.attention(*args, **kw)

  out = kernels.paged_attention(*case.args(), sm_scale=SCALE,
                                backend=dataclasses.replace(real, attention=spy),
                                interpret=True, block_sizes=tiles)
  assert seen["block_sizes"] is tiles
  live = case.num_live_tokens
  np.testing.assert_allclose(np.asarray(out)[:live], oracle(case, sm_scale=SCALE)[:live],
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend,tiles", [
    ("reference", kernels.GPUBlockSizes()),
    ("pallas_tpu", kernels.GPUBlockSizes()),
    ("pallas_gpu", kernels.TPUBlockSizes()),
])
def test_paged_attention_rejects_block_sizes_of_another_backend(backend, tiles):
  case = make_case(23, [(1, 9)], num_kv_heads=1, group=2)
  with pytest.raises(ValueError, match="do not fit backend"):
    kernels.paged_attention(*case.args(), sm_scale=SCALE, backend=backend, interpret=True,
                            block_sizes=tiles)
