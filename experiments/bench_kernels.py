r"""Paged-attention benchmark: the paged path vs dense attention over contiguous KV.

Command (CPU, full sizes; about a minute):
  python -m experiments.bench_kernels
Quick run:
  python -m experiments.bench_kernels --sizes=small
CPU smoke test of the accelerator path (interpret mode; timings meaningless):
  python -m experiments.bench_kernels --sizes=small --backend=pallas_gpu --interpret \
      --bandwidth --iters=1 --inner=1
Tile sweep of the decode bandwidth case (GPU/TPU; each candidate compiles once):
  python -m experiments.bench_kernels --dtype=bfloat16 --tile_sweep
Expected on CPU: paged_over_dense <= 1.5 for every case (reference backend). On a GPU
or TPU the same command times the Pallas kernel ("auto") and adds the decode bandwidth
case (batch 64 x 4096, bf16) against the measured device copy bandwidth.

Prints one line per case, then (last line) a JSON object with all records and the
run's provenance.
"""
from __future__ import annotations

import json

from absl import app, flags
import jax
import jax.numpy as jnp

from experiments import _common
from experiments._common import provenance, to_jsonable
from experiments import _kernel_bench as benchmark

_PROGRESS = _common.define_progress_flag()
_SIZES = flags.DEFINE_enum("sizes", "full", ["full", "small"], "Case sizes.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "q/KV dtype of the paged-vs-dense cases.")
_BACKEND = flags.DEFINE_string("backend", "auto", "paged_attention backend.")
_INTERPRET = flags.DEFINE_bool(
    "interpret", False, "Run a Pallas backend in interpret mode (CPU smoke test of the "
    "accelerator path; timings then mean nothing).")
_ITERS = flags.DEFINE_integer("iters", 9, "Timed iterations per measurement.")
_INNER = flags.DEFINE_integer(
    "inner", 10, "Back-to-back calls per timed round of the decode bandwidth case "
    "(experiments._kernel_bench.time_device).")
_BW = flags.DEFINE_bool("bandwidth", None,
                        "Run the decode bandwidth case (default: on GPU/TPU only).")
_SWEEP = flags.DEFINE_bool(
    "tile_sweep", False, "In the decode bandwidth case, also time the Pallas backend's "
    "candidate block sizes (experiments._kernel_bench.tile_candidates) and report the best.")
_JAX_PEER = flags.DEFINE_bool(
    "jax_gpu_peer", None, "In the decode bandwidth case, also time jax's own Pallas GPU "
    "decode kernel on the same data (default: on GPU only).")


def main(argv):
  del argv
  dtype = jnp.dtype(_DTYPE.value)
  records = []
  cases = list(benchmark.standard_cases(_SIZES.value))
  for case in _common.progress_bar(cases, enabled=_PROGRESS.value, desc="bench_kernels",
                                   unit="case"):
    rec = benchmark.run_case(case, dtype=dtype, backend=_BACKEND.value, iters=_ITERS.value,
                               interpret=_INTERPRET.value)
    records.append(rec)
    print(f"{rec['case']:<40} paged {rec['paged_s'] * 1e3:8.2f} ms  dense "
          f"{rec['dense_s'] * 1e3:8.2f} ms  ratio {rec['paged_over_dense']:.2f}  "
          f"KV {rec['kv_bytes'] / 1e6:.1f} MB  {rec['flops'] / 1e9:.2f} GFLOP  "
          f"{rec['paged_kv_gbps']:.1f} GB/s  {rec['paged_gflops']:.1f} GFLOP/s  "
          f"max|paged-dense| {rec['max_abs_diff_vs_dense']:.1e}", flush=True)
  bw, sweep = None, None
  run_bw = _BW.value if _BW.value is not None else jax.default_backend() in ("gpu", "tpu")
  if _SWEEP.value and not run_bw:
    raise app.UsageError("--tile_sweep needs the decode bandwidth case (--bandwidth)")
  if run_bw:
    batch, context = (64, 4096) if _SIZES.value == "full" else (8, 512)
    tiles = (benchmark.tile_candidates(_BACKEND.value, _INTERPRET.value) if _SWEEP.value
             else [None])
    jax_peer = (_JAX_PEER.value if _JAX_PEER.value is not None
                else jax.default_backend() == "gpu")
    sweep = benchmark.decode_bandwidth_sweep(
        backend=_BACKEND.value, batch=batch, context=context, dtype=jnp.bfloat16,
        iters=_ITERS.value, interpret=_INTERPRET.value, tiles=tiles, jax_gpu_peer=jax_peer,
        inner=_INNER.value)
    for rec in sweep:
      if rec["error"]:
        print(f"{rec['case']:<40} {rec['backend']} tiles {rec['block_sizes'] or 'default'}"
              f"  FAILED {rec['error']}", flush=True)
        continue
      print(f"{rec['case']:<40} {rec['paged_s'] * 1e3:.3f} ms  {rec['achieved_gbps']:.1f} "
            f"GB/s of copy {rec['copy_gbps']:.1f} GB/s = {rec['fraction_of_copy_bw']:.1%}  "
            f"{rec['backend']} tiles {rec['block_sizes'] or 'default'}  "
            f"max|diff vs default| {rec['max_abs_diff_vs_first_tile']:.1e}", flush=True)
    bw = sweep[0]
    ours = [r for r in sweep if r["backend"] != benchmark.JAX_GPU_PEER and not r["error"]]
    if len(ours) > 1:
      best = min(ours, key=lambda r: r["paged_s"])
      print(f"best tiles {best['block_sizes'] or 'default'}: "
            f"{best['fraction_of_copy_bw']:.1%} of copy bandwidth", flush=True)
  summary = {
      "platform": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
      "cases": records, "decode_bandwidth": bw,
      "tile_sweep": sweep,
      "max_paged_over_dense": max(r["paged_over_dense"] for r in records),
      "provenance": provenance({"sizes": _SIZES.value, "dtype": _DTYPE.value,
                                "backend": _BACKEND.value, "iters": _ITERS.value, "inner": _INNER.value,
                                "interpret": _INTERPRET.value,
                                "bandwidth": run_bw, "tile_sweep": _SWEEP.value,
                                "jax_gpu_peer": _JAX_PEER.value},
                               seed=0),
  }
  print(json.dumps(to_jsonable(summary)))


if __name__ == "__main__":
  _common.run_app(main)
