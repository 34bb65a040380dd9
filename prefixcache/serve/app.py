"""The OpenAI-compatible HTTP API (FastAPI) over the engine core.

    from prefixcache.serve.app import build_app
    app = build_app(engine, served_model_name="tiny")   # app.state.serving: the loop
    app.state.serving.start(); uvicorn.run(app, host="127.0.0.1", port=8000)

    # or the engine in its own process (what `prefixcache serve` does by default):
    client = EngineCoreClient(parse_args(["serve", "tiny"]))   # returns once ready
    app = build_app(client, served_model_name="tiny")

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream`),
`GET /v1/models`, `GET /health`, `GET /metrics`, `POST /reset_prefix_cache`. Errors
are OpenAI's `{"error": {"message", "type", "param", "code"}}` (see `protocol`).

With `api_keys`, every `/v1` route and `/reset_prefix_cache` need `Authorization:
Bearer <key>` (401 otherwise); `/health` and `/metrics` stay open, as vLLM's. Request
bodies must be `application/json` (415: a form or `text/plain` post, which a browser
page may send cross-site without a CORS preflight, is refused) of at most
`max_request_body_bytes` (413).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixcache.serve.engine_loop import (EngineCall, EngineCoreError, EngineFrontEnd,
                                           ServingEngine)
from prefixcache.serve.metrics import ServerMetrics
from prefixcache.serve.protocol import (APIError, GenerationRequest, ServerContext,
                                        check_json_body, client_miss_reasons, parse_request)

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2 ** 20  # 32 MiB: a long prompt as JSON ids fits


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


class _Choice:
    """One choice's decoding state on the handler side (detokenizer, stop strings)."""

    __slots__ = ("index", "prompt_index", "request_id", "detok", "token_ids", "text",
                 "finish_reason", "cached_tokens", "done", "stopped_by_string", "error",
                 "miss_reasons", "error_status")

    def __init__(self, index, prompt_index, request_id, detok):
        self.index, self.prompt_index, self.request_id = index, prompt_index, request_id
        self.detok = detok
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.cached_tokens = 0
        self.miss_reasons: dict | None = None
        self.done = False
        self.stopped_by_string = False
        self.error: str | None = None
        self.error_status = 400  # 500: the engine failed (not the request's fault)

    def push(self, ids) -> str:
        """New text of `ids` ("" without a tokenizer); ends the choice on a stop string."""
        if self.stopped_by_string or not ids:
            return ""
        if self.detok is None:
            self.token_ids.extend(ids)
            return ""
        delta = []
        for t in ids:  # token by token: the stop string cuts the token list too
            self.token_ids.append(t)
            d = self.detok.push([t])
            if d:
                delta.append(d)
            if self.detok.stopped:
                self.stopped_by_string = True
                self.finish_reason = "stop"
                break
        s = "".join(delta)
        if s:
            self.text.append(s)
        return s

    def finish(self, out) -> str:
        """The rest of the text once the engine finished the request."""
        self.done = True
        self.cached_tokens = out.num_cached_tokens
        self.miss_reasons = out.miss_reasons
        if out.finish_reason == "error":
            self.error = out.error or "the engine rejected the request"
            return ""
        if self.stopped_by_string:
            return ""
        self.finish_reason = out.finish_reason
        s = self.detok.flush() if self.detok is not None else ""
        if s:
            self.text.append(s)
        return s


