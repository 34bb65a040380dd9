r"""Manager benchmark: our replay (hashing + KVCacheManager) vs vLLM 0.33's, same traces.

  python -m experiments.bench_manager                       # ours only
  python -m experiments.bench_manager \
      --vllm_python=$HOME/.cache/prefixcache-peers/vllm-venv/bin/python   # + the peer

The vLLM peer venv: ``bash experiments/peers/setup_vllm_env.sh`` (pinned vLLM 0.33.0 +
CPU torch in its own venv; prints the python to pass as ``--vllm_python``).

Generates the peer workloads with ``experiments/peers/make_traces.py`` itself (same code,
same seed: byte-identical traces to the ones vLLM's harness replays), then for every
workload x hash algorithm replays the trace through ``prefixcache.sim.replay`` and prints
requests/s, prompt tokens/s and the split of the loop between hashing (request
construction + incremental hashing on append) and bookkeeping (manager calls).

With ``--vllm_python`` the peer runs on the same trace in the same invocation
(``records_identical``: hits, failures and block ids agree request by request; its pool
has ``num_blocks`` blocks including its null block, ours ``num_blocks - 1`` with vLLM's
``unhashed_first`` free order). A 2-core machine drifts by 20-40% over seconds, so only
side-by-side ratios mean anything:

- ``--peer_mode=inprocess`` (default): the peer venv's Python runs
  ``experiments.peer_inprocess``, which alternates vLLM's harness (``vllm_replay``'s own
  ``replay_once``) and our replay round by round in one interpreter, with the same
  libraries and the same warm-up; the ratio is the median of the per-round ratios.
- ``--peer_mode=subprocess``: ours in this process, ``vllm_replay.py`` in a fresh
  process per round (with the same warm-up), interleaved; median of per-round ratios.

Both loops include request construction and hashing; neither includes reading the trace
or computing the deterministic output tokens.

Block sizes (``--block_sizes=16,128,512``): every workload runs at each; the pool keeps
the KV capacity in tokens of ``--num_blocks`` x ``--block_size`` (4096 x 16: 512 blocks
at 128, 128 at 512, vLLM's counts incl. its null block), so larger blocks still evict.

Mooncake traces (``--mooncake=synthetic,conversation``, files in ``--mooncake_dir``):
converted once to the peer's JSONL (``read_trace`` + ``write_trace``: hash ids expanded
to 512 tokens each), optionally only their first ``--mooncake_requests`` lines; pool
``--mooncake_num_blocks`` at 512 tokens (10,000 by default, evictions on both traces),
the same KV tokens at other block sizes. With ``--mooncake_hash_ids`` (default, in-process
mode) a second row per cell times our replay keying blocks by the hash ids themselves
(``read_trace(..., mooncake_tokens="lazy")``; same records, checked) against the SAME
vLLM rounds, which hash the expanded tokens: the headline is the token row.

Last stdout line: one JSON summary.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

from experiments import _common

FLAGS = flags.FLAGS

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_WORKLOADS = flags.DEFINE_list(
    "workloads", ["shared_system_prompt", "multi_turn", "few_shot", "mm_salt"],
    "Peer workloads (make_traces.py names).")
_ALGOS = flags.DEFINE_list("hash_algos", ["sha256", "xxhash_cbor"], "Hash algorithms.")
_NUM_BLOCKS = flags.DEFINE_integer(
    "num_blocks", 4096, "vLLM's pool size incl. its null block (ours: one less).")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per block.")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 8, "Requests holding blocks at once.")
_SEED = flags.DEFINE_integer("seed", 0, "make_traces.py seed.")
_REPEAT = flags.DEFINE_integer("repeat", 3, "Timed rounds (medians reported).")
_WARMUP = flags.DEFINE_integer(
    "warmup", 1,
    "Untimed replays before timing, for both sides: ours at the start (one process for "
    "all rounds), the peer at the start of each of its rounds (a fresh process each).")
_FREE_ORDER = flags.DEFINE_enum(
    "free_order", "unhashed_first", ["append", "unhashed_first"],
    "Our free order (vLLM's is unhashed_first; parity needs it).")
_VLLM_PYTHON = flags.DEFINE_string("vllm_python", None, "Python of the vLLM peer venv.")
_PEER_MODE = flags.DEFINE_enum(
    "peer_mode", "inprocess", ["inprocess", "subprocess"],
    "inprocess: both replays alternate in ONE interpreter (the peer venv's Python runs "
    "experiments.peer_inprocess with our package on PYTHONPATH; same libraries, same "
    "drift); subprocess: ours here, vllm_replay.py in a fresh process per round.")
_PEERS = flags.DEFINE_string(
    "peers_dir", os.path.join(_REPO, "experiments", "peers"),
    "Directory of make_traces.py and vllm_replay.py.")
_BLOCK_SIZES = flags.DEFINE_list(
    "block_sizes", [],
    "Block sizes to run (default: --block_size alone); pools keep --num_blocks x "
    "--block_size tokens of KV (resp. --mooncake_num_blocks x 512).")
_MOONCAKE = flags.DEFINE_list(
    "mooncake", [], "Mooncake traces to add (conversation, synthetic).")
_MOONCAKE_DIR = flags.DEFINE_string(
    "mooncake_dir", "",
    "Directory of local {conversation,synthetic}_trace.jsonl copies (default: the "
    "datasets module: $PREFIXCACHE_DATA, downloaded and checksum-verified on first use).")
_MOONCAKE_REQUESTS = flags.DEFINE_integer(
    "mooncake_requests", 0, "Replay only the first N requests of each Mooncake trace (0: all).")
_MOONCAKE_NUM_BLOCKS = flags.DEFINE_integer(
    "mooncake_num_blocks", 10000,
    "vLLM's pool for the Mooncake traces at 512-token blocks (incl. its null block).")
_MOONCAKE_HASH_IDS = flags.DEFINE_bool(
    "mooncake_hash_ids", True,
    "In-process mode: also time our replay keyed by Mooncake hash ids (a second row).")
_TRACE_DIR = flags.DEFINE_string(
    "trace_dir", None,
    "Where the generated traces (and vLLM's outputs) are written; default: a fresh "
    "temporary directory, so concurrent invocations never overwrite each other's files.")
_HASH_SEED = flags.DEFINE_integer(
    "hash_seed", 0, "Hash chain seed for both (vLLM gets PYTHONHASHSEED).")
_PROGRESS = _common.define_progress_flag()


def generate_traces(peers_dir: str, out_dir: str, seed: int, names: list[str]) -> dict[str, str]:
    """Run the peer's own generator: the very traces vllm_replay.py is given."""
    os.makedirs(out_dir, exist_ok=True)
    subprocess.run(
        [sys.executable, os.path.join(peers_dir, "make_traces.py"), "--out-dir", out_dir,
         "--seed", str(seed), "--traces", ",".join(names)],
        check=True, capture_output=True, text=True,
    )
    return {n: os.path.join(out_dir, f"{n}.jsonl") for n in names}


