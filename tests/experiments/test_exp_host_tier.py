"""experiments.host_tier: the tiny default config end to end, its rows, bad input."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from experiments import host_tier as ht

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_cfg_{name}", ROOT / "configs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def _read(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


@pytest.fixture
def config(tmp_path):
    cfg = _load("host_tier")
    cfg.workdir, cfg.workers = str(tmp_path / "work"), 2
    return cfg


def test_default_config_end_to_end(config, capsys):
    out = ht.run(config)
    rows = _read(out["rows"])
    assert pathlib.Path(out["png"]).stat().st_size > 0
    assert all({"config", "seed", "versions", "git"} <= set(r["provenance"]) for r in rows)
    assert {r["provenance"]["cache_state"] for r in rows} == {"cold"}
    replay = sorted((r for r in rows if r["record"] == "replay"),
                    key=lambda r: r["num_host_blocks"])
    des = sorted((r for r in rows if r["record"] == "des"), key=lambda r: r["num_host_blocks"])
    ideal = [r for r in rows if r["record"] == "ideal"]
    assert [r["num_host_blocks"] for r in replay] == [0, 128, 256, 640]  # 0, 2x, 4x, 10x 64
    assert [r["num_host_blocks"] for r in des] == [0, 128, 256, 640] and len(ideal) == 1
    block_bytes = 16 * 128 * 1024  # 16 tokens of Llama-3.1-8B's KV
    for r in replay + des:
        assert r["hit_tokens"] == r["device_hit_tokens"] + r["host_hit_tokens"]
        assert (r["host_hit_tokens"] > 0) == (r["num_host_blocks"] > 0)
        assert r["host_hit_tokens"] == 16 * r["host_blocks_loaded"]
        assert r["host_bytes_loaded"] == r["host_blocks_loaded"] * block_bytes
    hits = [r["hit_rate_tokens"] for r in replay]
    assert hits == sorted(hits) and hits[-1] > 2 * hits[0]  # the tier recovers evictions
    assert hits[-1] <= ideal[0]["hit_rate_tokens"]
    # Loads are cheaper than recomputing on this link: a bigger tier, a lower TTFT.
    assert des[-1]["ttft_s"]["mean"] < des[0]["ttft_s"]["mean"]
    assert des[0]["host_load_s"] == 0 and des[-1]["host_load_s"] > 0
    printed = capsys.readouterr().out
    assert "host tier" in printed and "10x" in printed and "ideal" in printed
    assert set(out["hit_rate_tokens"]) == {"none", "2x", "4x", "10x"}


@pytest.mark.parametrize("field, value, match", [
    ("host_multiples", "2,0", "host_multiples must be comma-separated numbers > 0"),
    ("host_multiples", "two", "host_multiples must be comma-separated numbers > 0"),
    ("host_multiples", "", "host_multiples must name at least one"),
    ("num_blocks", 0, "num_blocks must be >= 1"),
    ("host_eviction", "belady", "unknown host_eviction 'belady'"),
    ("host_link", "nvlink9", "unknown host link 'nvlink9'"),
    ("accelerator", "h900", "unknown accelerator 'h900'"),
    ("model", "gpt5", "unknown model preset 'gpt5'"),
    ("executor", "slurm", "unknown executor 'slurm'"),
    ("trace", "/nonexistent/t.jsonl", "does not exist"),
])
def test_bad_input_is_refused_before_anything_runs(config, field, value, match):
    setattr(config, field, value)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        ht.run(config)
    assert not (pathlib.Path(config.workdir) / ht.ROWS_FILE).exists()


def test_cli_bad_flag_is_one_error_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.host_tier", "--host_multiples=2,-4",
         f"--workdir={tmp_path / 'w'}", "--noprogress"],
        cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: host_multiples must be comma-separated numbers > 0 (host blocks per device "
        "block), got '2,-4'"]
    assert not (tmp_path / "w" / ht.ROWS_FILE).exists()


def test_mooncake_configs_reduced(tmp_path, local_datasets):
    from experiments import _common

    for name in ("host_tier_mooncake_conversation", "host_tier_mooncake_synthetic"):
        cfg = _load(name)
        assert (cfg.num_blocks, cfg.block_size, cfg.host_multiples) == (10_000, 512, "2,4,10")
        assert (cfg.model, cfg.accelerator, cfg.num_chips, cfg.host_link) == (
            "llama_3_1_8b", "h200", 8, "h200_pcie5")
        assert cfg.dataset == name[len("host_tier_"):] and not cfg.trace
        ht.resolve(cfg)
    # The conversation config runs (the synthetic one differs only in its dataset).
    src = pathlib.Path(_common.trace_path(cfg))  # the verified local copy
    small = tmp_path / src.name
    with open(src) as f:
        small.write_text("".join(next(f) for _ in range(8)))
    cfg.dataset, cfg.trace = "", str(small)
    cfg.workdir, cfg.num_blocks, cfg.workers = str(tmp_path / "w"), 40, 1
    rows = _read(ht.run(cfg)["rows"])
    assert len(rows) == 9 and all(r["requests"] == 8 for r in rows)
    for r in rows:
        assert r["hit_tokens"] == r["device_hit_tokens"] + r["host_hit_tokens"]