class _Handler:
    """Serves one validated request: submits its engine requests, collects events."""

    def __init__(self, app_state, gen: GenerationRequest):
        self.s = app_state
        self.gen = gen
        self.created = int(time.time())
        prefix = "chatcmpl" if gen.kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        tok = app_state.ctx.tokenizer
        self.choices: list[_Choice] = []
        calls = []
        for i, prompt in enumerate(gen.prompts):
            for j in range(gen.n):
                k = i * gen.n + j
                detok = None
                if tok is not None:
                    detok = tok.detokenizer(
                        prompt_token_ids=prompt, skip_special_tokens=gen.skip_special_tokens,
                        stop=gen.stop, include_stop_str_in_output=gen.include_stop_str_in_output)
                rid = f"{self.id}-{k}"
                self.choices.append(_Choice(k, i, rid, detok))
                calls.append(EngineCall(rid, list(prompt), gen.params[k], tag=k,
                                        cache_salt=gen.cache_salt, priority=gen.priority,
                                        lora=gen.lora, retention=gen.retention))
        self.queue: asyncio.Queue = asyncio.Queue()
        app_state.serving.submit(calls, asyncio.get_running_loop(), self.queue)
        self.num_open = len(self.choices)

    def abort_open(self) -> None:
        ids = [c.request_id for c in self.choices if not c.done]
        for c in self.choices:
            c.done = True
        self.s.serving.abort(ids)

    def handle(self, event) -> tuple[_Choice, str, bool]:
        """(choice, new text, finished now) of one engine event."""
        c = self.choices[event[0]]
        kind = event[1]
        if kind == "tokens":
            text = c.push(event[2])
            if c.stopped_by_string:
                self.s.serving.abort([c.request_id])  # its final comes with the next step
            return c, text, False
        if kind == "final":
            text = c.push(event[2])
            text += c.finish(event[3])
        else:  # "error": add_request refused it; "failed": the engine failed
            c.done, c.error, text = True, event[2], ""
            if kind == "failed":
                c.error_status = 500
        self.num_open -= 1
        return c, text, True

    def usage(self) -> dict:
        gen = self.gen
        prompt = sum(len(p) for p in gen.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        # NOTE: n choices share a prompt: its cached tokens are those of its first choice.
        firsts = [self.choices[i * gen.n] for i in range(len(gen.prompts))]
        cached = sum(c.cached_tokens for c in firsts)
        details = {"cached_tokens": cached}
        if any(c.miss_reasons is not None for c in firsts):  # serve --miss-reasons
            # NOTE: a vendor extension (OpenAI clients keep unknown fields): missed
            # prompt blocks by reason, summed over the prompts (prefixcache.core.misses).
            misses: dict[str, int] = {}
            for c in firsts:
                for r, v in (client_miss_reasons(c.miss_reasons) or {}).items():
                    misses[r] = misses.get(r, 0) + v
            details["prefixcache_block_miss_reasons"] = misses
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": details}

    def first_error(self) -> str | None:
        for c in self.choices:
            if c.error is not None:
                return c.error
        return None

    # -- non-streaming --------------------------------------------------------------

    async def collect(self) -> dict:
        try:
            while self.num_open:
                c, _, _ = self.handle(await self.queue.get())
                if c.error is not None:
                    raise _choice_error(c, self.gen)
        finally:
            if self.num_open:
                self.abort_open()
        gen = self.gen
        if gen.kind == "chat":
            choices = [{"index": c.index, "message": {"role": "assistant",
                                                      "content": "".join(c.text)},
                        "logprobs": None, "finish_reason": c.finish_reason,
                        "token_ids": c.token_ids} for c in self.choices]
            obj = "chat.completion"
        else:
            choices = [{"index": c.index, "text": "".join(c.text), "logprobs": None,
                        "finish_reason": c.finish_reason, "token_ids": c.token_ids}
                       for c in self.choices]
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": gen.model,
                "choices": choices, "usage": self.usage()}

    # -- streaming ------------------------------------------------------------------

    async def first_events(self) -> list:
        """Waits for the engine's first delivery to this request and what came with it,
        so that an engine rejection is still a 400 (the stream's headers are not sent
        before); the rest streams as it comes.

        NOTE: the engine loop refuses a request (add_request's ValueError, or an
        admission error finishing it at once) in the first delivery after the add,
        before or with the first tokens of any choice: its calls are added in one
        command and the step after it returns the refusals. So the first delivery
        holds every refusal, and waiting for each choice's first event (with n above
        max_num_seqs: until most choices have finished) is not needed.
        """
        buffered = [await self.queue.get()]
        while True:  # the rest of that delivery (put in the queue at once)
            try:
                buffered.append(self.queue.get_nowait())
            except asyncio.QueueEmpty:
                break
        for ev in buffered:
            if ev[1] in ("error", "failed") or (ev[1] == "final"
                                                and ev[3].finish_reason == "error"):
                c = self.choices[ev[0]]
                self.handle(ev)
                if c.error is None:
                    c.error = "the engine rejected the request"
                raise _choice_error(c, self.gen)
        return buffered

    async def start_stream(self) -> list:
        """`first_events`, aborting every open choice if it raises or is cancelled (the
        client left before the first chunk)."""
        try:
            return await self.first_events()
        except BaseException:
            self.abort_open()
            raise

    def _chunk(self, c: _Choice, text: str, finish: str | None, ids, first: bool) -> str:
        gen = self.gen
        if gen.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else (
                {"content": text} if text or finish is None else {})
            choice = {"index": c.index, "delta": delta, "logprobs": None,
                      "finish_reason": finish, "token_ids": ids}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": c.index, "text": text, "logprobs": None,
                      "finish_reason": finish, "token_ids": ids}
            obj = "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": gen.model,
                "choices": [choice]}
        if gen.include_usage:
            body["usage"] = None
        return f"data: {_dumps(body)}\n\n"

    async def stream(self, buffered: list):
        gen = self.gen
        started = set()
        try:
            pending = list(buffered)
            while self.num_open:
                ev = pending.pop(0) if pending else await self.queue.get()
                c = self.choices[ev[0]]
                if c.done:
                    continue
                before = len(c.token_ids)
                c, text, finished = self.handle(ev)
                ids = c.token_ids[before:]
                if c.error is not None:  # a failure after the stream began
                    err = APIError(500, c.error, code="engine_error").body()
                    yield f"data: {_dumps(err)}\n\n"
                    self.abort_open()
                    break
                first = c.index not in started
                started.add(c.index)
                if finished:
                    yield self._chunk(c, text, c.finish_reason, ids, first)
                elif text or ids or first:
                    yield self._chunk(c, text, None, ids, first)
            else:
                if gen.include_usage:
                    body = {"id": self.id, "object": ("chat.completion.chunk"
                                                      if gen.kind == "chat"
                                                      else "text_completion"),
                            "created": self.created, "model": gen.model, "choices": [],
                            "usage": self.usage()}
                    yield f"data: {_dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            # A client that left mid-stream (the generator is closed or cancelled): its
            # requests are aborted and their blocks freed by the engine thread.
            if self.num_open:
                self.abort_open()


