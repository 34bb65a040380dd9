"""Provenance a reader can trust: the JAX device, the trace's checksum, the cache state,
and one provenance record per file where rows are many."""

import json
import pathlib
import subprocess
import sys

from experiments import _common
from prefixcache.sim import datasets
from prefixcache.sim import workloads as wl
from prefixcache.sim.trace import write_trace

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_provenance_names_the_trace_and_its_checksum(tmp_path, local_datasets):
    import ml_collections  # noqa: PLC0415

    trace = tmp_path / "t.jsonl"
    write_trace(trace, wl.rag(num_requests=5, num_documents=2, doc_len=(8, 16),
                              system_len=8, output_len=(1, 2), seed=0))
    cfg = ml_collections.ConfigDict({"trace": str(trace), "dataset": ""})
    prov = _common.provenance(cfg, seed=0)
    assert prov["trace_checksum"] == {"dataset": None, "trace": str(trace),
                             "sha256": datasets.sha256_of(trace)}
    cfg = ml_collections.ConfigDict({"trace": "", "dataset": "mooncake_synthetic"})
    assert _common.provenance(cfg, seed=0)["trace_checksum"]["sha256"] == datasets.get(
        "mooncake_synthetic").sha256
    # A local copy of a public trace, given as a file, is named as that dataset.
    copy = local_datasets / "mooncake_synthetic" / "synthetic_trace.jsonl"
    cfg = ml_collections.ConfigDict({"trace": str(copy), "dataset": ""})
    assert _common.provenance(cfg, seed=0)["trace_checksum"]["dataset"] == "mooncake_synthetic"
    assert _common.provenance(None, seed=0)["trace_checksum"] is None


def test_jax_backend_is_recorded_only_where_jax_is_used():
    code = ("from experiments import _common; import sys; p = _common.provenance(None, seed=0);"
            "assert p['jax'] is None and 'jax' not in sys.modules, p['jax'];"
            "import jax; p = _common.provenance(None, seed=0);"
            "assert p['jax']['backend'] == jax.default_backend(), p['jax'];"
            "assert p['jax']['device_kind'] == jax.devices()[0].device_kind")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_provenance_once_writes_a_header_and_ids(tmp_path):
    out = tmp_path / "r.jsonl"
    with _common.AtomicJsonlWriter(out, {"seed": 1}, provenance_once=True) as w:
        w.write({"x": 1})
        w.write({"x": 2})
        w.write({"x": 3}, provenance={"seed": 2})
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    head, a, b, head2, c = lines
    assert head["record"] == "provenance" and head["provenance"] == {"seed": 1}
    assert a == {"x": 1, "provenance_id": head["provenance_id"]}
    assert b["provenance_id"] == head["provenance_id"]
    assert head2["provenance"] == {"seed": 2} and c["provenance_id"] == head2["provenance_id"]
    assert head["provenance_id"] != head2["provenance_id"]


def test_latency_by_prefix_rows_all_have_a_cache_state(tmp_path):
    import importlib.util  # noqa: PLC0415

    from experiments import latency_by_prefix  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("_cfg_lbp", ROOT / "configs/latency_by_prefix.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config()
    c.workdir = str(tmp_path / "w")
    c.workload.kwargs.num_requests = 30
    c.accelerators = ("h100",)
    c.measured.enable = False
    latency_by_prefix.run(c)
    rows = [json.loads(x) for x in (tmp_path / "w" / "results.jsonl").read_text().splitlines()]
    roofline = [r for r in rows if r["record"] == "roofline"]
    assert roofline and all(r["provenance"]["cache_state"] in ("cold", "warm") for r in rows)
    assert {r["cache_state"] for r in roofline} == {"cold", "warm"}
    assert all(r["cache_state"] == ("warm" if r["cached_tokens"] else "cold") for r in roofline)
