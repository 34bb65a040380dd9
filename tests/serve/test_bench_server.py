"""experiments.bench_server on a reduced size: it runs, both passes produce the same
token count, and its record carries the figures and provenance."""

import json

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")


@pytest.mark.slow
def test_bench_server_reduced(tmp_path):
    import ml_collections

    from configs.bench_server import get_config
    from experiments import bench_server

    cfg = get_config()
    cfg.update(ml_collections.ConfigDict(dict(
        workdir=str(tmp_path), num_requests=8, concurrency=4, num_prefixes=2, prefix_len=32,
        suffix_len=4, max_tokens=3, num_blocks=64, max_num_seqs=4,
        max_num_batched_tokens=128)))
    r = bench_server.run(cfg)
    assert r["output_tokens"] == r["server_output_tokens"] == 8 * 3
    assert r["same_token_count"] and r["num_ttft_pairs"] == 8
    assert r["server_tokens_per_s"] > 0 and r["inprocess_tokens_per_s"] > 0
    rec = [json.loads(x) for x in (tmp_path / "bench_server.jsonl").read_text().splitlines()]
    assert any("throughput_ratio" in json.dumps(x) for x in rec)
    assert any("git" in json.dumps(x) for x in rec)
