r"""Time to first token by cached-prefix length: simulated at scale, and measured.

  python -m experiments.latency_by_prefix --config=configs/latency_by_prefix.py \
      --workdir=/tmp/latency

Two parts, both written to ``results.jsonl`` (provenance on every line) and
``latency_by_prefix.png`` in ``--workdir``:

* simulated (``prefixcache.sim.des``): the workload's requests arrive (trace
  timestamps or Poisson), are batched under a token budget, hit or miss in the
  real ``KVCacheManager`` and take roofline step times of ``config.model`` on each
  accelerator in ``config.accelerators``. Per accelerator and cache state: TTFT
  percentiles per cached-prefix bin (``config.prefix_edges``), a summary, and the
  queue-free roofline curve ``prefill_time(P - c, c)`` for a ``curve_prompt_len``
  prompt. Cold runs start with an empty cache; with ``warmup_requests = N > 0``
  warm runs prefill the first N prompts first and both measure the rest.
* measured (``config.measured.enable``; needs the engine and jax): the tiny model
  on this machine's backend. For each target prefix length c, a prompt of
  ``c + suffix_len`` tokens is served cold (prefix cache reset) and warm (a request
  sharing the c-token prefix ran just before); TTFT from the engine's request
  metrics. One untimed pass compiles every shape first; medians over
  ``repeats``.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Iterable, Sequence

from experiments import _common


# ----------------------------------------------------------------------------
# simulated
# ----------------------------------------------------------------------------


def simulate_latency(make_requests: Callable[[], Iterable], config, *,
                     progress: bool = False, num_requests: int | None = None) -> list[dict]:
    """Runs the DES per accelerator and cache state; returns result rows.

    Args:
      make_requests: returns a fresh iterator over the requests (each run streams
        its own pass over the trace, so memory stays O(running requests) even for
        Mooncake-size traces).
      config: the latency_by_prefix config.
      progress: tqdm progress bars.
      num_requests: requests ``make_requests`` yields, when known (the bars' totals;
        default: ``config.max_requests`` when set).

    Rows: ``{"record": "bin", "accelerator", "cache_state", "lo", "hi", "count",
    "mean", "p50", "p90", "p99"}`` (TTFT seconds per cached-prefix bin),
    ``{"record": "sim_summary", ...}`` (``prefixcache.sim.des.simulate``'s
    summary) and ``{"record": "roofline", "accelerator", "cache_state", "prompt_tokens",
    "cached_tokens", "ttft_s"}`` (cache_state "warm": ``cached_tokens`` of the prompt
    are cached; "cold" at 0).
    """
    from prefixcache.sim import des  # noqa: PLC0415

    n_warm = int(config.warmup_requests)
    if n_warm < 0:
        raise ValueError(f"warmup_requests must be >= 0, got {n_warm}")
    known = num_requests or config.max_requests
    total = max(known - n_warm, 0) if known else None
    states = ("cold", "warm") if n_warm else ("cold",)
    sched = des.SchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens,
                                max_num_seqs=config.max_num_seqs)
    rows: list[dict] = []
    for acc in config.accelerators:
        cost = _common.cost_model(config, accelerator=acc)
        num_blocks = config.num_blocks or cost.kv_cache_blocks(config.block_size)
        if num_blocks < 1:
            raise ValueError(f"{config.model} leaves no HBM for the KV cache on {acc}; "
                             "set num_blocks or num_chips")
        for state in states:
            recs: list[dict] = []
            summary = des.simulate(
                itertools.islice(make_requests(), n_warm, None), cost_model=cost,
                cache_config=_common.cache_config(config, num_blocks=num_blocks),
                scheduler=sched,
                warmup=itertools.islice(make_requests(), n_warm) if state == "warm" else None,
                arrival_rate=config.arrival_rate or None, seed=config.seed,
                on_record=recs.append, progress=progress, total=total)
            if summary["requests"] == 0:
                raise ValueError(f"no requests left to measure after warmup_requests={n_warm}")
            for b in des.bucket_by(recs, "num_cached_tokens", "ttft_s", list(config.prefix_edges)):
                rows.append({"record": "bin", "accelerator": acc, "cache_state": state, **b})
            rows.append({"record": "sim_summary", "accelerator": acc, "num_blocks": num_blocks,
                         **summary})
        p = int(config.curve_prompt_len)
        for c in range(0, p, max(1, p // 16)):
            # The curve point of c cached tokens: warm (that prefix cached), cold at 0.
            rows.append({"record": "roofline", "accelerator": acc,
                         "cache_state": "warm" if c else "cold",
                         "prompt_tokens": p, "cached_tokens": c,
                         "ttft_s": cost.prefill_time(p - c, c)})
    return rows


# ----------------------------------------------------------------------------
# measured (engine)
# ----------------------------------------------------------------------------


def measure_engine_ttft(mc, *, seed: int = 0, hash_algo: str = "sha256",
                        progress: bool = False) -> list[dict]:
    """TTFT of the tiny model by cached-prefix length, cold and warm.

    Args:
      mc: the ``config.measured`` block: ``prefix_lengths`` (multiples of
        ``block_size``), ``suffix_len``, ``repeats``, ``num_blocks``,
        ``block_size``, ``max_num_batched_tokens``, ``max_tokens``.
      seed: engine / prompt seed.

    Returns:
      Rows ``{"record": "measured", "cache_state", "target_cached_tokens",
      "num_cached_tokens", "prompt_tokens", "ttft_s", "repeat"}``.
    """
    import numpy as np  # noqa: PLC0415

    from prefixcache.engine import Engine, SamplingParams  # noqa: PLC0415
    from prefixcache.model import ModelConfig  # noqa: PLC0415

    lengths = [int(c) for c in mc.prefix_lengths]
    if any(c < 0 or c % mc.block_size for c in lengths):
        raise ValueError(f"prefix_lengths must be multiples of block_size={mc.block_size}: {lengths}")
    model_config = ModelConfig.tiny()
    engine = Engine(model_config, num_blocks=mc.num_blocks, block_size=mc.block_size,
                    enable_caching=True, seed=seed, hash_algo=hash_algo,
                    max_num_batched_tokens=mc.max_num_batched_tokens)
    params = SamplingParams(max_tokens=mc.max_tokens, temperature=0.0)
    rng = np.random.default_rng(seed)
    vocab = model_config.vocab_size

    def tokens(n):
        return rng.integers(1, vocab, size=n).tolist()

    def one(prefix, state):
        prompt = prefix + tokens(mc.suffix_len)
        engine.kv_cache_manager.reset_prefix_cache()
        if state == "warm":  # a request sharing the prefix runs first
            engine.generate([prefix + tokens(mc.suffix_len)], params)
        out = engine.generate([prompt], params)[0]
        return out.metrics

    rows = []
    passes = [(r, c, s) for r in range(-1, mc.repeats) for c in lengths for s in ("cold", "warm")]
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        passes = tqdm(passes, desc="engine ttft", unit="req")
    for r, c, state in passes:
        m = one(tokens(c), state)
        if r < 0:
            continue  # the untimed compile pass
        rows.append({"record": "measured", "cache_state": state, "target_cached_tokens": c,
                     "num_cached_tokens": m.num_cached_tokens,
                     "prompt_tokens": m.num_prompt_tokens, "ttft_s": m.ttft_s, "repeat": r})
    return rows


def median_by(rows: Sequence[dict], *keys: str, value: str = "ttft_s") -> list[dict]:
    """Median of ``value`` grouped by ``keys`` (sorted by the keys)."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r[value])
    return [{**dict(zip(keys, k)), "count": len(v), f"median_{value}": statistics.median(v)}
            for k, v in sorted(groups.items())]