def run_ours(trace, algo: str, records: list | None = None, bs=None, nb=None) -> dict:
    from prefixcache.sim.replay import replay  # noqa: PLC0415

    gc.collect()
    return replay(
        trace,
        num_blocks=(nb or _NUM_BLOCKS.value) - 1,
        block_size=bs or _BLOCK_SIZE.value,
        hash_algo=algo,
        hash_seed=_HASH_SEED.value,
        free_order=_FREE_ORDER.value,
        concurrency=_CONCURRENCY.value,
        on_record=records.append if records is not None else None,
    )


def run_vllm(path: str, algo: str, out: str | None, bs=None, nb=None) -> dict:
    cmd = [
        _VLLM_PYTHON.value, os.path.join(_PEERS.value, "vllm_replay.py"),
        "--trace", path, "--num-blocks", str(nb or _NUM_BLOCKS.value),
        "--block-size", str(bs or _BLOCK_SIZE.value), "--hash-algo", algo,
        "--concurrency", str(_CONCURRENCY.value), "--repeat", "1",
        # NOTE: each round is a fresh interpreter; without a warm-up its one timed
        # replay would be a cold one (first-touch allocations, cold caches: measured
        # ~20% slower) against our warm rounds.
        "--warmup", str(_WARMUP.value),
    ]
    if out:
        cmd += ["--out", out]
    env = dict(os.environ, PYTHONHASHSEED=str(_HASH_SEED.value))
    res = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(res.stdout.strip().splitlines()[-1])


def records_identical(ours: list[dict], vllm_out: str) -> bool:
    """Same hits / failures / truncations, block ids shifted by vLLM's null block."""
    with open(vllm_out) as f:
        theirs = [json.loads(line) for line in f]
    if len(theirs) != len(ours):
        return False
    for a, b in zip(ours, theirs):
        b = dict(b, block_ids=[x - 1 for x in b["block_ids"]])
        if a != b:
            return False
    return True


