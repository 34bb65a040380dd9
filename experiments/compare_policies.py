r"""Eviction policies x prefix indexes x cache capacities on one trace, in one run.

  python -m experiments.compare_policies --config=configs/compare_policies.py --workdir=/tmp/cp
  python -m experiments.compare_policies --trace=T.jsonl --block_size=16 \
      --capacities=256,1024,4096 --policies=lru,lfu,belady --indexes=hash,radix \
      --concurrency=8 --model=llama_3_1_8b --workdir=/tmp/cp
  # on a Ray cluster (pip install -e ".[ray]"):
  python -m experiments.compare_policies --config=... --executor=ray --ray_address=HOST:6379

Every cell (policy, index, capacity) replays the whole trace through a fresh
``KVCacheManager`` (``prefixcache.sim.compare.replay_cell``); no cell depends on
another. Cells run in parallel: local worker processes (``--executor=local``,
``--workers`` of them, 0: one per CPU) or Ray tasks (``--executor=ray``). Each worker
reads the trace itself from the config, so both executors give identical rows (timings
aside). One more cell replays the trace at a capacity where nothing is ever evicted:
the infinite-cache ideal (``record: "ideal"``; see ``compare.ideal_num_blocks``).

``--policies`` / ``--indexes`` take comma-separated names or ``all`` (every registered
one); ``--capacities`` comma-separated block counts, or ``--kv_bytes`` byte budgets
(``2GiB,4GiB``; with ``--capacities=`` empty: both -> error) converted to blocks with
``--model``'s bytes per block for ``--kv_dtype`` (``prefixcache.kv_dtypes``; fp8 and
int8 blocks include their scales); with ``--kv_dtype`` or ``--kv_bytes`` every row
carries ``kv_dtype``, ``bytes_per_block``, ``kv_bytes`` and ``kv_bytes_budget`` and its
cached bytes are of that dtype:

  python -m experiments.compare_policies --config=configs/compare_policies.py \
      --workdir=/tmp/cp_fp8 --capacities= --kv_bytes=1GiB,4GiB --kv_dtype=float8_e4m3fn

``belady`` (the offline bound) joins
the policies whenever it is registered, unless ``--config.belady_bound=false``.

Policy variants: a ``policies`` entry may be a label of ``policy_variants`` (label ->
``{"eviction": name, "options": {...}}``: the policy with those ``eviction_options``,
e.g. ``"ttl60": {"eviction": "ttl_lru", "options": {"ttl": 60, "unit": "s"}}``), checked
by building each variant's policy before any cell runs
(``prefixcache.sim.compare.resolve_policy_variants``). Rows carry the label as ``policy``
and the ``eviction`` / ``eviction_options`` they ran; the table and the plot show labels.

Outputs in ``--workdir``:
  * ``compare_policies.jsonl``: one row per cell (``policy``, ``eviction``,
    ``eviction_options``, ``index``,
    ``num_blocks``, ``block_size``, ``concurrency``, ``requests``, ``prompt_tokens``,
    ``hit_tokens``, ``hit_rate_tokens``, ``requests_with_hit``, ``evictions``,
    ``stranded_blocks``, ``peak_cached_blocks``, ``peak_cached_bytes``, ``loop_s``,
    ``cell_s``, ...) and the ideal row, each with provenance (cache state cold).
    Fields the replay does not report are null.
  * ``compare_policies.cells.jsonl``: each cell's row appended (and fsynced) as the
    cell finishes, after a header with the run's fingerprint (config hash, seed, trace
    checksum). ``compare_policies.jsonl`` and the plot are written once every cell is
    done; a rerun with the same ``--workdir`` skips the cells already there (an
    interrupted run resumes), and refuses a workdir of another config, seed or trace.
  * ``compare_policies.png``: token hit rate against capacity, one panel per index, one
    line per policy (own color and marker), the ideal as a horizontal line and
    ``belady`` (when run) as the bound; titled with the trace's file name.
  * stdout: a table of hit rates; the last line a JSON object with the paths.

Miss reasons (``miss_reasons``, on by default): each row also carries ``missed_blocks``,
``miss_reasons`` (the replay's totals: ``cold``, ``evicted``, ``isolated``, ``partial``,
``last_token``, ``evicted_device`` / ``evicted_host``; ``prefixcache.sim.misses``) and
``evicted_blocks`` (the evicted-block prefills that separate policies); with belady in the
grid every cell row carries its distance to it at the same index and capacity:
``belady_gap_tokens``, ``belady_gap_rate`` and ``belady_gap_evicted_blocks``. The table on
stdout is followed by the evicted blocks per cell. ``queue_depth`` sets ``queue_aware``'s
waiting queue in the replay (0: ``concurrency``).

Non-prefix reuse (``nonprefix_bound``, on by default): the ideal row also carries what a
position-independent chunk cache (CacheBlend / EPIC style) could reuse beyond prefix
caching at infinite capacity (``prefixcache.sim.nonprefix``): ``nonprefix_hit_tokens``,
``nonprefix_hit_rate_tokens``, ``nonprefix_blocks`` (full blocks found by content only),
with ``nonprefix_recompute_fraction`` (the share of a reused chunk recomputed) and
``nonprefix_alignment`` (``block`` or ``token``: where earlier chunks may start); the plot
draws it as a dotted line above the infinite-cache ideal.

Bad input (unknown policy, index, hash algorithm, free order, model preset or
executor; Ray missing for ``--executor=ray``; a policy or index the replay cannot run;
a missing trace; a registered dataset at another block size than its own) ->
``ValueError`` naming the problem before any cell runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from experiments import _common, _kv_budget, _parallel

ROWS_FILE = "compare_policies.jsonl"
BELADY = "belady"  # the offline optimum: the bound drawn in the plot
PNG_FILE = "compare_policies.png"


def resolve_grid(config) -> dict:
    """Validates the config; returns ``{"policies", "indexes", "capacities"}`` (tuples)
    and ``"variants"`` (label -> ``{"eviction", "options"}`` for every policy label).

    Raises:
        ValueError: any bad field (see the module docstring), before anything runs.
    """
    from prefixcache.core.hashing import HASH_ALGOS  # noqa: PLC0415
    from prefixcache.core.kv_cache_manager import FREE_ORDERS  # noqa: PLC0415
    from prefixcache.sim import compare  # noqa: PLC0415

    _parallel.check_executor(config.executor, config.workers)
    _common.check_dataset_block_size(config)  # (a hash-id dataset: its own block size)
    for field in ("block_size", "concurrency"):
        v = config[field]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{field} must be a positive int, got {v!r}")
    if config.hash_algo not in HASH_ALGOS:
        raise ValueError(f"unknown hash_algo {config.hash_algo!r}; expected one of {HASH_ALGOS}")
    if config.free_order not in FREE_ORDERS:
        raise ValueError(f"unknown free_order {config.free_order!r}; expected one of {FREE_ORDERS}")
    if config.nonprefix_bound:  # its options, checked before any cell (an empty trace)
        from prefixcache.sim.nonprefix import nonprefix_bound  # noqa: PLC0415

        nonprefix_bound([], config.block_size,
                        recompute_fraction=config.nonprefix_recompute_fraction,
                        alignment=config.nonprefix_alignment)
    known = compare.policy_names()
    variants = _common.to_jsonable(config.get("policy_variants") or {})
    policies = compare.parse_names(config.policies, known=known + tuple(variants),
                                   what="eviction policy")
    # NOTE: the offline bound is drawn whenever it exists: belady joins the grid unless
    # belady_bound is off (before the policy seam is merged it is not registered yet).
    if config.belady_bound and BELADY in known and BELADY not in policies:
        policies += (BELADY,)
    grid = {
        "policies": policies,
        "variants": compare.resolve_policy_variants(policies, variants,
                                                    block_size=config.block_size),
        "indexes": compare.parse_names(config.indexes, known=compare.index_names(),
                                       what="index"),
    }
    # KV bytes: capacities (blocks) or kv_bytes (byte budgets, per kv_dtype), not both.
    kv_bytes, kv_dtype = config.get("kv_bytes", ""), config.get("kv_dtype", "")
    if kv_bytes or kv_dtype:
        plan = _kv_budget.resolve(capacities=config.capacities, kv_bytes=kv_bytes,
                                  kv_dtype=kv_dtype or "bfloat16", model=config.model,
                                  block_size=config.block_size)
        if len({dt for dt, *_ in plan}) > 1:
            raise ValueError(f"compare_policies takes one kv_dtype, got {kv_dtype!r} "
                             "(sweep_capacity compares several)")
        grid["capacities"] = tuple(sorted({nb for _, nb, _, _ in plan}))
        grid["kv"] = {nb: (dt, bpb, budget) for dt, nb, bpb, budget in plan}
    else:
        grid["capacities"] = compare.parse_capacities(config.capacities)
    for label in grid["policies"]:
        for index in grid["indexes"]:
            compare.check_replay_supports(grid["variants"][label]["eviction"], index,
                                          model=config.model or None)
    return grid


def make_cells(config, grid: dict) -> list[dict]:
    """The cells: every (index, policy label, capacity), then the ideal (``num_blocks``
    0); each cell names its label's ``eviction`` and ``eviction_options``."""
    cfg = config.to_dict()
    variants = grid["variants"]
    cells = [{"config": cfg, "policy": p, "eviction": variants[p]["eviction"],
              "eviction_options": variants[p]["options"], "index": i, "num_blocks": n}
             for i in grid["indexes"] for p in grid["policies"] for n in grid["capacities"]]
    for cell in cells:
        if "kv" in grid:
            cell["kv"] = grid["kv"][cell["num_blocks"]]
    # The ideal: lru on the hash chain with nothing ever evicted (the policy cannot matter).
    cells.append({"config": cfg, "policy": "lru", "eviction": "lru", "eviction_options": {},
                  "index": "hash", "num_blocks": 0})
    if "kv" in grid:  # the ideal's bytes in the same dtype (it has no budget)
        dt, bpb, _ = next(iter(grid["kv"].values()))
        cells[-1]["kv"] = (dt, bpb, None)
    return cells


