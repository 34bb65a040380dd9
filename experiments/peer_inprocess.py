r"""Our replay and vLLM's, alternated in ONE interpreter: the steadiest speed ratio.

Run by ``experiments.bench_manager --peer_mode=inprocess`` with the peer venv's Python
(it needs vLLM; our package comes from ``PYTHONPATH``; no absl, no jax), from the
checkout root::

  cd $REPO && PYTHONHASHSEED=0 PYTHONPATH=$REPO:$REPO/experiments/peers \
      $VLLM_PY -m experiments.peer_inprocess --trace T.jsonl --hash_algos sha256,xxhash_cbor

Why: on a shared 2-core machine the speed drifts by 20-40% over seconds. Two processes
timed one after the other see different drift; here every round times vLLM's replay
(``vllm_replay.replay_once``, the harness's own code) and ours
(``prefixcache.sim.replay.replay``) back to back, swapping which goes first each round,
with the same Python, numpy, cbor2 and xxhash, after the same untimed warm-up replays.
Records (hits, block ids shifted by vLLM's null block, failures, truncations) are
compared request by request.

With ``--mooncake_trace`` (the Mooncake file ``--trace`` was converted from) a third side
joins the rounds: our replay keying blocks by the Mooncake hash ids
(``read_trace(..., mooncake_tokens="lazy")``), its records checked against vLLM's too.
Our token-path requests share the peer's prompt lists (one copy of the tokens).

Prints one JSON line per hash algorithm: per-round ``loop_s``/``hashing_s``/
``manager_s`` of both, their hits, ``records_identical`` and the library versions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types


def _versions() -> dict:
    import cbor2  # noqa: PLC0415
    import numpy  # noqa: PLC0415
    import vllm  # noqa: PLC0415
    import xxhash  # noqa: PLC0415
    from importlib import metadata  # noqa: PLC0415

    def ver(dist, mod):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:  # pragma: no cover - odd installs
            return getattr(mod, "__version__", None)

    return {
        "python": sys.version.split()[0],
        "vllm": ver("vllm", vllm),
        "numpy": ver("numpy", numpy),
        "cbor2": ver("cbor2", cbor2),
        "xxhash": ver("xxhash", xxhash),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True, help="peer-format JSONL trace")
    ap.add_argument("--hash_algos", default="sha256,xxhash_cbor",
                    help="comma-separated hash algorithms, one JSON line each")
    ap.add_argument("--num_blocks", type=int, default=4096,
                    help="vLLM's pool incl. its null block (ours: one less)")
    ap.add_argument("--block_size", type=int, default=16, help="tokens per block")
    ap.add_argument("--concurrency", type=int, default=8,
                    help="requests holding blocks at once")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds of each")
    ap.add_argument("--warmup", type=int, default=1, help="untimed replays of each first")
    ap.add_argument("--hash_seed", type=int, default=0,
                    help="ours; vLLM reads PYTHONHASHSEED, which must equal it")
    ap.add_argument("--free_order", default="unhashed_first",
                    help="our free order (vLLM's is unhashed_first; parity needs it)")
    ap.add_argument("--mooncake_trace", default=None,
                    help="the Mooncake file --trace was converted from: adds a third "
                         "side, ours keyed by its hash ids (read_trace mooncake_tokens="
                         "'lazy'), on the same first len(trace) requests")
    args = ap.parse_args(argv)
    if os.environ.get("PYTHONHASHSEED") != str(args.hash_seed):
        ap.error(f"set PYTHONHASHSEED={args.hash_seed}: vLLM seeds its hash chain from it")
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import vllm_replay as peer  # noqa: PLC0415  (the harness, from PYTHONPATH)

    from prefixcache.sim.replay import replay  # noqa: PLC0415
    from prefixcache.sim.trace import read_trace  # noqa: PLC0415

    trace = peer.load_trace(args.trace)
    max_model_len = max(len(e["prompt"]) + max(1, e["output_len"]) for e in trace)
    inputs = peer.prepare_inputs(trace)
    out_tokens = [
        [peer.output_token(e["id"], s) for s in range(max(1, e["output_len"]))] for e in trace
    ]
    # NOTE: our requests share the peer's prompt lists (one copy of the tokens: a
    # Mooncake trace is ~36 bytes per token as Python ints); read_trace still validates.
    ours_trace = []
    for tr, e in zip(read_trace(args.trace), trace):
        tr.prompt = e["prompt"]
        ours_trace.append(tr)
    keyed_trace = None
    if args.mooncake_trace:
        import itertools  # noqa: PLC0415

        keyed_trace = list(itertools.islice(
            read_trace(args.mooncake_trace, mooncake_tokens="lazy"), len(trace)
        ))
        if [t.id for t in keyed_trace] != [t.id for t in ours_trace]:
            ap.error("--mooncake_trace does not match --trace (request ids differ)")
    versions = _versions()

    for algo in filter(None, args.hash_algos.split(",")):
        pargs = types.SimpleNamespace(
            num_blocks=args.num_blocks, block_size=args.block_size, hash_algo=algo,
            concurrency=args.concurrency, events=False,
            kv_groups=None, retention_interval=None,  # (one full-attention group)
        )

        def run_vllm():
            records, timings, _, _ = peer.replay_once(
                pargs, trace, inputs, out_tokens, max_model_len, False
            )
            return records, {
                "loop_s": timings["loop_s"],
                "manager_s": timings["manager_s"],
                "hashing_s": timings["request_build_s"] + timings["append_s"],
            }

        def run_ours(reqs=ours_trace):
            records: list[dict] = []
            r = replay(
                reqs, num_blocks=args.num_blocks - 1, block_size=args.block_size,
                hash_algo=algo, hash_seed=args.hash_seed, free_order=args.free_order,
                concurrency=args.concurrency, on_record=records.append,
            )
            return records, dict(r["timing"])

        sides = [("vllm", run_vllm), ("ours", run_ours)]
        if keyed_trace is not None:
            sides.append(("ours_hash_ids", lambda: run_ours(keyed_trace)))
        for _ in range(args.warmup):
            for _, fn in sides:
                fn()
        timed = {name: [] for name, _ in sides}
        first = {}
        for i in range(args.rounds):
            for name, fn in sides if i % 2 == 0 else sides[::-1]:
                records, t = fn()
                timed[name].append(t)
                first.setdefault(name, records)
        theirs = [dict(r, block_ids=[b - 1 for b in r["block_ids"]]) for r in first["vllm"]]
        ours = first["ours"]
        extra = {}
        if keyed_trace is not None:
            extra = {
                "ours_hash_ids": timed["ours_hash_ids"],
                "ours_hash_ids_hit_tokens": sum(
                    r["num_computed_tokens"] for r in first["ours_hash_ids"]
                ),
                "hash_ids_records_identical": theirs == first["ours_hash_ids"],
            }
        print(json.dumps({
            "hash_algo": algo,
            "trace": os.path.abspath(args.trace),
            "rounds": args.rounds,
            "warmup": args.warmup,
            "vllm": timed["vllm"],
            "ours": timed["ours"],
            "vllm_hit_tokens": sum(r["num_computed_tokens"] for r in first["vllm"]),
            "ours_hit_tokens": sum(r["num_computed_tokens"] for r in first["ours"]),
            "records_identical": theirs == ours,
            "versions": versions,
            **extra,
        }), flush=True)


if __name__ == "__main__":
    main()
