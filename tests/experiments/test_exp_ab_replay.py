"""experiments.ab_replay: the working tree against a git revision, one process."""
import json
import subprocess
import sys

import pytest

from experiments.ab_replay import _IMPORT_RE


def test_import_rewrite_touches_imports_only():
    src = ("from prefixcache.core import x\nimport prefixcache\nfrom prefixcache import y\n"
           "v = metadata.version('prefixcache')\nimport prefixcache_other\n")
    got = _IMPORT_RE.sub("prefixcache_base", src)
    assert got == ("from prefixcache_base.core import x\nimport prefixcache_base\n"
                   "from prefixcache_base import y\nv = metadata.version('prefixcache')\n"
                   "import prefixcache_other\n")


def test_ab_against_head_runs_both_and_finds_identical_records():
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.ab_replay", "--base=HEAD", "--workloads=mm_salt",
         "--hash_algos=sha256", "--rounds=2", "--warmup=1", "--num_blocks=1024"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["base"]["commit"] == head
    (r,) = summary["results"]
    assert r["workload"] == "mm_salt" and r["records_identical"] is True
    for side in ("base", "new"):
        assert len(r[side]["loop_s_runs"]) == 2 and r[side]["loop_s_min"] > 0
    assert r["ratio_min"] == pytest.approx(r["new"]["loop_s_min"] / r["base"]["loop_s_min"])
    assert "provenance" in summary


def test_ab_of_a_sliding_window_layout():
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.ab_replay", "--base=HEAD", "--workloads=multi_turn",
         "--hash_algos=sha256", "--rounds=1", "--warmup=0", "--num_blocks=256",
         "--kv_groups=full,sw32"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["kv_groups"] == "full,sw32"
    (r,) = summary["results"]
    assert r["records_identical"] is True


def test_unknown_revision_is_a_clear_error():
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.ab_replay", "--base=no-such-rev-xyz",
         "--workloads=mm_salt", "--rounds=1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1 and "no-such-rev-xyz" in proc.stderr and "not a commit" in proc.stderr
