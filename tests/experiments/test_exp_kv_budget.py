"""KV byte budgets in the capacity experiments (--kv_bytes / --kv_dtype)."""

import json
import pathlib

import pytest

from experiments import _kv_budget
from experiments import compare_policies as cp
from experiments import sweep_capacity as sc
from prefixcache.sim import workloads as wl
from prefixcache.sim.trace import write_trace

from test_exp_compare_policies import _load  # noqa: E402

# Llama-3.2-1B, 8-token blocks: 16 layers x (8 x 2 x 8 kv heads x 64 x itemsize [+ 16 x 4]).
BF16_BLOCK, FP8_BLOCK = 16 * 8 * 2 * 8 * 64 * 2, 16 * (8 * 2 * 8 * 64 + 16 * 4)


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "rag.jsonl"
    write_trace(path, wl.rag(num_requests=30, num_documents=6, doc_len=(20, 80), system_len=32,
                             output_len=(2, 6), seed=4))
    return str(path)


def _sweep_config(trace, tmp_path):
    cfg = _load("sweep_capacity_kv_dtypes")
    cfg.workload.name, cfg.trace, cfg.workdir = "", trace, str(tmp_path / "work")
    cfg.block_size, cfg.warmup_requests = 8, 10
    cfg.kv_bytes = f"{40 * BF16_BLOCK},{200 * BF16_BLOCK}"
    return cfg


def test_sweep_capacity_budget_rows_per_dtype(trace, tmp_path):
    cfg = _sweep_config(trace, tmp_path)
    out = sc.run(cfg)
    rows = out["rows"]
    assert len(rows) == 2 * 3 * 2  # budgets x dtypes x cold/warm
    blocks = {(r["kv_dtype"], r["kv_bytes_budget"]): r["num_blocks"] for r in rows}
    assert blocks[("bfloat16", 40 * BF16_BLOCK)] == 40
    assert blocks[("float8_e4m3fn", 40 * BF16_BLOCK)] == 40 * BF16_BLOCK // FP8_BLOCK == 79
    assert blocks[("int8", 200 * BF16_BLOCK)] == 200 * BF16_BLOCK // FP8_BLOCK == 396
    for r in rows:
        assert r["kv_bytes"] == r["num_blocks"] * r["bytes_per_block"] <= r["kv_bytes_budget"]
        assert r["bytes_per_block"] == (BF16_BLOCK if r["kv_dtype"] == "bfloat16" else FP8_BLOCK)
    # More blocks per byte: fp8 hits at least as often as bf16 at every budget.
    rate = {(r["kv_dtype"], r["kv_bytes_budget"], r["cache_state"]): r["hit_rate_tokens"]
            for r in rows}
    for (dt, budget, state), hr in rate.items():
        assert hr >= rate[("bfloat16", budget, state)]
    # The same block count gives the same replay whatever the dtype.
    small = 40 * BF16_BLOCK
    assert rate[("int8", small, "cold")] == rate[("float8_e4m3fn", small, "cold")]
    work = pathlib.Path(cfg.workdir)
    assert (work / "sweep_capacity_kv.png").exists()
    lines = [json.loads(l) for l in (work / "results.jsonl").read_text().splitlines()]
    assert {l["kv_dtype"] for l in lines} == {"bfloat16", "float8_e4m3fn", "int8"}


@pytest.mark.parametrize("change,match", [
    (dict(capacities=(16, 64)), "not both"),
    (dict(kv_bytes=""), "give the cache size as capacities"),
    (dict(kv_dtype="fp8"), "unknown kv_dtype 'fp8'"),
    (dict(kv_bytes="1000"), "smaller than one block"),
    (dict(kv_bytes="2 parsecs"), "cannot read a byte count"),
    (dict(model="gpt5"), "unknown model preset"),
])
def test_sweep_capacity_bad_budget_refused_before_anything_runs(trace, tmp_path, change, match):
    cfg = _sweep_config(trace, tmp_path)
    for k, v in change.items():
        setattr(cfg, k, v)
    with pytest.raises(ValueError, match=match):
        sc.run(cfg)
    assert not pathlib.Path(cfg.workdir).exists()


def test_sweep_capacity_default_config_rows_carry_kv_fields(trace, tmp_path):
    rows = sc.kv_sweep(_read_trace(trace), config=_blocks_config(trace, tmp_path),
                       warmup_requests=0)
    assert [r["num_blocks"] for r in rows] == [16, 16, 64, 64]
    assert all(r["kv_dtype"] == "bfloat16" and r["kv_bytes_budget"] is None
               and r["kv_bytes"] == r["num_blocks"] * BF16_BLOCK for r in rows)


