"""experiments.bench_metadata runs and reports a build time for every case."""
import json
import subprocess
import sys


def test_bench_metadata_runs_and_reports_every_case():
    out = subprocess.run(
        [sys.executable, "-m", "experiments.bench_metadata", "--number=2", "--repeat=1",
         "--num_seqs=32"],
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout.strip().splitlines()
    summary = json.loads(out[-1])
    assert len(summary["cases"]) == 4  # 2 schedules x (lists, int32 arrays)
    assert all(c["min_us"] > 0 for c in summary["cases"])
    assert summary["provenance"]["seed"] == 0
