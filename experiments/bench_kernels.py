r"""Paged-attention benchmark: the paged path vs dense attention over contiguous KV.

Command (CPU, full sizes; about a minute):
  python -m experiments.bench_kernels
Quick run:
  python -m experiments.bench_kernels --sizes=small
CPU smoke test of the accelerator path (interpret mode; timings meaningless):
  python -m experiments.bench_kernels --sizes=small --backend=pallas_gpu --interpret \
      --bandwidth --iters=1
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

from experiments._common import provenance, to_jsonable
from kernels import benchmark

_SIZES = flags.DEFINE_enum("sizes", "full", ["full", "small"], "Case sizes.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "q/KV dtype of the paged-vs-dense cases.")
_BACKEND = flags.DEFINE_string("backend", "auto", "paged_attention backend.")
_INTERPRET = flags.DEFINE_bool(
    "interpret", False, "Run a Pallas backend in interpret mode (CPU smoke test of the "
    "accelerator path; timings then mean nothing).")
_ITERS = flags.DEFINE_integer("iters", 9, "Timed iterations per measurement.")
_BW = flags.DEFINE_bool("bandwidth", None,
                        "Run the decode bandwidth case (default: on GPU/TPU only).")


def main(argv):
  del argv
  dtype = jnp.dtype(_DTYPE.value)
  records = []
  for case in benchmark.standard_cases(_SIZES.value):
    rec = benchmark.run_case(case, dtype=dtype, backend=_BACKEND.value, iters=_ITERS.value,
                               interpret=_INTERPRET.value)
    records.append(rec)
    print(f"{rec['case']:<40} paged {rec['paged_s'] * 1e3:8.2f} ms  dense "
          f"{rec['dense_s'] * 1e3:8.2f} ms  ratio {rec['paged_over_dense']:.2f}  "
          f"KV {rec['kv_bytes'] / 1e6:.1f} MB  {rec['flops'] / 1e9:.2f} GFLOP  "
          f"{rec['paged_kv_gbps']:.1f} GB/s  {rec['paged_gflops']:.1f} GFLOP/s  "
          f"max|paged-dense| {rec['max_abs_diff_vs_dense']:.1e}", flush=True)
  bw = None
  run_bw = _BW.value if _BW.value is not None else jax.default_backend() in ("gpu", "tpu")
  if run_bw:
    batch, context = (64, 4096) if _SIZES.value == "full" else (8, 512)
    bw = benchmark.decode_bandwidth(backend=_BACKEND.value, batch=batch, context=context,
                                    dtype=jnp.bfloat16, iters=_ITERS.value,
                                    interpret=_INTERPRET.value)
    print(f"{bw['case']:<40} {bw['paged_s'] * 1e3:.3f} ms  {bw['achieved_gbps']:.1f} GB/s "
          f"of copy {bw['copy_gbps']:.1f} GB/s = {bw['fraction_of_copy_bw']:.1%}", flush=True)
  summary = {
      "platform": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
      "cases": records, "decode_bandwidth": bw,
      "max_paged_over_dense": max(r["paged_over_dense"] for r in records),
      "provenance": provenance({"sizes": _SIZES.value, "dtype": _DTYPE.value,
                                "backend": _BACKEND.value, "iters": _ITERS.value,
                                "interpret": _INTERPRET.value,
                                "bandwidth": run_bw}, seed=0),
  }
  print(json.dumps(to_jsonable(summary)))


if __name__ == "__main__":
  app.run(main)