def run_cell(cell: dict) -> dict:
    """One cell, in a worker: reads the trace from the config, replays, returns the row.

    Args:
        cell: ``{"config": dict, "policy" (the label), "eviction", "eviction_options",
            "index", "num_blocks"}``; ``num_blocks == 0`` is the infinite-cache ideal
            (``compare.ideal_num_blocks`` of the trace).
    """
    import ml_collections  # noqa: PLC0415

    from prefixcache.core.eviction import get_policy_class  # noqa: PLC0415
    from prefixcache.sim import compare  # noqa: PLC0415

    t0 = time.perf_counter()
    config = ml_collections.ConfigDict(cell["config"])

    def make_requests():
        return _common.requests_from_config(config, config.workdir or None)

    num_blocks, record = cell["num_blocks"], "cell"
    if num_blocks == 0:
        num_blocks, record = compare.ideal_num_blocks(make_requests(), config.block_size), compare.IDEAL
    extra = {}
    if config.miss_reasons:
        extra["miss_reasons"] = True
    eviction, options = cell["eviction"], cell["eviction_options"]
    if config.queue_depth and get_policy_class(eviction).needs_waiting:
        extra["queue_depth"] = config.queue_depth  # (0: the replay's default, concurrency)
    summary = compare.replay_cell(
        make_requests, policy=eviction, index=cell["index"], num_blocks=num_blocks,
        block_size=config.block_size, model=config.model or None, hash_algo=config.hash_algo,
        hash_seed=config.hash_seed or None, free_order=config.free_order,
        concurrency=config.concurrency, eviction_options=options, **extra)
    row = compare.cell_row(summary, policy=cell["policy"], index=cell["index"],
                           num_blocks=num_blocks, block_size=config.block_size,
                           concurrency=config.concurrency, model=config.model or None,
                           record=record, eviction=eviction, eviction_options=options)
    if "queue_depth" in summary:
        row["queue_depth"] = summary["queue_depth"]
    if config.miss_reasons:  # why the missed prompt blocks missed (prefixcache.sim.misses)
        misses = summary["miss_reasons"]
        row["missed_blocks"] = misses["missed_blocks"]
        row["miss_reasons"] = misses["reasons"]
        row["evicted_blocks"] = misses["reasons"]["evicted"]  # eviction-induced prefills
    if record == compare.IDEAL and config.nonprefix_bound:
        row.update(nonprefix_fields(make_requests(), config))
    if record == compare.IDEAL and row["evictions"]:  # pragma: no cover - a bug
        raise AssertionError(f"the ideal cell evicted {row['evictions']} blocks "
                             f"at {num_blocks} blocks")
    if "kv" in cell:  # bytes of this KV dtype (scales included), not the preset's dtype
        dt, bpb, budget = cell["kv"]
        row.update(_kv_budget.row_fields(dt, num_blocks, bpb, budget))
        for which in ("peak", "mean"):
            blocks = row.get(f"{which}_cached_blocks")
            row[f"{which}_cached_bytes"] = None if blocks is None else blocks * bpb
    row["cell_s"] = time.perf_counter() - t0
    return row


