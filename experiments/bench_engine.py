r"""Engine benchmark: warm vs cold TTFT, host step cost, compiled-program count.

  python -m experiments.bench_engine --workdir=/tmp/bench_engine

See configs/bench_engine.py. The last stdout line is the JSON result.
"""

from __future__ import annotations

import json

from absl import app, flags
from ml_collections import config_flags

from experiments import _common

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/bench_engine.py", "Benchmark config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.", required=True)


def run(config, workdir) -> dict:
    from prefixcache.engine import bench
    from prefixcache.model import ModelConfig

    workdir = _common.prepare_workdir(workdir)
    mc = ModelConfig.tiny()
    common = dict(block_size=config.block_size, seed=config.seed,
                  attention_backend=config.attention_backend)
    result = {}
    result.update(bench.ttft_cold_vs_warm(mc, **config.ttft.to_dict(), **common))
    result.update(bench.host_step_cost(mc, **config.host.to_dict(), **common))
    result.update(bench.compiled_programs(mc, **config.programs.to_dict(), **common))
    result["ttft_ratio_ok"] = result["ttft_ratio"] <= 1 / 8
    result["host_step_ok"] = result["host_step_ms"] < 1.0
    prov = _common.provenance(config, seed=config.seed, extra={"model": "tiny"})
    with _common.AtomicJsonlWriter(workdir / "bench_engine.jsonl", provenance=prov) as w:
        w.write(result)
    print(json.dumps(_common.to_jsonable(result), sort_keys=True))
    return result


def main(argv):
    del argv
    run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    app.run(main)