def bench_one(name: str, path: str, algo: str, bs=None, nb=None) -> dict:
    from prefixcache.sim.trace import read_trace  # noqa: PLC0415

    trace = list(read_trace(path))  # parsed once, outside every timed loop
    records: list[dict] = []
    for _ in range(_WARMUP.value):
        run_ours(trace, algo, bs=bs, nb=nb)
    ours_runs, vllm_runs = [], []
    vllm_out = None
    for r in range(_REPEAT.value):
        ours_runs.append(run_ours(trace, algo, records if r == 0 else None, bs, nb))
        if _VLLM_PYTHON.value:
            if r == 0:
                vllm_out = os.path.join(_TRACE_DIR.value, f"{name}.{bs}.{algo}.vllm.jsonl")
            vllm_runs.append(run_vllm(path, algo, vllm_out if r == 0 else None, bs, nb))
    med = lambda xs: statistics.median(xs)  # noqa: E731
    s0 = ours_runs[0]
    loop = med([s["timing"]["loop_s"] for s in ours_runs])
    result = {
        "workload": name,
        "hash_algo": algo,
        "block_size": bs or _BLOCK_SIZE.value,
        "num_blocks_vllm": nb or _NUM_BLOCKS.value,
        "keys": "tokens",
        "requests": s0["requests"],
        "prompt_tokens": s0["prompt_tokens"],
        "hit_tokens": s0["hit_tokens"],
        "hit_rate_tokens": s0["hit_rate_tokens"],
        "evictions": s0["evictions"],
        "failed": s0["failed"],
        "ours": {
            "loop_s": loop,
            "hashing_s": med([s["timing"]["hashing_s"] for s in ours_runs]),
            "manager_s": med([s["timing"]["manager_s"] for s in ours_runs]),
            "loop_s_runs": [s["timing"]["loop_s"] for s in ours_runs],
            "requests_per_s": s0["requests"] / loop,
            "prompt_tokens_per_s": s0["prompt_tokens"] / loop,
        },
    }
    if vllm_runs:
        v0 = vllm_runs[0]
        vt = lambda k: med([v["timing"][k] for v in vllm_runs])  # noqa: E731
        vhash = med([v["timing"]["request_build_s"] + v["timing"]["append_s"] for v in vllm_runs])
        result["vllm"] = {
            "loop_s": vt("loop_s"),
            "hashing_s": vhash,  # Request construction (prompt hashing) + appends
            "manager_s": vt("manager_s"),
            "loop_s_runs": [v["timing"]["loop_s"] for v in vllm_runs],
            "requests_per_s": v0["requests"] / vt("loop_s"),
            "prompt_tokens_per_s": v0["prompt_tokens"] / vt("loop_s"),
            "hit_tokens": v0["hit_tokens"],
        }
        result["hit_tokens_equal"] = v0["hit_tokens"] == s0["hit_tokens"]
        result["records_identical"] = records_identical(records, vllm_out)
        result["speedup_loop"] = med(
            [v["timing"]["loop_s"] / o["timing"]["loop_s"] for v, o in zip(vllm_runs, ours_runs)]
        )
        result["speedup_manager"] = med(
            [v["timing"]["manager_s"] / o["timing"]["manager_s"]
             for v, o in zip(vllm_runs, ours_runs)]
        )
        # Min over rounds: on a loaded machine the least disturbed run of each.
        result["speedup_loop_min"] = min(result["vllm"]["loop_s_runs"]) / min(
            result["ours"]["loop_s_runs"]
        )
        result["speedup_hashing"] = vhash / result["ours"]["hashing_s"]
    return result


def _trace_stats(path: str) -> tuple[int, int]:
    """(requests, prompt tokens) of a JSONL trace, streamed (no token lists kept)."""
    from prefixcache.sim.trace import read_trace  # noqa: PLC0415

    n = tokens = 0
    for t in read_trace(path):
        n += 1
        tokens += len(t.prompt)
    return n, tokens