def nonprefix_fields(requests, config) -> dict:
    """The ideal row's non-prefix reuse bound (``prefixcache.sim.nonprefix``): what a
    position-independent chunk cache (CacheBlend-style) could reuse beyond prefix
    caching on this trace, at infinite capacity, one request at a time."""
    from prefixcache.sim.nonprefix import nonprefix_bound  # noqa: PLC0415

    b = nonprefix_bound(requests, config.block_size,
                        recompute_fraction=config.nonprefix_recompute_fraction,
                        alignment=config.nonprefix_alignment)
    return {"nonprefix_hit_tokens": b["nonprefix_hit_tokens"],
            "nonprefix_hit_rate_tokens": b["nonprefix_hit_rate_tokens"],
            "nonprefix_blocks": b["nonprefix_blocks"],
            "nonprefix_prefix_hit_tokens": b["prefix_hit_tokens"],
            "nonprefix_recompute_fraction": b["recompute_fraction"],
            "nonprefix_alignment": b["alignment"]}


def add_belady_distance(rows: Sequence[dict]) -> None:
    """Adds ``belady_gap_tokens`` / ``belady_gap_rate`` (belady's hit tokens / token hit
    rate minus the row's, at the same index and capacity; negative: the row beat it)
    and, with miss reasons, ``belady_gap_evicted_blocks`` (the row's evicted-block
    prefills minus belady's) to every cell row, when belady is in the grid."""
    bound = {(r["index"], r["num_blocks"]): r for r in rows
             if r["record"] == "cell" and r.get("eviction", r["policy"]) == BELADY}
    for r in rows:
        b = bound.get((r["index"], r["num_blocks"])) if r["record"] == "cell" else None
        if b is None:
            continue
        r["belady_gap_tokens"] = b["hit_tokens"] - r["hit_tokens"]
        r["belady_gap_rate"] = b["hit_rate_tokens"] - r["hit_rate_tokens"]
        if r.get("evicted_blocks") is not None and b.get("evicted_blocks") is not None:
            r["belady_gap_evicted_blocks"] = r["evicted_blocks"] - b["evicted_blocks"]


