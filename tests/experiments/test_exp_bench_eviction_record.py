"""`experiments.bench_eviction_record`: its variants, and the shipped eviction path restored."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_variants_and_record():
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench_eviction_record", "--rounds=1",
         "--num_blocks=100"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rec["benchmark"] == "bench_eviction_record" and rec["cell"] == "multi_turn"
    assert rec["num_evictions"] > 0  # (an eviction-free run would measure no record)
    assert [r["variant"] for r in rec["results"]] == [
        "off", "on", "record_dict", "record_list", "record_none"]
    assert rec["results"][0]["ratio_min"] == 1.0
    assert {"versions", "git", "seed"} <= set(rec["provenance"])


_UNDONE = """
from absl import flags
from experiments import bench_eviction_record
from prefixcache.core.block_pool import BlockPool
from prefixcache.sim import misses

evict, classify = BlockPool._evict, misses.MissAccountant.classify
flags.FLAGS(["bench", "--rounds=1", "--num_blocks=100"])
bench_eviction_record.main([])
assert BlockPool._evict is evict and misses.MissAccountant.classify is classify
print("restored")
"""


def test_the_patch_is_undone_after_main():
    # (in a child: the experiments' absl flags share one registry per process)
    proc = subprocess.run([sys.executable, "-c", _UNDONE], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "restored"
