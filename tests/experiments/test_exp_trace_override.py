"""``--trace=FILE`` replaces a config's dataset (a local copy needs no --config.dataset=)."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_trace_flag_replaces_the_configs_dataset(local_datasets, tmp_path):
    copy = (local_datasets / "mooncake_synthetic" / "synthetic_trace.jsonl").resolve()
    work = tmp_path / "w"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.compare_policies",
         "--config=configs/compare_policies_mooncake_synthetic.py:quick", f"--trace={copy}",
         f"--workdir={work}", "--policies=lru", "--capacities=300", "--workers=1",
         "--max_requests=20", "--config.belady_bound=false", "--noprogress"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in (work / "compare_policies.jsonl").read_text().splitlines()]
    assert {r["source"] for r in rows} == {str(copy)}
    prov = rows[0]["provenance"]
    assert prov["config"]["dataset"] == "" and prov["config"]["trace"] == str(copy)
    assert prov["trace_checksum"]["dataset"] == "mooncake_synthetic"
    assert rows[0]["requests"] == 20
