"""The engine in its own process (`EngineCoreClient`, the default of `prefixcache serve`):
requests, streaming, aborts, utilities and KV events across the process boundary, and
what clients see when the engine-core process is killed (5xx error objects, /health
503, no hang)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading

import httpx
import numpy as np
import openai
import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq (the serve extra) is not installed")
pytest.importorskip("msgspec", reason="msgspec (the serve extra) is not installed")

from prefixcache.serve import kv_events as kv  # noqa: E402
from prefixcache.serve.app import build_app  # noqa: E402
from prefixcache.serve.cli import parse_args  # noqa: E402
from prefixcache.serve.engine_loop import EngineCoreClient, EngineCoreError  # noqa: E402

from serve_support import ServerThread, build_refused, build_small_engine  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 64
MAX_LEN = 1024 + 64  # > the pool (64 x 16): a prompt can fit the context, not the pool
TIMEOUT = httpx.Timeout(120)  # a hang fails the test instead of blocking it


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def _args(*extra):
    return parse_args(["serve", "tiny", "--num-blocks", str(NUM_BLOCKS), "--block-size",
                       str(BLOCK), "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                       "--max-model-len", str(MAX_LEN), "--no-warmup", "--no-compilation-cache",
                       *extra])


@pytest.fixture(scope="module")
def events():
    """A SUB socket on loopback that the core's KV-events publisher connects to."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    yield sub, f"tcp://127.0.0.1:{port}"
    sub.close(0)
    ctx.term()


@pytest.fixture(scope="module")
def server(events):
    client = EngineCoreClient(_args("--kv-events-endpoint", events[1]),
                              build=build_small_engine, max_waiting=8)
    # NOTE: a bound SUB socket sends its subscription to a new peer (the core's
    # publisher, connected before ready) only once this thread touches the socket.
    events[0].poll(100)
    try:
        srv = ServerThread(build_app(client, served_model_name="tiny", tokenizer=None))
    except BaseException:
        client.shutdown()
        raise
    yield srv
    srv.close()
    assert client.process.exitcode is not None  # the core process is gone


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def _state(server):
    return server.serving.utility("state").result(60)


def _wait_idle(server):
    for _ in range(600):
        usage, unfinished, _ = _state(server)
        if unfinished == 0 and usage == 0.0:
            return
        threading.Event().wait(0.05)
    raise AssertionError(f"engine not idle: {_state(server)}")


def test_completions_streaming_cache_and_metrics(server, oai, events):
    assert server.serving.pid != os.getpid() and server.serving.alive
    prompt = _prompt(1, 2 * BLOCK + 5)
    r1 = oai.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
    r2 = oai.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
    assert r1.choices[0].token_ids == r2.choices[0].token_ids
    assert len(r1.choices[0].token_ids) == 5 and r1.choices[0].finish_reason == "length"
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.usage.prompt_tokens_details.cached_tokens == 2 * BLOCK
    chunks = list(oai.completions.create(model="tiny", prompt=prompt, max_tokens=5,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == \
        r1.choices[0].token_ids
    assert chunks[-1].usage.completion_tokens == 5
    # Seeded sampling and n across the wire (SamplingParams as a field list).
    a = oai.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=1.0,
                               seed=3, n=2)
    b = oai.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=1.0,
                               seed=4)
    assert sorted(a.choices, key=lambda c: c.index)[1].token_ids == b.choices[0].token_ids
    text = httpx.get(server.url + "/metrics").text
    assert 'prefixcache:prefix_cache_hits_total{model_name="tiny"}' in text
    hits = [ln for ln in text.splitlines()
            if ln.startswith('prefixcache:prefix_cache_hits_total{')]
    assert float(hits[0].split()[-1]) >= 2 * BLOCK * 4
    assert httpx.get(server.url + "/health").status_code == 200
    # The KV events come from the core process, in vLLM's wire format.
    sub = events[0]
    stored = []
    while sub.poll(2000):
        topic, seq, payload = sub.recv_multipart()
        batch = kv.decode_batch(payload)
        assert kv.encode_batch(batch.events, ts=batch.ts) == payload
        stored += [e for e in batch.events if isinstance(e, kv.BlockStored)]
    assert stored[0].token_ids == prompt[:2 * BLOCK] and len(stored[0].block_hashes) == 2
    assert stored[0].block_size == BLOCK and stored[0].parent_block_hash is None
    # Utilities by name; the reset empties the cache.
    assert httpx.post(server.url + "/reset_prefix_cache").json() == {"reset": True}
    assert _state(server) == [0.0, 0, []]
    with pytest.raises(EngineCoreError, match="no engine-core utility 'nope'"):
        server.serving.utility("nope").result(60)


