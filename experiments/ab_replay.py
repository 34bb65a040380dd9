r"""A/B of our own replay: the working tree against an earlier commit, in ONE process.

  python -m experiments.ab_replay --base=HEAD~3 --workloads=shared_system_prompt \
      --hash_algos=xxhash_cbor,sha256_cbor --rounds=12

Why: on a shared 2-core machine the speed drifts by 20-40% over seconds, and the
min-to-median spread of one process's runs is ~15%, so two versions timed in separate
processes (or one after the other) cannot resolve a 5-10% change. Here ``git archive``
exports the base revision's ``prefixcache`` package, renamed ``prefixcache_base`` (its
imports rewritten), and each round replays the same trace through the base and the
working tree back to back, swapping which goes first every round. Per cell it prints
min and median of ``loop_s`` (and the hashing / manager split) for both, the ratio
new/base (< 1: the working tree is faster), and whether both produced identical records.
``--kv_groups=full,sw32`` replays a sliding-window / hybrid layout (each side parses it
with its own ``kv_groups.parse_kv_groups``); default: one full-attention group.

Workloads come from ``prefixcache.sim.workloads`` (the peer traces' generators, same
seed -> the same requests as ``experiments/peers/make_traces.py``). Last stdout line: one
JSON summary with provenance.
"""

from __future__ import annotations

import functools
import importlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile

from absl import app, flags

from experiments import _common

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_BASE = flags.DEFINE_string("base", None, "Git revision to compare against (required).")
_WORKLOADS = flags.DEFINE_list(
    "workloads", ["shared_system_prompt", "multi_turn", "few_shot", "mm_salt"],
    "Workload generators (prefixcache.sim.workloads names).")
_ALGOS = flags.DEFINE_list("hash_algos", ["sha256", "xxhash_cbor"], "Hash algorithms.")
_ROUNDS = flags.DEFINE_integer("rounds", 10, "Timed rounds of each side.")
_WARMUP = flags.DEFINE_integer(
    "warmup", 1, "Untimed replays of each side first (at least one, which also collects "
    "the records compared).")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 4095, "Allocatable blocks.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per block.")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 8, "Requests holding blocks at once.")
_FREE_ORDER = flags.DEFINE_enum(
    "free_order", "unhashed_first", ["append", "unhashed_first"], "Free order.")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed.")
_KV_GROUPS = flags.DEFINE_string(
    "kv_groups", "", "KV cache group layout (kv_groups.parse_kv_groups, e.g. full,sw32); "
    "'' (default): one full-attention group.")
_HASH_SEED = flags.DEFINE_integer("hash_seed", 0, "Hash chain seed.")
_PROGRESS = _common.define_progress_flag()

_IMPORT_RE = re.compile(r"\bprefixcache(?=\.|\s+import\b|\s*$)", re.MULTILINE)


