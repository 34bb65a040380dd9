r"""The main job: prefix caching end to end on the tiny model.

  python -m experiments.quickstart --workdir=/tmp/quickstart

See configs/quickstart.py for what it runs and what to expect.
"""

from __future__ import annotations

import time

from experiments import _common


def page_buckets(config) -> tuple[int, ...]:
    """The engine's page buckets: ``config.page_buckets``, or () -> one bucket.

    NOTE: one bucket of ``ceil(max_model_len / block_size)`` pages (every sequence
    padded to the longest) compiles the fewest programs, which is what makes the
    quickstart fast; deriving it keeps ``--config.block_size`` a one-flag change.

    Raises:
      ValueError: a non-positive block size or max_model_len.
    """
    if config.block_size < 1 or config.max_model_len < 1:
        raise ValueError(f"block_size and max_model_len must be >= 1, got "
                         f"{config.block_size} and {config.max_model_len}")
    if config.page_buckets:
        return tuple(config.page_buckets)
    return (-(-config.max_model_len // config.block_size),)


def run(config, *, progress: bool = False) -> dict:
    """Runs the quickstart; returns the summary record (also written to config.workdir).

    Args:
      config: ``configs/quickstart.py``'s fields.
      progress: one tqdm bar over the four passes' requests (compile warm-up cold and
        warm, then the measured cold and warm passes) on stderr.

    Raises:
      ValueError: no workdir given, bad sizes.
    """
    from tqdm.auto import tqdm  # noqa: PLC0415

    from prefixcache.engine import Engine, SamplingParams
    from experiments import _chat_bench as chat_bench
    from prefixcache.model import ModelConfig

    t_start = time.perf_counter()
    workdir = _common.prepare_workdir(config.workdir)
    model_config = ModelConfig.tiny()
    engine = Engine(model_config, num_blocks=config.num_blocks, block_size=config.block_size,
                    enable_caching=True, seed=config.seed, max_num_seqs=config.max_num_seqs,
                    max_num_batched_tokens=config.max_num_batched_tokens,
                    max_model_len=config.max_model_len,
                    page_buckets=page_buckets(config), hash_algo=config.hash_algo,
                    attention_backend=config.attention_backend, eviction=config.eviction)
    params = SamplingParams(max_tokens=config.max_tokens, temperature=0.0)

    def workload(seed):
        return chat_bench.chat_workload(
            vocab_size=model_config.vocab_size, system_prompt_lens=tuple(config.system_prompt_lens),
            num_users=config.num_users, num_turns=config.num_turns,
            user_msg_len=config.user_msg_len, num_cold=config.num_cold,
            cold_prompt_len=config.cold_prompt_len, seed=seed)

    # Warm-up on different tokens with the same shapes: compiles every step program.
    warm_up_system, warm_up_turns = workload(config.seed + 1)
    system, turns = workload(config.seed)
    bar = tqdm(total=2 * len(warm_up_turns) + 2 * len(turns), unit="req", desc="quickstart",
               disable=not progress)

    def counted(items, stage):
        bar.set_postfix_str(stage)
        for item in items:
            yield item
            bar.update(1)

    with bar:
        chat_bench.run_chat(engine, warm_up_system, counted(warm_up_turns, "compile, cold"),
                            params, cold=True)
        chat_bench.run_chat(engine, warm_up_system, counted(warm_up_turns, "compile, warm"),
                            params, cold=False)
        engine.kv_cache_manager.reset_prefix_cache()
        cold_rows = chat_bench.run_chat(engine, system, counted(turns, "cold"), params,
                                        cold=True)
        engine.kv_cache_manager.reset_prefix_cache()
        engine.reset_metrics()
        warm_rows = chat_bench.run_chat(engine, system, counted(turns, "warm"), params,
                                        cold=False)
    metrics = engine.metrics()
    mismatches = [i for i, (c, w) in enumerate(zip(cold_rows, warm_rows))
                  if c["token_ids"] != w["token_ids"]]

    table = chat_bench.ttft_table(cold_rows, warm_rows)
    print(chat_bench.format_table(table, [
        "cached_prefix", "num_requests", "mean_prompt_tokens", "mean_cached_tokens",
        "cold_ttft_ms", "warm_ttft_ms", "warm_over_cold"]))
    summary = dict(
        record="summary", num_requests=len(warm_rows),
        reused_tokens=metrics.num_cached_tokens, prompt_tokens=metrics.num_prompt_tokens,
        token_hit_rate=metrics.token_hit_rate, request_hit_rate=metrics.request_hit_rate,
        num_evictions=metrics.num_evictions, peak_usage=metrics.peak_usage,
        mean_usage=metrics.mean_usage, num_preemptions=metrics.num_preemptions,
        num_compiled_programs=metrics.num_compiled_programs,
        computed_tokens_warm=metrics.num_computed_tokens,
        outputs_identical_cold_warm=not mismatches, ttft_table=table,
        wall_s=time.perf_counter() - t_start)
    print()
    print(chat_bench.format_table([summary], [
        "reused_tokens", "prompt_tokens", "token_hit_rate", "request_hit_rate",
        "num_evictions", "peak_usage", "mean_usage", "num_preemptions",
        "num_compiled_programs", "outputs_identical_cold_warm"]))

    # Each pass's cache state in its rows' provenance; the summary's metrics are the warm
    # pass's (reset_metrics before it).
    provs = {mode: _common.provenance(config, seed=config.seed, hash_algo=config.hash_algo,
                                      cache_state=mode, extra={"model": "tiny"})
             for mode in _common.CACHE_STATES}
    with _common.AtomicJsonlWriter(workdir / "results.jsonl", provenance=provs["warm"]) as w:
        for mode, rows in (("cold", cold_rows), ("warm", warm_rows)):
            for i, r in enumerate(rows):
                w.write(dict(record="request", cache_state=mode, index=i,
                             **{k: v for k, v in r.items() if k != "token_ids"},
                             num_output_tokens=len(r["token_ids"])), provenance=provs[mode])
        w.write(summary)

    fig, ax = _common.new_figure(figsize=(6, 4))
    for mode, rows, marker in (("cold (cache reset)", cold_rows, "o"),
                               ("warm (cache kept)", warm_rows, "x")):
        ax.scatter([r["num_cached_tokens"] for r in warm_rows],
                   [r["ttft_s"] * 1e3 for r in rows], label=mode, marker=marker)
    ax.set_xlabel("cached prefix of the request in the warm pass (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("tiny model, CPU: TTFT vs cached prefix")
    # NOTE: one pass per mode, one sample per request: where nothing is cached (x = 0)
    # both passes do the same work and their order is timing noise, not an effect.
    fig.text(0.5, -0.02, "one pass per mode, no repeats: at 0 cached tokens cold and warm "
             "do the same work; any gap there is timing noise", ha="center", va="top",
             fontsize=7, color="dimgray")
    ax.legend()
    _common.save_plot(fig, workdir / "ttft_vs_cached_prefix.png")
    print(f"\nwrote {workdir / 'results.jsonl'} and {workdir / 'ttft_vs_cached_prefix.png'} "
          f"in {summary['wall_s']:.1f} s")
    if mismatches:
        raise RuntimeError(f"outputs differ between cold and warm runs at requests {mismatches}")
    return summary


def main() -> None:
    _common.run_cli(run, config_name="quickstart")


if __name__ == "__main__":
    main()
