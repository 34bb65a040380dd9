"""Multi-process JAX: 2 CPU processes x 4 devices on one mesh == one process.

Starts real processes (bounded in time; the launcher kills them whatever happens).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from prefixcache.engine import distributed


def test_two_processes_one_mesh_equal_one_process(tmp_path):
    from configs import launch_multiprocess as cfg
    from experiments import launch_multiprocess

    c = cfg.get_config()
    c.workdir = str(tmp_path)
    c.num_requests = 4
    c.max_tokens = 5
    c.timeout_s = 110.0
    s = launch_multiprocess.run(c)
    assert s["mesh_devices"] == 8 and s["local_devices"] == [4, 4]
    assert s["tokens_identical"] and s["inputs_identical"], s
    assert s["steps"] > 1 and s["cached_tokens"][1:] == [32, 32, 32]
    rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert rows[0]["tokens_identical"] is True


def test_unreachable_coordinator_times_out_with_a_clear_message(tmp_path):
    from experiments.launch_multiprocess import free_port

    port = free_port()  # nothing listens there
    with pytest.raises(TimeoutError, match=f"could not reach the JAX coordinator at "
                                           f"127.0.0.1:{port} within 0.5 s"):
        distributed.wait_for_coordinator(f"127.0.0.1:{port}", 0.5)
    # A second process whose coordinator never comes up: a one-line error, no hang.
    spec = tmp_path / "x_spec.json"
    spec.write_text(json.dumps({"num_processes": 2, "coordinator": f"127.0.0.1:{port}",
                                "timeout_s": 1.0}))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "experiments.launch_multiprocess", "--worker",
                        f"--spec={spec}", "--process_id=1"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1
    assert f"error: process 1: could not reach the JAX coordinator at 127.0.0.1:{port}" \
        in p.stderr
    assert "Traceback" not in p.stderr
    assert time.monotonic() - t0 < 30


def test_bad_arguments():
    with pytest.raises(ValueError, match="host:port"):
        distributed.parse_address("localhost")
    with pytest.raises(ValueError, match="process_id 2 >= num_processes 2"):
        distributed.initialize("127.0.0.1:1234", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="num_processes must be an int >= 1"):
        distributed.initialize("127.0.0.1:1234", num_processes=0, process_id=0)
