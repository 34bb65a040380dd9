r"""The radix index beside the hash index on sliding-window layouts: hits, evictions,
stranded blocks and replay loop time, side by side in one process.

    python -m experiments.bench_radix_hybrid                 # ~2 min on 2 cores
    python -m experiments.bench_radix_hybrid --quick         # one workload, one layout

Per workload x layout x pool size, both indexes replay the same trace
(``prefixcache.sim.replay.replay``, block size 16, concurrency 8, ``unhashed_first``),
best of ``--rounds`` by loop time; one JSON line each (a provenance line first):
``hit_rate``, ``evictions``, ``stranded`` (cached but unreachable: the hash chain's holes;
always 0 for the tree), ``loop_s``, and ``radix_over_hash_loop``. On an unbounded pool the
two hit rates are equal by construction (vLLM's hybrid hit rule on both; pinned by
``tests/core/test_radix_hybrid.py``). argparse only (no absl, no jax).
"""

from __future__ import annotations

import argparse
import json

from experiments import _common
from prefixcache.core.kv_groups import parse_kv_groups
from prefixcache.sim import workloads
from prefixcache.sim.replay import replay


def one(reqs, layout: str, num_blocks: int, index: str, rounds: int) -> dict:
    best = None
    for _ in range(rounds):
        s = replay(reqs, num_blocks=num_blocks, block_size=16, concurrency=8, index=index,
                   kv_cache_groups=parse_kv_groups(layout), free_order="unhashed_first")
        if best is None or s["timing"]["loop_s"] < best["timing"]["loop_s"]:
            best = s
    return {"hit_rate": round(best["hit_rate_tokens"], 4), "evictions": best["evictions"],
            "stranded": best["stranded_blocks"], "loop_s": round(best["timing"]["loop_s"], 3)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3,
                   help="replays per cell (the fastest is kept)")
    p.add_argument("--quick", action="store_true", help="one workload, one layout")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    traces = {"multi_turn": lambda: workloads.generate("multi_turn", num_conversations=100,
                                                       num_turns=4)}
    layouts = ("full,sw128",)
    pools = (100_000, 600)
    if not args.quick:
        traces["shared_system_prompt"] = lambda: workloads.generate(
            "shared_system_prompt", num_requests=400)
        traces["rag(600)"] = lambda: workloads.generate("rag", num_requests=600)
        layouts = ("full,sw128", "sw128", "full,sw64,sw256")
        pools = (100_000, 4000, 1500, 600)
    print(json.dumps({"record": "provenance", "provenance": _common.to_jsonable(
        _common.provenance({"rounds": args.rounds, "quick": args.quick}, seed=0,
                           hash_algo="sha256", cache_state="cold"))}), flush=True)
    for name, make in traces.items():
        reqs = make()
        for layout in layouts:
            for num_blocks in pools:
                row = {"trace": name, "layout": layout, "num_blocks": num_blocks}
                for index in ("hash", "radix"):
                    row[index] = one(reqs, layout, num_blocks, index, args.rounds)
                row["radix_over_hash_loop"] = round(
                    row["radix"]["loop_s"] / max(row["hash"]["loop_s"], 1e-9), 2)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
