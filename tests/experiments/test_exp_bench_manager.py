"""bench_manager end to end against a stand-in peer (CI has no vLLM).

The stand-in peers directory holds a tiny ``make_traces.py``, a ``vllm_replay.py`` whose
``replay_once`` replays through OUR manager but reports vLLM's block ids (+1 for its null
block) and a fixed timing, and an empty ``vllm`` package: enough for
``experiments.peer_inprocess`` and ``bench_manager --peer_mode=inprocess`` to run, and
for the test to check what they compute and report.
"""

import json
import subprocess
import sys
import textwrap

import pytest

MAKE_TRACES = '''
import argparse, json, os
ap = argparse.ArgumentParser()
ap.add_argument("--out-dir"); ap.add_argument("--seed"); ap.add_argument("--traces")
a = ap.parse_args()
os.makedirs(a.out_dir, exist_ok=True)
for name in a.traces.split(","):
    with open(os.path.join(a.out_dir, name + ".jsonl"), "w") as f:
        for i in range(12):
            prompt = list(range(1, 41)) + [100 + i] * (5 + i)
            f.write(json.dumps({"id": f"{name}-{i}", "prompt": prompt, "output_len": 6,
                                "cache_salt": None, "lora": None, "mm": []}) + "\\n")
'''

VLLM_REPLAY = '''
"""Stand-in for the peer harness: our replay, vLLM's block ids, fixed timings."""
import json
from prefixcache.sim.replay import replay
from prefixcache.sim.trace import TraceRequest, output_token

LOOP_S = {"sha256": 2.0, "xxhash_cbor": 3.0}

def load_trace(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]

def prepare_inputs(trace):
    return [dict(e) for e in trace]

def replay_once(args, trace, inputs, out_tokens, max_model_len, log_stats):
    records = []
    reqs = [TraceRequest(id=e["id"], prompt=e["prompt"], output_len=e["output_len"])
            for e in trace]
    replay(reqs, num_blocks=args.num_blocks - 1, block_size=args.block_size,
           hash_algo=args.hash_algo, hash_seed=0, free_order="unhashed_first",
           concurrency=args.concurrency, on_record=records.append)
    for r in records:
        r["block_ids"] = [b + 1 for b in r["block_ids"]]
    loop = LOOP_S[args.hash_algo]
    t = {"loop_s": loop, "manager_s": loop / 2, "request_build_s": loop / 4,
         "append_s": loop / 4}
    return records, t, None, None
'''


@pytest.fixture
def peers(tmp_path):
    d = tmp_path / "peers"
    (d / "vllm").mkdir(parents=True)
    (d / "vllm" / "__init__.py").write_text("")
    (d / "make_traces.py").write_text(textwrap.dedent(MAKE_TRACES))
    (d / "vllm_replay.py").write_text(textwrap.dedent(VLLM_REPLAY))
    return d


def test_inprocess_peer_mode_reports_ratios_and_identical_records(peers, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench_manager", f"--vllm_python={sys.executable}",
         f"--peers_dir={peers}", f"--trace_dir={tmp_path / 'traces'}",
         "--workloads=tiny", "--hash_algos=sha256,xxhash_cbor", "--repeat=3",
         "--warmup=1", "--num_blocks=64", "--block_size=4", "--concurrency=2"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["peer_mode"] == "inprocess" and summary["warmup"] == 1
    assert summary["all_records_identical"] is True
    by_algo = {r["hash_algo"]: r for r in summary["results"]}
    assert set(by_algo) == {"sha256", "xxhash_cbor"}
    for algo, peer_loop in (("sha256", 2.0), ("xxhash_cbor", 3.0)):
        r = by_algo[algo]
        assert r["peer_mode"] == "inprocess" and r["requests"] == 12
        assert r["hit_tokens_equal"] and r["hit_tokens"] > 0
        assert r["vllm"]["loop_s_runs"] == [peer_loop] * 3
        ours = r["ours"]["loop_s_runs"]
        assert len(ours) == 3 and all(0 < x < peer_loop for x in ours)
        ratios = sorted(peer_loop / x for x in ours)
        assert r["speedup_loop"] == pytest.approx(ratios[1])  # median of the pairs
        assert r["speedup_loop_min"] == pytest.approx(peer_loop / min(ours))
        assert r["vllm"]["hashing_s"] == pytest.approx(peer_loop / 2)
    assert "x" in proc.stdout and "records identical: True" in proc.stdout


def test_inprocess_peer_flags_a_record_mismatch(peers, tmp_path):
    # A peer whose block ids disagree (no +1 shift) must be reported, not hidden.
    src = (peers / "vllm_replay.py").read_text().replace("b + 1", "b + 2")
    (peers / "vllm_replay.py").write_text(src)
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench_manager", f"--vllm_python={sys.executable}",
         f"--peers_dir={peers}", f"--trace_dir={tmp_path / 'traces'}",
         "--workloads=tiny", "--hash_algos=sha256", "--repeat=1", "--warmup=0",
         "--num_blocks=64", "--block_size=4", "--concurrency=2"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["all_records_identical"] is False


def test_inprocess_peer_needs_the_hash_seed_in_the_environment(peers, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"id": "a", "prompt": [1, 2, 3], "output_len": 1}) + "\n")
    env = {"PYTHONPATH": str(peers), "PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "7"}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.peer_inprocess", f"--trace={trace}",
         "--hash_seed=0"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode != 0 and "PYTHONHASHSEED=0" in proc.stderr


def test_block_sizes_and_mooncake_rows(peers, tmp_path):
    """--block_sizes runs every cell at each size (pools of equal KV tokens); a Mooncake
    trace is converted for the peer and gets a second row keyed by its hash ids."""
    mc = tmp_path / "mc"
    mc.mkdir()
    lines = [
        {"timestamp": i, "input_length": 600 + 37 * i, "output_length": 5,
         "hash_ids": [1, 2] if i % 2 else [1, 3 + i]}
        for i in range(10)
    ]
    (mc / "tiny_trace.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench_manager", f"--vllm_python={sys.executable}",
         f"--peers_dir={peers}", f"--trace_dir={tmp_path / 'traces'}",
         "--workloads=tiny", "--hash_algos=sha256", "--repeat=1", "--warmup=0",
         "--num_blocks=64", "--block_size=4", "--block_sizes=4,16", "--concurrency=2",
         "--mooncake=tiny", f"--mooncake_dir={mc}", "--mooncake_requests=8",
         "--mooncake_num_blocks=6"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["block_sizes"] == [4, 16] and summary["all_records_identical"] is True
    cells = {(r["workload"], r["block_size"], r["keys"]): r for r in summary["results"]}
    assert set(cells) == {
        ("tiny", 4, "tokens"), ("tiny", 16, "tokens"),
        ("mooncake_tiny", 4, "tokens"), ("mooncake_tiny", 4, "hash_ids"),
        ("mooncake_tiny", 16, "tokens"), ("mooncake_tiny", 16, "hash_ids"),
    }
    assert cells["tiny", 16, "tokens"]["num_blocks_vllm"] == 16  # 64 x 4 tokens
    assert cells["mooncake_tiny", 16, "tokens"]["num_blocks_vllm"] == 6 * 512 // 16
    for bs in (4, 16):
        tok, ids = cells["mooncake_tiny", bs, "tokens"], cells["mooncake_tiny", bs, "hash_ids"]
        assert tok["requests"] == ids["requests"] == 8
        assert tok["hit_tokens"] == ids["hit_tokens"] > 0 and ids["hit_tokens_equal"]
        assert ids["vllm"]["loop_s_runs"] == tok["vllm"]["loop_s_runs"]  # the same rounds