async def _listen_for_disconnect(request: Request) -> None:
    """Returns when the client's connection closes (the body is already read, so the
    next ASGI message is ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, coro):
    """``await coro`` unless the client leaves first (vLLM's ``with_cancellation``): then
    ``coro`` is cancelled -- its ``finally`` aborts the open requests, so the engine
    frees their blocks -- and a 499 (client closed request) no one reads is returned."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_listen_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # its finally has run
    return Response(status_code=499)


_PROTECTED_PREFIXES = ("/v1/", "/reset_prefix_cache")


class _APIKeyMiddleware:
    """vLLM's `--api-key` check as plain ASGI middleware (no body buffering: streams and
    the disconnect watch are untouched): `/v1` routes and `/reset_prefix_cache` need
    `Authorization: Bearer <one of keys>`; a 401 OpenAI error object otherwise."""

    def __init__(self, app, keys):
        self.app = app
        self.keys = [k.encode() for k in keys]

    def _authorized(self, scope) -> bool:
        got = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                got = value
                break
        if got is None or not got[:7].lower() == b"bearer ":
            return False
        token = got[7:].strip()
        ok = False
        for k in self.keys:  # every key compared (constant time each)
            ok |= secrets.compare_digest(token, k)
        return ok

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope["method"] == "OPTIONS"
                or not (scope["path"] + "/").startswith(_PROTECTED_PREFIXES)
                or self._authorized(scope)):
            return await self.app(scope, receive, send)
        err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer "
                            "<key>' (the key the server was started with, --api-key)",
                       code="invalid_api_key")
        resp = JSONResponse(err.body(), status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})
        await resp(scope, receive, send)


