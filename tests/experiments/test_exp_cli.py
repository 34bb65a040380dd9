"""The experiments' command line: one-line errors naming the flag or path, progress bars.

(Every experiment's --help is checked from a bare copy of the repository in
tests/test_standalone_clone.py.)
"""

import concurrent.futures
import json
import pathlib
import subprocess
import sys

import pytest

from prefixcache.sim import workloads
from prefixcache.sim.trace import write_trace

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _replay(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "experiments.replay", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def _assert_one_line_error(proc, *needles):
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, workloads.shared_system_prompt(num_requests=12, system_len=32,
                                                     unique_len=(4, 12), output_len=(2, 4)))
    return path


def test_command_line_mistakes_are_one_line_errors(tmp_path, trace):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    cases = [
        ([f"--workdir={blocker}/sub"], ["workdir", str(blocker / "sub"), "not writable"]),
        ([f"--trace={trace}", f"--out={blocker}/o.jsonl"], ["cannot write",
                                                          str(blocker / "o.jsonl")]),
        (["--config.num_blockz=3"], ["--config.num_blockz", "no such config field",
                                     'Did you mean "num_blocks"']),
        (["--config.workload.kwargs.num_requestz=3"], ["--config.workload.kwargs.num_requestz"]),
        ([f"--config={tmp_path}/nope.py"], ["--config", "no such config file",
                                            f"{tmp_path}/nope.py"]),
        ([f"--trace={empty}", f"--out={tmp_path}/o.jsonl"], [str(empty), "has no requests"]),
        (["--dataset=mooncake"], ["unknown dataset 'mooncake'", "mooncake_conversation"]),
        ([f"--trace={trace}", "--dataset=mooncake_synthetic"], ["either trace", "or dataset"]),
        (["--num_blocks=many"], ["--num_blocks=many"]),
        (["--no_such_flag=1"], ["no_such_flag"]),
        (["stray"], ["unexpected arguments: stray"]),
        ([f"--trace={tmp_path}/missing.jsonl"], [f"{tmp_path}/missing.jsonl", "does not exist"]),
    ]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # subprocesses, in parallel
        procs = list(pool.map(lambda case: _replay(*case[0], "--noprogress"), cases))
    for (args, needles), proc in zip(cases, procs):
        _assert_one_line_error(proc, *needles)
    assert not (tmp_path / "o.jsonl").exists()  # the empty trace left no output behind


def test_progress_bar_has_a_total_and_noprogress_silences_it(trace, tmp_path):
    proc = _replay(f"--trace={trace}", "--num_blocks=64", "--block_size=4")
    assert proc.returncode == 0, proc.stderr
    assert "replay" in proc.stderr and "12/12" in proc.stderr  # counted before the replay
    assert json.loads(proc.stdout.splitlines()[-1])["requests"] == 12
    quiet = _replay(f"--trace={trace}", "--num_blocks=64", "--block_size=4", "--noprogress",
                    "--max_requests=5")
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert json.loads(quiet.stdout.splitlines()[-1])["requests"] == 5


def test_load_requests_counts_files_and_workloads(trace, tmp_path):
    from configs import replay as replay_config
    from experiments import _common

    cfg = replay_config.get_config()
    cfg.trace, cfg.max_requests = str(trace), 0
    reqs, total = _common.load_requests(cfg)
    assert total == 12 == len(list(reqs))
    cfg.max_requests = 5
    assert _common.load_requests(cfg)[1] == 5
    cfg.trace, cfg.max_requests = "", 0
    cfg.workload.kwargs.num_requests = 7
    reqs, total = _common.load_requests(cfg)
    assert total == 7 == len(list(reqs))
    assert _common.source_name(cfg) == "workload:shared_system_prompt"


def test_replay_runs_a_dataset_by_name(local_datasets, tmp_path):
    proc = _replay("--dataset=mooncake_synthetic", "--max_requests=3", "--num_blocks=500",
                   "--block_size=512", "--concurrency=1", "--noprogress")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["trace"] == "dataset:mooncake_synthetic" and summary["requests"] == 3


def test_quickstart_page_bucket_follows_the_block_size():
    from configs import quickstart as quickstart_config
    from experiments import quickstart

    cfg = quickstart_config.get_config()
    assert quickstart.page_buckets(cfg) == (64,)  # 1024 tokens / 16
    cfg.block_size = 32
    assert quickstart.page_buckets(cfg) == (32,)
    cfg.max_model_len = 1000
    assert quickstart.page_buckets(cfg) == (32,)  # ceil(1000 / 32)
    cfg.page_buckets = (8, 32)
    assert quickstart.page_buckets(cfg) == (8, 32)
    cfg.block_size = 0
    with pytest.raises(ValueError, match="block_size"):
        quickstart.page_buckets(cfg)