def format_table(rows: Sequence[dict], field: str = "hit_rate_tokens") -> str:
    """``field`` (token hit rate; or ``evicted_blocks``) per (index, policy) and
    capacity, the ideal in the last column."""
    ideal = [r for r in rows if r["record"] == "ideal"]
    cells = [r for r in rows if r["record"] == "cell"]
    caps = sorted({r["num_blocks"] for r in cells})
    width = max([len(f"{r['index']}/{r['policy']}") for r in cells] + [12])
    head = f"{'index/policy':<{width}} " + " ".join(f"{c:>8}" for c in caps)
    what = "token hit rate" if field == "hit_rate_tokens" else field

    def fmt(v):
        return f"{'-':>8}" if v is None else (f"{v:>8.4f}" if isinstance(v, float) else f"{v:>8}")

    lines = [f"{what} by capacity (blocks of {rows[0]['block_size']} tokens)",
             head + (f" {'ideal':>8}" if ideal else "")]
    for key in dict.fromkeys((r["index"], r["policy"]) for r in cells):
        by_cap = {r["num_blocks"]: r for r in cells if (r["index"], r["policy"]) == key}
        vals = " ".join(fmt(by_cap[c].get(field)) if c in by_cap else f"{'-':>8}"
                        for c in caps)
        lines.append(f"{key[0] + '/' + key[1]:<{width}} {vals}"
                     + (f" {fmt(ideal[0].get(field))}" if ideal else ""))
    return "\n".join(lines)


