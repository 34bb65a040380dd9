"""serve_bench with a KV byte budget and kv_dtype (--config.kv_cache_bytes / kv_dtype)."""

import json
import pathlib

import pytest

from experiments import serve_bench
from prefixcache.model import ModelConfig

from test_exp_compare_policies import _load  # noqa: E402

FP8_BLOCK = 2 * (16 * 4 * 64 + 4 * 4)  # tiny model, 16-token blocks: 8224 bytes


def _config(tmp_path):
    cfg = _load("serve_bench")
    cfg.workdir = str(tmp_path / "work")
    kw = cfg.workload.kwargs
    kw.num_requests, kw.system_len, kw.unique_len, kw.output_len = 4, 64, (8, 16), (1, 1)
    cfg.batch_size, cfg.max_tokens, cfg.max_num_batched_tokens = 2, 1, 256
    return cfg


@pytest.mark.parametrize("changes, match", [
    ({"kv_cache_bytes": "1MiB"}, "not both.*num_blocks=0"),  # num_blocks=512 by default
    ({"num_blocks": 0}, "num_blocks must be >= 1 without kv_cache_bytes"),
    ({"num_blocks": 0, "kv_cache_bytes": "a lot"}, "cannot read a byte count"),
    ({"num_blocks": 0, "kv_cache_bytes": "-2MiB"}, "cannot read a byte count"),
    ({"num_blocks": 0, "kv_cache_bytes": str(2 * FP8_BLOCK - 1),
      "kv_dtype": "float8_e4m3fn"}, "holds no allocatable block"),
    ({"kv_dtype": "fp8"}, "unknown kv_dtype"),
])
def test_bad_pool_config_fails_before_anything_runs(changes, match, tmp_path):
    cfg = _config(tmp_path)
    for k, v in changes.items():
        setattr(cfg, k, v)
    with pytest.raises(ValueError, match=match):
        serve_bench.run(cfg)
    assert not pathlib.Path(cfg.workdir).exists()  # nothing written, nothing run


def test_pool_kwargs():
    cfg = _load("serve_bench")
    tiny = ModelConfig.tiny()
    assert serve_bench.pool_kwargs(cfg, tiny) == {"num_blocks": 512, "kv_dtype": "float32"}
    cfg.num_blocks, cfg.kv_cache_bytes, cfg.kv_dtype = 0, "2 * FP8", "int8"
    with pytest.raises(ValueError, match="cannot read"):
        serve_bench.pool_kwargs(cfg, tiny)
    cfg.kv_cache_bytes = str(2 * FP8_BLOCK)
    assert serve_bench.pool_kwargs(cfg, tiny) == {"kv_cache_bytes": str(2 * FP8_BLOCK),
                                                   "kv_dtype": "int8"}


def test_fp8_budget_run_rows_carry_the_pool(tmp_path):
    cfg = _config(tmp_path)
    # 13 fp8 pages: 12 blocks + the padding page (a bf16 pool this size: 5 blocks).
    cfg.num_blocks, cfg.kv_cache_bytes, cfg.kv_dtype = 0, str(13 * FP8_BLOCK + 100), \
        "float8_e4m3fn"
    out = serve_bench.run(cfg)
    for s in out["summaries"]:
        assert (s["kv_dtype"], s["num_blocks"], s["kv_bytes_per_block"], s["kv_pool_bytes"],
                s["kv_cache_bytes"]) == ("float8_e4m3fn", 12, FP8_BLOCK, 13 * FP8_BLOCK,
                                         13 * FP8_BLOCK + 100)
        assert s["outputs_identical_to_off"] and s["errors"] == 0
    assert out["summaries"][2]["cached_tokens"] > 0  # on_warm hits the system prompt
    lines = [json.loads(l) for l in
             (pathlib.Path(cfg.workdir) / "results.jsonl").read_text().splitlines()]
    summaries = [l for l in lines if l["record"] == "summary"]
    assert len(summaries) == 3 and all(l["num_blocks"] == 12 for l in summaries)
