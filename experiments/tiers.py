r"""The storage tier chain: device only / + host / + host + disk / + a remote store
shared by the replicas, on one trace: hit rate by tier and simulated TTFT.

  python -m experiments.tiers --config=configs/tiers.py --workdir=/tmp/tiers
  python -m experiments.tiers --config=configs/tiers.py:quick --workdir=/tmp/tiers_q

Every scenario runs the same cluster (``prefixcache.sim.cluster.simulate_cluster``:
``config.replicas`` replicas of ``config.num_blocks`` device blocks, ``config.router``,
``config.model`` on ``config.accelerator``): ``device`` (no tier), ``host`` (a host tier
of ``host_multiple x num_blocks`` per replica), ``host+disk`` (and a disk tier of
``disk_multiple x num_blocks`` pages per replica) and ``host+disk+remote`` (and one
remote store of ``remote_multiple x num_blocks`` pages shared by every replica: a block
one replica demoted is a hit for another). Each tier's loads are charged at its own
link (the host at ``config.host_link``, disk and remote at their ``TierLink``s,
``prefixcache.core.tiers``). Plus two bounds from the replay of the whole trace on one
pool: Belady's eviction with the chain's whole capacity in one place (``record:
"belady"``: ``replicas x (1 + host + disk) x num_blocks + remote`` blocks, no replica
split, no tier boundary) and a cache that never evicts (``record: "ideal"``).

Outputs in ``--workdir``: ``tiers.jsonl`` (one row per scenario with provenance),
``tiers.png`` (left: token hit rate stacked by tier; right: TTFT mean / p90), a table
on stdout; the last stdout line is a JSON object with the paths and headline figures.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from experiments import _common

ROWS_FILE = "tiers.jsonl"
PNG_FILE = "tiers.png"
SCENARIOS = ("device", "host", "host+disk", "host+disk+remote")
TIER_ORDER = ("device", "host", "disk", "remote")


def scenario_cache(config, scenario: str, page_bytes: int):
    """The ``CacheConfig`` of one scenario (every replica's)."""
    n = config.num_blocks
    kw = {}
    if scenario != "device":
        kw["num_host_blocks"] = int(config.host_multiple * n)
    if "disk" in scenario:
        kw.update(disk_bytes=int(config.disk_multiple * n) * page_bytes,
                  disk_eviction=config.disk_eviction, page_bytes=page_bytes)
    if "remote" in scenario:
        kw.update(remote_bytes=int(config.remote_multiple * n) * page_bytes,
                  remote_eviction=config.remote_eviction, page_bytes=page_bytes)
    return _common.cache_config(config, **kw)


def run_scenario(config, scenario: str) -> dict:
    """One scenario's row (the cluster's summary fields this study reads)."""
    from prefixcache.sim.cluster import simulate_cluster  # noqa: PLC0415
    from prefixcache.sim.des import SchedulerConfig  # noqa: PLC0415

    t0 = time.perf_counter()
    cost = _common.cost_model(config)
    page_bytes = cost.block_bytes(config.block_size)
    cache = scenario_cache(config, scenario, page_bytes)
    s = simulate_cluster(
        _common.requests_from_config(config, config.workdir or None),
        num_replicas=config.replicas, router=config.router, cost_model=cost,
        cache_config=cache,
        scheduler=SchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_num_seqs=config.max_num_seqs),
        seed=config.seed)
    by = s.get("hit_tokens_by_tier") or {
        "device": s.get("device_hit_tokens", s["hit_tokens"]),
        "host": s.get("host_hit_tokens", 0)}
    prompt = s["prompt_tokens"]
    return {"record": "cluster", "scenario": scenario, "replicas": config.replicas,
            "num_blocks": config.num_blocks, "page_bytes": page_bytes,
            "cache": cache.to_dict(), "requests": s["requests"], "prompt_tokens": prompt,
            "hit_tokens": s["hit_tokens"], "hit_rate_tokens": s["hit_rate_tokens"],
            "hit_tokens_by_tier": by,
            "hit_rate_by_tier": {t: (v / prompt if prompt else 0.0) for t, v in by.items()},
            "ttft_s": s["ttft_s"], "host_load_s": s.get("host_load_s", 0.0),
            "cell_s": time.perf_counter() - t0}


def bound_rows(config) -> list[dict]:
    """The bounds: the whole trace on one pool of the chain's whole capacity under
    Belady's eviction, and on one pool that never evicts."""
    from prefixcache.sim import compare  # noqa: PLC0415
    from prefixcache.sim.replay import replay  # noqa: PLC0415

    def reqs():
        return list(_common.requests_from_config(config, config.workdir or None))

    n = config.num_blocks
    total = int(config.replicas * n * (1 + config.host_multiple + config.disk_multiple)
                + config.remote_multiple * n)
    rows = []
    for record, scenario, num_blocks, eviction in (
            ("belady", "belady, all capacity", total, "belady"),
            ("ideal", "never evicts", compare.ideal_num_blocks(reqs(), config.block_size),
             config.eviction)):
        s = replay(reqs(), cache_config=_common.cache_config(
            config, num_blocks=num_blocks, eviction=eviction, eviction_options=None))
        rows.append({"record": record, "scenario": scenario, "num_blocks": num_blocks,
                     "requests": s["requests"], "prompt_tokens": s["prompt_tokens"],
                     "hit_tokens": s["hit_tokens"], "hit_rate_tokens": s["hit_rate_tokens"]})
    return rows