def _blocks_config(trace, tmp_path):
    cfg = _load("sweep_capacity")
    cfg.workload.name, cfg.trace, cfg.workdir = "", trace, str(tmp_path / "w")
    cfg.block_size, cfg.capacities = 8, (16, 64)
    return cfg


def _read_trace(trace):
    from prefixcache.sim.trace import read_trace

    return list(read_trace(trace))


def _cp_config(trace, tmp_path):
    cfg = _load("compare_policies")
    cfg.trace, cfg.workdir = trace, str(tmp_path / "work")
    cfg.block_size, cfg.concurrency, cfg.workers = 8, 2, 1
    cfg.policies, cfg.indexes, cfg.belady_bound = "lru", "hash", False
    cfg.model = "llama_3_2_1b"
    return cfg


def test_compare_policies_budget_rows(trace, tmp_path):
    cfg = _cp_config(trace, tmp_path)
    cfg.capacities, cfg.kv_bytes, cfg.kv_dtype = "", f"{40 * FP8_BLOCK},{400 * FP8_BLOCK}", "int8"
    cp.run(cfg)
    rows = [json.loads(l) for l in
            (pathlib.Path(cfg.workdir) / cp.ROWS_FILE).read_text().splitlines()]
    cells = [r for r in rows if r["record"] == "cell"]
    assert [r["num_blocks"] for r in cells] == [40, 400]
    for r in rows:
        assert r["kv_dtype"] == "int8" and r["bytes_per_block"] == FP8_BLOCK
        assert r["peak_cached_bytes"] == r["peak_cached_blocks"] * FP8_BLOCK
    assert [r["kv_bytes_budget"] for r in rows] == [40 * FP8_BLOCK, 400 * FP8_BLOCK, None]


@pytest.mark.parametrize("change,match", [
    (dict(kv_bytes="1GiB"), "not both"),  # the config's capacities are still there
    (dict(capacities="", kv_bytes="1GiB", kv_dtype="int4"), "unknown kv_dtype 'int4'"),
    (dict(capacities="", kv_bytes="1KiB", kv_dtype="int8"), "smaller than one block"),
    (dict(capacities="", kv_bytes="1GiB", kv_dtype="int8,bfloat16"), "one kv_dtype"),
    (dict(capacities="", kv_bytes="1GiB", model=""), "needs a model preset"),
])
def test_compare_policies_bad_budget_refused_before_anything_runs(trace, tmp_path, change,
                                                                  match):
    cfg = _cp_config(trace, tmp_path)
    for k, v in change.items():
        setattr(cfg, k, v)
    with pytest.raises(ValueError, match=match):
        cp.run(cfg)
    assert not (pathlib.Path(cfg.workdir) / cp.ROWS_FILE).exists()


def test_parse_helpers():
    assert _kv_budget.parse_budgets("1GiB, 512MiB,1GiB") == (2**29, 2**30)
    assert _kv_budget.parse_kv_dtypes("int8,int8, bfloat16") == ("int8", "bfloat16")
    with pytest.raises(ValueError, match="at least one"):
        _kv_budget.parse_kv_dtypes(" , ")


def test_kv_quant_experiment_reduced(tmp_path):
    from experiments import kv_quant

    cfg = _load("kv_quant")
    cfg.workdir, cfg.kv_dtypes, cfg.cases, cfg.models = (
        str(tmp_path / "kq"), "bfloat16,int8,float8_e4m3fn", "chunk_over_prefix", "tiny")
    out = kv_quant.run(cfg)
    lines = [json.loads(l) for l in
             (tmp_path / "kq" / "results.jsonl").read_text().splitlines()]
    acc = {(l["kv_dtype"], l["write"]): l for l in lines if l["record"] == "accuracy"}
    assert len(acc) == 6 and all("provenance" in l for l in lines)
    assert acc[("bfloat16", "prefill")]["rel_error"] < acc[("int8", "prefill")]["rel_error"] \
        < acc[("float8_e4m3fn", "prefill")]["rel_error"] < 8e-2
    # fp8 pages written token by token are the pages written at once (pow2 scales).
    assert acc[("float8_e4m3fn", "decode")]["rel_error"] == \
        acc[("float8_e4m3fn", "prefill")]["rel_error"]
    assert out["bytes_per_token"] == {"tiny/bfloat16": 1024, "tiny/int8": 514,
                                      "tiny/float8_e4m3fn": 514}
    cfg.cases = "nope"
    with pytest.raises(ValueError, match="unknown cases"):
        kv_quant.run(cfg)