def test_rejections_and_disconnects(server, oai):
    long = _prompt(2, NUM_BLOCKS * BLOCK + 1)  # fits the context, not the pool
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="KV blocks"):
            oai.completions.create(model="tiny", prompt=long, max_tokens=1, stream=stream)

    async def one(aclient, i):
        stream = await aclient.completions.create(
            model="tiny", prompt=_prompt(10 + i, 20), max_tokens=30, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        n = 0
        async for chunk in stream:
            n += len(chunk.choices[0].token_ids)
            if i % 2 == 0 and n >= 2:
                await stream.close()  # the client leaves mid-stream
                return "left"
        return n

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none",
                                      max_retries=0) as aclient:
            return await asyncio.wait_for(
                asyncio.gather(*(one(aclient, i) for i in range(6))), 120)

    assert asyncio.run(run()) == ["left", 30] * 3
    _wait_idle(server)  # the streams that were left were aborted: every block free
    assert server.serving.num_waiting() == 0


def test_killed_core_fails_requests_with_5xx_and_health_503(server):
    """kill -9 of the engine-core process: the in-flight streaming request ends with an
    error event, the in-flight non-streaming one gets a 500 error object, new requests a
    503, /health 503 -- promptly (every call here has a 120 s timeout: a hang fails)."""
    url = server.url + "/v1/completions"
    body = {"model": "tiny", "prompt": _prompt(3, 20), "max_tokens": MAX_LEN - 40,
            "temperature": 0, "ignore_eos": True}
    result = {}

    def non_streaming():
        with httpx.Client(timeout=TIMEOUT) as h:
            result["r"] = h.post(url, json=body)

    with httpx.Client(timeout=TIMEOUT) as h:
        with h.stream("POST", url, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(ln for ln in lines if ln).startswith("data: {")
            t = threading.Thread(target=non_streaming)
            t.start()
            while server.serving.num_running() < 2:  # both requests run in the core
                threading.Event().wait(0.01)
            os.kill(server.serving.pid, signal.SIGKILL)
            rest = [ln for ln in lines if ln]
    t.join(120)
    assert not t.is_alive()
    errors = [json.loads(ln[6:]) for ln in rest if ln.startswith('data: {"error"')]
    assert len(errors) == 1 and rest[-1] == "data: [DONE]"
    assert errors[0]["error"]["type"] == "internal_server_error"
    assert "engine core process died (killed by SIGKILL)" in errors[0]["error"]["message"]
    r = result["r"]
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "engine_failed"
    assert "killed by SIGKILL" in r.json()["error"]["message"]
    new = httpx.post(url, json={**body, "max_tokens": 2}, timeout=TIMEOUT)
    assert new.status_code == 503 and new.json()["error"]["code"] == "unavailable"
    health = httpx.get(server.url + "/health", timeout=TIMEOUT)
    assert health.status_code == 503 and "killed by SIGKILL" in health.json()["error"]["message"]
    reset = httpx.post(server.url + "/reset_prefix_cache", timeout=TIMEOUT)
    assert reset.status_code == 503 and set(reset.json()["error"]) == {
        "message", "type", "param", "code"}
    assert not server.serving.alive


def test_startup_failure_is_named_and_leaves_no_process():
    import multiprocessing

    before = set(multiprocessing.active_children())
    with pytest.raises(EngineCoreError, match="ValueError: no model 'tiny' here"):
        EngineCoreClient(_args(), build=build_refused)
    assert set(multiprocessing.active_children()) <= before


def test_flag_engine_in_process():
    assert parse_args(["serve", "tiny"]).engine_in_process is False
    assert parse_args(["serve", "tiny", "--engine-in-process"]).engine_in_process is True
