"""experiments.tiers' quick variant: one row per scenario, hit rates split by tier that
add up, growing down the chain, the remote's hits only where a shared store exists."""

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_tiers_rows(tmp_path):
    import importlib.util

    from experiments import tiers

    spec = importlib.util.spec_from_file_location("_cfg_tiers", ROOT / "configs" / "tiers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config("quick")
    c.workload.kwargs.num_conversations = 12
    c.workdir = str(tmp_path)
    out = tiers.run(c)
    rows = [json.loads(line) for line in pathlib.Path(out["rows"]).read_text().splitlines()]
    cells = {r["scenario"]: r for r in rows if r.get("record") == "cluster"}
    assert list(cells) == list(tiers.SCENARIOS)
    for r in cells.values():
        assert sum(r["hit_tokens_by_tier"].values()) == r["hit_tokens"]
        assert "git" in json.dumps(rows[0]) or "provenance" in json.dumps(rows[0])
    hit = [cells[s]["hit_rate_tokens"] for s in tiers.SCENARIOS]
    assert hit == sorted(hit)
    assert "remote" not in cells["host+disk"]["hit_tokens_by_tier"]
    bound = {r["record"]: r["hit_rate_tokens"] for r in rows
             if r.get("record") in ("belady", "ideal")}
    assert bound["ideal"] >= bound["belady"] >= hit[-1]
    assert pathlib.Path(out["png"]).stat().st_size > 0
