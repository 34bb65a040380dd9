r"""First step after load, unrolled vs scanned decoder layers, in fresh processes; each
process's peak resident memory after load and after the engine is built.

  python -m experiments.bench_first_step --config=configs/bench_first_step.py \
      --workdir=/tmp/bench_first_step

See configs/bench_first_step.py. Writes bench_first_step.jsonl (one line per process,
with provenance) into the workdir; the last stdout line is the JSON result.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from experiments import _common


def _clock():
    return time.perf_counter(), time.process_time()


def _since(t0) -> dict:
    wall, cpu = _clock()
    return {"wall_s": round(wall - t0[0], 3), "cpu_s": round(cpu - t0[1], 3)}


def _peak_rss_mb() -> float:
    """This process's peak resident set so far (MiB; Linux reports KiB)."""
    import resource  # noqa: PLC0415

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def child(spec: dict) -> dict:
    """One process: load, then time the first and the steady steps (`spec`: the config
    fields, `scan`, `stacked` (the loader's layout) and `cache_dir`)."""
    import numpy as np  # noqa: PLC0415

    from prefixcache.engine import Engine, SamplingParams  # noqa: PLC0415
    from prefixcache.engine.warmup import enable_compilation_cache  # noqa: PLC0415
    from prefixcache.model import load_pretrained  # noqa: PLC0415

    enable_compilation_cache(spec["cache_dir"])
    out = {}
    t = _clock()
    pre = load_pretrained(spec["path"], dtype=spec["dtype"], stacked=spec["stacked"])
    out["load"] = _since(t)
    out["peak_rss_after_load_mb"] = _peak_rss_mb()
    engine = Engine(pre.config, model=pre.model, num_blocks=spec["num_blocks"],
                    block_size=spec["block_size"], enable_caching=False, max_num_seqs=1,
                    max_num_batched_tokens=spec["prompt_len"],
                    max_model_len=spec["prompt_len"] + spec["decode_tokens"] + 64,
                    seed=spec["seed"], scan_layers=spec["scan"])
    out["peak_rss_after_engine_mb"] = _peak_rss_mb()
    rng = np.random.default_rng(spec["seed"])

    def prompt(n):
        return rng.integers(0, pre.config.vocab_size, n).tolist()

    one = SamplingParams(max_tokens=1)
    many = SamplingParams(max_tokens=1 + spec["decode_tokens"])
    t = _clock()
    engine.generate([prompt(spec["prompt_len"])], one)
    out["first_prefill"] = _since(t)
    times = []
    for _ in range(spec["repeats"]):
        t = _clock()
        engine.generate([prompt(spec["prompt_len"])], one)
        times.append(_since(t))
    out["prefill_tok_s"] = _rates(spec["prompt_len"], times)
    t = _clock()
    engine.generate([prompt(32)], many)  # compiles the decode program(s)
    out["first_decode_run"] = _since(t)
    t1, t2 = [], []
    for _ in range(spec["repeats"]):
        t = _clock()
        engine.generate([prompt(32)], one)
        t1.append(_since(t))
        t = _clock()
        engine.generate([prompt(32)], many)
        t2.append(_since(t))
    out["decode_b1_tok_s"] = {
        k: (round(spec["decode_tokens"] / d, 2) if d > 0 else None)
        for k in ("wall_s", "cpu_s")
        for d in [statistics.median(x[k] for x in t2) - statistics.median(x[k] for x in t1)]}
    return out


def _rates(tokens: int, times: list[dict]) -> dict:
    """Tokens per wall second and per CPU second (medians of the runs)."""
    return {k: round(tokens / statistics.median(x[k] for x in times), 1)
            for k in ("wall_s", "cpu_s")}


# mode -> (the engine's step, the loader's layout). "scan_copy": a per-layer load whose
# scanned step holds a stacked copy (the layout before the loaders filled the stack).
MODES = {"unrolled": dict(scan=False, stacked=False), "scan": dict(scan=True, stacked=True),
         "scan_copy": dict(scan=True, stacked=False)}


def run(config, *, progress: bool = False) -> dict:
    del progress
    from experiments.bench_real_model import default_checkpoint  # noqa: PLC0415
    from experiments.chat import checkpoint_path  # noqa: PLC0415

    workdir = _common.prepare_workdir(config.workdir)
    path = checkpoint_path(config.checkpoint) if config.checkpoint else default_checkpoint()
    modes = [m.strip() for m in config.modes.split(",") if m.strip()]
    bad = sorted(set(modes) - set(MODES))
    if bad:
        raise ValueError(f"config.modes: unknown {bad}; expected some of {sorted(MODES)}")
    results = []
    with _common.AtomicJsonlWriter(workdir / "bench_first_step.jsonl") as out:
        for mode in modes:
            with tempfile.TemporaryDirectory(dir=workdir) as cache_dir:
                for process in ("first", "second"):
                    spec = dict(path=path, dtype=config.dtype, **MODES[mode],
                                cache_dir=cache_dir, num_blocks=config.num_blocks,
                                block_size=config.block_size, prompt_len=config.prompt_len,
                                decode_tokens=config.decode_tokens, repeats=config.repeats,
                                seed=config.seed)
                    code = ("import json, sys; from experiments.bench_first_step import child; "
                            "print(json.dumps(child(json.loads(sys.argv[1]))))")
                    proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)],
                                          capture_output=True, text=True, check=False,
                                          cwd=os.getcwd())
                    if proc.returncode:
                        raise RuntimeError(f"{mode} ({process} process) failed:\n"
                                           + proc.stderr[-3000:])
                    rec = {"mode": mode, "process": process, "checkpoint": path,
                           **json.loads(proc.stdout.strip().splitlines()[-1])}
                    out.write({**rec, "provenance": _common.provenance(config,
                                                                        seed=config.seed)})
                    results.append(rec)
                    print(json.dumps(rec), file=sys.stderr, flush=True)
    return {"results": results}


if __name__ == "__main__":
    _common.run_cli(run, config_name="bench_first_step")
