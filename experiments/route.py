r"""Prefix-aware routing across replicas: a trace x replica counts x routing policies.

  python -m experiments.route --config=configs/route.py --workdir=/tmp/route
  python -m experiments.route --config=configs/route_llmd.py --workdir=/tmp/route \
      --replicas=8 --policies=random,round_robin,kv_events

For every (policy, replica count) the trace is streamed through
``prefixcache.sim.cluster.simulate_cluster``: N simulated replicas (each its own
``KVCacheManager`` with ``num_blocks`` blocks, FCFS chunked-prefill scheduling and
roofline step times of ``model`` on ``accelerator``) behind the router. Arrival
times are the trace's timestamps times ``time_scale`` (or Poisson at
``arrival_rate`` when it is > 0).

Host tier: ``num_host_blocks > 0`` gives every replica a host-memory tier of that many
blocks (``host_eviction``), loads charged over ``host_link``; ``kv_events`` then scores
host blocks at ``host_weight`` (a number in [0, 1], or ``"auto"``: ``kv_events.
host_hit_weight`` of the cost model) and rows gain the host fields
(``device_hit_tokens``, ``host_hit_tokens``, ``host_load_s``, ...) and ``host_weight``.

Outputs in ``--workdir``: ``route.jsonl`` (one row per policy and replica count:
``policy``, ``replicas``, ``requests``, ``prompt_tokens``, ``hit_tokens``,
``hit_rate_tokens``, ``ttft_p50_s``/``ttft_p90_s``/``ttft_p99_s``,
``throughput_tok_s``, ``load_imbalance``, ``route_us``, per-replica figures, plus
provenance), ``route_ttft.png`` (P90 TTFT and token hit rate against replicas, one
line per policy); a printed table on stderr; the last stdout line is a JSON object
with the paths and the rows.

Resume: each finished cell is appended to ``<workdir>/route.cells.jsonl``
(``_common.CellLog``); a rerun with the same workdir runs only the missing cells and
refuses a workdir of another config, seed or trace.
"""

from __future__ import annotations

import sys

from experiments import _common


def parse_list(name: str, value, convert=str) -> list:
    """A comma-separated flag/config value (or a sequence) as a non-empty list of
    distinct values (ValueError naming the flag and the repeated value otherwise)."""
    items = value.split(",") if isinstance(value, str) else list(value)
    items = [x.strip() if isinstance(x, str) else x for x in items]
    items = [x for x in items if x != ""]
    if not items:
        raise ValueError(f"--{name} is empty")
    try:
        out = [convert(x) for x in items]
    except ValueError:
        raise ValueError(f"--{name}: cannot read {value!r} as a comma-separated list of "
                         f"{convert.__name__}") from None
    dup = sorted({x for x in out if out.count(x) > 1}, key=out.index)
    if dup:  # "--replicas=2,2" would run (and write) the same cell twice
        raise ValueError(f"--{name}={value!r} repeats {', '.join(map(repr, dup))}: give each "
                         "value once")
    return out


def host_weight(config, cost) -> float:
    """``config.host_weight`` as a number: ``"auto"`` -> ``host_hit_weight`` of ``cost``."""
    from prefixcache.sim.routing import kv_events  # noqa: PLC0415

    w = config.host_weight
    if isinstance(w, str):
        if w.strip() == "auto":
            return kv_events.host_hit_weight(cost, config.block_size)
        try:
            w = float(w)
        except ValueError:
            raise ValueError(f"--host_weight must be 'auto' or a number in [0, 1], "
                             f"got {config.host_weight!r}") from None
    return kv_events.check_host_weight(w)


