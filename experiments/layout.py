r"""Prompt layout: the stable part before vs after the request-specific part.

  python -m experiments.layout --config=configs/layout.py --workdir=/tmp/layout

The seeds advise "put stable instructions before request-specific data": a prefix
cache only reuses a prompt's *prefix*, so a shared system prompt (or few-shot header)
placed after the per-request text is never hit. This experiment builds the same
generated workload twice -- ``layout="stable_first"`` and ``"stable_last"`` (the same
tokens, reordered; ``prefixcache.sim.workloads.LAYOUTS``) -- replays both through the
same cache and reports, side by side:

* reused tokens (``hit_tokens``) and the token hit rate;
* simulated TTFT per request: ``CostModel.prefill_time(prompt - hit, hit)`` of
  ``config.model`` on ``config.accelerator`` (the queue-free roofline prefill of the
  request alone; no batching or queueing), mean / p50 / p90 / p99.

Outputs in ``--workdir``: ``layout.jsonl`` (one row per layout, provenance with cache
state cold), ``layout.png`` (hit rate and TTFT per layout; the TTFT CDF); the last
stdout line a JSON object with both paths and the rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from experiments import _common

ROWS_FILE = "layout.jsonl"
PNG_FILE = "layout.png"


def layout_row(records: Sequence[dict], cost, *, layout: str) -> tuple[dict, list[float]]:
    """The summary row of one layout's replay records, and its per-request TTFTs.

    Args:
        records: the replay's per-request records (``prompt_tokens``,
            ``num_computed_tokens``, ``failed``).
        cost: a ``CostModel``.
        layout: the layout's name.
    """
    import numpy as np  # noqa: PLC0415

    admitted = [r for r in records if not r.get("failed")]
    ttft = [cost.prefill_time(r["prompt_tokens"] - r["num_computed_tokens"],
                              r["num_computed_tokens"]) for r in admitted]
    prompt = sum(r["prompt_tokens"] for r in records)
    hits = sum(r["num_computed_tokens"] for r in admitted)
    t = np.asarray(ttft, dtype=np.float64)
    pct = (lambda q: float(np.percentile(t, q))) if len(t) else (lambda q: None)
    return {
        "record": "layout", "layout": layout, "requests": len(records),
        "failed": len(records) - len(admitted), "prompt_tokens": prompt, "hit_tokens": hits,
        "hit_rate_tokens": hits / prompt if prompt else 0.0,
        "requests_with_hit": sum(1 for r in admitted if r["num_computed_tokens"]),
        "ttft_mean_s": float(t.mean()) if len(t) else None,
        "ttft_p50_s": pct(50), "ttft_p90_s": pct(90), "ttft_p99_s": pct(99),
    }, ttft


def run_layouts(config, *, progress: bool = False) -> tuple[list[dict], dict[str, list[float]]]:
    """Generates and replays the workload in every layout; returns rows and TTFTs.

    Raises:
        ValueError: an unknown workload (only generators with a ``layout`` argument),
            model, accelerator or replay setting.
    """
    import inspect  # noqa: PLC0415

    from prefixcache.sim import workloads  # noqa: PLC0415
    from prefixcache.sim.replay import replay  # noqa: PLC0415

    name = config.workload.name
    gen = workloads.WORKLOADS.get(name)
    if gen is None or "layout" not in inspect.signature(gen).parameters:
        with_layout = [n for n, g in workloads.WORKLOADS.items()
                       if "layout" in inspect.signature(g).parameters]
        raise ValueError(f"workload {name!r} has no layout variant; expected one of {with_layout}")
    cost = _common.cost_model(config)
    kwargs = _common._tuples(_common.to_jsonable(config.workload.kwargs))
    rows, ttfts = [], {}
    for layout in workloads.LAYOUTS:
        requests = workloads.generate(name, seed=config.seed, layout=layout, **kwargs)
        records: list[dict] = []
        summary = replay(requests, cache_config=_common.cache_config(config),
                         concurrency=config.concurrency, on_record=records.append,
                         progress=progress)
        row, ttfts[layout] = layout_row(records, cost, layout=layout)
        assert row["hit_tokens"] == summary["hit_tokens"], (row, summary)
        rows.append({**row, "workload": name, "num_blocks": config.num_blocks,
                     "block_size": config.block_size, "concurrency": config.concurrency,
                     "model": config.model, "accelerator": config.accelerator,
                     "evictions": summary["evictions"]})
    return rows, ttfts


def plot(rows: Sequence[dict], ttfts: dict[str, list[float]], path, *, title: str = "") -> None:
    """Hit rate and mean / p90 TTFT per layout (bars), and the TTFT CDFs."""
    import numpy as np  # noqa: PLC0415

    fig, (ax1, ax2, ax3) = _common.new_figure(1, 3, figsize=(13, 3.8))
    names = [r["layout"] for r in rows]
    x = np.arange(len(rows))
    ax1.bar(x, [r["hit_rate_tokens"] for r in rows], color=["tab:green", "tab:red"][:len(rows)])
    ax1.set_ylabel("token hit rate")
    ax1.set_ylim(0, 1)
    for ax in (ax1, ax2):
        ax.set_xticks(x, names)
    ax2.bar(x - 0.2, [r["ttft_mean_s"] * 1e3 for r in rows], 0.4, label="mean")
    ax2.bar(x + 0.2, [r["ttft_p90_s"] * 1e3 for r in rows], 0.4, label="p90")
    ax2.set_ylabel("simulated TTFT (ms)")
    ax2.legend()
    for layout, t in ttfts.items():
        t = np.sort(np.asarray(t)) * 1e3
        ax3.plot(t, np.arange(1, len(t) + 1) / max(len(t), 1), label=layout)
    ax3.set_xlabel("simulated TTFT (ms)")
    ax3.set_ylabel("fraction of requests")
    ax3.legend()
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    _common.save_plot(fig, path)


def run(config, *, progress: bool = False) -> dict:
    """Runs both layouts; writes the rows and the plot into ``config.workdir``."""
    workdir = _common.prepare_workdir(config.workdir)
    rows, ttfts = run_layouts(config, progress=progress)
    prov = _common.provenance(config, seed=config.seed, hash_algo=config.hash_algo,
                              cache_state="cold")
    rows_path, png_path = workdir / ROWS_FILE, workdir / PNG_FILE
    with _common.AtomicJsonlWriter(rows_path, provenance=prov) as w:
        for row in rows:
            w.write(row)
    plot(rows, ttfts, png_path,
         title=f"workload:{config.workload.name}, {config.model} on {config.accelerator}, "
               f"{config.num_blocks} x {config.block_size}-token blocks")
    for r in rows:
        print(f"{r['layout']:<13} reused {r['hit_tokens']:>10,} of {r['prompt_tokens']:,} tokens "
              f"(hit rate {r['hit_rate_tokens']:.3f}); TTFT mean {r['ttft_mean_s'] * 1e3:.2f} ms, "
              f"p50 {r['ttft_p50_s'] * 1e3:.2f}, p90 {r['ttft_p90_s'] * 1e3:.2f}", flush=True)
    return {"rows": str(rows_path), "png": str(png_path),
            "layouts": [{k: r[k] for k in ("layout", "hit_tokens", "hit_rate_tokens",
                                           "ttft_mean_s", "ttft_p50_s", "ttft_p90_s")}
                        for r in rows]}


def main() -> None:
    _common.run_cli(run, config_name="layout")


if __name__ == "__main__":
    main()
