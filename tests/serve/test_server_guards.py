"""What an operator and an adversarial client expect of the server: the API key, body
and output bounds, JSON only, OpenAI error objects for malformed input, sampling values
at their extremes (a request the step cannot run fails alone: other clients' outputs
and the prefix cache survive), streams with more choices than the running batch, miss
reasons that say nothing of another tenant's cache, KV events on loopback.

One server (api key, small bounds, two running sequences, miss reasons on) for the
module; uvicorn on 127.0.0.1. Every request samples (no temperature 0) and every step
has one shape, so the module compiles one program."""

from __future__ import annotations

import json
import threading
import time
import types

import httpx
import numpy as np
import pytest

from prefixcache.engine import Engine
from prefixcache.model import ModelConfig
from prefixcache.serve.app import build_app
from prefixcache.serve.cli import parse_args, pool_fit_error

from serve_support import ServerThread  # noqa: E402  (tests/serve on sys.path)

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BLOCK = 16
NUM_BLOCKS = 64
MAX_LEN = NUM_BLOCKS * BLOCK  # the pool holds one request of max_model_len
BODY_LIMIT = 256 * 1024
OUT_LIMIT = 4096
MAX_SEQS, MAX_WAITING = 2, 4
ABORTED = "prefixcache:request_success_total{finished_reason=abort}"


def _prompt(seed: int, n: int, prefix=()) -> list[int]:
    return list(prefix) + np.random.default_rng(seed).integers(3, 500, n).tolist()