def check_config(config) -> tuple[list[str], list[int]]:
    """Validates the grid before anything runs; returns (policies, replica counts)."""
    from prefixcache.sim.routing import check_router_name  # noqa: PLC0415

    policies = [check_router_name(p) for p in parse_list("policies", config.policies)]
    replicas = parse_list("replicas", config.replicas, int)
    for r in replicas:
        if r < 1:
            raise ValueError(f"--replicas: a replica count must be >= 1, got {r}")
    if not config.time_scale > 0:
        raise ValueError(f"--time_scale must be > 0, got {config.time_scale}")
    if config.num_blocks < 0 or config.block_size < 1:
        raise ValueError("num_blocks must be >= 0 (0: all HBM left after the weights) and "
                         "block_size >= 1")
    _common.check_dataset_block_size(config)
    from prefixcache._validate import check_count  # noqa: PLC0415

    check_count("num_host_blocks", config.num_host_blocks)
    return policies, replicas


def run(config, *, progress: bool = False) -> dict:
    """Runs the routing grid of ``config``; writes route.jsonl + the plot."""
    from prefixcache.sim.cluster import simulate_cluster  # noqa: PLC0415
    from prefixcache.sim.des import SchedulerConfig  # noqa: PLC0415

    policies, replicas = check_config(config)
    # NOTE: the host link only with a host tier (the cost model of a run without one
    # stays as it was).
    cost = _common.cost_model(config, **({} if config.num_host_blocks else {"host_link": None}))
    num_blocks = config.num_blocks or cost.kv_cache_blocks(config.block_size)
    if num_blocks < 1:
        raise ValueError(f"{config.model} leaves no HBM for the KV cache on "
                         f"{config.accelerator}; set --num_blocks")
    num_host = config.num_host_blocks
    weight = host_weight(config, cost) if num_host else None
    cache = _common.cache_config(config, num_blocks=num_blocks)
    sched = SchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens,
                            max_num_seqs=config.max_num_seqs)
    workdir = _common.prepare_workdir(config.workdir)
    source = _common.source_name(config)
    cells = [(p, n) for n in replicas for p in policies]
    log = _common.CellLog(workdir, "route", _common.run_fingerprint(config, seed=config.seed))
    keys = [_common.cell_key({"policy": p, "replicas": n}) for p, n in cells]
    bar = None
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        bar = tqdm(total=len(cells), desc="route", unit="cell", initial=sum(
            k in log for k in keys))
    try:
        for (policy, n), key in zip(cells, keys):
            if key in log:  # finished by an earlier, interrupted run
                continue
            requests = _common.requests_from_config(config, workdir)
            s = simulate_cluster(
                requests, num_replicas=n, router=policy, cost_model=cost,
                cache_config=cache, scheduler=sched, time_scale=float(config.time_scale),
                arrival_rate=config.arrival_rate or None, seed=config.seed,
                router_options={"host_weight": weight} if num_host and policy == "kv_events"
                else None,
                # (optional config field: miss reasons per replica and summed in the rows)
                miss_reasons=bool(config.get("miss_reasons", False)))
            extra = {"host_weight": weight} if num_host and policy == "kv_events" else {}
            log.add(key, {"num_blocks": num_blocks, "block_size": config.block_size,
                          "model": config.model, "accelerator": config.accelerator, **s,
                          **extra})
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    rows = [log.get(k) for k in keys]
    prov = _common.provenance(config, seed=config.seed, hash_algo=config.hash_algo,
                              cache_state="cold", extra={"source": source})
    rows_path = workdir / "route.jsonl"
    with _common.AtomicJsonlWriter(rows_path, provenance=prov) as w:
        for row in rows:
            w.write({"record": "route", **row})
    png = workdir / "route_ttft.png"
    plot(rows, png, title=f"{_common.source_label(config)}: {config.model} on {config.accelerator}, "
                          f"{num_blocks} blocks x {config.block_size} per replica")
    print_table(rows)
    keep = ("policy", "replicas", "hit_rate_tokens", "host_hit_tokens", "hit_tokens_by_tier",
            "ttft_p50_s",
            "ttft_p90_s", "ttft_p99_s", "throughput_tok_s", "load_imbalance")
    return {"rows_file": str(rows_path), "png": str(png),
            "rows": [{k: r[k] for k in keep if k in r} for r in rows]}


