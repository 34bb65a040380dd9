"""experiments.retention's quick variant: rows with provenance, the figure, and the
order the study is about (hints never lose to lru here; belady bounds them)."""

import importlib.util
import json
import pathlib

import pytest

from experiments import retention

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _config():
    spec = importlib.util.spec_from_file_location("_cfg_retention", ROOT / "configs" / "retention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quick_variant(tmp_path):
    mod = _config()
    assert set(mod.get_config().to_dict()) == set(mod.get_config("quick").to_dict())
    c = mod.get_config("quick")
    c.workdir = str(tmp_path / "r")
    out = retention.run(c)
    rows = [json.loads(line) for line in pathlib.Path(out["rows"]).read_text().splitlines()]
    assert len(rows) == 3 * 2 + 1 and rows[-1]["record"] == "ideal"
    assert all({"config", "seed", "git", "cost_model"} <= set(r["provenance"]) for r in rows)
    assert pathlib.Path(out["png"]).stat().st_size > 0
    hit = out["hit_rate"]
    # configs/retention.py's quick figures (146 requests; 90 and 180 blocks)
    assert hit["lru"] == [0.2248, 0.4784] and hit["hinted"] == [0.2272, 0.4815]
    assert hit["belady"] == [0.2285, 0.4865]
    for k in range(2):
        assert hit["lru"][k] <= hit["hinted"][k] <= hit["belady"][k] <= out["ideal_hit_rate_tokens"]
    by = {(r["policy"], r["capacity_blocks"]): r for r in rows}
    assert by[("hinted", 180)]["ttft_mean_s"] < by[("lru", 180)]["ttft_mean_s"]


def test_bad_policies_are_refused(tmp_path):
    c = _config().get_config("quick")
    c.workdir = str(tmp_path / "r")
    c.policies = "lru,hintd"
    with pytest.raises(ValueError, match="policies: unknown"):
        retention.run(c)


def test_a_session_trace_file(tmp_path):
    c = _config().get_config("quick")
    c.workdir = str(tmp_path / "r")
    c.trace = str(ROOT / "tests" / "data" / "agent_traces" / "agentx_small.jsonl")
    c.trace_format = "agentx"
    c.capacities = "4"
    out = retention.run(c)
    assert out["requests"] == 6 and set(out["hit_rate"]) == {"lru", "hinted", "belady"}
    c.trace_format = "mooncake"
    with pytest.raises(ValueError, match="formats with sessions"):
        retention.run(c)