def format_table(rows: Sequence[dict]) -> str:
    """One line per scenario: hit rate by tier, TTFT."""
    lines = [f"{'scenario':>20} {'hit':>6} " + " ".join(f"{t:>7}" for t in TIER_ORDER)
             + f" {'mean ms':>8} {'p90 ms':>8}"]
    for r in rows:
        if r["record"] != "cluster":
            lines.append(f"{r['scenario']:>20} {r['hit_rate_tokens']:>6.4f}")
            continue
        by = r["hit_rate_by_tier"]
        lines.append(f"{r['scenario']:>20} {r['hit_rate_tokens']:>6.4f} "
                     + " ".join(f"{by.get(t, 0.0):>7.4f}" for t in TIER_ORDER)
                     + f" {r['ttft_s']['mean'] * 1e3:>8.2f} {r['ttft_s']['p90'] * 1e3:>8.2f}")
    return "\n".join(lines)


def plot(rows: Sequence[dict], path, *, title: str = "") -> None:
    """Left: token hit rate stacked by tier per scenario; right: TTFT mean and p90."""
    fig, (ax, bx) = _common.new_figure(1, 2, figsize=(11, 4.2))
    cells = [r for r in rows if r["record"] == "cluster"]
    x = list(range(len(cells)))
    bottom = [0.0] * len(cells)
    for i, tier in enumerate(TIER_ORDER):
        v = [r["hit_rate_by_tier"].get(tier, 0.0) for r in cells]
        ax.bar(x, v, bottom=bottom, color=f"C{i}", label=f"{tier} hits")
        bottom = [b + w for b, w in zip(bottom, v)]
    for r, style in ((r, {"ideal": "-.", "belady": ":"}.get(r["record"])) for r in rows):
        if style is not None:
            ax.axhline(r["hit_rate_tokens"], color="gray", linestyle=style,
                       label=f"{r['scenario']} ({r['hit_rate_tokens']:.3f})")
    ax.set_xticks(x, [r["scenario"] for r in cells], fontsize=8)
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper left")
    for stat, style in (("mean", "o-"), ("p90", "^:")):
        bx.plot(x, [r["ttft_s"][stat] * 1e3 for r in cells], style, label=f"TTFT {stat}")
    bx.set_xticks(x, [r["scenario"] for r in cells], fontsize=8)
    bx.set_ylabel("simulated TTFT (ms), each tier's loads at its link")
    bx.set_ylim(bottom=0)
    bx.grid(alpha=0.3)
    bx.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    _common.save_plot(fig, path)


def run(config, *, progress: bool = False) -> dict:
    """Runs every scenario of ``config``; writes the rows and the plot into its workdir."""
    for name in ("host_multiple", "disk_multiple", "remote_multiple"):
        if not config[name] > 0:
            raise ValueError(f"{name} must be > 0, got {config[name]!r}")
    workdir = _common.prepare_workdir(config.workdir)
    _common.trace_path(config)  # a missing trace / unknown dataset fails before any cell
    rows = [run_scenario(config, s) for s in SCENARIOS] + bound_rows(config)
    source = _common.source_name(config)
    prov = _common.provenance(config, seed=config.seed, hash_algo=config.hash_algo,
                              cache_state="cold", extra={"source": source})
    rows_path, png_path = workdir / ROWS_FILE, workdir / PNG_FILE
    with _common.AtomicJsonlWriter(rows_path, provenance=prov) as w:
        for row in rows:
            w.write({"source": source, "block_size": config.block_size, **row})
    plot(rows, png_path, title=f"{source}: {config.replicas} replicas x {config.num_blocks} "
                               f"device blocks of {config.block_size} tokens")
    print(format_table(rows), flush=True)
    return {"rows": str(rows_path), "png": str(png_path), "source": source,
            "hit_rate_tokens": {r["scenario"]: r["hit_rate_tokens"] for r in rows},
            "ttft_mean_s": {r["scenario"]: r["ttft_s"]["mean"] for r in rows
                            if r["record"] == "cluster"}}


def main() -> None:
    _common.run_cli(run, config_name="tiers", extra_flags={
        "num_blocks": ("integer", "Device pool per replica, in blocks"),
        "replicas": ("integer", "Replicas"),
        "max_requests": ("integer", "Only the first N requests (0: all)"),
    })


if __name__ == "__main__":
    main()