def print_table(rows, file=None) -> None:
    # NOTE: stderr looked up per call (a default bound at import outlives a replaced one).
    file = sys.stderr if file is None else file
    host = any("host_hit_tokens" in r for r in rows)
    print(f"{'policy':>13} {'replicas':>8} {'hit rate':>8} {'TTFT p50':>9} {'p90':>9} "
          f"{'p99':>9} {'tok/s':>10} {'imbal.':>6} {'route us':>8}"
          + (f" {'host hits':>9}" if host else ""), file=file)
    for r in rows:
        hh = (f" {r['host_hit_tokens'] / max(r['prompt_tokens'], 1):>9.3f}"
              if "host_hit_tokens" in r else "")
        print(f"{r['policy']:>13} {r['replicas']:>8} {r['hit_rate_tokens']:>8.3f} "
              f"{r['ttft_p50_s']:>9.3f} {r['ttft_p90_s']:>9.3f} {r['ttft_p99_s']:>9.3f} "
              f"{r['throughput_tok_s']:>10.0f} {r['load_imbalance']:>6.2f} "
              f"{r['route_us']['p50']:>8.1f}{hh}", file=file)


def plot(rows, path, *, title: str = "") -> None:
    """P90 TTFT and token hit rate against replicas, one line per policy.

    Policies that give the same numbers (every policy at 1 replica) would hide each
    other: each policy has its own marker and dash pattern and is drawn slightly
    offset along x (a fraction of a tick, in log space), so all stay visible; ticks are
    the replica counts run.
    """
    fig, (ax1, ax2) = _common.new_figure(1, 2, figsize=(10, 3.8))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    markers = "osD^v<>ph*"
    dashes = ["-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1))]
    for k, policy in enumerate(policies):
        pts = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["replicas"])
        # Offsets of +-4% of x, symmetric around the true replica count.
        shift = 1.0 + 0.08 * ((k - (len(policies) - 1) / 2) / max(len(policies) - 1, 1))
        x = [r["replicas"] * shift for r in pts]
        style = dict(marker=markers[k % len(markers)], linestyle=dashes[k % len(dashes)],
                     markerfacecolor="none", markersize=6, label=policy)
        ax1.plot(x, [r["ttft_p90_s"] for r in pts], **style)
        ax2.plot(x, [r["hit_rate_tokens"] for r in pts], **style)
    counts = sorted({r["replicas"] for r in rows})
    ax1.set_yscale("log")
    ax1.set_ylabel("P90 TTFT (s)")
    ax2.set_ylabel("token hit rate")
    ax2.set_ylim(0, 1)
    from matplotlib.ticker import NullFormatter, NullLocator  # noqa: PLC0415

    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xticks(counts, [str(c) for c in counts])  # integer ticks only
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlim(counts[0] / 1.3, counts[-1] * 1.3)
        ax.set_xlabel("replicas (points offset slightly per policy)")
        ax.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    _common.save_plot(fig, path)


def main() -> None:
    _common.run_cli(run, config_name="route", extra_flags={
        "trace": ("string", "Trace file (our JSONL or Mooncake)"),
        "replicas": ("string", "Comma-separated replica counts"),
        "policies": ("string", "Comma-separated routing policies"),
        "num_blocks": ("integer", "KV blocks per replica (0: all HBM left after the weights)"),
        "block_size": ("integer", "Tokens per block"),
        "model": ("string", "Cost-model preset"),
        "time_scale": ("float", "Multiplies inter-arrival times"),
        "num_host_blocks": ("integer", "Host-memory tier blocks per replica (0: none)"),
        "host_weight": ("string", "kv_events: a host block's worth in device blocks, "
                                  "[0, 1] or 'auto' (from the cost model)"),
    })


if __name__ == "__main__":
    main()
