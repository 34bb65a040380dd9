"""Every config in configs/ loads, documents its command and expected result, and runs
its script on a reduced size."""

import ast
import importlib
import importlib.util
import json
import pathlib
import re

import ml_collections
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.py") if not p.name.startswith("_"))

# Reduced generator arguments per workload (the test budget is seconds, not minutes).
SMALL_WORKLOADS = {
    "shared_system_prompt": dict(num_requests=12, system_len=64, unique_len=(8, 24),
                                 output_len=(2, 6)),
    "multi_turn": dict(num_conversations=3, num_turns=3, new_tokens=(8, 24), output_len=(2, 8)),
    "few_shot": dict(num_headers=2, num_questions=5, header_len=80, output_len=(2, 6)),
    "mm_salt": dict(num_requests=12, image_len=40, suffix_len=(4, 16), output_len=(2, 6)),
    "rag": dict(num_requests=16, num_documents=6, doc_len=(20, 80), system_len=32,
                output_len=(2, 6)),
    "mooncake_scale": dict(num_requests=30, max_input_blocks=40),
}


def load(path):
    spec = importlib.util.spec_from_file_location(f"_cfg_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_of(path):
    """(docstring, script) where the docstring shows `python -m experiments.<script>`."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    m = re.search(r"python -m experiments\.(\w+)", doc)
    return doc, (m.group(1) if m else None)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_documents_its_command(path):
    doc, script = script_of(path)
    assert doc, f"{path.name} has no docstring"
    assert script, f"{path.name}'s docstring lacks `python -m experiments.<script>`"
    assert importlib.util.find_spec(f"experiments.{script}"), script
    if script in OURS:  # the exact command, with this config file
        assert re.search(r"python -m experiments\.\w+[^\n]*--config=configs/" + re.escape(path.name),
                         doc), f"{path.name}: the command does not name the config file"
    assert re.search(r"Expected", doc), f"{path.name}: no expected result"
    assert "EXPECT\n" not in doc and not doc.rstrip().endswith("EXPECT")
    cfg = load(path).get_config()
    assert isinstance(cfg, ml_collections.ConfigDict)


def _reduce(cfg, tmp_path, request):
    """Small sizes for any of our configs (Mooncake traces: their first 12 requests)."""
    cfg.workdir = str(tmp_path / "work")
    if "workload" in cfg and cfg.workload.name in SMALL_WORKLOADS:
        for k, v in SMALL_WORKLOADS[cfg.workload.name].items():
            setattr(cfg.workload.kwargs, k, v)
    assert not cfg.get("trace"), "configs name public traces by dataset, not by path"
    if cfg.get("dataset"):
        # The Mooncake configs: the dataset's local copy (through $PREFIXCACHE_DATA and
        # the checksum check, as after a download), its first 12 requests.
        request.getfixturevalue("local_datasets")
        cfg.max_requests = 12
        cfg.num_blocks = 2000


OURS = {"replay", "sweep_capacity", "latency_by_prefix", "bench_hashing", "serve_bench"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_runs_its_script_reduced(path, tmp_path, request):
    _, script = script_of(path)
    if script not in OURS:
        pytest.skip(f"experiments.{script} is tested by its owner")
    cfg = load(path).get_config()
    _reduce(cfg, tmp_path, request)
    if script == "sweep_capacity":
        if cfg.get("kv_bytes"):  # sized in bytes: 16 and 4096 bf16 blocks of its model
            cfg.kv_bytes = "8MiB,2GiB"
        else:
            cfg.capacities = (16, 4096)
        cfg.warmup_requests = 4
    elif script == "latency_by_prefix":
        cfg.accelerators = ("h100", "tpu_v5e")
        cfg.warmup_requests = 4
        cfg.measured.prefix_lengths = (0, 32)
        cfg.measured.suffix_len = 8
        cfg.measured.max_tokens = 1
        cfg.measured.repeats = 1
        cfg.measured.num_blocks = 32
        cfg.measured.max_num_batched_tokens = 64
    elif script == "bench_hashing":
        cfg.repeats, cfg.warmup, cfg.compare_vllm = 1, 0, False
    elif script == "serve_bench":
        # Two requests in one batch, one output token each: few step shapes to compile.
        cfg.workload.kwargs.num_requests = 2
        cfg.workload.kwargs.vocab = 512
        cfg.batch_size, cfg.max_tokens, cfg.num_blocks = 2, 1, 64
        cfg.max_num_batched_tokens = 256
    module = importlib.import_module(f"experiments.{script}")
    result = module.run(cfg)
    work = pathlib.Path(cfg.workdir)
    lines = [json.loads(l) for l in (work / "results.jsonl").read_text().splitlines()]
    assert lines and all("provenance" in l for l in lines)
    for line in lines:
        prov = line["provenance"]
        assert prov["config"]["workdir"] == cfg.workdir
        assert {"seed", "versions", "git", "hash_algo", "cache_state"} <= set(prov)
    assert list(work.glob("*.png")), "no plot written"
    json.dumps(result)  # the printed summary is JSON-able
    if script == "replay":
        assert result["requests"] > 0 and result["failed"] == 0
        assert lines[0]["provenance"]["cache_state"] == "cold"
    elif script == "sweep_capacity":
        assert {r["cache_state"] for r in result["rows"]} == {"cold", "warm"}
    elif script == "latency_by_prefix" and not cfg.measured.enable:
        assert {r["cache_state"] for r in result["simulated"]} == {"cold", "warm"}
        assert result["measured"] == []
    elif script == "latency_by_prefix":
        assert {r["cache_state"] for r in result["simulated"]} == {"cold", "warm"}
        hits = {(m["cache_state"], m["target_cached_tokens"]) for m in result["measured"]}
        assert hits == {("cold", 0), ("cold", 32), ("warm", 0), ("warm", 32)}
        measured = [l for l in lines if l["record"] == "measured"]
        assert all(l["num_cached_tokens"] == (32 if (l["cache_state"], l["target_cached_tokens"])
                                              == ("warm", 32) else 0) for l in measured)
    elif script == "serve_bench":
        assert all(s["outputs_identical_to_off"] for s in result["summaries"])
        warm = result["summaries"][2]
        assert warm["cache_state"] == "warm" and warm["token_hit_rate"] > 0
