r"""Replay a request trace (or a generated workload) through the KV cache manager.

  python -m experiments.replay --trace=T.jsonl --num_blocks=4096 --block_size=16 \
      --hash_algo=sha256 --free_order=append --concurrency=8 --out=O.jsonl
  python -m experiments.replay --config=configs/replay_mooncake_conversation.py \
      --eviction=belady --num_blocks=10000   # the offline bound (reads the trace twice)
  python -m experiments.replay --config=configs/replay_few_shot.py --workdir=/tmp/r
  python -m experiments.replay --dataset=mooncake_synthetic --block_size=512 \
      --num_blocks=200000 --concurrency=1    # a public trace by name (downloaded once)

Flags given on the command line override the config (default:
``configs/replay.py``); ``--config.<field>=...`` overrides work too.

Outputs:
  * ``--out`` (default ``<workdir>/requests.jsonl`` when ``--workdir`` is set):
    one JSON line per request, exactly the replay records (``id``,
    ``num_computed_tokens``, ``block_ids``, ``prompt_tokens``, ``failed`` /
    ``decode_truncated_at``) -- no timing and no provenance, so the same trace,
    flags and seed give a byte-identical file (and it can be diffed against
    ``experiments/peers/vllm_replay.py --out``).
  * the last stdout line: the summary JSON (``requests``, ``prompt_tokens``,
    ``hit_tokens``, ``hit_rate_tokens``, ``evictions``, ``failed``, ``timing``
    with ``loop_s``/``hashing_s``/``manager_s``, rates, ``peak_rss_mib``; with
    ``--config.miss_reasons=true`` also ``miss_reasons``: missed prompt blocks by
    reason, as each record's ``miss_reasons``; with ``--config.residency=RATE`` also
    ``residency``: per-tier histograms of block lifetime, idle time before eviction,
    reuse gap and hits per stay, ``prefixcache.core.residency``).
  * ``--workdir``: ``results.jsonl`` (the summary with provenance, cache state
    ``cold``) and ``replay.png`` (cumulative token hit rate over the trace);
    ``residency.png`` (the residency histograms) when ``residency`` is on.

Bad input (malformed line, missing field, negative length, mm range outside
the prompt, unknown hash algorithm, missing file, empty trace, unknown dataset)
-> ``error: ...`` on stderr, exit status 1, and no output file is left behind (outputs are written to a
temporary file and renamed only when the replay completed).
"""

from __future__ import annotations

import array

from experiments import _common


def run(config, *, progress: bool = False) -> dict:
    """Replays the config's trace; writes ``config.out`` and the workdir outputs.

    Args:
      config: a replay config (see ``configs/replay.py``): dataset / trace / workload,
        ``num_blocks``, ``block_size``, ``hash_algo``, ``hash_seed``,
        ``free_order``, ``eviction``, ``index``, ``model`` ("": none),
        ``num_host_blocks`` (0: no host tier), ``host_eviction``,
        ``concurrency``, ``max_model_len`` (0: none), ``miss_reasons`` (records
        and the summary carry why each missed prompt block missed,
        ``prefixcache.core.misses``), ``out``, ``workdir``, ``max_requests``, ``seed``.
      progress: tqdm progress bar.

    Returns:
      The summary (as printed by the script).

    Raises:
      ValueError / FileNotFoundError: bad config or trace; no output file is
        then left at ``config.out`` or in the workdir.
    """
    from prefixcache.sim.replay import replay  # noqa: PLC0415

    _common.check_dataset_block_size(config)  # (before the workdir is touched)
    workdir = _common.prepare_workdir(config.workdir) if config.workdir else None
    out = config.out or (str(workdir / "requests.jsonl") if workdir else "")
    first, total = _common.load_requests(config, workdir, progress=progress)
    unused = [first]

    # NOTE: a callable: belady reads the trace twice (the stream opened above first,
    # then a fresh one).
    def requests():
        return unused.pop() if unused else _common.requests_from_config(
            config, workdir, progress=progress)
    prompt = array.array("q")  # per-request prompt tokens, for the plot
    hits = array.array("q")

    def run_with(writer):
        def on_record(rec):
            if writer is not None:
                writer.write(rec)
            prompt.append(rec["prompt_tokens"])
            hits.append(rec["num_computed_tokens"])

        return replay(
            requests, cache_config=_common.cache_config(config),
            concurrency=config.concurrency, on_record=on_record, progress=progress,
            total=total, model=config.model or None, miss_reasons=config.miss_reasons,
            residency=config.residency or None)

    if out:
        with _common.AtomicJsonlWriter(out) as writer:
            summary = run_with(writer)
    else:
        summary = run_with(None)
    summary = {"trace": _common.source_name(config), **summary,
               "peak_rss_mib": _common.peak_rss_mib()}
    if workdir is not None:
        prov = _common.provenance(config, seed=config.seed, hash_algo=config.hash_algo,
                                  cache_state="cold")
        with _common.AtomicJsonlWriter(workdir / "results.jsonl", provenance=prov) as w:
            w.write({"record": "summary", **summary})
        plot_cumulative_hit_rate(prompt, hits, workdir / "replay.png",
                                 title=f"{summary['trace']} ({config.hash_algo}, "
                                       f"{config.num_blocks} x {config.block_size})")
        if "residency" in summary:
            plot_residency(summary["residency"], workdir / "residency.png",
                           title=f"{summary['trace']}: block residency "
                                 f"({config.num_blocks} x {config.block_size}, sample rate "
                                 f"{config.residency})")
    return summary


