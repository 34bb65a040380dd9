r"""bf16 vs f32 matrix-vector product on CPU, and what XLA compiles for each.

  python -m experiments.bench_bf16_matvec --config=configs/bench_bf16_matvec.py \
      --workdir=/tmp/bench_bf16_matvec

See configs/bench_bf16_matvec.py. Writes bench_bf16_matvec.jsonl (one line per dtype,
with provenance) into the workdir; the last stdout line is the JSON result.
"""

from __future__ import annotations

import json
import re
import sys
import time

from experiments import _common


def run(config, *, progress: bool = False) -> dict:
    del progress
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    workdir = _common.prepare_workdir(config.workdir)
    rng = np.random.default_rng(config.seed)
    w32 = rng.standard_normal((config.rows, config.cols), np.float32)
    f = jax.jit(lambda x, w: jnp.einsum("sd,vd->sv", x, w,
                                        preferred_element_type=jnp.float32))
    results = []
    with _common.AtomicJsonlWriter(workdir / "bench_bf16_matvec.jsonl") as out:
        for dtype in ("float32", "bfloat16"):
            w = jnp.asarray(w32, dtype)
            x = jnp.ones((1, config.cols), dtype)
            f(x, w).block_until_ready()  # compile
            runs = []
            for _ in range(config.repeats):
                t, c = time.perf_counter(), time.process_time()
                for _ in range(config.calls):
                    y = f(x, w)
                y.block_until_ready()
                runs.append(((time.perf_counter() - t) / config.calls,
                             (time.process_time() - c) / config.calls))
            wall, cpu = min(runs)
            hlo = f.lower(x, w).compile().as_text()
            # a convert producing a full [rows, cols] f32 array: the weights copied as f32
            full = rf"f32\[{config.rows},{config.cols}\][^=]*convert|= f32\[{config.rows}," \
                   rf"{config.cols}\]\S* convert"
            rec = {"dtype": dtype, "rows": config.rows, "cols": config.cols,
                   "wall_ms": round(wall * 1e3, 3), "cpu_ms": round(cpu * 1e3, 3),
                   "weight_gb_per_s": round(w.nbytes / wall / 1e9, 2),
                   "converts_weights_to_f32": bool(re.search(full, hlo))}
            out.write({**rec, "provenance": _common.provenance(config, seed=config.seed)})
            results.append(rec)
            print(json.dumps(rec), file=sys.stderr, flush=True)
    return {"results": results}


if __name__ == "__main__":
    _common.run_cli(run, config_name="bench_bf16_matvec")
