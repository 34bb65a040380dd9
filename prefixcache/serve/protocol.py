"""Request bodies of the OpenAI API (and vLLM's extensions) -> validated engine requests.

Every check here runs before anything reaches the engine: a bad request raises
`APIError` (an OpenAI-style error object naming the field) and changes nothing.

Status codes: 400 for a value the API does not accept (out of range, too long for the
context, an option the engine does not implement, a batch the server can never admit),
422 for a field of the wrong JSON type, 404 for an unknown model (base name or LoRA
module), 503 when the waiting queue is full or the server is shutting down. Every
number is range-checked against what the model step can represent (int32 / float32
arrays), so no request can fail a step that other requests share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from prefixcache.engine.sampling_params import SamplingParams

MAX_N = 128  # most choices per prompt (n)
_INT32_MAX = 2 ** 31 - 1  # the step's top_k row is int32
_INT64 = 2 ** 63  # priority and stop token ids: what a host-side int64 array holds
MAX_TEMPERATURE = 2.0 ** 16
_ROLES = ("system", "user", "assistant", "tool", "developer")


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _default_type(self.status)
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _default_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "internal_server_error"
    return "invalid_request_error"


@dataclasses.dataclass(frozen=True)
class ServerContext:
    """What request validation needs to know about the served model.

    Attributes:
      served_model_name: the base model's name (`model` in requests).
      lora_modules: LoRA module name -> `prefixcache.LoRARequest`.
      tokenizer: a `prefixcache.text.Tokenizer`-like object, or None (token-id
        prompts only).
      max_model_len: the engine's longest request (prompt + output).
      vocab_size: the model's vocabulary (token ids must be below it).
      max_request_output_tokens: the most output tokens one request may ask for in
        all (prompts x n x max_tokens; `serve --max-request-output-tokens`); None: no
        bound.
      max_request_choices: the most engine requests (prompts x n) one request may
        make: more could never be admitted at once (the running batch plus the waiting
        queue's bound); None: no bound.
    """

    served_model_name: str
    lora_modules: Mapping[str, Any]
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    max_request_output_tokens: int | None = None
    max_request_choices: int | None = None


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One validated completions / chat request.

    Attributes:
      kind: "completion" or "chat".
      model: the `model` asked for (echoed in responses).
      prompts: token ids of each prompt (chat: one, the rendered template).
      n: choices per prompt; choice `i * n + j` is prompt i's j-th.
      params: SamplingParams of each choice (len(prompts) * n).
      stream, include_usage: SSE streaming and its final usage chunk.
      stop: stop strings (applied by the detokenizer); include_stop_str_in_output and
        skip_special_tokens as vLLM's.
      cache_salt, priority, lora: forwarded to `Engine.add_request`.
      retention: the client's retention hints (`RetentionHints`, from the extra body
        field ``retention``: ``{"priority", "ttl_s", "ttl_steps", "keep_range",
        "session_end"}``), forwarded to `Engine.add_request`; None when absent.
    """

    kind: str
    model: str
    prompts: tuple[tuple[int, ...], ...]
    n: int
    params: tuple[SamplingParams, ...]
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    cache_salt: str | None
    priority: int
    lora: Any
    retention: Any = None


def client_miss_reasons(reasons: Mapping[str, int] | None) -> dict[str, int] | None:
    """Miss reasons as a client (and `/metrics`) may see them: ``isolated`` folded into
    ``cold``.

    NOTE: ``isolated`` means "these tokens are cached under another cache salt or
    adapter": shown to a client it tells whether another tenant's prompt is cached (a
    membership oracle without timing, which defeats ``cache_salt``). ``cold`` is what
    the client's own cache namespace says of those blocks (its own key was never
    cached: ``evicted`` takes precedence over ``isolated``, so no other reason changes).
    `/metrics` is open (as vLLM's), so its counter folds them too; per-tenant series
    would not help, since a tenant's own series would still carry the bit. The
    engine's own figures (`Engine.metrics`, in-process replays) keep ``isolated``.
    """
    if reasons is None:
        return None
    out = dict(reasons)
    iso = out.pop("isolated", 0)
    if iso:
        out["cold"] = out.get("cold", 0) + iso
    return out


_MISSING = object()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _typed(body: Mapping, name: str, check, what: str, default=None):
    """body[name] if present and not null (422 unless `check` accepts it), else default."""
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not check(v):
        raise APIError(422, f"'{name}' must be {what}, got {v!r}", param=name,
                       code="invalid_type")
    return v


def _bad(name: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=name, code=code)


def _retention(body: Mapping[str, Any]):
    """The extra body field ``retention`` (as vLLM's ``cache_salt``: not OpenAI's) as
    `RetentionHints`, or None; a bad one is a 400 naming the field."""
    from prefixcache.core.request import RetentionHints  # noqa: PLC0415

    value = body.get("retention")
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _bad("retention", "'retention' must be an object with some of 'priority', "
                   "'ttl_s', 'ttl_steps', 'keep_range', 'session_end'")
    pr = value.get("priority", 0)
    if _is_int(pr) and not -_INT64 <= pr < _INT64:
        raise _bad("retention", f"'retention.priority' must be in [-2**63, 2**63), got {pr}")
    try:
        return RetentionHints.from_dict(dict(value))
    except (TypeError, ValueError) as e:
        raise _bad("retention", f"'retention': {e}") from None


MAX_JSON_DEPTH = 64  # deepest nesting of arrays / objects a request body may have


def check_json_body(body: Any) -> None:
    """Refuses a parsed request body nested deeper than `MAX_JSON_DEPTH` or holding a
    string that is not valid Unicode (a lone surrogate such as ``"\\ud800"``, which JSON
    escapes allow but neither UTF-8 nor a tokenizer can carry).

    Raises:
      APIError: 400 naming the top-level field it was found under.
    """
    stack = [(body, 1, None)]
    while stack:
        v, depth, field = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise _bad(field, "the request body holds a string with a lone surrogate "
                                  f"(not valid Unicode){'' if field is None else f' in {field!r}'}",
                           code="invalid_unicode") from None
        elif isinstance(v, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                raise _bad(field, f"the request body is nested deeper than {MAX_JSON_DEPTH} "
                                  "levels", code="too_deep")
            if isinstance(v, dict):
                for k, x in v.items():
                    f = k if depth == 1 and isinstance(k, str) and k.isascii() else field
                    stack.append((k, depth, f))
                    if not isinstance(x, (int, float, bool)) and x is not None:
                        stack.append((x, depth + 1, f))
            else:
                stack.extend((x, depth + 1, field) for x in v
                             if not isinstance(x, (int, float, bool)) and x is not None)


def _resolve_model(body: Mapping, ctx: ServerContext) -> tuple[str, Any]:
    model = _typed(body, "model", lambda v: isinstance(v, str), "a string",
                   default=ctx.served_model_name)
    if model == ctx.served_model_name:
        return model, None
    if model in ctx.lora_modules:
        return model, ctx.lora_modules[model]
    names = [ctx.served_model_name, *ctx.lora_modules]
    raise APIError(404, f"The model `{model}` does not exist (served: {names}; a LoRA "
                        "module must be given at start-up with --lora-modules)",
                   param="model", code="model_not_found")


def _check_tokens(name: str, ids: list, ctx: ServerContext) -> tuple[int, ...]:
    if not ids:
        raise _bad(name, f"'{name}' is empty")
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise APIError(422, f"'{name}' token ids must be ints, got {t!r} at position {i}",
                           param=name, code="invalid_type")
        if not 0 <= t < ctx.vocab_size:
            raise _bad(name, f"'{name}' token id {t} at position {i} is outside the "
                             f"vocabulary [0, {ctx.vocab_size})")
    return tuple(ids)


def _need_tokenizer(ctx: ServerContext, name: str, what: str):
    if ctx.tokenizer is None:
        raise _bad(name, f"model `{ctx.served_model_name}` has no tokenizer, so {what}; "
                         "send the prompt as a list of token ids", code="no_tokenizer")
    return ctx.tokenizer


def _completion_prompts(body: Mapping, ctx: ServerContext) -> list[tuple[int, ...]]:
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise _bad("prompt", "'prompt' is required", code="missing_field")
    if isinstance(prompt, str):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list):
        if not prompt:
            raise _bad("prompt", "'prompt' is empty")
        items = prompt
    else:
        raise APIError(422, "'prompt' must be a string, a list of token ids, or a list of "
                            f"either, got {type(prompt).__name__}", param="prompt",
                       code="invalid_type")
    out = []
    for item in items:
        if isinstance(item, str):
            tok = _need_tokenizer(ctx, "prompt", "text prompts cannot be encoded")
            if not item:
                raise _bad("prompt", "'prompt' holds an empty string")
            out.append(_check_tokens("prompt", list(tok.encode(item)), ctx))
        elif isinstance(item, list):
            out.append(_check_tokens("prompt", item, ctx))
        else:
            raise APIError(422, "'prompt' items must be strings or token-id lists, got "
                                f"{item!r}", param="prompt", code="invalid_type")
    return out


def _message_text(i: int, content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, Mapping) and p.get("type") == "text"
                    and isinstance(p.get("text"), str)):
                raise _bad("messages", f"messages[{i}].content: only text parts "
                                       "({\"type\": \"text\", \"text\": ...}) are supported, "
                                       f"got {p!r}")
            parts.append(p["text"])
        return "".join(parts)
    raise APIError(422, f"messages[{i}].content must be a string or a list of text parts",
                   param="messages", code="invalid_type")


