r"""Token hit rate and evictions vs cache size, cold vs warm cache.

  python -m experiments.sweep_capacity --config=configs/sweep_capacity.py --workdir=/tmp/sweep

For each capacity (``num_blocks``) in the config the same measured requests are
replayed twice through a fresh ``KVCacheManager``:

* ``cold``: the cache starts empty;
* ``warm``: the cache was first filled by replaying the warm-up requests (the
  first ``warmup_requests`` of the trace; the measured ones are the rest; with
  ``warmup_requests = 0`` the measured requests themselves, i.e. a second pass).

Hits and evictions are counted over the measured requests only. (Evictions during
the warm-up are subtracted: the replay is deterministic, so replaying the warm-up
alone reproduces them exactly.)

Writes ``results.jsonl`` (one line per capacity and cache state, with provenance)
and ``sweep_capacity.png`` into ``--workdir``; prints one summary JSON line.
"""

from __future__ import annotations

from collections.abc import Sequence

from experiments import _common


def measure(requests: Sequence, warmup: Sequence, *, num_blocks: int, block_size: int,
            cache_state: str, **replay_kwargs) -> dict:
    """Replays ``requests`` after ``warmup`` (warm) or alone (cold).

    Args:
      requests: the measured ``TraceRequest``s.
      warmup: requests replayed first when ``cache_state == "warm"``.
      num_blocks, block_size: the cache.
      cache_state: "cold" or "warm".
      **replay_kwargs: ``hash_algo``, ``hash_seed``, ``free_order``, ``concurrency``,
        ``eviction``.

    Returns:
      ``{"num_blocks", "capacity_tokens", "cache_state", "requests", "prompt_tokens",
      "hit_tokens", "hit_rate_tokens", "evictions", "failed"}`` over ``requests``.
    """
    from prefixcache.sim.replay import replay  # noqa: PLC0415

    if cache_state not in _common.CACHE_STATES:
        raise ValueError(f"cache_state must be one of {_common.CACHE_STATES}, got {cache_state!r}")
    pre = list(warmup) if cache_state == "warm" else []
    recs: list[dict] = []
    summary = replay([*pre, *requests], num_blocks=num_blocks, block_size=block_size,
                     on_record=recs.append, **replay_kwargs)
    evictions = summary["evictions"]
    if pre:
        evictions -= replay(pre, num_blocks=num_blocks, block_size=block_size,
                            **replay_kwargs)["evictions"]
    measured = recs[len(pre):]
    prompt = sum(r["prompt_tokens"] for r in measured)
    hits = sum(r["num_computed_tokens"] for r in measured)
    return {
        "num_blocks": num_blocks, "capacity_tokens": num_blocks * block_size,
        "cache_state": cache_state, "requests": len(measured), "prompt_tokens": prompt,
        "hit_tokens": hits, "hit_rate_tokens": hits / prompt if prompt else 0.0,
        "evictions": evictions, "failed": sum(1 for r in measured if r.get("failed")),
    }


def sweep(requests: Sequence, *, capacities: Sequence[int], block_size: int,
          warmup_requests: int = 0, progress: bool = False, **replay_kwargs) -> list[dict]:
    """``measure`` cold and warm at each capacity; rows in (capacity, cold/warm) order."""
    requests = list(requests)
    if warmup_requests < 0 or warmup_requests >= len(requests) and warmup_requests:
        raise ValueError(f"warmup_requests={warmup_requests} must be in [0, {len(requests)})")
    if not capacities or any(int(c) < 1 for c in capacities):
        raise ValueError(f"capacities must be positive block counts, got {list(capacities)}")
    warm, measured = ((requests[:warmup_requests], requests[warmup_requests:])
                      if warmup_requests else (requests, requests))
    rows = []
    items = [(int(c), s) for c in capacities for s in _common.CACHE_STATES]
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        items = tqdm(items, desc="sweep", unit="run")
    for cap, state in items:
        rows.append(measure(measured, warm, num_blocks=cap, block_size=block_size,
                            cache_state=state, **replay_kwargs))
    return rows


def plot(rows: Sequence[dict], path, *, title: str = "") -> None:
    """Hit rate and evictions vs capacity (tokens), one line per cache state."""
    fig, (ax1, ax2) = _common.new_figure(1, 2, figsize=(10, 3.8))
    for state, style in (("cold", "o-"), ("warm", "s--")):
        pts = [r for r in rows if r["cache_state"] == state]
        x = [r["capacity_tokens"] for r in pts]
        ax1.plot(x, [r["hit_rate_tokens"] for r in pts], style, label=state)
        ax2.plot(x, [r["evictions"] for r in pts], style, label=state)
    for ax, label in ((ax1, "token hit rate"), (ax2, "evicted blocks")):
        ax.set_xscale("log")
        ax.set_xlabel("cache capacity (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylim(0, 1)
    fig.suptitle(title, fontsize=9)
    _common.save_plot(fig, path)


def run(config, *, progress: bool = False) -> dict:
    """Runs the sweep of ``config``; writes results.jsonl + the plot into config.workdir."""
    workdir = _common.prepare_workdir(config.workdir)
    requests = list(_common.requests_from_config(config, workdir))
    rows = sweep(requests, capacities=list(config.capacities), block_size=config.block_size,
                 warmup_requests=config.warmup_requests, hash_algo=config.hash_algo,
                 hash_seed=config.hash_seed or None, free_order=config.free_order,
                 concurrency=config.concurrency, eviction=config.eviction, progress=progress)
    source = _common.source_name(config)
    with _common.AtomicJsonlWriter(workdir / "results.jsonl") as w:
        for state in _common.CACHE_STATES:
            prov = _common.provenance(config, seed=config.seed, hash_algo=config.hash_algo,
                                      cache_state=state, extra={"source": source})
            for row in rows:
                if row["cache_state"] == state:
                    w.write({"record": "capacity", **row}, provenance=prov)
    plot(rows, workdir / "sweep_capacity.png",
         title=f"{source}, block size {config.block_size}, {config.hash_algo}")
    return {"source": source, "rows": rows}


def main() -> None:
    _common.run_cli(run, config_name="sweep_capacity")


if __name__ == "__main__":
    main()