def plot_residency(residency: dict, path, *, title: str = "") -> None:
    """The residency histograms (``replay(residency=...)``): one panel per metric, one
    line per tier, as a PNG."""
    import numpy as np  # noqa: PLC0415

    names = (("lifetime", "lifetime"), ("idle_before_evict", "idle before eviction"),
             ("reuse_gap", "gap between reuses"), ("hits_per_residency", "hits per stay"))
    fig, axes = _common.new_figure(1, 4, figsize=(15, 3.4), squeeze=False)
    unit = {"seconds": "s", "requests": "requests", "mixed": "clock"}[residency["clock"]]
    for ax, (key, label) in zip(axes[0], names):
        for medium, metrics in residency["tiers"].items():
            h = metrics[key]
            if not h["count"]:
                continue
            bounds = [*h["bounds"], h["bounds"][-1] * 10 if h["bounds"][-1] else 1]
            share = np.asarray(h["counts"], dtype=float) / h["count"]
            ax.step(np.arange(len(share)), share, where="mid",
                    label=f"{medium} (n={h['count']:,}, p50 {h['p50']:.3g})")
            ax.set_xticks(np.arange(len(bounds))[::3],
                          [f"{b:.3g}" for b in bounds][::3], fontsize=7, rotation=45)
        ax.set_xlabel(f"{label} (<= bucket bound" + ("" if key == "hits_per_residency"
                                                     else f", {unit}") + ")", fontsize=8)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("share of blocks")
    fig.suptitle(title, fontsize=9)
    _common.save_plot(fig, path)


def plot_cumulative_hit_rate(prompt_tokens, hit_tokens, path, *, title: str = "") -> None:
    """Cumulative token hit rate over the trace's requests, as a PNG."""
    import numpy as np  # noqa: PLC0415

    p = np.cumsum(np.asarray(prompt_tokens, dtype=np.float64))
    h = np.cumsum(np.asarray(hit_tokens, dtype=np.float64))
    fig, ax = _common.new_figure(figsize=(6, 3.5))
    if len(p):
        ax.plot(np.arange(1, len(p) + 1), h / np.maximum(p, 1))
    ax.set_xlabel("requests replayed")
    ax.set_ylabel("cumulative token hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    _common.save_plot(fig, path)


def main() -> None:
    _common.run_cli(run, config_name="replay", extra_flags={
        "trace": ("string", "Trace file (our JSONL or Mooncake)"),
        "dataset": ("string", "Public trace by name, e.g. mooncake_conversation "
                              "(downloaded once into $PREFIXCACHE_DATA)"),
        "num_blocks": ("integer", "KV cache blocks"),
        "block_size": ("integer", "Tokens per block"),
        "hash_algo": ("string", "sha256 | sha256_cbor | xxhash | xxhash_cbor"),
        "free_order": ("string", "append | unhashed_first (vLLM's)"),
        "eviction": ("string", "Eviction policy: lru | fifo | lfu | slru | priority | length "
                               "| cost | belady"),
        "index": ("string", "Prefix index: hash | radix"),
        "num_host_blocks": ("integer", "Host-memory tier slots under the device cache "
                                       "(0: none)"),
        "host_eviction": ("string", "The host tier's eviction policy (any but belady)"),
        "concurrency": ("integer", "Most requests holding blocks at once"),
        "max_requests": ("integer", "Only the first N requests (0: all)"),
        "out": ("string", "Per-request JSONL output"),
    })


if __name__ == "__main__":
    main()
