r"""A host-memory tier behind a fixed device pool: token hit rate and simulated TTFT.

  python -m experiments.host_tier --config=configs/host_tier.py --workdir=/tmp/host_tier
  python -m experiments.host_tier --config=configs/host_tier_mooncake_conversation.py \
      --workdir=/tmp/host_tier_conv
  python -m experiments.host_tier --trace=T.jsonl --num_blocks=10000 --host_multiples=2,4,10

The device pool stays at ``num_blocks`` blocks; each cell adds a host tier of
``m * num_blocks`` blocks for ``m`` in ``host_multiples`` (``m = 0``, no tier, is always
run first: the baseline). Two measurements per tier size, on the same trace:

* ``replay`` (``prefixcache.sim.replay``, fast): the token hit rate split into tokens hit
  on the device and tokens loaded from the host, bytes loaded (``config.model``'s KV);
  plus one cell with a cache that never evicts (``record: "ideal"``), the bound any tier
  size can reach.
* ``des`` (``prefixcache.sim.des``): arrivals at the trace's timestamps (or Poisson),
  chunked-prefill batching and ``config.model``'s roofline step times on
  ``config.num_chips`` x ``config.accelerator``; every step waits for the host blocks
  it promotes to be copied over ``config.host_link`` (``cost_model.HOST_LINKS``; loads
  overlap nothing -- a pessimistic bound -- unless ``host_load_overlap``: then a step
  takes max(compute, load), the optimistic one). TTFT mean / p50 / p90 / p99, the hit split,
  load time charged; ``des_max_requests`` caps the requests it simulates (0: all).

Cells are independent (each reads the trace itself) and run in parallel through
``experiments._parallel.map_cells`` (``--executor=local|ray``, ``--workers``).

Outputs in ``--workdir``: ``host_tier.jsonl`` (one row per cell with provenance: the
config, seed, versions, git revision; cache state cold), ``host_tier.png`` (left:
device + host token hit rate per tier size, the ideal as a line; right: TTFT mean /
p50 / p90 per tier size), a table on stdout; the last stdout line is a JSON object
with the paths and the headline figures.

Bad input (a host multiple that is not a positive number, a bad ``num_blocks``, an
unknown model, accelerator, host link, host eviction policy or executor, a missing
trace) -> ``ValueError`` naming it before any cell runs (``error: ...``, one line, exit
status 1 on the command line).

Resume: each finished cell is appended to ``<workdir>/host_tier.cells.jsonl``
(``_common.CellLog``); a rerun with the same workdir runs only the missing cells and
refuses a workdir of another config, seed or trace.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from experiments import _common, _parallel

ROWS_FILE = "host_tier.jsonl"
PNG_FILE = "host_tier.png"


def parse_multiples(value) -> tuple[float, ...]:
    """Comma-separated host tier sizes as multiples of the device pool (each > 0).

    Returns:
        The multiples, sorted and unique, without 0 (the baseline is always run).

    Raises:
        ValueError: empty, not a number, not finite or <= 0.
    """
    items = [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) \
        else list(value) if isinstance(value, (list, tuple)) else [value]  # (one value)
    out = []
    for item in items:
        try:
            m = float(item)
        except (TypeError, ValueError):
            m = None
        if m is None or isinstance(item, bool) or not (0 < m < float("inf")):
            raise ValueError(f"host_multiples must be comma-separated numbers > 0 "
                             f"(host blocks per device block), got {value!r}")
        out.append(m)
    if not out:
        raise ValueError(f"host_multiples must name at least one multiple, got {value!r}")
    return tuple(sorted(set(out)))


def resolve(config) -> dict:
    """Validates the config before anything runs; returns the grid.

    Returns:
        ``{"multiples": (0, m1, ...), "host_blocks": (0, n1, ...)}``.

    Raises:
        ValueError: any bad field (see the module docstring).
    """
    from prefixcache._validate import check_count  # noqa: PLC0415
    from prefixcache.core.eviction import POLICIES, get_policy_class  # noqa: PLC0415
    from prefixcache.sim import cost_model as cm  # noqa: PLC0415

    _parallel.check_executor(config.executor, config.workers)
    for field in ("num_blocks", "block_size", "concurrency", "num_chips",
                  "max_num_batched_tokens", "max_num_seqs"):
        check_count(field, config[field], min=1)
    _common.check_dataset_block_size(config)
    check_count("des_max_requests", config.des_max_requests)
    multiples = parse_multiples(config.host_multiples)
    online = tuple(p for p in POLICIES if not get_policy_class(p).needs_future)
    if config.host_eviction not in online:  # (the host tier never has the future)
        raise ValueError(f"unknown host_eviction {config.host_eviction!r}; expected one of "
                         f"{online}")
    cm.ModelShape.preset(config.model)
    _common.cost_model(config)  # unknown accelerator / host link -> ValueError
    if not isinstance(config.host_load_overlap, bool):
        raise ValueError(f"host_load_overlap must be a bool, got {config.host_load_overlap!r}")
    if not config.arrival_rate >= 0:
        raise ValueError(f"arrival_rate must be >= 0 (0: the trace's timestamps), "
                         f"got {config.arrival_rate!r}")
    host_blocks = [0]
    for m in multiples:
        n = round(m * config.num_blocks)
        if n < 1:
            raise ValueError(f"host multiple {m:g} of num_blocks={config.num_blocks} is "
                             "less than one block")
        host_blocks.append(n)
    return {"multiples": (0.0, *multiples), "host_blocks": tuple(host_blocks)}


def make_cells(config, grid: dict) -> list[dict]:
    """A replay and a des cell per tier size (the baseline first), then the ideal."""
    cfg = config.to_dict()
    cells = [{"config": cfg, "kind": kind, "multiple": m, "num_host_blocks": n}
             for kind in ("replay", "des")
             for m, n in zip(grid["multiples"], grid["host_blocks"])]
    cells.append({"config": cfg, "kind": "ideal", "multiple": None, "num_host_blocks": 0})
    return cells


def _replay_row(config, cell: dict, make_requests) -> dict:
    from prefixcache.sim import compare  # noqa: PLC0415
    from prefixcache.sim.replay import replay  # noqa: PLC0415

    num_blocks, record = config.num_blocks, "replay"
    if cell["kind"] == "ideal":
        num_blocks, record = compare.ideal_num_blocks(make_requests(), config.block_size), "ideal"
    cache = _common.cache_config(config, num_blocks=num_blocks,
                                 num_host_blocks=cell["num_host_blocks"])
    s = replay(make_requests(), cache_config=cache, concurrency=config.concurrency,
               model=config.model)
    row = {"record": record, "multiple": cell["multiple"], "num_blocks": num_blocks,
           "num_host_blocks": cell["num_host_blocks"]}
    for key in ("requests", "failed", "prompt_tokens", "hit_tokens", "hit_rate_tokens",
                "evictions", "bytes_per_block"):
        row[key] = s[key]
    # With no tier every hit is a device hit (the replay reports the split only with one).
    row["device_hit_tokens"] = s.get("device_hit_tokens", s["hit_tokens"])
    row["host_hit_tokens"] = s.get("host_hit_tokens", 0)
    row["host_blocks_loaded"] = s.get("host_blocks_loaded", 0)
    row["host_bytes_loaded"] = s.get("host_bytes_loaded", 0)
    row["host_blocks_stored"] = s.get("host_blocks_stored", 0)
    row["peak_host_cached_blocks"] = s.get("peak_host_cached_blocks", 0)  # host memory used
    row["loop_s"] = s["timing"]["loop_s"]
    return row


def _des_row(config, cell: dict, make_requests) -> dict:
    import itertools  # noqa: PLC0415

    from prefixcache.sim import des  # noqa: PLC0415

    reqs = make_requests()
    if config.des_max_requests:
        reqs = itertools.islice(reqs, config.des_max_requests)
    cost = _common.cost_model(config)
    s = des.simulate(
        reqs, cost_model=cost,
        cache_config=_common.cache_config(config, num_host_blocks=cell["num_host_blocks"]),
        scheduler=des.SchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens,
                                      max_num_seqs=config.max_num_seqs),
        arrival_rate=config.arrival_rate or None, seed=config.seed,
        host_load_overlap=config.host_load_overlap)
    row = {"record": "des", "multiple": cell["multiple"], "num_blocks": config.num_blocks,
           "num_host_blocks": cell["num_host_blocks"], "model": config.model,
           "accelerator": config.accelerator, "num_chips": config.num_chips,
           "host_link": config.host_link, "host_load_overlap": config.host_load_overlap}
    for key in ("requests", "failed", "prompt_tokens", "hit_tokens", "hit_rate_tokens",
                "steps", "preemptions", "evictions", "makespan_s", "ttft_s", "queue_s"):
        row[key] = s[key]
    row["device_hit_tokens"] = s.get("device_hit_tokens", s["hit_tokens"])
    for key in ("host_hit_tokens", "host_blocks_loaded", "host_bytes_loaded",
                "host_load_steps", "host_load_s"):
        row[key] = s.get(key, 0)
    return row


def run_cell(cell: dict) -> dict:
    """One cell, in a worker: reads the trace from the config and returns its row."""
    import ml_collections  # noqa: PLC0415

    t0 = time.perf_counter()
    config = ml_collections.ConfigDict(cell["config"])

    def make_requests():
        return _common.requests_from_config(config, config.workdir or None)

    if cell["kind"] == "des":
        row = _des_row(config, cell, make_requests)
    else:
        row = _replay_row(config, cell, make_requests)
    row["device_hit_rate_tokens"] = (row["device_hit_tokens"] / row["prompt_tokens"]
                                     if row["prompt_tokens"] else 0.0)
    row["host_hit_rate_tokens"] = (row["host_hit_tokens"] / row["prompt_tokens"]
                                   if row["prompt_tokens"] else 0.0)
    row["cell_s"] = time.perf_counter() - t0
    return row


def _label(row) -> str:
    return "none" if not row["num_host_blocks"] else f"{row['multiple']:g}x"


def format_table(rows: Sequence[dict]) -> str:
    """One line per tier size: replay hit rates (device + host) and des TTFT."""
    replays = {r["num_host_blocks"]: r for r in rows if r["record"] == "replay"}
    dess = {r["num_host_blocks"]: r for r in rows if r["record"] == "des"}
    base = dess.get(0)
    lines = [f"device pool {rows[0]['num_blocks']} blocks; hit rate = device + host "
             "(replay); TTFT in ms (des)",
             f"{'host tier':>9} {'blocks':>8} {'hit':>6} {'device':>6} {'host':>6} "
             f"{'des hit':>7} {'mean':>8} {'p50':>8} {'p90':>8} {'d mean':>7} {'load s':>8}"]
    for n in sorted(replays):
        r, d = replays[n], dess.get(n)
        t = d["ttft_s"] if d else None
        delta = (f"{t['mean'] / base['ttft_s']['mean'] - 1:>+7.1%}"
                 if d and base and base["ttft_s"]["mean"] else f"{'-':>7}")
        ttft = (f"{d['hit_rate_tokens']:>7.4f} {t['mean'] * 1e3:>8.1f} {t['p50'] * 1e3:>8.1f} "
                f"{t['p90'] * 1e3:>8.1f} {delta} {d['host_load_s']:>8.3f}" if d else "")
        lines.append(f"{_label(r):>9} {n:>8} {r['hit_rate_tokens']:>6.4f} "
                     f"{r['device_hit_rate_tokens']:>6.4f} {r['host_hit_rate_tokens']:>6.4f} "
                     + ttft)
    ideal = [r for r in rows if r["record"] == "ideal"]
    if ideal:
        lines.append(f"{'ideal':>9} {'-':>8} {ideal[0]['hit_rate_tokens']:>6.4f} "
                     "(a cache that never evicts)")
    return "\n".join(lines)


def plot(rows: Sequence[dict], path, *, title: str = "") -> None:
    """Left: stacked device / host token hit rate per tier size; right: TTFT."""
    fig, (ax, bx) = _common.new_figure(1, 2, figsize=(11, 4.2))
    replays = sorted((r for r in rows if r["record"] == "replay"),
                     key=lambda r: r["num_host_blocks"])
    labels = [_label(r) for r in replays]
    x = list(range(len(replays)))
    dev = [r["device_hit_rate_tokens"] for r in replays]
    host = [r["host_hit_rate_tokens"] for r in replays]
    ax.bar(x, dev, color="C0", label="device hits")
    ax.bar(x, host, bottom=dev, color="C1", label="host hits (loaded)")
    for i, r in enumerate(replays):
        ax.text(i, r["hit_rate_tokens"] + 0.01, f"{r['hit_rate_tokens']:.3f}", ha="center",
                fontsize=8)
    for r in rows:
        if r["record"] == "ideal":
            ax.axhline(r["hit_rate_tokens"], color="gray", linestyle="-.",
                       label=f"never evicts ({r['hit_rate_tokens']:.3f})")
    ax.set_xticks(x, labels)
    ax.set_xlabel(f"host tier (x device pool of {replays[0]['num_blocks']} blocks)")
    ax.set_ylabel("token hit rate (replay)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper left")
    dess = sorted((r for r in rows if r["record"] == "des"), key=lambda r: r["num_host_blocks"])
    if dess:
        xs = list(range(len(dess)))
        for stat, style in (("mean", "o-"), ("p50", "s--"), ("p90", "^:")):
            bx.plot(xs, [r["ttft_s"][stat] * 1e3 for r in dess], style, label=f"TTFT {stat}")
        bx.set_xticks(xs, [_label(r) for r in dess])
        bx.set_xlabel("host tier")
        bx.set_ylabel("simulated TTFT (ms)")
        bx.set_ylim(bottom=0)
        bx.grid(alpha=0.3)
        bx.legend(fontsize=7)
        d = dess[0]
        bx.set_title(f"des: {d['model']} on {d['num_chips']} x {d['accelerator']}, "
                     f"{d['host_link']}, loads "
                     f"{'overlapped' if d.get('host_load_overlap') else 'not overlapped'}",
                     fontsize=8)
    fig.suptitle(title, fontsize=9)
    _common.save_plot(fig, path)


def run(config, *, progress: bool = False) -> dict:
    """Runs every cell of ``config``; writes the rows and the plot into ``config.workdir``."""
    grid = resolve(config)
    workdir = _common.prepare_workdir(config.workdir)
    _common.trace_path(config)  # a missing trace / unknown dataset fails before any cell
    log = _common.CellLog(workdir, "host_tier", _common.run_fingerprint(config, seed=config.seed))
    rows = _common.map_cells_resumable(
        run_cell, make_cells(config, grid), log=log, executor=config.executor,
        workers=config.workers, ray_address=config.ray_address, progress=progress,
        desc="host_tier")
    source = _common.source_name(config)
    prov = _common.provenance(config, seed=config.seed, hash_algo=config.hash_algo,
                              cache_state="cold", extra={"source": source, **grid})
    rows_path, png_path = workdir / ROWS_FILE, workdir / PNG_FILE
    with _common.AtomicJsonlWriter(rows_path, provenance=prov) as w:
        for row in rows:
            w.write({"source": source, "block_size": config.block_size, **row})
    plot(rows, png_path, title=f"{source}: device pool {config.num_blocks} blocks of "
                               f"{config.block_size} tokens, host tiers {config.host_multiples}")
    print(format_table(rows), flush=True)
    dess = {r["num_host_blocks"]: r for r in rows if r["record"] == "des"}
    replays = {r["num_host_blocks"]: r for r in rows if r["record"] == "replay"}
    return {
        "rows": str(rows_path), "png": str(png_path), "source": source,
        "hit_rate_tokens": {_label(r): r["hit_rate_tokens"] for r in replays.values()},
        "ttft_mean_s": {_label(r): r["ttft_s"]["mean"] for r in dess.values()},
        "cells_s": sum(r["cell_s"] for r in rows),
    }


def main() -> None:
    _common.run_cli(run, config_name="host_tier", extra_flags={
        "trace": ("string", "Trace file (our JSONL or Mooncake)"),
        "num_blocks": ("integer", "Device pool size in blocks"),
        "block_size": ("integer", "Tokens per block"),
        "host_multiples": ("string", "Comma-separated host tier sizes, as multiples of "
                                     "num_blocks (no tier is always run)"),
        "host_eviction": ("string", "The host tier's eviction policy"),
        "host_link": ("string", "Host -> device link preset (cost_model.HOST_LINKS)"),
        "model": ("string", "Model preset (cost_model.MODEL_PRESETS)"),
        "accelerator": ("string", "Accelerator preset (cost_model.ACCELERATORS)"),
        "num_chips": ("integer", "Chips the model is sharded over"),
        "des_max_requests": ("integer", "Requests the des simulates (0: all)"),
        "executor": ("string", "local | ray"),
        "workers": ("integer", "Local worker processes / local Ray CPUs (0: one per CPU)"),
        "max_requests": ("integer", "Only the first N requests (0: all)"),
    })


if __name__ == "__main__":
    main()
