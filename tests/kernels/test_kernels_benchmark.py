"""experiments._kernel_bench: roofline arithmetic, tile candidates, and the decode sweep."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import prefixcache_kernels as kernels
from experiments import _kernel_bench as benchmark


def test_roofline_counts_kv_bytes_and_causal_flops():
  case = benchmark.BenchCase("c", ((1, 8), (3, 4)), num_kv_heads=2, num_q_heads=4,
                             head_dim=16)
  rl = benchmark.roofline(case, jnp.bfloat16)
  assert rl["kv_bytes"] == (8 + 4) * 2 * 2 * 16 * 2
  # Visible scores: 1 row x 8 keys; 3 rows over keys 0..1 plus a causal triangle 1+2+3.
  assert rl["flops"] == 4 * (8 + (3 * 1 + 6)) * 4 * 16


def test_tile_candidates_default_first_and_per_backend():
  gpu = benchmark.tile_candidates("pallas_gpu", interpret=True)
  assert gpu[0] is None and len(gpu) > 1
  assert all(isinstance(t, kernels.GPUBlockSizes) for t in gpu[1:])
  assert len(set(gpu[1:])) == len(gpu) - 1
  tpu = benchmark.tile_candidates("pallas_tpu", interpret=True)
  assert tpu[0] is None and all(isinstance(t, kernels.TPUBlockSizes) for t in tpu[1:])
  assert benchmark.tile_candidates("reference") == [None]


def test_decode_sweep_times_each_tile_and_the_jax_peer_on_the_same_data():
  tiles = [None, kernels.GPUBlockSizes(num_q_per_block=4, num_kv_pages_per_block=4,
                                       k_splits=2)]
  recs = benchmark.decode_bandwidth_sweep(
      backend="pallas_gpu", interpret=True, batch=2, context=256, dtype=jnp.float32,
      iters=1, inner=1, tiles=tiles, num_kv_heads=1, num_q_heads=4, head_dim=64,
      jax_gpu_peer=True)
  assert [r["backend"] for r in recs] == ["pallas_gpu", "pallas_gpu", benchmark.JAX_GPU_PEER]
  assert recs[0]["block_sizes"] is None
  assert recs[1]["block_sizes"]["k_splits"] == 2
  for r in recs:
    assert r["kv_bytes"] == 2 * 256 * 2 * 1 * 64 * 4
    assert r["paged_s"] > 0 and r["fraction_of_copy_bw"] > 0
    # Same attention on the same data: outputs agree (f32).
    assert r["max_abs_diff_vs_first_tile"] < 1e-4
  assert recs[0]["max_abs_diff_vs_first_tile"] == 0.0


def test_decode_sweep_rejects_tiles_of_another_backend():
  with pytest.raises(ValueError, match="do not fit backend"):
    benchmark.decode_bandwidth_sweep(
        backend="reference", batch=1, context=16, dtype=jnp.float32, iters=1,
        tiles=[kernels.GPUBlockSizes()], num_kv_heads=1, num_q_heads=1, head_dim=16)


def test_decode_sweep_records_a_tile_the_device_cannot_run_and_goes_on(monkeypatch):
  bad = kernels.GPUBlockSizes(k_splits=3)
  real = benchmark.paged_attention

  def flaky(*args, block_sizes=None, **kw):
    if block_sizes == bad:
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Shared memory size limit exceeded")
    return real(*args, block_sizes=block_sizes, **kw)

  monkeypatch.setattr(benchmark, "paged_attention", flaky)
  recs = benchmark.decode_bandwidth_sweep(
      backend="pallas_gpu", interpret=True, batch=1, context=32, dtype=jnp.float32,
      iters=1, inner=1, tiles=[bad, None], num_kv_heads=1, num_q_heads=2, head_dim=64)
  assert recs[0]["error"].startswith("JaxRuntimeError: RESOURCE_EXHAUSTED")
  assert recs[0]["paged_s"] is None and recs[0]["fraction_of_copy_bw"] is None
  assert recs[1]["error"] is None and recs[1]["paged_s"] > 0
  assert recs[1]["max_abs_diff_vs_first_tile"] == 0.0  # the first tile that ran
