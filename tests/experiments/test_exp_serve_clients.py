"""The serving experiments end to end on loopback: replicas behind sglang-router
(experiments.serve_cluster) and AIPerf replaying a Mooncake trace (experiments.serve_trace),
each in its quick form, with the real clients."""

import json
import os
import shutil

import pytest

from configs import serve_cluster as cluster_config
from configs import serve_trace as trace_config

# Small servers that compile on demand (a handful of programs), sharing one persistent
# compilation cache per test session (never the user's home).
FAST = "--no-warmup"


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax-cache"))


def _rows(path):
    return [r for r in map(json.loads, open(path)) if "provenance" not in r or len(r) > 1]


def test_serve_cluster_quick(tmp_path, compile_cache):
    pytest.importorskip("sglang_router", reason="sglang-router is not installed "
                        "(pip install sglang-router)")
    from experiments import serve_cluster

    c = cluster_config.get_config("quick")
    c.workdir = str(tmp_path)
    c.num_requests, c.arrival_rate = 16, 8.0
    c.serve_flags += f" {FAST} --compilation-cache-dir {compile_cache}"
    out = serve_cluster.run(c)
    rows = {(r["policy"], r["source"]): r for r in _rows(out["rows"])}
    assert set(rows) == {(p, s) for p in ("cache_aware", "round_robin")
                         for s in ("served", "simulated")}
    for r in rows.values():
        assert r["failed"] == 0 and r["requests"] == 16 and sum(r["replica_requests"]) == 16
    # round_robin alternates: both replicas serve; served and simulated agree exactly
    rr, rr_sim = rows["round_robin", "served"], rows["round_robin", "simulated"]
    assert rr["replica_requests"] == rr_sim["replica_requests"] == [8, 8]
    assert rr["hit_tokens"] == rr_sim["hit_tokens"] and rr["prompt_tokens"] == rr_sim["prompt_tokens"]
    # cache_aware keeps tenants together: at least round_robin's hits, served and simulated
    ca, ca_sim = rows["cache_aware", "served"], rows["cache_aware", "simulated"]
    assert ca["hit_tokens"] >= rr["hit_tokens"] and ca_sim["hit_tokens"] >= rr_sim["hit_tokens"]
    assert os.path.getsize(out["png"]) > 0


def test_serve_trace_quick(tmp_path, compile_cache, local_datasets):
    from experiments import serve_trace

    c = trace_config.get_config("quick")
    try:
        serve_trace.find_aiperf(c)
    except ValueError as e:
        pytest.skip(f"AIPerf is not installed ({e})")
    c.workdir = str(tmp_path)
    c.max_requests = 8
    c.serve_flags += f" {FAST} --compilation-cache-dir {compile_cache}"
    out = serve_trace.run(c)
    (row,) = [r for r in _rows(out["rows"]) if "served_hit_rate_tokens" in r]
    assert row["requests"] == row["served_requests"] == 8
    # every prompt reached the server, the hits are the prediction's (the tokenizer's
    # merges may move a few tokens across hash-id blocks, never a whole block here)
    assert row["served_hit_tokens"] == row["predicted_hit_tokens"] > 0
    assert abs(row["served_prompt_tokens"] - row["predicted_prompt_tokens"]) < 0.02 * row[
        "predicted_prompt_tokens"]
    assert row["aiperf"]["time_to_first_token"]["avg"] > 0
    assert row["aiperf"]["request_count"]["avg"] == 8
    shutil.rmtree(tmp_path / "hf_cache")
