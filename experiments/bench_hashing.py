r"""Block hashing throughput (prompt tokens/s) per hash algorithm.

  python -m experiments.bench_hashing --config=configs/bench_hashing.py --workdir=/tmp/hash

Hashes every prompt of a workload into its chain of full-block digests, two ways:

* ``pure``: ``BlockHasher.hash_token_blocks`` (the pure function);
* ``request``: building a ``Request`` bound to the hasher and reading its
  ``block_hashes`` (what the replay and the engine pay per request).

Rounds are interleaved over the algorithms (round-robin) so machine drift hits all
alike; medians over ``repeats`` rounds after ``warmup`` untimed ones, plus each
algorithm's per-round time ratio to the first one. With ``compare_vllm`` and the
peer venv present (``experiments/peers/``), vLLM's own ``--hash-only`` benchmark runs
on the same trace in the same invocation for a side-by-side ratio.

Writes ``results.jsonl`` (one line per algorithm and mode, provenance on each) and
``bench_hashing.png``; prints one summary JSON line.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import time
from collections.abc import Sequence

from experiments import _common

MODES = ("pure", "request")


def _hash_all(requests: Sequence, algo: str, block_size: int, mode: str, seed) -> tuple[float, int]:
    """Seconds to hash every prompt once; and the number of blocks hashed."""
    from prefixcache.core.hashing import BlockHasher  # noqa: PLC0415
    from prefixcache.core.request import LoRARequest, MultiModalFeature, Request  # noqa: PLC0415

    hasher = BlockHasher(algo, seed)
    # Untimed: the inputs a frontend would hand over.
    inputs = [(r.id, r.prompt, r.lora and LoRARequest(*r.lora),
               tuple(MultiModalFeature(*m) for m in r.mm), r.cache_salt) for r in requests]
    gc.collect()
    gc.freeze()
    nblocks = 0
    t0 = time.perf_counter()
    if mode == "pure":
        for _, prompt, lora, mm, salt in inputs:
            nblocks += len(hasher.hash_token_blocks(prompt, block_size, lora=lora,
                                                    mm_features=mm, cache_salt=salt))
    else:
        for rid, prompt, lora, mm, salt in inputs:
            req = Request(rid, prompt, mm_features=mm, lora=lora, cache_salt=salt,
                          hasher=hasher, block_size=block_size)
            nblocks += len(req.block_hashes)
    dt = time.perf_counter() - t0
    gc.unfreeze()
    return dt, nblocks


def bench(requests: Sequence, *, algos: Sequence[str], block_size: int, modes=MODES,
          repeats: int = 5, warmup: int = 1, seed="0", progress: bool = False) -> list[dict]:
    """Interleaved timing rounds; one row per (mode, algo).

    Returns:
      Rows ``{"mode", "hash_algo", "median_s", "min_s", "runs_s", "blocks",
      "prompt_tokens", "prompt_tokens_per_s", "blocks_per_s",
      "median_round_ratio_vs_<first algo>"}``.
    """
    requests = list(requests)
    algos = list(algos)
    if not algos or repeats < 1 or warmup < 0:
        raise ValueError(f"need algos, repeats >= 1, warmup >= 0; got {algos}, {repeats}, {warmup}")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; expected one of {MODES}")
    prompt_tokens = sum(len(r.prompt) for r in requests)
    times = {(m, a): [] for m in modes for a in algos}
    blocks = {}
    rounds = range(warmup + repeats)
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        rounds = tqdm(rounds, desc="hash rounds", unit="round")
    for i in rounds:
        for m in modes:
            for a in algos:
                dt, blocks[(m, a)] = _hash_all(requests, a, block_size, m, seed)
                if i >= warmup:
                    times[(m, a)].append(dt)
    rows = []
    for m in modes:
        base = times[(m, algos[0])]
        for a in algos:
            t = times[(m, a)]
            med = statistics.median(t)
            rows.append({
                "mode": m, "hash_algo": a, "median_s": med, "min_s": min(t), "runs_s": t,
                "blocks": blocks[(m, a)], "prompt_tokens": prompt_tokens,
                "prompt_tokens_per_s": prompt_tokens / med,
                "blocks_per_s": blocks[(m, a)] / med,
                f"median_round_ratio_vs_{algos[0]}": statistics.median(
                    x / y for x, y in zip(t, base)),
            })
    return rows


def vllm_hash_only(trace_path: str, *, algos: Sequence[str], block_size: int, repeats: int,
                   warmup: int, python: str, script: str) -> dict | None:
    """Runs the vLLM peer's ``--hash-only`` benchmark; None when it is not installed."""
    if not (os.path.exists(python) and os.path.exists(script)):
        return None
    cmd = [python, script, "--trace", trace_path, "--hash-only", "--hash-algo", ",".join(algos),
           "--block-size", str(block_size), "--repeat", str(repeats), "--warmup", str(warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(rows: Sequence[dict], path, *, title: str = "", vllm: dict | None = None) -> None:
    """Grouped bars: prompt tokens/s per algorithm and mode (+ vLLM's)."""
    import numpy as np  # noqa: PLC0415

    algos = list(dict.fromkeys(r["hash_algo"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    series = [(f"prefixcache ({m})", [next(r["prompt_tokens_per_s"] for r in rows
                                          if r["mode"] == m and r["hash_algo"] == a)
                                     for a in algos]) for m in modes]
    if vllm:
        series.append(("vLLM 0.33 (Request build)",
                       [vllm["algos"].get(a, {}).get("prompt_tokens_per_s", 0.0) for a in algos]))
    fig, ax = _common.new_figure(figsize=(7, 3.8))
    x = np.arange(len(algos))
    w = 0.8 / len(series)
    for i, (label, ys) in enumerate(series):
        ax.bar(x + i * w - 0.4 + w / 2, [y / 1e6 for y in ys], w, label=label)
    ax.set_xticks(x, algos)
    ax.set_ylabel("prompt tokens/s (millions)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    _common.save_plot(fig, path)


def run(config, *, progress: bool = False) -> dict:
    """Runs the benchmark; writes results.jsonl and bench_hashing.png into config.workdir."""
    from prefixcache.sim.trace import write_trace  # noqa: PLC0415

    workdir = _common.prepare_workdir(config.workdir)
    requests = list(_common.requests_from_config(config, workdir))
    rows = bench(requests, algos=list(config.algos), block_size=config.block_size,
                 modes=list(config.modes), repeats=config.repeats, warmup=config.warmup,
                 seed=config.hash_seed or None, progress=progress)
    vllm = None
    if config.compare_vllm:
        trace_path = workdir / "bench_hashing_trace.jsonl"
        write_trace(trace_path, requests)
        vllm = vllm_hash_only(str(trace_path), algos=list(config.algos),
                              block_size=config.block_size, repeats=config.repeats,
                              warmup=config.warmup, python=config.vllm_python,
                              script=config.vllm_replay_script)
        if vllm is not None:
            for r in rows:
                theirs = vllm["algos"][r["hash_algo"]]["prompt_tokens_per_s"]
                r["vllm_prompt_tokens_per_s"] = theirs
                r["speedup_vs_vllm"] = r["prompt_tokens_per_s"] / theirs
    source = _common.source_name(config)
    with _common.AtomicJsonlWriter(workdir / "results.jsonl") as w:
        for r in rows:
            prov = _common.provenance(config, seed=config.seed, hash_algo=r["hash_algo"],
                                      extra={"source": source})
            w.write({"record": "hashing", **r}, provenance=prov)
    plot(rows, workdir / "bench_hashing.png", vllm=vllm,
         title=f"{source}: block hashing, block size {config.block_size}")
    return {"source": source, "vllm_ran": vllm is not None,
            "rows": [{k: r[k] for k in r if k not in ("runs_s",)} for r in rows]}


def main() -> None:
    _common.run_cli(run, config_name="bench_hashing")


if __name__ == "__main__":
    main()