def _chat_prompt(body: Mapping, ctx: ServerContext) -> tuple[int, ...]:
    messages = body.get("messages", _MISSING)
    if messages is _MISSING or messages is None:
        raise _bad("messages", "'messages' is required", code="missing_field")
    if not isinstance(messages, list):
        raise APIError(422, "'messages' must be a list of message objects",
                       param="messages", code="invalid_type")
    if not messages:
        raise _bad("messages", "'messages' is empty")
    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise APIError(422, f"messages[{i}] must be an object", param="messages",
                           code="invalid_type")
        role = m.get("role")
        if role not in _ROLES:
            raise _bad("messages", f"messages[{i}].role must be one of {list(_ROLES)}, "
                                   f"got {role!r}")
        content = m.get("content")
        msg = {**m, "content": "" if content is None else _message_text(i, content)}
        msgs.append(msg)
    tok = _need_tokenizer(ctx, "messages", "chat messages cannot be rendered")
    tools = _typed(body, "tools", lambda v: isinstance(v, list), "a list")
    kwargs = _typed(body, "chat_template_kwargs", lambda v: isinstance(v, Mapping),
                    "an object", default={})
    add_gen = _typed(body, "add_generation_prompt", lambda v: isinstance(v, bool),
                     "a boolean", default=True)
    try:
        text = tok.apply_chat_template(msgs, add_generation_prompt=add_gen, tokenize=False,
                                       tools=tools, **dict(kwargs))
    except Exception as e:  # a template error is the request's (its messages / kwargs)
        raise _bad("messages", f"the chat template failed on these messages: "
                               f"{type(e).__name__}: {e}") from None
    # NOTE: as vLLM: the template already wrote the special tokens (BOS & co).
    return _check_tokens("messages", list(tok.encode(text, add_special_tokens=False)), ctx)


