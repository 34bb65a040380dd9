"""`prefixcache serve tiny` as a user starts it: warmed up before /health answers, the
compile gauges in /metrics, text in and out through the openai client (the built-in
tiny tokenizer), token-id prompts as before, the compilation cache in the given dir.

One server process with single shape buckets (2 step programs); its start (jax import,
the two compiles) is most of this module's time.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gauge(text: str, name: str) -> float | None:
    m = re.search(rf"^prefixcache:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    return None if m is None else float(m.group(1))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_tiny")
    cache_dir = tmp / "jax_cache"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp / "server.log"
    log = open(log_path, "w")
    # (token, seq and page buckets of one size each: 16 tokens, 4 rows, 4 pages)
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixcache.serve", "tiny", "--port", str(port),
         "--num-blocks", "16", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
         "--max-model-len", "64", "--compilation-cache-dir", str(cache_dir),
         "--log-level", "info"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp / "xdg")})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        yield url, cache_dir, log_path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def test_ready_means_compiled(served):
    url, cache_dir, log_path = served
    # /health answered only after the warm-up: both programs are built already.
    text = httpx.get(url + "/metrics").text
    assert _gauge(text, "compiled_programs") == 2, text
    assert _gauge(text, "compiles_after_warmup") == 0, text
    assert "warm-up: 2 step programs ready" in log_path.read_text()
    assert os.listdir(cache_dir), "nothing written to the compilation cache"


def test_text_chat_and_completion_on_tiny(served):
    from prefixcache.text import Tokenizer

    url, _, _ = served
    tok = Tokenizer.tiny()
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8, temperature=0)
    reply = chat.choices[0].message.content
    assert isinstance(reply, str) and reply, chat
    assert chat.usage.completion_tokens == 8 and chat.choices[0].finish_reason == "length"
    prompt = "Hello, world! The quick brown fox"
    comp = client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                     temperature=0)
    out = comp.choices[0]
    assert out.text and out.text == tok.decode(out.model_extra["token_ids"])
    assert comp.usage.prompt_tokens == len(tok.encode(prompt))
    # Token ids keep working, and give the same tokens as the text they encode.
    ids = client.completions.create(model="tiny", prompt=tok.encode(prompt), max_tokens=8,
                                    temperature=0)
    assert ids.choices[0].model_extra["token_ids"] == out.model_extra["token_ids"]
    assert ids.choices[0].text == out.text
    # Streaming text, sampling: still no compile after the warm-up.
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                            temperature=0.9, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    metrics = httpx.get(url + "/metrics").text
    assert _gauge(metrics, "compiles_after_warmup") == 0, metrics
    assert _gauge(metrics, "compiled_programs") == 2, metrics