@pytest.fixture(scope="module")
def server(tiny_tokenizer):
    eng = Engine(ModelConfig.tiny(), num_blocks=NUM_BLOCKS, block_size=BLOCK,
                 max_num_seqs=MAX_SEQS, seq_buckets=(MAX_SEQS,), max_num_batched_tokens=128,
                 token_buckets=(128,), max_model_len=MAX_LEN,
                 page_buckets=(MAX_LEN // BLOCK,), seed=0, miss_reasons=True)
    srv = ServerThread(build_app(eng, served_model_name="tiny", tokenizer=tiny_tokenizer,
                                 max_waiting=MAX_WAITING, api_keys=[KEY, "second-key"],
                                 max_request_body_bytes=BODY_LIMIT,
                                 max_request_output_tokens=OUT_LIMIT))
    yield srv
    srv.close()


def _post(server, body, path="/v1/completions", headers=None, **kw):
    content = body if not isinstance(body, (dict, list)) else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **AUTH, **(headers or {})}
    return httpx.post(server.url + path, content=content, headers=h, timeout=120, **kw)


def _error(r, status, param="any", code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "any":
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def _metric(server, key):
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for s in fam.samples:
            name = s.name + ("{finished_reason=%s}" % s.labels["finished_reason"]
                             if "finished_reason" in s.labels else "")
            if name == key:
                total += s.value
    return total


def _wait(cond, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


# -- the API key -------------------------------------------------------------------------

def test_api_key_guards_v1_and_reset_only(server):
    ok = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1}
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("POST", "/reset_prefix_cache")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, server.url + path, json=ok, headers=headers, timeout=30)
            err = _error(r, 401, param=None, code="invalid_api_key")
            assert err["type"] == "invalid_request_error"
            assert r.headers["WWW-Authenticate"] == "Bearer"
    for key in (KEY, "second-key"):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
    assert _post(server, ok).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200  # open, as vLLM
    assert httpx.get(server.url + "/metrics").status_code == 200
    # the engine never saw the refused requests
    assert server.engine_state()[1] == 0


def test_api_key_flag_and_env(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert parse_args(["serve", "tiny"]).api_key is None
    assert parse_args(["serve", "tiny", "--api-key", "a", "b"]).api_key == ["a", "b"]
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert parse_args(["serve", "tiny"]).api_key == ["from-env"]
    assert parse_args(["serve", "tiny", "--api-key", "flag"]).api_key == ["flag"]
    with pytest.raises(ValueError, match="api_keys"):
        build_app(types.SimpleNamespace(), api_keys=[""])


# -- bodies: size, media type, nesting, Unicode ----------------------------------------------

def test_body_limit_media_type_depth_and_surrogates(server):
    big = {"model": "tiny", "prompt": [1] * (BODY_LIMIT // 2)}
    _error(_post(server, big), 413, code="request_too_large")

    def chunked():  # no Content-Length: counted as it streams in
        yield b'{"model": "tiny", "prompt": ['
        for _ in range(BODY_LIMIT // 1000 + 1):
            yield b"1," * 500
        yield b"1]}"
    r = _post(server, chunked())
    assert "content-length" not in r.request.headers
    _error(r, 413, code="request_too_large")

    ok = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1}
    for ctype in ("text/plain", "application/x-www-form-urlencoded", ""):
        _error(_post(server, ok, headers={"Content-Type": ctype}), 415,
               code="unsupported_media_type")
    assert _post(server, ok, headers={"Content-Type": "application/json; charset=utf-8"}
                 ).status_code == 200

    deep = {"model": "tiny", "prompt": [1, 2], "chat_template_kwargs": {"x": []}}
    nested = json.dumps(deep).replace("[]", "[" * 100 + "]" * 100)
    _error(_post(server, nested), 400, param="chat_template_kwargs", code="too_deep")
    _error(_post(server, '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"), 400,
           code="too_deep")  # past the JSON parser's own recursion limit

    for field, body in (
            ("prompt", '{"model": "tiny", "prompt": "hi \\ud800 there"}'),
            ("model", '{"model": "\\udfff", "prompt": [1, 2]}'),
            ("cache_salt", '{"model": "tiny", "prompt": [1, 2], "cache_salt": "\\ud83d"}'),
            ("messages", '{"model": "tiny", "messages": [{"role": "user", '
                         '"content": "\\udc00"}]}')):
        path = "/v1/chat/completions" if field == "messages" else "/v1/completions"
        _error(_post(server, body.encode(), path=path), 400, param=field,
               code="invalid_unicode")
    assert server.engine_state()[1] == 0


# -- bounds: output tokens, sequences, the context --------------------------------------------

def test_output_sequence_and_context_bounds(server):
    r = _post(server, {"model": "tiny", "prompt": [[1, 2], [3, 4]], "n": 3,
                       "max_tokens": OUT_LIMIT // 6 + 1})
    err = _error(r, 400, param="max_tokens", code="too_many_output_tokens")
    assert "'n'=3" in err["message"] and "2 prompt(s)" in err["message"]
    r = _post(server, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                       "n": 5}, path="/v1/chat/completions")
    # the default max_tokens (the rest of the context) counts too
    _error(r, 400, param="max_tokens", code="too_many_output_tokens")
    # More sequences than the running batch plus the waiting queue: never admissible,
    # so a 400 (not a 503 to retry).
    r = _post(server, {"model": "tiny", "prompt": [1, 2], "n": MAX_SEQS + MAX_WAITING + 1,
                       "max_tokens": 1})
    _error(r, 400, param="n", code="too_many_sequences")
    r = _post(server, {"model": "tiny", "prompt": [1, 2], "n": MAX_SEQS + MAX_WAITING,
                       "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_SEQS + MAX_WAITING

    # A prompt that fills the context: refused with or without max_tokens (as vLLM).
    full = _prompt(1, MAX_LEN)
    for extra in ({}, {"max_tokens": 1}):
        _error(_post(server, {"model": "tiny", "prompt": full, **extra}), 400,
               code="context_length_exceeded")
    r = _post(server, {"model": "tiny", "prompt": full[:-1]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    models = httpx.get(server.url + "/v1/models", headers=AUTH).json()
    assert models["data"][0]["max_model_len"] == MAX_LEN
    server.wait_idle()


def test_refuses_to_start_when_the_pool_cannot_hold_max_model_len():
    fits = types.SimpleNamespace(max_model_len=1024, block_size=16, num_blocks=64)
    assert pool_fit_error(fits) is None
    msg = pool_fit_error(types.SimpleNamespace(max_model_len=1025, block_size=16,
                                               num_blocks=64))
    assert "--max-model-len" in msg and "--num-blocks" in msg and "1024" in msg


# -- sampling values at their extremes --------------------------------------------------------

EXTREMES = [
    ("top_k", 2 ** 31), ("top_k", 2 ** 63), ("top_k", 2 ** 80), ("top_k", -2),
    ("top_k", 2 ** 31 - 1), ("top_p", 1e-46), ("top_p", 5e-324), ("top_p", 1e-30),
    ("temperature", 1e-45), ("temperature", 5e-324), ("temperature", 65536.0),
    ("temperature", 65537), ("temperature", 1e308), ("seed", 2 ** 32), ("seed", -1),
    ("seed", 2 ** 32 - 1), ("max_tokens", 2 ** 31), ("max_tokens", 2 ** 63), ("n", 2 ** 31),
    ("priority", 2 ** 63), ("priority", -2 ** 63 - 1), ("priority", 2 ** 63 - 1),
    ("stop_token_ids", [2 ** 63]), ("stop_token_ids", [2 ** 63 - 1]),
    ("logit_bias", {"1": 100}), ("presence_penalty", 1e308), ("frequency_penalty", -1e308),
    ("repetition_penalty", 0), ("min_p", 1), ("min_tokens", 2 ** 31), ("best_of", 2 ** 31),
    ("temperature", "NaN"), ("temperature", "Infinity"), ("top_p", "NaN"),
]


def test_extreme_sampling_values_never_hurt_other_clients_or_the_cache(server):
    """Each extreme is a 400 / 422 naming its field, or served; meanwhile another
    client's stream gives the tokens it gives alone, and nothing cached is dropped."""
    prefix = _prompt(10, 3 * BLOCK)
    victim = {"model": "tiny", "prompt": prefix + [5, 6, 7], "max_tokens": 60,
              "temperature": 0.7, "seed": 3, "ignore_eos": True, "stream": True}

    def stream_tokens(body):
        ids = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH,
                          timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    ids += chunk["choices"][0]["token_ids"]
        return ids

    server.wait_idle()
    assert _post(server, b"", path="/reset_prefix_cache").status_code == 200  # no pressure
    alone = stream_tokens(victim)
    server.wait_idle()
    cached_before = set(server.engine_state()[2])
    assert len(cached_before) >= 3
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("ids", stream_tokens(victim)))
    t.start()
    for field, value in EXTREMES:
        body = {"model": "tiny", "prompt": prefix + [9, 9], "max_tokens": 2,
                field: value}
        text = json.dumps(body).replace('"NaN"', "NaN").replace('"Infinity"', "Infinity")
        r = _post(server, text)
        assert r.status_code in (200, 400, 422), (field, value, r.text)
        if r.status_code != 200:
            err = _error(r, r.status_code)
            assert err["param"] == field, (field, value, err)
        else:
            assert all(c["finish_reason"] == "length" for c in r.json()["choices"])
    t.join(120)
    assert got["ids"] == alone
    assert server.serving.alive
    server.wait_idle()
    assert cached_before <= set(server.engine_state()[2])
    # A request that once overflowed the step is now refused at the boundary, by name.
    err = _error(_post(server, {"model": "tiny", "prompt": [1, 2], "top_k": 2 ** 31}),
                 400, param="top_k")
    assert "2147483647" in err["message"]


# -- streams with more choices than the running batch -------------------------------------

def _open_stream(server, body, timeout=120):
    client = httpx.Client(timeout=httpx.Timeout(timeout))
    cm = client.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH)
    r = cm.__enter__()
    assert r.status_code == 200, r.read()
    return client, cm, r.iter_lines()


def _first_chunk(lines):
    for line in lines:
        if line.startswith("data: {"):
            return json.loads(line[6:])
    raise AssertionError("the stream ended without a chunk")


def test_stream_with_n_above_max_num_seqs_starts_at_once_and_aborts_when_left(server):
    long = {"model": "tiny", "max_tokens": MAX_LEN - 8, "seed": 0, "ignore_eos": True,
            "stream": True}
    before = _metric(server, ABORTED)
    # One slot taken by a blocker; two choices: one runs, one waits.
    blocker = _open_stream(server, {**long, "prompt": _prompt(20, 8)})
    _first_chunk(blocker[2])
    many = _open_stream(server, {**long, "prompt": _prompt(21, 8), "n": 2})
    chunk = _first_chunk(many[2])
    # The first chunk came while its first choice runs (not after it finished).
    assert chunk["choices"][0]["index"] == 0 and chunk["choices"][0]["finish_reason"] is None
    assert server.engine_state()[1] == 3  # blocker + both choices unfinished
    many[1].__exit__(None, None, None)  # the client leaves: both choices aborted
    many[0].close()
    _wait(lambda: _metric(server, ABORTED) - before >= 2, "the left stream's choices")

    # Both slots taken; a stream of three choices whose client leaves before its first
    # chunk: all three are aborted while the blockers still run.
    second = _open_stream(server, {**long, "prompt": _prompt(22, 8)})
    _first_chunk(second[2])
    with httpx.Client(timeout=httpx.Timeout(60, read=0.5)) as h:
        with pytest.raises(httpx.ReadTimeout):
            with h.stream("POST", server.url + "/v1/completions", headers=AUTH,
                          json={**long, "prompt": _prompt(23, 8), "n": 3}) as r:
                r.read()
    _wait(lambda: _metric(server, ABORTED) - before >= 5,
          "a stream whose client left before the first chunk was not aborted")
    assert server.serving.num_waiting() == 0
    assert server.engine_state()[1] == 2  # the blockers alone
    for client, cm, _ in (blocker, second):
        cm.__exit__(None, None, None)
        client.close()
    server.wait_idle()
    assert _metric(server, ABORTED) - before == 7


# -- miss reasons: no tenant learns of another's cache -----------------------------------------

def test_miss_reasons_are_the_same_whether_another_tenant_cached_the_prompt(server):
    def reasons(prompt, salt):
        r = _post(server, {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                           "cache_salt": salt})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["prefixcache_block_miss_reasons"]

    cached_by_a, never = _prompt(30, 2 * BLOCK + 3), _prompt(31, 2 * BLOCK + 3)
    reasons(cached_by_a, "tenant-a")
    guess_cached, guess_not = reasons(cached_by_a, "tenant-b"), reasons(never, "tenant-b")
    assert guess_cached == guess_not == {"cold": 2, "partial": 1}
    server.wait_idle()
    text = httpx.get(server.url + "/metrics").text
    assert 'reason="isolated"' not in text and 'reason="cold"' in text
    # the operator's in-process figures keep the reason
    per = server.on_engine(lambda e: e.metrics().miss_reasons["per_tenant"]["tenant-b"])
    assert per["isolated"] == 2


# -- KV events bind loopback unless told otherwise ---------------------------------------------

def test_kv_events_wildcard_binds_loopback_by_default():
    pytest.importorskip("zmq")
    from prefixcache.serve.kv_events import KVEventPublisher, with_bind_host

    assert parse_args(["serve", "tiny"]).kv_events_bind_host == "127.0.0.1"
    assert with_bind_host("tcp://*:5557", "127.0.0.1") == "tcp://127.0.0.1:5557"
    assert with_bind_host("tcp://*:5557", "::1") == "tcp://[::1]:5557"
    assert with_bind_host("tcp://*:5557", "*") == "tcp://*:5557"
    assert with_bind_host("ipc:///tmp/x", "127.0.0.1") == "ipc:///tmp/x"
    pub = KVEventPublisher.from_endpoint("tcp://*:0", replay_endpoint="tcp://*:0")
    try:
        assert pub.endpoint.startswith("tcp://127.0.0.1:")
        assert pub.replay_endpoint.startswith("tcp://127.0.0.1:")
    finally:
        pub.close()
    with pytest.raises(ValueError, match="bind_host"):
        KVEventPublisher.from_endpoint("tcp://*:0", bind_host="")
    with pytest.raises(SystemExit):
        parse_args(["serve", "tiny", "--kv-events-bind-host", "a b"])


def test_an_internal_failure_is_still_an_openai_error_object(server):
    from starlette.testclient import TestClient

    class Broken:
        stop_token_ids = ()

        def encode(self, text, add_special_tokens=True):
            raise RuntimeError("tokenizer bug")

    app = build_app(server.serving.engine, served_model_name="tiny", tokenizer=Broken())
    with TestClient(app, raise_server_exceptions=False) as c:  # (its loop never starts)
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
    err = _error(r, 500, code="internal_error")
    assert err["type"] == "internal_server_error" and "RuntimeError" in err["message"]
