"""experiments.layout: stable part first vs last on the same tokens."""

import importlib.util
import json
import pathlib

import statistics

import pytest

from experiments import layout
from prefixcache.sim import workloads as wl
from prefixcache.sim.cost_model import CostModel

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_cfg_{name}", ROOT / "configs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


@pytest.mark.parametrize("name, small, stable", [
    ("layout", dict(num_requests=12, system_len=64, unique_len=(8, 24), output_len=(2, 6)), 64),
    ("layout_few_shot", dict(num_headers=2, num_questions=5, header_len=80, output_len=(2, 6)), 80),
])
def test_layouts_side_by_side(name, small, stable, tmp_path, capsys):
    cfg = _load(name)
    for k, v in small.items():
        setattr(cfg.workload.kwargs, k, v)
    cfg.workdir = str(tmp_path / "w")
    out = layout.run(cfg)
    rows = [json.loads(l) for l in pathlib.Path(out["rows"]).read_text().splitlines()]
    assert pathlib.Path(out["png"]).stat().st_size > 0
    first, last = rows
    assert (first["layout"], last["layout"]) == ("stable_first", "stable_last")
    assert first["prompt_tokens"] == last["prompt_tokens"]  # the same tokens, reordered
    B = cfg.block_size
    repeats = first["requests"] - cfg.workload.kwargs.get("num_headers", 1)  # first uses miss
    assert first["hit_tokens"] == repeats * (stable // B) * B
    assert last["hit_tokens"] == 0 and last["requests_with_hit"] == 0
    cost = CostModel.create(cfg.model, cfg.accelerator)
    assert first["ttft_mean_s"] < last["ttft_mean_s"]
    # The cached part still costs attention reads: the TTFT gain is less than the tokens'.
    assert first["ttft_mean_s"] > last["ttft_mean_s"] * (1 - first["hit_rate_tokens"]) * 0.5
    assert last["ttft_p50_s"] <= last["ttft_p90_s"] <= last["ttft_p99_s"]
    # stable_last hits nothing: each TTFT is the prefill of the whole prompt.
    reqs = wl.generate(cfg.workload.name, seed=cfg.seed, layout="stable_last", **small)
    want = statistics.mean(cost.prefill_time(len(r.prompt), 0) for r in reqs)
    assert last["ttft_mean_s"] == pytest.approx(want, rel=1e-12)
    for r in rows:
        assert r["provenance"]["cache_state"] == "cold" and r["failed"] == 0
    assert "stable_first" in capsys.readouterr().out


def test_unknown_workload_or_model(tmp_path):
    cfg = _load("layout")
    cfg.workdir = str(tmp_path / "w")
    cfg.workload.name = "rag"
    with pytest.raises(ValueError, match="workload 'rag' has no layout variant"):
        layout.run(cfg)
    cfg = _load("layout")
    cfg.workdir, cfg.model = str(tmp_path / "w"), "gpt5"
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'"):
        layout.run(cfg)
    assert not (tmp_path / "w" / layout.ROWS_FILE).exists()
