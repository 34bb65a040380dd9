r"""Agent retention hints: hit rate and cost-model TTFT with vs without hints, beside lru,
ttl_lru and the offline bound (belady), on the generated agentic workload.

  python -m experiments.retention --config=configs/retention.py --workdir=/tmp/retention

See configs/retention.py. The workload (``prefixcache.sim.agentic``: coding-agent
sessions of tool-call loops with sub-agents, through the AgentX format; or a session
trace a user has: ``--config.dataset=agentx|claude_code_subagents|tracelab|...`` or
``--config.trace=FILE --config.trace_format=agentx|claude_code|tracelab``, whose reader
derives the hints) is replayed at each capacity with:

* ``lru`` (vLLM's order) on the trace without hints;
* ``ttl_lru`` (SGLang-style: blocks idle longer than the hints' TTL go first), no hints;
* ``hinted`` on the trace **with** the hints the session structure gives
  (``trace_formats.agentx_hints``: a live loop keeps its context for ``ttl_s``, the
  main agent above its sub-agents, a finished sub-agent's / session's private blocks
  first); without hints ``hinted`` is ``lru`` exactly (tested), so its row is the
  effect of the hints;
* ``belady``, the offline optimum (it reads the future, not the hints).

Per row: token hit rate, hit tokens, evictions, and the roofline cost model's TTFT of
every request's prefill alone (``CostModel.prefill_time(prompt - hit, hit)``: no
queueing; ``config.model`` on ``config.accelerator``): mean, p50, p90, p99. Writes
``retention.jsonl`` (one row per policy x capacity + the infinite-cache row, each with
provenance) and ``retention.png`` (hit rate and mean / p90 TTFT against capacity).
"""

from __future__ import annotations

import time

from experiments import _common

POLICIES = ("lru", "ttl_lru", "hinted", "belady")


def _percentile(xs, q):
    import numpy as np  # noqa: PLC0415

    return float(np.percentile(np.asarray(xs, dtype=float), q)) if xs else 0.0


def _row(policy, capacity, summary, recs, cm):
    ttft = [cm.prefill_time(r["prompt_tokens"] - r["num_computed_tokens"],
                            r["num_computed_tokens"]) for r in recs if "prompt_tokens" in r]
    return dict(record="cell", policy=policy, capacity_blocks=capacity,
                hints=policy == "hinted", requests=summary["requests"],
                prompt_tokens=summary["prompt_tokens"], hit_tokens=summary["hit_tokens"],
                hit_rate_tokens=summary["hit_rate_tokens"], evictions=summary["evictions"],
                ttft_mean_s=sum(ttft) / len(ttft) if ttft else 0.0,
                ttft_p50_s=_percentile(ttft, 50), ttft_p90_s=_percentile(ttft, 90),
                ttft_p99_s=_percentile(ttft, 99))


HINTED_FORMATS = ("agentx", "claude_code", "tracelab")  # readers that derive hints


def _traces(config, ttl_s: float):
    """(requests without hints, the same with hints): the generated workload, or a
    session trace a user has (``config.dataset`` by name, or ``config.trace`` with
    ``config.trace_format``), read twice by its reader."""
    from prefixcache.sim import datasets, workloads  # noqa: PLC0415
    from prefixcache.sim.trace_formats import READERS  # noqa: PLC0415

    dataset, trace = config.get("dataset", ""), config.get("trace", "")
    if dataset and trace:
        raise ValueError("give dataset or trace, not both")
    if not dataset and not trace:
        kwargs = dict(config.workload.to_dict())
        return (workloads.generate("agentic", seed=config.seed, hints=False, **kwargs),
                workloads.generate("agentic", seed=config.seed, hints=True, ttl_s=ttl_s,
                                   **kwargs))
    fmt = datasets.get(dataset).trace_format if dataset else config.get("trace_format", "")
    if fmt not in HINTED_FORMATS:
        raise ValueError(f"trace_format must be one of {HINTED_FORMATS} (formats with "
                         f"sessions), got {fmt!r}")
    path = datasets.path_of(dataset, progress=False) if dataset else trace
    read = READERS[fmt]
    return (list(read(path, lazy=True)), list(read(path, lazy=True, hints=True, ttl_s=ttl_s)))