def bench_inprocess(
    name: str, path: str, algos: list[str], bs=None, nb=None, mooncake: str | None = None
) -> list[dict]:
    """All algorithms of one workload through ``experiments.peer_inprocess``.

    ``mooncake``: the Mooncake file ``path`` was converted from; adds our hash-id rows."""
    bs, nb = bs or _BLOCK_SIZE.value, nb or _NUM_BLOCKS.value
    num_requests, prompt_tokens = _trace_stats(path)
    cmd = [
        _VLLM_PYTHON.value, "-m", "experiments.peer_inprocess", "--trace", path,
        "--hash_algos", ",".join(algos), "--num_blocks", str(nb),
        "--block_size", str(bs), "--concurrency", str(_CONCURRENCY.value),
        "--rounds", str(_REPEAT.value), "--warmup", str(_WARMUP.value),
        "--hash_seed", str(_HASH_SEED.value), "--free_order", _FREE_ORDER.value,
    ]
    if mooncake:
        cmd += ["--mooncake_trace", mooncake]
    env = dict(
        os.environ, PYTHONHASHSEED=str(_HASH_SEED.value),
        PYTHONPATH=os.pathsep.join([_REPO, _PEERS.value]),
        VLLM_LOGGING_STREAM="ext://sys.stderr",
    )
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=_REPO)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")
    med = statistics.median
    results = []
    for line in res.stdout.splitlines():
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        o, v = d["ours"], d["vllm"]
        def side(runs, hits):
            loop = med([t["loop_s"] for t in runs])
            return {
                "loop_s": loop,
                "hashing_s": med([t["hashing_s"] for t in runs]),
                "manager_s": med([t["manager_s"] for t in runs]),
                "loop_s_runs": [t["loop_s"] for t in runs],
                "requests_per_s": num_requests / loop,
                "prompt_tokens_per_s": prompt_tokens / loop,
                "hit_tokens": hits,
            }
        r = {
            "workload": name,
            "hash_algo": d["hash_algo"],
            "block_size": bs,
            "num_blocks_vllm": nb,
            "keys": "tokens",
            "peer_mode": "inprocess",
            "requests": num_requests,
            "prompt_tokens": prompt_tokens,
            "hit_tokens": d["ours_hit_tokens"],
            "hit_rate_tokens": d["ours_hit_tokens"] / prompt_tokens,
            "ours": side(o, d["ours_hit_tokens"]),
            "vllm": side(v, d["vllm_hit_tokens"]),
            "hit_tokens_equal": d["ours_hit_tokens"] == d["vllm_hit_tokens"],
            "records_identical": d["records_identical"],
            # Rounds are pairs timed back to back: the median of per-pair ratios.
            "speedup_loop": med([a["loop_s"] / b["loop_s"] for a, b in zip(v, o)]),
            "speedup_manager": med([a["manager_s"] / b["manager_s"] for a, b in zip(v, o)]),
            "speedup_hashing": med([a["hashing_s"] / b["hashing_s"] for a, b in zip(v, o)]),
            "speedup_loop_min": min(t["loop_s"] for t in v) / min(t["loop_s"] for t in o),
            "peer_versions": d["versions"],
        }
        results.append(r)
        if "ours_hash_ids" in d:
            k = d["ours_hash_ids"]
            results.append(dict(
                r,
                keys="hash_ids",
                hit_tokens=d["ours_hash_ids_hit_tokens"],
                hit_rate_tokens=d["ours_hash_ids_hit_tokens"] / prompt_tokens,
                ours=side(k, d["ours_hash_ids_hit_tokens"]),
                hit_tokens_equal=d["ours_hash_ids_hit_tokens"] == d["vllm_hit_tokens"],
                records_identical=d["hash_ids_records_identical"],
                speedup_loop=med([a["loop_s"] / b["loop_s"] for a, b in zip(v, k)]),
                speedup_manager=med([a["manager_s"] / b["manager_s"] for a, b in zip(v, k)]),
                speedup_hashing=med([a["hashing_s"] / b["hashing_s"] for a, b in zip(v, k)]),
                speedup_loop_min=min(t["loop_s"] for t in v) / min(t["loop_s"] for t in k),
            ))
    if len(results) != len(algos) * (2 if mooncake and _MOONCAKE_HASH_IDS.value else 1):
        raise RuntimeError(f"peer_inprocess printed {len(results)} results for {algos}")
    return results


def _line(r: dict) -> str:
    o = r["ours"]
    label = f"{r['workload']}@{r.get('block_size', '')}" + (
        " [hash ids]" if r.get("keys") == "hash_ids" else ""
    )
    s = (
        f"{label:>22} {r['hash_algo']:>11}: {o['requests_per_s']:9.0f} req/s "
        f"{o['prompt_tokens_per_s'] / 1e6:6.2f} M prompt tok/s | loop {o['loop_s']:.3f}s = "
        f"hashing {o['hashing_s']:.3f}s + manager {o['manager_s']:.3f}s (+ loop overhead) | "
        f"hit rate {r['hit_rate_tokens']:.3f}"
    )
    if "vllm" in r:
        v = r["vllm"]
        s += (
            f"\n{'':>36}vLLM loop {v['loop_s']:.3f}s (hashing {v['hashing_s']:.3f}s, manager "
            f"{v['manager_s']:.3f}s) -> x{r['speedup_loop']:.2f} loop (x{r['speedup_loop_min']:.2f} at "
            f"min), x{r['speedup_hashing']:.2f} "
            f"hashing, x{r['speedup_manager']:.2f} manager; hits equal: {r['hit_tokens_equal']}, "
            f"records identical: {r['records_identical']}"
        )
    return s


