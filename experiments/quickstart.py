r"""The main job: prefix caching end to end on the tiny model.

  python -m experiments.quickstart --workdir=/tmp/quickstart

See configs/quickstart.py for what it runs and what to expect.
"""

from __future__ import annotations

import time

from experiments import _common


def run(config, *, progress: bool = False) -> dict:
    """Runs the quickstart; returns the summary record (also written to config.workdir).

    Raises:
      ValueError: no workdir given.
    """
    del progress  # one short run: no progress bar
    from prefixcache.engine import Engine, SamplingParams
    from prefixcache.engine import chat_bench
    from prefixcache.model import ModelConfig

    t_start = time.perf_counter()
    workdir = _common.prepare_workdir(config.workdir)
    model_config = ModelConfig.tiny()
    engine = Engine(model_config, num_blocks=config.num_blocks, block_size=config.block_size,
                    enable_caching=True, seed=config.seed, max_num_seqs=config.max_num_seqs,
                    max_num_batched_tokens=config.max_num_batched_tokens,
                    max_model_len=config.max_model_len,
                    page_buckets=tuple(config.page_buckets), hash_algo=config.hash_algo, attention_backend=config.attention_backend,
                    eviction=config.eviction)
    params = SamplingParams(max_tokens=config.max_tokens, temperature=0.0)

    def workload(seed):
        return chat_bench.chat_workload(
            vocab_size=model_config.vocab_size, system_prompt_lens=tuple(config.system_prompt_lens),
            num_users=config.num_users, num_turns=config.num_turns,
            user_msg_len=config.user_msg_len, num_cold=config.num_cold,
            cold_prompt_len=config.cold_prompt_len, seed=seed)

    # Warm-up on different tokens with the same shapes: compiles every step program.
    system, turns = workload(config.seed + 1)
    chat_bench.run_chat(engine, system, turns, params, cold=True)
    chat_bench.run_chat(engine, system, turns, params, cold=False)

    system, turns = workload(config.seed)
    engine.kv_cache_manager.reset_prefix_cache()
    cold_rows = chat_bench.run_chat(engine, system, turns, params, cold=True)
    engine.kv_cache_manager.reset_prefix_cache()
    engine.reset_metrics()
    warm_rows = chat_bench.run_chat(engine, system, turns, params, cold=False)
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

    prov = _common.provenance(config, seed=config.seed, hash_algo=config.hash_algo,
                              extra={"model": "tiny"})
    with _common.AtomicJsonlWriter(workdir / "results.jsonl", provenance=prov) as w:
        for mode, rows in (("cold", cold_rows), ("warm", warm_rows)):
            for i, r in enumerate(rows):
                w.write(dict(record="request", cache_state=mode, index=i,
                             **{k: v for k, v in r.items() if k != "token_ids"},
                             num_output_tokens=len(r["token_ids"])))
        w.write(summary)

    fig, ax = _common.new_figure(figsize=(6, 4))
    for mode, rows, marker in (("cold (cache reset)", cold_rows, "o"),
                               ("warm (cache kept)", warm_rows, "x")):
        ax.scatter([r["num_cached_tokens"] for r in warm_rows],
                   [r["ttft_s"] * 1e3 for r in rows], label=mode, marker=marker)
    ax.set_xlabel("cached prefix of the request in the warm pass (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("tiny model, CPU: TTFT vs cached prefix")
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