def _stop_strings(body: Mapping, ctx: ServerContext) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(422, "'stop' must be a string or a list of strings", param="stop",
                       code="invalid_type")
    if any(not s for s in stop):
        raise _bad("stop", "'stop' holds an empty string")
    if stop:
        _need_tokenizer(ctx, "stop", "stop strings cannot be matched")
    return tuple(stop)


def _refuse_unsupported(body: Mapping, kind: str) -> None:
    """Options the engine does not implement: accepted at their neutral value only."""
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0),
                          ("repetition_penalty", 1), ("min_p", 0), ("min_tokens", 0)):
        v = body.get(name)
        if v is not None and v != neutral:
            raise _bad(name, f"'{name}' is not supported by this engine (only {neutral})",
                       code="unsupported")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "'logit_bias' is not supported by this engine",
                   code="unsupported")
    lp = body.get("logprobs")
    if lp not in (None, False, 0) or body.get("top_logprobs"):
        raise _bad("logprobs", "logprobs are not supported by this engine",
                   code="unsupported")
    if kind == "completion":
        if body.get("echo"):
            raise _bad("echo", "'echo' is not supported by this engine", code="unsupported")
        if body.get("suffix"):
            raise _bad("suffix", "'suffix' is not supported by this engine",
                       code="unsupported")