MOONCAKE_BLOCK_TOKENS = 512


def convert_mooncake(name: str) -> tuple[str, str]:
    """(Mooncake source, our JSONL of its first --mooncake_requests lines), converted
    once into --trace_dir (the peer reads only our format)."""
    import itertools  # noqa: PLC0415

    from prefixcache.sim.trace import read_trace, write_trace  # noqa: PLC0415

    if _MOONCAKE_DIR.value:
        src = os.path.join(_MOONCAKE_DIR.value, f"{name}_trace.jsonl")
    else:
        from prefixcache.sim import datasets  # noqa: PLC0415

        src = str(datasets.path_of(f"mooncake_{name}", progress=_PROGRESS.value))
    n = _MOONCAKE_REQUESTS.value
    out = os.path.join(_TRACE_DIR.value, f"mooncake_{name}{f'_{n}' if n else ''}.jsonl")
    if not os.path.exists(out):
        write_trace(out, itertools.islice(read_trace(src), n or None))
    return src, out


def main(argv):
    del argv

    if _TRACE_DIR.value is None:
        FLAGS.trace_dir = tempfile.mkdtemp(prefix="prefixcache-bench-")
    os.makedirs(_TRACE_DIR.value, exist_ok=True)
    block_sizes = [int(b) for b in _BLOCK_SIZES.value] or [_BLOCK_SIZE.value]
    paths = (
        generate_traces(_PEERS.value, _TRACE_DIR.value, _SEED.value, _WORKLOADS.value)
        if _WORKLOADS.value else {}
    )
    # (name, JSONL path, Mooncake source or None, vLLM pool at block size bs)
    cells = [
        (name, paths[name], None, lambda bs: _NUM_BLOCKS.value * _BLOCK_SIZE.value // bs)
        for name in _WORKLOADS.value
    ]
    for name in _MOONCAKE.value:
        src, path = convert_mooncake(name)
        cells.append((
            f"mooncake_{name}", path, src,
            lambda bs: _MOONCAKE_NUM_BLOCKS.value * MOONCAKE_BLOCK_TOKENS // bs,
        ))
    inprocess = _VLLM_PYTHON.value and _PEER_MODE.value == "inprocess"
    results = []
    bar = _common.progress_bar(enabled=_PROGRESS.value, desc="bench_manager", unit="cell",
                               total=len(cells) * len(block_sizes) * len(_ALGOS.value))
    for name, path, src, pool in cells:
        for bs in block_sizes:
            nb = pool(bs)
            if inprocess:
                rs = bench_inprocess(
                    name, path, _ALGOS.value, bs, nb,
                    src if _MOONCAKE_HASH_IDS.value else None,
                )
            else:
                rs = (bench_one(name, path, algo, bs, nb) for algo in _ALGOS.value)
            for r in rs:
                results.append(r)
                if r.get("keys", "tokens") == "tokens":
                    bar.update(1)
                print(_line(r), flush=True)
    bar.close()
    summary = {
        "benchmark": "bench_manager",
        "num_blocks_vllm": _NUM_BLOCKS.value,
        "num_blocks_ours": _NUM_BLOCKS.value - 1,
        "block_size": _BLOCK_SIZE.value,
        "block_sizes": block_sizes,
        "mooncake": _MOONCAKE.value,
        "mooncake_requests": _MOONCAKE_REQUESTS.value or None,
        "mooncake_num_blocks_vllm_at_512": _MOONCAKE_NUM_BLOCKS.value,
        "concurrency": _CONCURRENCY.value,
        "free_order": _FREE_ORDER.value,
        "repeat": _REPEAT.value,
        "warmup": _WARMUP.value,
        "peer_mode": _PEER_MODE.value if _VLLM_PYTHON.value else None,
        "results": results,
        "provenance": _common.provenance(None, seed=_SEED.value),
    }
    if any("speedup_loop" in r for r in results):
        tok = [r for r in results if r.get("keys", "tokens") == "tokens"]
        summary["min_speedup_loop"] = min(r["speedup_loop"] for r in tok)
        summary["min_speedup_loop_at_min"] = min(r["speedup_loop_min"] for r in tok)
        summary["all_records_identical"] = all(r["records_identical"] for r in results)
    print(json.dumps(summary))


if __name__ == "__main__":
    _common.run_app(main)
