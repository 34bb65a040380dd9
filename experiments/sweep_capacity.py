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

Capacities are block counts (``config.capacities``) or KV byte budgets
(``--kv_bytes``, e.g. ``2GiB`` or ``"256MiB,1GiB"``; then ``config.capacities`` must
be empty: both -> error), converted per KV dtype (``--kv_dtype``, one or a
comma-separated list of ``prefixcache.kv_dtypes.KV_DTYPES``) with the model preset's
bytes per block (``--model``, a ``prefixcache.sim.cost_model`` preset; fp8/int8
blocks include their scales). Every row carries ``kv_dtype``, ``bytes_per_block``,
``kv_bytes`` (``num_blocks * bytes_per_block``) and ``kv_bytes_budget``.

  python -m experiments.sweep_capacity --config=configs/sweep_capacity_kv_dtypes.py \
      --workdir=/tmp/sweep_kv
  python -m experiments.sweep_capacity --workdir=/tmp/s --kv_bytes=2GiB \
      --kv_dtype=float8_e4m3fn --config.capacities='()'

Writes ``results.jsonl`` (one line per capacity, KV dtype and cache state, with
provenance), ``sweep_capacity.png`` and ``sweep_capacity_kv.png`` (token hit rate
against GiB of KV, a line per KV dtype and cache state) into ``--workdir``; prints
one summary JSON line.

Resume: each finished cell is appended to ``<workdir>/sweep_capacity.cells.jsonl``
(``_common.CellLog``); a rerun with the same workdir runs only the missing cells and
refuses a workdir of another config, seed or trace.
"""

from __future__ import annotations

from collections.abc import Sequence

from experiments import _common, _kv_budget


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
          warmup_requests: int = 0, progress: bool = False, log=None,
          **replay_kwargs) -> list[dict]:
    """``measure`` cold and warm at each capacity; rows in (capacity, cold/warm) order.

    ``log``: a ``_common.CellLog``: each (capacity, cache state) is saved as it
    finishes, and those it already holds are not measured again.
    """
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
        key = _common.cell_key({"num_blocks": cap, "cache_state": state})
        if log is not None and key in log:
            rows.append(log.get(key))
            continue
        row = measure(measured, warm, num_blocks=cap, block_size=block_size,
                      cache_state=state, **replay_kwargs)
        if log is not None:
            log.add(key, row)
        rows.append(row)
    return rows


def plot(rows: Sequence[dict], path, *, title: str = "") -> None:
    """Hit rate and evictions vs capacity (tokens), one line per cache state (and KV
    dtype, when rows hold several)."""
    fig, (ax1, ax2) = _common.new_figure(1, 2, figsize=(10, 3.8))
    dtypes = list(dict.fromkeys(r.get("kv_dtype") for r in rows))
    for dt in dtypes:
        for state, style in (("cold", "o-"), ("warm", "s--")):
            pts = [r for r in rows if r["cache_state"] == state and r.get("kv_dtype") == dt]
            x = [r["capacity_tokens"] for r in pts]
            label = state if len(dtypes) == 1 else f"{dt} {state}"
            ax1.plot(x, [r["hit_rate_tokens"] for r in pts], style, label=label)
            ax2.plot(x, [r["evictions"] for r in pts], style, label=label)
    for ax, label in ((ax1, "token hit rate"), (ax2, "evicted blocks")):
        ax.set_xscale("log")
        ax.set_xlabel("cache capacity (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylim(0, 1)
    fig.suptitle(title, fontsize=9)
    _common.save_plot(fig, path)


def plot_per_gib(rows: Sequence[dict], path, *, title: str = "") -> None:
    """Token hit rate vs GiB of KV, one line per (KV dtype, cache state)."""
    fig, ax = _common.new_figure(1, 1, figsize=(6, 3.8))
    for dt in dict.fromkeys(r["kv_dtype"] for r in rows):
        for state, style in (("cold", "o-"), ("warm", "s--")):
            pts = sorted((r for r in rows if r["cache_state"] == state and r["kv_dtype"] == dt),
                         key=lambda r: r["kv_bytes"])
            ax.plot([r["kv_bytes"] / 2**30 for r in pts], [r["hit_rate_tokens"] for r in pts],
                    style, label=f"{dt} {state}")
    ax.set_xscale("log")
    ax.set_xlabel("KV cache (GiB)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    _common.save_plot(fig, path)


def kv_sweep(requests: Sequence, *, config, progress: bool = False, log=None,
             **replay_kwargs) -> list[dict]:
    """``sweep`` over the (KV dtype, num_blocks) of ``config``'s capacities or byte
    budgets (`_kv_budget.resolve`); rows carry the KV fields. A block count shared by
    several dtypes is replayed once (the hit rate depends on blocks only)."""
    plan = _kv_budget.resolve(capacities=config.capacities, kv_bytes=config.get("kv_bytes", ""),
                              kv_dtype=config.get("kv_dtype", "bfloat16"),
                              model=config.get("model", "llama_3_2_1b"),
                              block_size=config.block_size)
    caps = sorted({nb for _, nb, _, _ in plan})
    rows = sweep(requests, capacities=caps, block_size=config.block_size,
                 progress=progress, log=log, **replay_kwargs)
    by_cap = {(r["num_blocks"], r["cache_state"]): r for r in rows}
    return [{**by_cap[(nb, state)], **_kv_budget.row_fields(dt, nb, bpb, budget)}
            for dt, nb, bpb, budget in plan for state in _common.CACHE_STATES]


def run(config, *, progress: bool = False) -> dict:
    """Runs the sweep of ``config``; writes results.jsonl + the plots into config.workdir."""
    # Bad budgets, dtypes or models fail here, before the trace is read.
    _kv_budget.resolve(capacities=config.capacities, kv_bytes=config.get("kv_bytes", ""),
                       kv_dtype=config.get("kv_dtype", "bfloat16"),
                       model=config.get("model", "llama_3_2_1b"), block_size=config.block_size)
    _common.check_dataset_block_size(config)
    workdir = _common.prepare_workdir(config.workdir)
    requests = list(_common.requests_from_config(config, workdir))
    rows = kv_sweep(requests, config=config, warmup_requests=config.warmup_requests,
                    hash_algo=config.hash_algo, hash_seed=config.hash_seed or None,
                    free_order=config.free_order, concurrency=config.concurrency,
                    eviction=config.eviction, progress=progress,
                    log=_common.CellLog(workdir, "sweep_capacity",
                                        _common.run_fingerprint(config, seed=config.seed)))
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
    plot_per_gib(rows, workdir / "sweep_capacity_kv.png",
                 title=f"{source}, {config.get('model', 'llama_3_2_1b')} KV, block size "
                       f"{config.block_size}")
    return {"source": source, "rows": rows}


def main() -> None:
    _common.run_cli(run, config_name="sweep_capacity", extra_flags={
        "kv_bytes": ("string", "KV byte budgets, comma-separated ('2GiB', '512MiB', ints); "
                              "config.capacities must then be empty"),
        "kv_dtype": ("string", "KV dtypes, comma-separated (bfloat16, float32, "
                              "float8_e4m3fn, int8)"),
        "model": ("string", "Model preset for bytes per block (prefixcache.sim.cost_model)"),
    })


if __name__ == "__main__":
    main()