def parse_request(kind: str, body: Any, ctx: ServerContext) -> GenerationRequest:
    """Validates a completions (`kind="completion"`) or chat (`"chat"`) request body.

    Raises:
      APIError: the first problem found (its field in `.param`).
    """
    if not isinstance(body, Mapping):
        raise APIError(422, f"the request body must be a JSON object, got "
                            f"{type(body).__name__}", code="invalid_type")
    model, lora = _resolve_model(body, ctx)
    _refuse_unsupported(body, kind)
    prompts = _completion_prompts(body, ctx) if kind == "completion" else [_chat_prompt(body, ctx)]
    n = _typed(body, "n", _is_int, "an integer", default=1)
    if not 1 <= n <= MAX_N:
        raise _bad("n", f"'n' must be in [1, {MAX_N}], got {n}")
    best_of = _typed(body, "best_of", _is_int, "an integer")
    if best_of is not None and best_of != n:
        raise _bad("best_of", "'best_of' other than n is not supported", code="unsupported")
    max_tokens = _typed(body, "max_tokens", _is_int, "an integer")
    name = "max_tokens"
    if kind == "chat":
        mct = _typed(body, "max_completion_tokens", _is_int, "an integer")
        if mct is not None:
            max_tokens, name = mct, "max_completion_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise _bad(name, f"'{name}' must be at least 1, got {max_tokens}")
    longest = max(len(p) for p in prompts)
    pname = "messages" if kind == "chat" else "prompt"
    if longest > ctx.max_model_len or (max_tokens is None and longest == ctx.max_model_len):
        # NOTE: as vLLM: without max_tokens a prompt must leave room for one output
        # token (so it is refused exactly when an explicit max_tokens of 1 is).
        raise _bad(pname, f"This model's maximum context length is {ctx.max_model_len} "
                          f"tokens. However, your prompt has {longest} tokens"
                          + ("" if longest > ctx.max_model_len else
                             ", which leaves no room for the completion")
                          + ". Please reduce the length of the prompt.",
                   code="context_length_exceeded")
    if max_tokens is None:
        # OpenAI's completions default (16); chat: the rest of the context (vLLM's).
        max_tokens = (min(16, ctx.max_model_len - longest) if kind == "completion"
                      else ctx.max_model_len - longest)
    elif longest + max_tokens > ctx.max_model_len:
        raise _bad(name, f"This model's maximum context length is {ctx.max_model_len} "
                         f"tokens. However, you requested {longest + max_tokens} tokens "
                         f"({longest} in the prompt, {max_tokens} in the completion).",
                   code="context_length_exceeded")
    n_out = len(prompts) * n
    if ctx.max_request_choices is not None and n_out > ctx.max_request_choices:
        raise _bad("n", f"this request makes {n_out} sequences ({len(prompts)} prompt(s) x "
                        f"'n'={n}) but the server can hold at most {ctx.max_request_choices} "
                        "at once (running batch plus waiting queue), so it could never be "
                        "admitted; send fewer prompts or a smaller 'n'",
                   code="too_many_sequences")
    if (ctx.max_request_output_tokens is not None
            and n_out * max_tokens > ctx.max_request_output_tokens):
        raise _bad(name, f"this request asks for up to {n_out * max_tokens} output tokens "
                         f"({len(prompts)} prompt(s) x 'n'={n} x '{name}'={max_tokens}) but "
                         f"the server's bound is {ctx.max_request_output_tokens} per request "
                         "(--max-request-output-tokens); lower 'n' or "
                         f"'{name}'", code="too_many_output_tokens")
    temperature = _typed(body, "temperature", _is_number, "a number", default=1.0)
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise _bad("temperature", f"'temperature' must be in [0, {MAX_TEMPERATURE:g}], "
                                  f"got {temperature}")
    top_p = _typed(body, "top_p", _is_number, "a number", default=1.0)
    if not (0 < top_p <= 1 and np.float32(top_p) > 0):
        raise _bad("top_p", f"'top_p' must be in (0, 1] (and above 0 as a float32), got "
                            f"{top_p}")
    top_k = _typed(body, "top_k", _is_int, "an integer", default=0)
    if not -1 <= top_k <= _INT32_MAX:
        raise _bad("top_k", f"'top_k' must be -1 or 0 (off) or in [1, {_INT32_MAX}], got "
                            f"{top_k}")
    seed = _typed(body, "seed", _is_int, "an integer")
    if seed is not None and not 0 <= seed < 2 ** 32:
        raise _bad("seed", f"'seed' must be in [0, 2**32), got {seed}")
    stop_ids = _typed(body, "stop_token_ids", lambda v: isinstance(v, list)
                      and all(_is_int(t) for t in v), "a list of integers", default=[])
    if any(not 0 <= t < _INT64 for t in stop_ids):
        raise _bad("stop_token_ids", f"'stop_token_ids' must be in [0, 2**63), got "
                                     f"{stop_ids}")
    ignore_eos = _typed(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean",
                        default=False)
    stop = _stop_strings(body, ctx)
    stop_ids = list(stop_ids)
    if ctx.tokenizer is not None and not ignore_eos:
        for t in getattr(ctx.tokenizer, "stop_token_ids", None) or ():
            if t not in stop_ids:
                stop_ids.append(int(t))
    stream = _typed(body, "stream", lambda v: isinstance(v, bool), "a boolean", default=False)
    opts = _typed(body, "stream_options", lambda v: isinstance(v, Mapping), "an object",
                  default={})
    include_usage = _typed(opts, "include_usage", lambda v: isinstance(v, bool), "a boolean",
                           default=False)
    if opts and not stream:
        raise _bad("stream_options", "'stream_options' needs 'stream': true")
    cache_salt = _typed(body, "cache_salt", lambda v: isinstance(v, str), "a string")
    if cache_salt is not None and not cache_salt:
        raise _bad("cache_salt", "'cache_salt' must be a non-empty string")
    priority = _typed(body, "priority", _is_int, "an integer", default=0)
    if not -_INT64 <= priority < _INT64:
        raise _bad("priority", f"'priority' must be in [-2**63, 2**63), got {priority}")
    retention = _retention(body)
    params = []
    for _ in prompts:
        for j in range(n):
            s = seed if seed is None else (seed + j) % 2 ** 32
            try:
                params.append(SamplingParams(
                    max_tokens=int(max_tokens), temperature=float(temperature),
                    top_k=int(top_k), top_p=float(top_p), seed=s,
                    stop_token_ids=tuple(stop_ids)))
            except ValueError as e:  # pragma: no cover - the checks above come first
                raise _bad(None, f"invalid sampling parameters: {e}") from None
    return GenerationRequest(
        kind=kind, model=model, prompts=tuple(prompts), n=n, params=tuple(params),
        stream=stream, include_usage=include_usage, stop=stop,
        include_stop_str_in_output=bool(_typed(
            body, "include_stop_str_in_output", lambda v: isinstance(v, bool), "a boolean",
            default=False)),
        skip_special_tokens=bool(_typed(
            body, "skip_special_tokens", lambda v: isinstance(v, bool), "a boolean",
            default=True)),
        cache_salt=cache_salt, priority=priority, lora=lora, retention=retention)
