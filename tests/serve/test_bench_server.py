"""experiments.bench_server on a reduced size: it runs, both sides produce the same
token count, and its records carry the figures and provenance."""

import json

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("zmq")


@pytest.mark.slow
def test_bench_server_reduced(tmp_path):
    import ml_collections

    from configs.bench_server import get_config
    from experiments import bench_server

    cfg = get_config()
    cfg.update(ml_collections.ConfigDict(dict(
        workdir=str(tmp_path), concurrencies=(1, 4), num_requests=(4, 8), num_prefixes=2,
        prefix_len=32, suffix_len=4, max_tokens=3, num_blocks=64, max_num_seqs=4,
        max_num_batched_tokens=128)))
    r = bench_server.run(cfg)
    assert r["server_mode"] == "process"
    assert [p["concurrency"] for p in r["passes"]] == [1, 4]
    for p, n in zip(r["passes"], (4, 8)):
        assert p["output_tokens"] == p["server_output_tokens"] == n * 3
        assert p["same_token_count"] and p["num_ttft_pairs"] == n
        assert p["server_tokens_per_s"] > 0 and p["inprocess_tokens_per_s"] > 0
        # Two prefixes: the first request of each is cold, the rest warm.
        assert p["warm_cold_ttft_ratio_client"] > 0 and p["warm_cold_ttft_ratio_inprocess"] > 0
    rec = [json.loads(x) for x in (tmp_path / "bench_server.jsonl").read_text().splitlines()]
    assert len(rec) == 2 and all("throughput_ratio" in x and "e2e_ratio" in x for x in rec)
    assert any("git" in json.dumps(x) for x in rec)