def plot(rows: Sequence[dict], path, *, title: str = "") -> None:
    """Hit rate vs capacity: one panel per index (so identical hash and radix lines
    cannot hide each other), a line per policy (its own color and marker), the ideal
    and belady bounds."""
    from matplotlib.ticker import NullFormatter  # noqa: PLC0415

    cells = [r for r in rows if r["record"] == "cell"]
    from prefixcache.core.eviction import POLICIES, get_policy_class  # noqa: PLC0415

    evictions = {r["policy"]: r.get("eviction", r["policy"]) for r in cells}

    def offline(label):  # a bound that needs the future (belady), drawn as a bound
        policy = evictions.get(label, label)
        return policy in POLICIES and get_policy_class(policy).needs_future

    indexes = list(dict.fromkeys(r["index"] for r in cells))
    fig, axes = _common.new_figure(1, len(indexes), figsize=(4.6 * len(indexes) + 1.8, 4.2),
                                   sharey=True, squeeze=False)
    policies = [p for p in dict.fromkeys(r["policy"] for r in cells) if not offline(p)]
    colors = {p: f"C{i % 10}" for i, p in enumerate(policies)}
    markers = dict(zip(policies, "osD^v<>ph*"))
    ideal = [r for r in rows if r["record"] == "ideal"]
    for ax, index in zip(axes[0], indexes):
        for policy in dict.fromkeys(r["policy"] for r in cells if r["index"] == index):
            pts = sorted((r for r in cells if (r["policy"], r["index"]) == (policy, index)),
                         key=lambda r: r["num_blocks"])
            if offline(policy):
                style = dict(color="black", linewidth=2.5, alpha=0.45)
                label = f"{policy} (offline bound)"
            else:
                style = dict(color=colors[policy], marker=markers.get(policy, "o"),
                             markersize=5, markerfacecolor="none", linewidth=1.2)
                label = policy
            ax.plot([r["num_blocks"] for r in pts], [r["hit_rate_tokens"] for r in pts],
                    label=label, **style)
        for r in ideal:
            ax.axhline(r["hit_rate_tokens"], color="gray", linestyle="-.",
                       label=f"infinite cache ({r['hit_rate_tokens']:.3f})")
            if r.get("nonprefix_hit_rate_tokens") is not None:
                ax.axhline(r["nonprefix_hit_rate_tokens"], color="tab:purple", linestyle=":",
                           linewidth=1.6, label=f"non-prefix bound "
                           f"({r['nonprefix_hit_rate_tokens']:.3f})")
        ax.set_xscale("log")
        # Ticks at the capacities run, as plain numbers (no minor labels to collide).
        caps = sorted({r["num_blocks"] for r in cells})
        ax.set_xticks(caps, [f"{c:,}" for c in caps], fontsize=7,
                      rotation=45 if len(caps) > 5 else 0)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("cache capacity (blocks)")
        ax.set_title(f"{index} index", fontsize=9)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("token hit rate")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title, fontsize=9)
    _common.save_plot(fig, path)


