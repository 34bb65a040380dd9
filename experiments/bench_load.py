r"""Checkpoint load time and peak memory, ours vs transformers, in fresh processes.

  python -m experiments.bench_load --config=configs/bench_load.py --workdir=/tmp/bench_load \
      --config.peer_python=$HOME/.cache/prefixcache-peers/vllm-venv/bin/python

See configs/bench_load.py. Writes bench_load.jsonl (one line per process, with
provenance) into the workdir; the last stdout line is the JSON result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from experiments import _common

# One process of ours: load_pretrained into the stacked layout (the converted-weights
# cache in the directory the parent gives), wall / CPU seconds and peak RSS.
_OURS = """
import json, resource, sys, time
t, c = time.perf_counter(), time.process_time()
from prefixcache.model import load_pretrained
spec = json.loads(sys.argv[1])
t1, c1 = time.perf_counter(), time.process_time()
pre = load_pretrained(spec["path"], dtype=spec["dtype"], progress=False,
                      converted_cache=spec["cache"])
import jax
jax.block_until_ready(jax.tree.leaves(pre.model.layer_stack))
print(json.dumps({"load_wall_s": time.perf_counter() - t1, "load_cpu_s": time.process_time() - c1,
                  "import_wall_s": t1 - t,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

# One process of transformers (its own venv): AutoModelForCausalLM.from_pretrained of
# the GGUF file (a directory holding a link to it, as transformers wants).
_PEER = """
import json, os, resource, sys, tempfile, time
t, c = time.perf_counter(), time.process_time()
import torch
from transformers import AutoModelForCausalLM
spec = json.loads(sys.argv[1])
d, fn = os.path.split(os.path.abspath(spec["path"]))
tmp = tempfile.mkdtemp()
os.symlink(os.path.join(d, fn), os.path.join(tmp, fn))
t1, c1 = time.perf_counter(), time.process_time()
model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=fn, dtype=getattr(torch, spec["dtype"]))
print(json.dumps({"load_wall_s": time.perf_counter() - t1, "load_cpu_s": time.process_time() - c1,
                  "import_wall_s": t1 - t,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _child(python: str, code: str, spec: dict, env: dict) -> dict:
    args = [python, "-c", code, json.dumps(spec)]
    if python != sys.executable:
        args.insert(1, "-I")  # (a peer venv: none of this checkout on its path)
    proc = subprocess.run(args, capture_output=True, text=True, check=False, env=env,
                          cwd=os.getcwd())
    if proc.returncode:
        raise RuntimeError(f"load process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(config, *, progress: bool = False) -> dict:
    del progress
    from experiments.bench_real_model import default_checkpoint  # noqa: PLC0415
    from experiments.chat import checkpoint_path  # noqa: PLC0415

    workdir = _common.prepare_workdir(config.workdir)
    path = checkpoint_path(config.checkpoint) if config.checkpoint else default_checkpoint()
    if config.peer_python and not os.path.isfile(config.peer_python):
        raise ValueError(f"config.peer_python: no such file {config.peer_python!r}")
    env = dict(os.environ, OMP_NUM_THREADS=str(config.threads))
    results = []
    with _common.AtomicJsonlWriter(workdir / "bench_load.jsonl") as out, \
            tempfile.TemporaryDirectory(dir=workdir) as cache:
        modes = [m.strip() for m in config.modes.split(",") if m.strip()]
        bad = sorted(set(modes) - {"no_cache", "cold_cache", "warm_cache"})
        if bad or ("warm_cache" in modes and "cold_cache" not in modes):
            raise ValueError(f"config.modes {config.modes!r}: some of no_cache, cold_cache, "
                             "warm_cache (warm_cache after cold_cache)")
        runs = [("ours", m, False if m == "no_cache" else cache)
                for m in ("no_cache", "cold_cache", "warm_cache") if m in modes]
        if config.peer_python:
            runs.insert(0, ("transformers", "-", None))
        for rep in range(config.repeats):
            for who, mode, cache_dir in runs:
                spec = {"path": path, "dtype": config.dtype, "cache": cache_dir}
                if mode == "cold_cache":  # (a fresh copy each repeat)
                    spec["cache"] = cache_dir = os.path.join(cache, f"rep{rep}")
                    runs[-1] = ("ours", "warm_cache", cache_dir)
                t = time.perf_counter()
                got = (_child(config.peer_python, _PEER, spec, env) if who == "transformers"
                       else _child(sys.executable, _OURS, spec, env))
                rec = {"who": who, "converted_cache": mode, "repeat": rep, "checkpoint": path,
                       "dtype": config.dtype, "process_wall_s": time.perf_counter() - t,
                       **{k: round(v, 3) for k, v in got.items()}}
                out.write({**rec, "provenance": _common.provenance(config, seed=None)})
                results.append(rec)
                print(json.dumps(rec), file=sys.stderr, flush=True)
    return {"results": results}


if __name__ == "__main__":
    _common.run_cli(run, config_name="bench_load")