def _param(gen: GenerationRequest) -> str:
    return "messages" if gen.kind == "chat" else "prompt"


def _choice_error(c: _Choice, gen: GenerationRequest) -> APIError:
    if c.error_status >= 500:
        return APIError(c.error_status, c.error, code="engine_failed")
    return APIError(c.error_status, c.error, param=_param(gen), code="engine_error")


class _State:
    def __init__(self, serving: EngineFrontEnd, ctx: ServerContext, metrics: ServerMetrics):
        self.serving, self.ctx, self.metrics = serving, ctx, metrics
        self.created = int(time.time())


def build_app(engine, *, served_model_name: str = "model", tokenizer: Any = "engine",
              lora_modules: Mapping[str, Any] | None = None, max_waiting: int | None = None,
              kv_event_publisher=None, serving: ServingEngine | None = None,
              api_keys=None,
              max_request_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES,
              max_request_output_tokens: int | None = None):
    """The FastAPI app serving `engine` (its front end in `app.state.serving`).

    Args:
      engine: a `prefixcache.engine.Engine` (served from a thread of this process:
        `ServingEngine`, not started), or a running
        `prefixcache.serve.engine_loop.EngineCoreClient` (the engine in its own process).
      served_model_name: the base model's name in requests and `/v1/models`.
      tokenizer: a tokenizer (see `prefixcache.text.Tokenizer`), None (token-id prompts
        only), or "engine" (default): the engine's tokenizer when it has one.
      lora_modules: LoRA module name -> `prefixcache.LoRARequest` (needs an engine
        built with `enable_lora=True`).
      max_waiting, kv_event_publisher: see `ServingEngine` (an `EngineCoreClient` has
        its own).
      serving: an existing ServingEngine over `engine` (then max_waiting and
        kv_event_publisher must not be given).
      api_keys: None or a list of non-empty strings: `/v1` routes and
        `/reset_prefix_cache` then need `Authorization: Bearer <one of them>` (401).
      max_request_body_bytes: the largest request body (413 beyond); None: no bound.
      max_request_output_tokens: the most output tokens one request may ask for,
        prompts x n x max_tokens (400 naming the fields beyond); None: no bound.
    """
    keys = list(api_keys or ())
    if any(not isinstance(k, str) or not k for k in keys):
        raise ValueError("api_keys must be non-empty strings")
    for name, v in (("max_request_body_bytes", max_request_body_bytes),
                    ("max_request_output_tokens", max_request_output_tokens)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")
    if isinstance(engine, EngineFrontEnd):
        if serving is not None or kv_event_publisher is not None or max_waiting is not None:
            raise ValueError("with an engine-core client, give max_waiting and the KV "
                             "events publisher to the client, not to build_app")
        serving, engine = engine, None
    elif serving is not None and serving.engine is not engine:
        raise ValueError("serving must wrap the same engine")
    if serving is None:
        serving = ServingEngine(engine, max_waiting=max_waiting,
                                kv_event_publisher=kv_event_publisher)
    info = serving.info
    if tokenizer == "engine":
        tokenizer = serving.tokenizer
    lora_modules = dict(lora_modules or {})
    if lora_modules and not info["enable_lora"]:
        raise ValueError("lora_modules need an engine built with enable_lora=True")
    if served_model_name in lora_modules:
        raise ValueError(f"LoRA module name {served_model_name!r} is the base model's name")
    metrics = ServerMetrics(served_model_name)
    serving.metrics = metrics
    metrics.set_programs(info["num_programs_built"], info["num_compiles_after_warmup"])
    if getattr(serving, "residency", None) is not None:
        # (the engine's histograms as its output batches carry them, either mode)
        metrics.watch_residency(serving.residency.summary)
    # A request of more sequences than the running batch plus the waiting queue can
    # never be admitted (it would get a 503 on an idle server): a 400 instead.
    waiting = getattr(serving, "max_waiting", None)
    most = None if waiting is None else int(info["max_num_seqs"]) + waiting
    ctx = ServerContext(served_model_name=served_model_name, lora_modules=lora_modules,
                        tokenizer=tokenizer, max_model_len=int(info["max_model_len"]),
                        vocab_size=int(info["vocab_size"]),
                        max_request_output_tokens=max_request_output_tokens,
                        max_request_choices=most)
    state = _State(serving, ctx, metrics)
    app = FastAPI(title="prefixcache", docs_url=None, redoc_url=None)
    if keys:
        app.add_middleware(_APIKeyMiddleware, keys=keys)
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.ctx = ctx

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request, exc: Exception):
        # A bug, not the request's fault: still an OpenAI error object (logged by
        # Starlette's server-error middleware, which calls this handler).
        return JSONResponse(APIError(500, f"internal server error: {type(exc).__name__}",
                                     code="internal_error").body(), status_code=500)

    async def _body(request: Request):
        ctype = request.headers.get("content-type", "")
        if ctype.split(";", 1)[0].strip().lower() != "application/json":
            raise APIError(415, "the request body must be JSON sent as 'Content-Type: "
                                f"application/json', got {ctype[:100]!r}",
                           code="unsupported_media_type")
        limit = max_request_body_bytes
        too_large = APIError(413, f"the request body is larger than {limit} bytes (the "
                                  "server's bound, --max-request-body-bytes)",
                             code="request_too_large")
        length = request.headers.get("content-length", "")
        if limit is not None and length.isdigit() and int(length) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():  # counted as it comes, never buffered past
            size += len(chunk)
            if limit is not None and size > limit:
                raise too_large
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", param=None,
                           code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "the request body is not valid JSON: nested too deeply",
                           param=None, code="too_deep") from None
        check_json_body(body)
        return body

    async def _generate(kind: str, request: Request):
        gen = parse_request(kind, await _body(request), ctx)
        h = _Handler(state, gen)
        if not gen.stream:
            # A non-streaming client that leaves is noticed at once (not when its
            # requests finish): its requests are aborted and their blocks freed.
            body = await _unless_disconnected(request, h.collect())
            return body if isinstance(body, Response) else JSONResponse(body)
        # The client may leave before the first chunk: then every choice is aborted.
        buffered = await _unless_disconnected(request, h.start_stream())
        if isinstance(buffered, Response):
            return buffered
        return StreamingResponse(h.stream(buffered), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate("completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate("chat", request)

    @app.get("/v1/models")
    async def models():
        base = {"id": served_model_name, "object": "model", "created": state.created,
                "owned_by": "prefixcache", "root": served_model_name, "parent": None,
                "max_model_len": ctx.max_model_len}
        loras = [{"id": name, "object": "model", "created": state.created,
                  "owned_by": "prefixcache", "root": getattr(lo, "path", name),
                  "parent": served_model_name, "max_model_len": ctx.max_model_len}
                 for name, lo in lora_modules.items()]
        return {"object": "list", "data": [base, *loras]}

    @app.get("/health")
    async def health():
        if not serving.alive:
            raise APIError(503, "the engine is not running"
                           + ("" if serving.failure is None else f": {serving.failure}"),
                           code="unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    async def _utility(method: str, *args):
        try:
            return await asyncio.wrap_future(serving.utility(method, *args))
        except EngineCoreError as e:
            raise APIError(503 if not serving.alive else 500, str(e),
                           code="unavailable" if not serving.alive else "engine_error"
                           ) from None

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        ok = await _utility("reset_prefix_cache")
        if not ok:
            raise APIError(409, "the prefix cache was not reset: KV blocks are held by "
                                "unfinished requests (retry when the server is idle)",
                           code="blocks_in_use", type="conflict_error")
        return {"reset": True}

    return app