def run(config, *, progress: bool = False) -> dict:
    from prefixcache.cost_model import CostModel  # noqa: PLC0415
    from prefixcache.sim.replay import replay  # noqa: PLC0415

    t0 = time.perf_counter()
    workdir = _common.prepare_workdir(config.workdir)
    policies = [p.strip() for p in config.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise ValueError(f"policies: unknown {unknown}; expected some of {POLICIES}")
    capacities = [int(c) for c in str(config.capacities).split(",") if c.strip()]
    if not capacities or min(capacities) < 1:
        raise ValueError(f"capacities must be positive block counts, got {config.capacities!r}")
    ttl_s = float(config.ttl_s)
    plain, hinted = _traces(config, ttl_s)
    cm = CostModel.create(config.model, config.accelerator)
    common = dict(block_size=config.block_size, concurrency=config.concurrency,
                  free_order="unhashed_first", hash_algo="xxhash", hash_seed=0)
    cells = [(p, c) for c in capacities for p in policies]
    rows = []
    for policy, cap in _common.progress_bar(cells, enabled=progress, total=len(cells)):
        recs = []
        trace = hinted if policy == "hinted" else plain
        opts = None
        if policy == "ttl_lru":
            opts = {"ttl": ttl_s, "unit": "s"}
        elif policy == "hinted":
            opts = {"unit": "s"}
        s = replay(trace, num_blocks=cap, eviction=policy, eviction_options=opts,
                   on_record=recs.append, **common)
        rows.append(_row(policy, cap, s, recs, cm))
    recs = []
    need = sum(-(-(len(r.prompt) + max(r.output_len, 1)) // config.block_size) for r in plain)
    ideal = replay(plain, num_blocks=need, on_record=recs.append, **common)
    ideal_row = _row("infinite", need, ideal, recs, cm)
    ideal_row["record"] = "ideal"
    prov = _common.provenance(config, seed=config.seed, hash_algo="xxhash",
                              cache_state="cold",
                              extra={"cost_model": {"model": config.model,
                                                    "accelerator": config.accelerator}})
    with _common.AtomicJsonlWriter(workdir / "retention.jsonl", provenance=prov) as w:
        for r in rows:
            w.write(r)
        w.write(ideal_row)
    png = _plot(rows, ideal_row, workdir / "retention.png", config)
    by = {(r["policy"], r["capacity_blocks"]): r for r in rows}
    summary = dict(rows=str(workdir / "retention.jsonl"), png=str(png),
                   requests=ideal["requests"], ideal_hit_rate_tokens=ideal["hit_rate_tokens"],
                   hit_rate={p: [round(by[(p, c)]["hit_rate_tokens"], 4) for c in capacities]
                             for p in policies},
                   ttft_p50_s={p: [round(by[(p, c)]["ttft_p50_s"], 4) for c in capacities]
                               for p in policies},
                   capacities=capacities, wall_s=round(time.perf_counter() - t0, 2))
    return summary


def _plot(rows, ideal, path, config):
    fig, axes = _common.new_figure(1, 3, figsize=(15, 4.2))
    styles = {"lru": ("tab:blue", "o"), "ttl_lru": ("tab:orange", "s"),
              "hinted": ("tab:green", "^"), "belady": ("black", "x")}
    for policy in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["capacity_blocks"], r) for r in rows if r["policy"] == policy)
        xs = [c for c, _ in pts]
        color, marker = styles.get(policy, ("gray", "."))
        label = "hinted (with hints)" if policy == "hinted" else policy
        for ax, key, scale in ((axes[0], "hit_rate_tokens", 1.0), (axes[1], "ttft_mean_s", 1e3),
                               (axes[2], "ttft_p90_s", 1e3)):
            ax.plot(xs, [r[key] * scale for _, r in pts], marker=marker, color=color,
                    label=label, linestyle="--" if policy == "belady" else "-")
    axes[0].axhline(ideal["hit_rate_tokens"], color="gray", linestyle=":",
                    label="infinite cache")
    axes[0].set_ylabel("token hit rate")
    axes[1].set_ylabel("mean TTFT, cost model (ms)")
    axes[2].set_ylabel("p90 TTFT, cost model (ms)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"cache capacity (blocks of {config.block_size} tokens)")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    src = (config.get("dataset") or config.get("trace") or
           f"the agentic workload, {config.workload.num_sessions} sessions")
    fig.suptitle(f"Retention hints on {src} (TTL {config.ttl_s:g} s; {config.model} on "
                 f"{config.accelerator})")
    return _common.save_plot(fig, path)


def main() -> None:
    _common.run_cli(run, config_name="retention")


if __name__ == "__main__":
    main()
