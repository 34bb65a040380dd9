"""experiments.replay: the CLI, config overrides, byte-identical outputs, bad input."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from experiments import replay as replay_exp
from prefixcache.core.misses import REASONS
from prefixcache.sim import workloads
from prefixcache.sim.replay import replay
from prefixcache.sim.trace import write_trace

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _config(**overrides):
    spec = importlib.util.spec_from_file_location("_cfg_replay", ROOT / "configs" / "replay.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture
def trace(tmp_path):
    reqs = workloads.mm_salt(num_requests=12, image_len=40, suffix_len=(4, 16), output_len=(2, 6),
                             seed=1)
    path = tmp_path / "trace.jsonl"
    write_trace(path, reqs)
    return path, reqs


def test_cli_flags_override_the_config_and_match_the_library(trace, tmp_path):
    path, reqs = trace
    out = tmp_path / "o.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.replay", f"--trace={path}", "--num_blocks=40",
         "--block_size=4", "--hash_algo=sha256_cbor", "--free_order=unhashed_first",
         "--concurrency=2", f"--out={out}", "--noprogress"],
        cwd=ROOT, capture_output=True, text=True, check=True)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["num_blocks"], summary["block_size"], summary["hash_algo"],
            summary["free_order"], summary["concurrency"]) == (40, 4, "sha256_cbor",
                                                               "unhashed_first", 2)
    assert summary["requests"] == 12 and {"loop_s", "hashing_s", "manager_s"} <= set(summary["timing"])
    expected = []
    replay(reqs, num_blocks=40, block_size=4, hash_algo="sha256_cbor",
           free_order="unhashed_first", concurrency=2, on_record=expected.append)
    assert [json.loads(l) for l in out.read_text().splitlines()] == expected
    assert sum(r["num_computed_tokens"] for r in expected) == summary["hit_tokens"]


def test_outputs_are_byte_identical_and_timing_free(trace, tmp_path):
    path, _ = trace
    outs = []
    for k in range(2):
        cfg = _config(trace=str(path), num_blocks=30, block_size=4, hash_algo="xxhash_cbor",
                      hash_seed="7", concurrency=3, out=str(tmp_path / f"o{k}.jsonl"),
                      workdir=str(tmp_path / f"w{k}"))
        summary = replay_exp.run(cfg)
        outs.append((tmp_path / f"o{k}.jsonl").read_bytes())
        assert summary["evictions"] > 0  # a small pool: the run exercises eviction
    assert outs[0] == outs[1]
    assert b"_s" not in outs[0]  # no timing in the per-request file
    results = [json.loads(l) for l in (tmp_path / "w0" / "results.jsonl").read_text().splitlines()]
    prov = results[0]["provenance"]
    assert prov["hash_algo"] == "xxhash_cbor" and prov["cache_state"] == "cold"
    assert prov["config"]["hash_seed"] == "7" and prov["git"]["revision"]
    assert (tmp_path / "w0" / "replay.png").stat().st_size > 0


def test_miss_reasons_reach_the_records_and_the_summary(trace, tmp_path):
    # The config field asks the library replay for miss accounting: each record's
    # reasons, the summary's totals, equal to the library's; off by default.
    path, reqs = trace
    out = tmp_path / "o.jsonl"
    summary = replay_exp.run(_config(trace=str(path), num_blocks=40, block_size=4,
                                     concurrency=2, out=str(out), miss_reasons=True))
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    expected = []
    lib = replay(reqs, num_blocks=40, block_size=4, concurrency=2, miss_reasons=True,
                 on_record=expected.append)
    assert rows == expected
    assert summary["miss_reasons"] == lib["miss_reasons"]
    totals = summary["miss_reasons"]["reasons"]
    assert totals["evicted"] > 0 and totals["isolated"] > 0  # (mm_salt at 40 blocks)
    # (each block once: the tier sub-reasons evicted_device / evicted_host split "evicted")
    assert sum(r["miss_reasons"].get(k, 0) for r in rows for k in REASONS) == summary[
        "miss_reasons"]["missed_blocks"] == sum(
        -(-r["prompt_tokens"] // 4) - r["num_computed_tokens"] // 4 for r in rows)
    plain = replay_exp.run(_config(trace=str(path), num_blocks=40, block_size=4,
                                   concurrency=2, out=str(tmp_path / "p.jsonl")))
    assert "miss_reasons" not in plain
    assert not any("miss_reasons" in json.loads(l)
                   for l in (tmp_path / "p.jsonl").read_text().splitlines())


def test_max_requests_replays_the_first_n(trace, tmp_path):
    path, _ = trace
    summary = replay_exp.run(_config(trace=str(path), max_requests=5, out=str(tmp_path / "o.jsonl")))
    assert summary["requests"] == 5
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 5


GOOD = '{"id": "a", "prompt": [1, 2, 3, 4, 5], "output_len": 2}'


@pytest.mark.parametrize("bad_line,message", [
    ('{"id": "b", "prompt": [1, 2', "malformed JSON"),
    ('{"id": "b", "output_len": 2}', "missing field 'prompt'"),
    ('{"id": "b", "prompt": [1, 2], "output_len": -3}', "output_len"),
    ('{"id": "b", "prompt": [1, -2], "output_len": 1}', "negative token id"),
    ('{"id": "b", "prompt": [1, 2, 3], "output_len": 1, "mm": [["img", 2, 5]]}', "outside the prompt"),
    ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}', "input_length"),
])
def test_bad_trace_line_is_reported_with_its_line_number_and_no_output(tmp_path, bad_line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([GOOD, GOOD.replace('"a"', '"c"'), bad_line, GOOD]) + "\n")
    out, work = tmp_path / "o.jsonl", tmp_path / "w"
    with pytest.raises(ValueError, match=message) as e:
        replay_exp.run(_config(trace=str(path), out=str(out), workdir=str(work)))
    assert f"{path}:3:" in str(e.value)
    assert not out.exists()
    assert not any(work.iterdir())  # no results.jsonl, no plot, no temp files
    assert set(tmp_path.iterdir()) == {path, work}


def test_unknown_hash_algorithm_and_missing_file(trace, tmp_path):
    path, _ = trace
    out = tmp_path / "o.jsonl"
    out.write_text("previous complete output\n")
    with pytest.raises(ValueError, match="unknown hash algorithm 'md5'"):
        replay_exp.run(_config(trace=str(path), hash_algo="md5", out=str(out)))
    assert out.read_text() == "previous complete output\n"  # left exactly as it was
    with pytest.raises(FileNotFoundError, match="does not exist"):
        replay_exp.run(_config(trace=str(tmp_path / "nope.jsonl"), out=str(tmp_path / "x.jsonl")))
    assert not (tmp_path / "x.jsonl").exists()


def test_cli_bad_input_exits_nonzero_with_a_clear_message(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(GOOD + "\n{oops\n")
    out = tmp_path / "o.jsonl"
    proc = subprocess.run([sys.executable, "-m", "experiments.replay", f"--trace={path}",
                           f"--out={out}", "--noprogress"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1
    assert f"error: {path}:2: malformed JSON" in proc.stderr
    assert proc.stdout == "" and not out.exists()
