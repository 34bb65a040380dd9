r"""The radix-tree index's replay beside the hash chain's (and vLLM 0.33's), one process.

Every round replays the same trace through ``prefixcache.sim.replay.replay`` with the
hash-chain ``KVCacheManager`` and with ``RadixKVCacheManager`` -- and, when vLLM is
importable, through vLLM's own manager (``vllm_replay.replay_once``, the peer harness) --
back to back, the order rotated each round, after untimed warm-up replays: on a shared
2-core machine only ratios timed side by side mean anything (see WORKSPACE_NOTES,
"Measuring against vLLM"). Hits are compared request by request.

Ours only (any venv with our package)::

  python -m experiments.bench_radix --trace_dir=/tmp/radix-traces

With vLLM (the peer venv's Python, our package and the peer harness on PYTHONPATH)::

  PYTHONHASHSEED=0 PYTHONPATH=$PWD:$PWD/experiments/peers \
      $HOME/.cache/prefixcache-peers/vllm-venv/bin/python -m experiments.bench_radix \
      --trace_dir=/tmp/radix-traces --rounds=5   # --peers_dir=DIR: another copy of experiments/peers

Under pressure (``--pressure=64,256,1024``: pool sizes in blocks; our two indexes only,
no timing): per workload x pool x eviction policy, hits, evictions and *stranded*
blocks -- cached but unreachable because a block before them in their chain was
evicted -- at the end of the replay (the summary's ``stranded_blocks``, the manager's
``num_stranded_blocks()``: always 0 for the tree)::

  python -m experiments.bench_radix --trace_dir=/tmp/radix-traces --pressure=64,256,1024

Traces: the peer's ``make_traces.py`` (the workloads ``bench_manager`` uses), written to
``--trace_dir`` when missing. Prints one JSON line per workload x hash algorithm:
``loop_s`` per round of each index, the median per-round ratios ``radix_over_hash`` and
``vllm_over_radix``, and whether the hits agree. argparse only (no absl, no jax), so the
peer venv runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import types

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PEERS_DEFAULT = os.path.join(_REPO, "experiments", "peers")
WORKLOADS = ("shared_system_prompt", "multi_turn", "few_shot", "mm_salt")


def run_ours(trace, index: str, *, num_blocks: int, block_size: int, hash_algo: str,
             concurrency: int, hash_seed: int, free_order: str) -> tuple[list[dict], dict]:
    """One replay through our manager of ``index`` ("hash" or "radix")."""
    from prefixcache.sim.replay import replay  # noqa: PLC0415

    records: list[dict] = []
    r = replay(trace, index=index, num_blocks=num_blocks, block_size=block_size,
               hash_algo=hash_algo, hash_seed=hash_seed, free_order=free_order,
               concurrency=concurrency, on_record=records.append)
    return records, dict(r["timing"], evictions=r["evictions"], hit_tokens=r["hit_tokens"])


def pressure(trace, index: str, *, num_blocks: int, eviction: str, block_size: int,
             concurrency: int, hash_seed: int) -> dict:
    """One replay of ``trace`` through ``index`` with ``num_blocks`` blocks: hits,
    evictions and the stranded blocks at the end."""
    from prefixcache.sim.replay import replay  # noqa: PLC0415

    r = replay(trace, num_blocks=num_blocks, block_size=block_size, hash_seed=hash_seed,
               free_order="unhashed_first", concurrency=concurrency, index=index,
               eviction=eviction)
    return {
        "hit_rate_tokens": r["hit_rate_tokens"],
        "hit_tokens": r["hit_tokens"],
        "evictions": r["evictions"],
        "stranded_end": r["stranded_blocks"],
    }


def _traces(peers: str, trace_dir: str, names: list[str], seed: int) -> dict[str, str]:
    paths = {n: os.path.join(trace_dir, f"{n}.jsonl") for n in names}
    missing = [n for n, p in paths.items() if not os.path.exists(p)]
    if missing:
        os.makedirs(trace_dir, exist_ok=True)
        subprocess.run(
            [sys.executable, os.path.join(peers, "make_traces.py"), "--out-dir", trace_dir,
             "--seed", str(seed), "--traces", ",".join(missing)],
            check=True, capture_output=True, text=True,
        )
    return paths


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace_dir", required=True,
                    help="where the peer traces are (made if missing)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help="comma-separated generated workloads")
    ap.add_argument("--hash_algos", default="sha256,xxhash_cbor",
                    help="comma-separated hash algorithms")
    ap.add_argument("--num_blocks", type=int, default=4096,
                    help="vLLM's pool incl. its null block (ours: one less)")
    ap.add_argument("--block_size", type=int, default=16, help="tokens per block")
    ap.add_argument("--concurrency", type=int, default=8,
                    help="most requests holding blocks at once")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per cell")
    ap.add_argument("--warmup", type=int, default=1, help="untimed replays first")
    ap.add_argument("--hash_seed", type=int, default=0,
                    help="hash root seed (vLLM reads PYTHONHASHSEED, which must equal it)")
    ap.add_argument("--seed", type=int, default=0, help="make_traces.py seed")
    ap.add_argument("--free_order", default="unhashed_first",
                    help="our free order (vLLM's is unhashed_first)")
    ap.add_argument("--peers_dir", default=_PEERS_DEFAULT,
                    help="directory of make_traces.py and vllm_replay.py")
    ap.add_argument("--pressure", default="",
                    help="pool sizes (blocks): measure hits and stranded blocks instead")
    ap.add_argument("--evictions", default="",
                    help="policies for --pressure (default: every one without a future)")
    ap.add_argument("--no_vllm", action="store_true", help="skip vLLM even when importable")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")

    from prefixcache.sim.trace import read_trace  # noqa: PLC0415

    if args.pressure:
        from prefixcache.core.eviction import get_policy_class, policy_names  # noqa: PLC0415

        evictions = [e for e in args.evictions.split(",") if e] or [
            p for p in policy_names() if not get_policy_class(p).needs_future
        ]
        paths = _traces(args.peers_dir, args.trace_dir,
                        [w for w in args.workloads.split(",") if w], args.seed)
        for name, path in paths.items():
            trace = list(read_trace(path))
            for nb in [int(x) for x in args.pressure.split(",") if x]:
                for ev in evictions:
                    row = {"workload": name, "num_blocks": nb, "eviction": ev}
                    for index in ("hash", "radix"):
                        row[index] = pressure(
                            trace, index, num_blocks=nb, eviction=ev,
                            block_size=args.block_size, concurrency=args.concurrency,
                            hash_seed=args.hash_seed,
                        )
                    print(json.dumps(row), flush=True)
        return

    peer = None
    if not args.no_vllm:
        try:
            import vllm  # noqa: F401, PLC0415
        except ImportError:
            pass
        else:
            if os.environ.get("PYTHONHASHSEED") != str(args.hash_seed):
                ap.error(f"set PYTHONHASHSEED={args.hash_seed}: vLLM seeds its hash chain from it")
            os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
            sys.path.insert(0, args.peers_dir)  # the peer harness, vllm_replay.py
            import vllm_replay as peer  # noqa: PLC0415

    paths = _traces(args.peers_dir, args.trace_dir,
                    [w for w in args.workloads.split(",") if w], args.seed)
    med = statistics.median
    for name, path in paths.items():
        ours_trace = list(read_trace(path))
        if peer is not None:
            ptrace = peer.load_trace(path)
            max_model_len = max(len(e["prompt"]) + max(1, e["output_len"]) for e in ptrace)
            inputs = peer.prepare_inputs(ptrace)
            out_tokens = [
                [peer.output_token(e["id"], s) for s in range(max(1, e["output_len"]))]
                for e in ptrace
            ]
        for algo in [a for a in args.hash_algos.split(",") if a]:
            runners = {}
            for index in ("hash", "radix"):
                runners[index] = (lambda index=index: run_ours(
                    ours_trace, index, num_blocks=args.num_blocks - 1,
                    block_size=args.block_size, hash_algo=algo,
                    concurrency=args.concurrency, hash_seed=args.hash_seed,
                    free_order=args.free_order,
                ))
            if peer is not None:
                pargs = types.SimpleNamespace(
                    num_blocks=args.num_blocks, block_size=args.block_size,
                    hash_algo=algo, concurrency=args.concurrency, events=False,
                )

                def run_vllm(pargs=pargs):
                    records, timings, _, _ = peer.replay_once(
                        pargs, ptrace, inputs, out_tokens, max_model_len, False
                    )
                    return records, {"loop_s": timings["loop_s"]}

                runners["vllm"] = run_vllm
            names = list(runners)
            for _ in range(args.warmup):
                for k in names:
                    runners[k]()
            timed = {k: [] for k in names}
            first = {}
            for i in range(args.rounds):
                order = names[i % len(names):] + names[: i % len(names)]
                for k in order:
                    records, t = runners[k]()
                    timed[k].append(t)
                    first.setdefault(k, records)
            hits = {k: [r["num_computed_tokens"] for r in first[k]] for k in names}
            loops = {k: [t["loop_s"] for t in timed[k]] for k in names}
            out = {
                "workload": name,
                "hash_algo": algo,
                "rounds": args.rounds,
                "num_blocks": args.num_blocks - 1,
                "loop_s": loops,
                "hit_tokens": {k: sum(v) for k, v in hits.items()},
                "evictions": {k: timed[k][0]["evictions"] for k in ("hash", "radix")},
                "radix_hits_equal_hash": hits["radix"] == hits["hash"],
                "radix_over_hash": med([r / h for r, h in zip(loops["radix"], loops["hash"])]),
                "radix_over_hash_min": min(loops["radix"]) / min(loops["hash"]),
            }
            if "vllm" in loops:
                out["radix_hits_equal_vllm"] = hits["radix"] == hits["vllm"]
                out["vllm_over_radix"] = med([v / r for v, r in zip(loops["vllm"], loops["radix"])])
                out["vllm_over_radix_min"] = min(loops["vllm"]) / min(loops["radix"])
                out["vllm_over_hash"] = med([v / h for v, h in zip(loops["vllm"], loops["hash"])])
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