# ----------------------------------------------------------------------------
# plot + run
# ----------------------------------------------------------------------------


def plot(rows: Sequence[dict], path, *, title: str = "") -> None:
    """Left: simulated p50 TTFT per bin and roofline curves; right: measured (if any)."""
    measured = [r for r in rows if r["record"] == "measured"]
    ncols = 2 if measured else 1
    fig, axes = _common.new_figure(1, ncols, figsize=(6 * ncols, 4), squeeze=False)
    ax = axes[0][0]
    for acc in dict.fromkeys(r["accelerator"] for r in rows if r["record"] == "bin"):
        curve = [r for r in rows if r["record"] == "roofline" and r["accelerator"] == acc]
        line = ax.plot([r["cached_tokens"] for r in curve], [r["ttft_s"] * 1e3 for r in curve],
                       "-", alpha=0.5, label=f"{acc} roofline, P={curve[0]['prompt_tokens']}")[0]
        for state, marker in (("cold", "o"), ("warm", "s")):
            pts = [r for r in rows if r["record"] == "bin" and r["accelerator"] == acc
                   and r["cache_state"] == state and r["count"]]
            if pts:
                ax.plot([(r["lo"] + r["hi"]) / 2 for r in pts], [r["p50"] * 1e3 for r in pts],
                        marker, color=line.get_color(), label=f"{acc} DES p50 ({state})")
    ax.set_xlabel("cached prefix (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("simulated", fontsize=9)
    if measured:
        ax = axes[0][1]
        for state, style in (("cold", "o-"), ("warm", "s--")):
            med = median_by([r for r in measured if r["cache_state"] == state],
                            "target_cached_tokens")
            ax.plot([m["target_cached_tokens"] for m in med],
                    [m["median_ttft_s"] * 1e3 for m in med], style, label=state)
        ax.set_xlabel("shared prefix (tokens)")
        ax.set_ylabel("median TTFT (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title("measured: tiny model on this machine", fontsize=9)
    fig.suptitle(title, fontsize=9)
    _common.save_plot(fig, path)


def run(config, *, progress: bool = False) -> dict:
    """Runs both parts; writes results.jsonl and latency_by_prefix.png into config.workdir."""
    workdir = _common.prepare_workdir(config.workdir)
    # NOTE: counted once up front (a trace file's lines, a generated workload's length)
    # so that every pass's progress bar has a total and an ETA.
    num_requests = _common.load_requests(config, workdir)[1] if progress else None
    rows = simulate_latency(lambda: _common.requests_from_config(config, workdir), config,
                            progress=progress, num_requests=num_requests)
    if config.measured.enable:
        rows += measure_engine_ttft(config.measured, seed=config.seed,
                                    hash_algo=config.hash_algo, progress=progress)
    source = _common.source_name(config)
    provs = {state: _common.provenance(config, seed=config.seed, hash_algo=config.hash_algo,
                                       cache_state=state, extra={"source": source})
             for state in (None, *_common.CACHE_STATES)}
    with _common.AtomicJsonlWriter(workdir / "results.jsonl") as w:
        for row in rows:
            # A DES summary's own field says the state its run started in.
            w.write(row, provenance=provs[row.get("cache_state")])
    plot(rows, workdir / "latency_by_prefix.png",
         title=f"{source}: {config.model}, block size {config.block_size}")
    return {
        "source": source,
        "simulated": [{k: r[k] for k in ("accelerator", "cache_state", "hit_rate_tokens",
                                          "ttft_s", "queue_s")}
                      for r in rows if r["record"] == "sim_summary"],
        "measured": median_by([r for r in rows if r["record"] == "measured"],
                              "cache_state", "target_cached_tokens"),
    }


def main() -> None:
    _common.run_cli(run, config_name="latency_by_prefix")


if __name__ == "__main__":
    main()