def export_base(rev: str, dest: str, name: str = "prefixcache_base") -> str:
    """Writes ``rev``'s ``prefixcache`` package to ``dest/name`` with its imports
    rewritten to ``name``; returns the commit id. ValueError for an unknown revision."""
    try:
        commit = subprocess.run(
            ["git", "-C", _REPO, "rev-parse", "--verify", f"{rev}^{{commit}}"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    except subprocess.CalledProcessError as e:
        raise ValueError(f"--base={rev!r} is not a commit of {_REPO}: {e.stderr.strip()}") from None
    blob = subprocess.run(
        ["git", "-C", _REPO, "archive", "--format=tar", commit, "prefixcache"],
        check=True, capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        try:
            tar.extractall(dest, filter="data")
        except TypeError:  # pragma: no cover - Pythons before the extraction filters
            tar.extractall(dest)
    os.rename(os.path.join(dest, "prefixcache"), os.path.join(dest, name))
    for root, _, files in os.walk(os.path.join(dest, name)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                with open(path) as fh:
                    src = fh.read()
                with open(path, "w") as fh:
                    fh.write(_IMPORT_RE.sub(name, src))
    return commit


def _side(runs: list[dict]) -> dict:
    loops = [r["loop_s"] for r in runs]
    return {
        "loop_s_min": min(loops),
        "loop_s_median": statistics.median(loops),
        "hashing_s_min": min(r["hashing_s"] for r in runs),
        "manager_s_min": min(r["manager_s"] for r in runs),
        "loop_s_runs": loops,
    }


def ab_cell(trace, algo: str, new_replay, base_replay) -> dict:
    """``rounds`` interleaved replays of ``trace`` through both; see the module doc.
    ``new_replay`` / ``base_replay`` take the replay's keywords (bind a layout first)."""
    kw = dict(
        num_blocks=_NUM_BLOCKS.value, block_size=_BLOCK_SIZE.value, hash_algo=algo,
        hash_seed=_HASH_SEED.value, free_order=_FREE_ORDER.value,
        concurrency=_CONCURRENCY.value,
    )
    sides = {"base": base_replay, "new": new_replay}
    records: dict[str, list] = {}
    for name, fn in sides.items():
        records[name] = []
        fn(trace, on_record=records[name].append, **kw)  # also a warm-up
        for _ in range(max(_WARMUP.value - 1, 0)):
            fn(trace, **kw)
    timed: dict[str, list] = {"base": [], "new": []}
    for i in range(_ROUNDS.value):
        order = ("base", "new") if i % 2 == 0 else ("new", "base")
        for name in order:
            timed[name].append(sides[name](trace, **kw)["timing"])
    base, new = _side(timed["base"]), _side(timed["new"])
    return {
        "hash_algo": algo,
        "base": base,
        "new": new,
        "ratio_min": new["loop_s_min"] / base["loop_s_min"],
        "ratio_median": new["loop_s_median"] / base["loop_s_median"],
        "records_identical": records["base"] == records["new"],
    }


def main(argv):
    del argv
    from experiments._common import provenance  # noqa: PLC0415
    from prefixcache.sim import workloads  # noqa: PLC0415
    from prefixcache.sim.replay import replay as new_replay  # noqa: PLC0415

    if not _BASE.value:
        raise app.UsageError("--base=REV is required (e.g. --base=HEAD)")
    if _ROUNDS.value < 1 or _WARMUP.value < 0:
        raise app.UsageError("--rounds must be >= 1 and --warmup >= 0")
    tmp = tempfile.mkdtemp(prefix="prefixcache-ab-")
    try:
        commit = export_base(_BASE.value, tmp)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    sys.path.insert(0, tmp)
    base_replay = importlib.import_module("prefixcache_base.sim.replay").replay
    if _KV_GROUPS.value:  # each side parses the layout with its own kv_groups
        from prefixcache.core.kv_groups import parse_kv_groups  # noqa: PLC0415

        base_parse = importlib.import_module("prefixcache_base.core.kv_groups").parse_kv_groups
        new_replay = functools.partial(new_replay,
                                       kv_cache_groups=parse_kv_groups(_KV_GROUPS.value))
        base_replay = functools.partial(base_replay,
                                        kv_cache_groups=base_parse(_KV_GROUPS.value))
    results = []
    bar = _common.progress_bar(enabled=_PROGRESS.value, desc="ab_replay", unit="cell",
                               total=len(_WORKLOADS.value) * len(_ALGOS.value))
    for w in _WORKLOADS.value:
        trace = workloads.generate(w, seed=_SEED.value)
        for algo in _ALGOS.value:
            r = dict(workload=w, **ab_cell(trace, algo, new_replay, base_replay))
            bar.update(1)
            results.append(r)
            b, n = r["base"], r["new"]
            print(
                f"{w:>22} {algo:>11}: loop base {b['loop_s_min']:.3f}/{b['loop_s_median']:.3f}"
                f" new {n['loop_s_min']:.3f}/{n['loop_s_median']:.3f} (min/median) -> new/base "
                f"{r['ratio_min']:.3f} min, {r['ratio_median']:.3f} median | hashing "
                f"{b['hashing_s_min']:.3f}->{n['hashing_s_min']:.3f} manager "
                f"{b['manager_s_min']:.3f}->{n['manager_s_min']:.3f} | records identical: "
                f"{r['records_identical']}",
                flush=True,
            )
    bar.close()
    print(json.dumps({
        "benchmark": "ab_replay",
        "base": {"rev": _BASE.value, "commit": commit},
        "kv_groups": _KV_GROUPS.value or None,
        "rounds": _ROUNDS.value,
        "warmup": _WARMUP.value,
        "results": results,
        "provenance": provenance(None, seed=_SEED.value),
    }))


if __name__ == "__main__":
    _common.run_app(main)
