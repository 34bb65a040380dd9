r"""Engine benchmark: warm vs cold TTFT, host step cost, compiled-program count.

  python -m experiments.bench_engine --workdir=/tmp/bench_engine
  python -m experiments.bench_engine --workdir=/tmp/bench_engine --config.sections=host
  python -m experiments.bench_engine --workdir=/tmp/bench_engine --config.sections=host_tier

See configs/bench_engine.py. The last stdout line is the JSON result.
"""

from __future__ import annotations

from experiments import _common

SECTIONS = ("ttft", "host", "programs", "host_tier")


def run(config, *, progress: bool = False) -> dict:
    """Runs the three measurements; writes bench_engine.jsonl into config.workdir.

    Args:
      config: ``configs/bench_engine.py``'s fields.
      progress: a tqdm bar over the sections on stderr.

    Returns:
      The measurements (one dict).

    Raises:
      ValueError: no workdir given.
    """
    from experiments import _engine_bench as bench  # noqa: PLC0415
    from prefixcache.model import ModelConfig  # noqa: PLC0415

    workdir = _common.prepare_workdir(config.workdir)
    mc = ModelConfig.tiny()
    common = dict(block_size=config.block_size, seed=config.seed,
                  attention_backend=config.attention_backend)
    sections = [x.strip() for x in config.sections.split(",") if x.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown or not sections:
        raise ValueError(f"--config.sections must name some of {SECTIONS}, got "
                         f"{config.sections!r}")
    result = {}
    bar = _common.progress_bar(enabled=progress, desc="bench_engine", unit="section",
                               total=len(sections))
    if "ttft" in sections:
        result.update(bench.ttft_cold_vs_warm(mc, **config.ttft.to_dict(), **common))
        result["ttft_ratio_target"] = config.ttft_ratio_target
        result["ttft_ratio_ok"] = result["ttft_ratio"] <= config.ttft_ratio_target
        bar.update(1)
    if "host" in sections:
        result.update(bench.host_step_cost(mc, **config.host.to_dict(), **common))
        result["host_step_target_ms"] = config.host_step_target_ms
        result["host_step_ok"] = result["host_step_ms"] < config.host_step_target_ms
        bar.update(1)
    if "programs" in sections:
        result.update(bench.compiled_programs(mc, **config.programs.to_dict(), **common))
        bar.update(1)
    if "host_tier" in sections:
        # Shapes of the model named by config.host_tier.model (no weights are built).
        ht = config.host_tier.to_dict()
        big = getattr(ModelConfig, ht.pop("model"))()
        result.update(bench.host_tier_promotion(big, **ht, block_size=config.block_size,
                                                seed=config.seed))
        result["host_tier_ratio_target"] = config.host_tier_ratio_target
        result["host_tier_ok"] = (result["promotion_vs_device_put"]
                                  >= config.host_tier_ratio_target)
        bar.update(1)
    bar.close()
    prov = _common.provenance(config, seed=config.seed, extra={"model": "tiny"})
    with _common.AtomicJsonlWriter(workdir / "bench_engine.jsonl", provenance=prov) as w:
        w.write(result)
    return result  # run_cli prints it as the last stdout line (JSON)


def main() -> None:
    _common.run_cli(run, config_name="bench_engine")


if __name__ == "__main__":
    main()