def run(config, *, progress: bool = False) -> dict:
    """Runs the grid of ``config``; writes the rows and the plot into ``config.workdir``."""
    grid = resolve_grid(config)
    workdir = _common.prepare_workdir(config.workdir)
    if next(iter(_common.requests_from_config(config, workdir)), None) is None:
        raise ValueError(f"the trace {config.trace or config.workload.name!r} has no requests")
    log = _common.CellLog(workdir, "compare_policies",
                          _common.run_fingerprint(config, seed=config.seed))
    rows = _common.map_cells_resumable(
        run_cell, make_cells(config, grid), log=log, executor=config.executor,
        workers=config.workers, ray_address=config.ray_address, progress=progress,
        desc="compare_policies")
    rows = [dict(r) for r in rows]
    add_belady_distance(rows)
    source = _common.source_name(config)
    prov = _common.provenance(config, seed=config.seed, hash_algo=config.hash_algo,
                              cache_state="cold", extra={"source": source, **{
                                  k: v for k, v in grid.items() if k != "kv"}})
    rows_path, png_path = workdir / ROWS_FILE, workdir / PNG_FILE
    with _common.AtomicJsonlWriter(rows_path, provenance=prov) as w:
        for row in rows:
            w.write({"source": source, **row})
    plot(rows, png_path, title=f"{_common.source_label(config)}: block size {config.block_size}, "
                               f"concurrency {config.concurrency}, {config.free_order}")
    print(format_table(rows), flush=True)
    if config.miss_reasons:
        print(format_table(rows, field="evicted_blocks"), flush=True)
    ideal = next(r for r in rows if r["record"] == "ideal")
    if ideal.get("nonprefix_hit_rate_tokens") is not None:
        print(f"non-prefix bound (chunk reuse, recompute fraction "
              f"{ideal['nonprefix_recompute_fraction']}, {ideal['nonprefix_alignment']} "
              f"alignment): token hit rate {ideal['nonprefix_hit_rate_tokens']:.4f} vs the "
              f"prefix ideal {ideal['hit_rate_tokens']:.4f}", flush=True)
    return {"rows": str(rows_path), "png": str(png_path), "cells": len(rows) - 1,
            "ideal_hit_rate_tokens": ideal["hit_rate_tokens"],
            "cells_s": sum(r["cell_s"] for r in rows)}


def main() -> None:
    _common.run_cli(run, config_name="compare_policies", extra_flags={
        "trace": ("string", "Trace file (our JSONL or Mooncake)"),
        "block_size": ("integer", "Tokens per block"),
        "capacities": ("string", "Comma-separated cache sizes in blocks"),
        "policies": ("string", "Comma-separated eviction policies, or all"),
        "indexes": ("string", "Comma-separated indexes (hash, radix), or all"),
        "concurrency": ("integer", "Most requests holding blocks at once"),
        "free_order": ("string", "unhashed_first (vLLM's) | append"),
        "hash_algo": ("string", "sha256 | sha256_cbor | xxhash | xxhash_cbor"),
        "model": ("string", "Model preset for cached bytes (prefixcache.sim.cost_model)"),
        "kv_bytes": ("string", "KV byte budgets, comma-separated ('2GiB', ints), converted "
                              "to blocks per kv_dtype; give --capacities= (empty) with it"),
        "kv_dtype": ("string", "KV dtype for bytes per block (bfloat16, float32, "
                              "float8_e4m3fn, int8); '': the model preset's bytes"),
        "executor": ("string", "local | ray"),
        "workers": ("integer", "Local worker processes / local Ray CPUs (0: one per CPU)"),
        "ray_address": ("string", "Ray cluster address ('': a local instance)"),
        "max_requests": ("integer", "Only the first N requests (0: all)"),
    })


if __name__ == "__main__":
    main()
