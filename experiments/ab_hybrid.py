r"""A/B of the hybrid (sliding-window) manager: the working tree against an earlier
commit, in ONE process (``ab_replay``'s method, with KV cache groups).

  python -m experiments.ab_hybrid --base=main --layouts='full;sw32' --rounds=10 \
      --workloads=multi_turn,few_shot,shared_system_prompt --num_blocks=1023

Each round replays the same trace through the base revision's ``prefixcache`` (exported
by ``ab_replay.export_base`` as ``prefixcache_base``) and the working tree back to back,
with ``kv_cache_groups`` parsed by each side's own ``kv_groups.parse_kv_groups``,
swapping which goes first every round. Per cell: min and median ``manager_s`` (the
manager calls: what a manager change moves) and ``loop_s``, the ratio new/base (< 1:
the working tree is faster) and whether both produced identical records. Last stdout
line: one JSON summary with provenance.
"""

from __future__ import annotations

import importlib
import json
import statistics
import sys
import tempfile

from absl import app, flags  # noqa: F401 (flags: --layouts)

from experiments import _common

# NOTE: ab_replay's flags (--base, --workloads, --rounds, --num_blocks, --block_size,
# --concurrency, --seed, ...) are this script's too; it adds --layouts.
from experiments.ab_replay import (
    _BASE,
    _BLOCK_SIZE,
    _CONCURRENCY,
    _NUM_BLOCKS,
    _ROUNDS,
    _SEED,
    _WORKLOADS,
    export_base,
)

_LAYOUTS = flags.DEFINE_list(
    "layouts", ["full;sw32", "full;sw32;sw64"],
    "KV cache layouts, groups separated by ';' (parse_kv_groups entries).")


def _side(runs: list[dict]) -> dict:
    return {k: {"min": min(r[k] for r in runs),
                "median": statistics.median(r[k] for r in runs)}
            for k in ("manager_s", "loop_s")}


def main(argv):
    del argv
    from experiments._common import provenance  # noqa: PLC0415
    from prefixcache.core.kv_groups import parse_kv_groups as new_groups  # noqa: PLC0415
    from prefixcache.sim import workloads  # noqa: PLC0415
    from prefixcache.sim.replay import replay as new_replay  # noqa: PLC0415

    if not _BASE.value:
        raise app.UsageError("--base=REV is required (e.g. --base=main)")
    tmp = tempfile.mkdtemp(prefix="prefixcache-ab-hybrid-")
    try:
        commit = export_base(_BASE.value, tmp)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    sys.path.insert(0, tmp)
    base_replay = importlib.import_module("prefixcache_base.sim.replay").replay
    base_groups = importlib.import_module("prefixcache_base.core.kv_groups").parse_kv_groups
    results = []
    for w in _WORKLOADS.value:
        trace = workloads.generate(w, seed=_SEED.value)
        for layout in _LAYOUTS.value:
            text = layout.replace(";", ",")
            kw = dict(num_blocks=_NUM_BLOCKS.value, block_size=_BLOCK_SIZE.value,
                      hash_algo="sha256", hash_seed=0, free_order="unhashed_first",
                      concurrency=_CONCURRENCY.value)
            sides = {
                "base": lambda t, _g=base_groups(text), **k: base_replay(
                    t, kv_cache_groups=_g, **k),
                "new": lambda t, _g=new_groups(text), **k: new_replay(
                    t, kv_cache_groups=_g, **k),
            }
            records = {}
            for name, fn in sides.items():
                records[name] = []
                fn(trace, on_record=records[name].append, **kw)  # (a warm-up too)
            timed: dict[str, list] = {"base": [], "new": []}
            for i in range(_ROUNDS.value):
                for name in (("base", "new") if i % 2 == 0 else ("new", "base")):
                    timed[name].append(sides[name](trace, **kw)["timing"])
            base, new = _side(timed["base"]), _side(timed["new"])
            r = {"workload": w, "layout": text, "base": base, "new": new,
                 "manager_ratio_min": new["manager_s"]["min"] / base["manager_s"]["min"],
                 "manager_ratio_median": (new["manager_s"]["median"]
                                          / base["manager_s"]["median"]),
                 "loop_ratio_min": new["loop_s"]["min"] / base["loop_s"]["min"],
                 "records_identical": records["base"] == records["new"]}
            results.append(r)
            print(f"{w:>22} {text:>14}: manager base {base['manager_s']['min']:.4f} new "
                  f"{new['manager_s']['min']:.4f} (min) -> new/base "
                  f"{r['manager_ratio_min']:.3f} min, {r['manager_ratio_median']:.3f} median;"
                  f" loop {r['loop_ratio_min']:.3f} | records identical: "
                  f"{r['records_identical']}", flush=True)
    print(json.dumps({
        "benchmark": "ab_hybrid",
        "base": {"rev": _BASE.value, "commit": commit},
        "rounds": _ROUNDS.value,
        "results": results,
        "provenance": provenance(None, seed=_SEED.value),
    }))


if __name__ == "__main__":
    _common.run_app(main)
