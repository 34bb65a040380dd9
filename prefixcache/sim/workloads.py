"""Deterministic synthetic workloads for prefix-cache studies.

Each generator returns a list of ``TraceRequest`` in arrival order, built from a
numpy ``Generator`` seeded with ``default_rng([seed, stream])`` (``stream`` is the
workload's index in ``WORKLOADS``, as in ``experiments/peers/make_traces.py``): the
same arguments give the same requests on every machine. Text token ids are drawn
uniformly from ``[1, vocab)``; id 0 is reserved for multimodal placeholders.

With default arguments, ``shared_system_prompt``, ``multi_turn``, ``few_shot`` and
``mm_salt`` reproduce ``make_traces.py --seed S`` request for request (ids, prompts,
output lengths, salts, adapters, multimodal ranges), so our replays and vLLM's
peer replays can be compared on generated or written traces alike.

Workloads (what reuse each one exercises):

* ``shared_system_prompt``: one system prompt shared by all + unique suffixes.
  Every request after the first hits the full-block part of the system prompt.
* ``multi_turn``: conversations whose turn k+1 prompt = turn k prompt + turn k's
  *output* (``output_token(turn_k_id, step)``, exactly what the replay decodes) +
  new user tokens; turns interleave in time (``timestamp`` set).
* ``few_shot``: a few long few-shot headers x many short questions, shuffled.
* ``rag``: a system prompt + ``docs_per_request`` documents drawn by Zipf
  popularity + a question; optional Poisson arrivals.
* ``tenant_prefixes``: many tenants, each with a long private prefix, Poisson
  arrivals (llm-d's routing benchmark shape: what routing across replicas decides).
* ``agentic``: coding-agent sessions of tool-call loops with sub-agents
  (``prefixcache.sim.agentic``), through the AgentX or TraceLab trace format.
* ``mm_salt``: token-identical prompts (text prefix + image placeholders + unique
  suffix) where only the image identity, cache salt and LoRA adapter decide
  which requests may share blocks.

``mooncake_scale`` streams a large Mooncake-format (``hash_ids``) trace for the
streaming/memory benchmark; ``write_mooncake_trace`` writes it as JSONL.

Host only: never imports jax.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from prefixcache.sim.trace import TraceRequest, output_token

VOCAB = 32000
MM_PLACEHOLDER_TOKEN = 0
# Where a prompt's stable part (system prompt, few-shot header) goes: before the
# request-specific part (the seeds' advice) or after it. Both draw the same tokens.
LAYOUTS = ("stable_first", "stable_last")
MOONCAKE_BLOCK_SIZE = 512


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------


def _range(name: str, value: Sequence[int]) -> tuple[int, int]:
    """Validates an inclusive ``(lo, hi)`` integer range."""
    try:
        lo, hi = (int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an inclusive (lo, hi) pair of ints, got {value!r}") from None
    if lo < 0 or hi < lo:
        raise ValueError(f"{name} must satisfy 0 <= lo <= hi, got {value!r}")
    return lo, hi


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _draw(rng: np.random.Generator, lo_hi: tuple[int, int]) -> int:
    """One integer uniform in the inclusive range."""
    return int(rng.integers(lo_hi[0], lo_hi[1] + 1))


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    """``n`` text token ids uniform in ``[1, vocab)``."""
    return rng.integers(1, vocab, size=int(n)).tolist()


def _rng(seed: int, stream: str) -> np.random.Generator:
    return np.random.default_rng([int(seed), _STREAMS[stream]])


def _layout(layout: str) -> bool:
    """True when the stable part goes first; ``ValueError`` for an unknown layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    return layout == "stable_first"


def _make(rid: str, prompt: list[int], output_len: int, *, cache_salt=None, lora=None,
          mm=(), timestamp=None) -> TraceRequest:
    return TraceRequest(
        id=rid,
        prompt=prompt,
        output_len=int(output_len),
        cache_salt=cache_salt,
        lora=None if lora is None else tuple(lora),
        mm=tuple(tuple(m) for m in mm),
        timestamp=None if timestamp is None else float(timestamp),
    )


def with_timestamps(requests: Iterable[TraceRequest], timestamps: Iterable[float]) -> list[TraceRequest]:
    """Copies of ``requests`` with the given arrival times (seconds)."""
    out = []
    for r, t in zip(requests, timestamps, strict=True):
        out.append(TraceRequest(id=r.id, prompt=r.prompt, output_len=r.output_len,
                                cache_salt=r.cache_salt, lora=r.lora, mm=r.mm,
                                timestamp=float(t)))
    return out


def poisson_arrivals(num: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival times (s) of a Poisson process: ``f64[num]``, starting near 0.

    Args:
      num: number of arrivals.
      rate: mean arrivals per second (> 0).
      seed: RNG seed.
    """
    if not rate > 0:
        raise ValueError(f"arrival rate must be > 0, got {rate!r}")
    rng = np.random.default_rng([int(seed), _STREAMS["poisson"]])
    return np.cumsum(rng.exponential(1.0 / rate, size=int(num)))


def _maybe_poisson(reqs: list[TraceRequest], arrival_rate: float | None, seed: int) -> list[TraceRequest]:
    if arrival_rate is None:
        return reqs
    return with_timestamps(reqs, poisson_arrivals(len(reqs), arrival_rate, seed))


# ----------------------------------------------------------------------------
# generators
# ----------------------------------------------------------------------------


def shared_system_prompt(
    *,
    num_requests: int = 2000,
    system_len: int = 1024,
    unique_len: Sequence[int] = (64, 512),
    output_len: Sequence[int] = (16, 64),
    vocab: int = VOCAB,
    arrival_rate: float | None = None,
    layout: str = "stable_first",
    seed: int = 0,
) -> list[TraceRequest]:
    """One system prompt shared by every request + a unique suffix each.

    Args:
      num_requests: requests (ids ``ssp-00000`` ...).
      system_len: tokens of the shared system prompt.
      unique_len: inclusive range of the unique suffix length.
      output_len: inclusive range of output tokens per request.
      vocab: text token ids are in ``[1, vocab)``.
      arrival_rate: if set, Poisson arrivals at this rate (req/s) as timestamps.
      layout: ``"stable_first"`` (system prompt + suffix) or ``"stable_last"``
        (the unique part first: the same tokens, reordered).
      seed: RNG seed.

    Returns:
      ``num_requests`` requests. Expected hits (block size B, enough blocks):
      every request after the first reuses ``(system_len // B) * B`` tokens
      (more only if its suffix happens to repeat, which random tokens do not);
      with ``stable_last``, none.
    """
    stable_first = _layout(layout)
    num_requests = _positive("num_requests", num_requests)
    unique_len, output_len = _range("unique_len", unique_len), _range("output_len", output_len)
    rng = _rng(seed, "shared_system_prompt")
    system = _tokens(rng, system_len, vocab)
    reqs = []
    for i in range(num_requests):
        uniq = _tokens(rng, _draw(rng, unique_len), vocab)
        out = _draw(rng, output_len)
        reqs.append(_make(f"ssp-{i:05d}", system + uniq if stable_first else uniq + system, out))
    return _maybe_poisson(reqs, arrival_rate, seed)


def multi_turn(
    *,
    num_conversations: int = 300,
    num_turns: int = 6,
    new_tokens: Sequence[int] = (50, 200),
    output_len: Sequence[int] = (16, 128),
    start_window_s: float = 300.0,
    turn_gap_s: Sequence[float] = (1.0, 20.0),
    vocab: int = VOCAB,
    seed: int = 0,
) -> list[TraceRequest]:
    """Chat conversations: each turn's prompt extends the previous turn exactly.

    Turn k+1 prompt = turn k prompt + turn k's output tokens (as the replay
    decodes them: ``output_token(turn_k_id, step)`` for ``step < output_len``) +
    ``new_tokens`` fresh user tokens. Conversations start uniformly in
    ``[0, start_window_s)``; turns follow after gaps uniform in ``turn_gap_s``.
    Requests are sorted by (time, conversation, turn) and carry ``timestamp``.

    NOTE: the replay never computes KV for a request's last sampled token, so
    turn k+1 can hit turn k's prompt and output blocks only up to the last
    *full* block before that token.

    Returns:
      ``num_conversations * num_turns`` requests, ids ``mt-cCCC-tT``.
    """
    num_conversations = _positive("num_conversations", num_conversations)
    num_turns = _positive("num_turns", num_turns)
    new_tokens, output_len = _range("new_tokens", new_tokens), _range("output_len", output_len)
    gap_lo, gap_hi = (float(g) for g in turn_gap_s)
    if not 0 <= gap_lo <= gap_hi:
        raise ValueError(f"turn_gap_s must be 0 <= lo <= hi, got {turn_gap_s!r}")
    rng = _rng(seed, "multi_turn")
    timed = []
    for c in range(num_conversations):
        start = rng.uniform(0.0, start_window_s)
        gaps = rng.uniform(gap_lo, gap_hi, size=num_turns - 1)
        times = start + np.concatenate([[0.0], np.cumsum(gaps)])
        prev_prompt: list[int] = []
        prev_id = None
        prev_out = 0
        for t in range(num_turns):
            rid = f"mt-c{c:03d}-t{t}"
            prompt = list(prev_prompt)
            if prev_id is not None:
                prompt += [output_token(prev_id, s) for s in range(prev_out)]
            prompt += _tokens(rng, _draw(rng, new_tokens), vocab)
            out = _draw(rng, output_len)
            timed.append((float(times[t]), c, t, rid, prompt, out))
            prev_prompt, prev_id, prev_out = prompt, rid, out
    timed.sort(key=lambda x: (x[0], x[1], x[2]))
    return [_make(rid, p, o, timestamp=ts) for ts, _, _, rid, p, o in timed]


def few_shot(
    *,
    num_headers: int = 10,
    num_questions: int = 200,
    header_len: int = 3000,
    question_len: Sequence[int] = (30, 80),
    output_len: Sequence[int] = (16, 64),
    vocab: int = VOCAB,
    arrival_rate: float | None = None,
    layout: str = "stable_first",
    seed: int = 0,
) -> list[TraceRequest]:
    """``num_headers`` long few-shot headers x ``num_questions`` questions, shuffled.

    Expected hits (block size B, enough blocks): the first request of each
    header misses; every later one reuses ``(header_len // B) * B`` tokens.
    ``layout="stable_last"`` puts the question before the header (same tokens):
    then nothing is reused.

    Returns:
      ``num_headers * num_questions`` requests, ids ``fs-hH-qQQQ``.
    """
    stable_first = _layout(layout)
    num_headers = _positive("num_headers", num_headers)
    num_questions = _positive("num_questions", num_questions)
    question_len, output_len = _range("question_len", question_len), _range("output_len", output_len)
    rng = _rng(seed, "few_shot")
    headers = [_tokens(rng, header_len, vocab) for _ in range(num_headers)]
    reqs = []
    for h in range(num_headers):
        for q in range(num_questions):
            question = _tokens(rng, _draw(rng, question_len), vocab)
            out = _draw(rng, output_len)
            prompt = headers[h] + question if stable_first else question + headers[h]
            reqs.append(_make(f"fs-h{h}-q{q:03d}", prompt, out))
    order = rng.permutation(len(reqs))
    return _maybe_poisson([reqs[i] for i in order], arrival_rate, seed)


def mm_salt(
    *,
    num_requests: int = 500,
    prefix_len: int = 10,
    image_len: int = 576,
    num_images: int = 5,
    num_salts: int = 4,
    num_loras: int = 2,
    suffix_len: Sequence[int] = (32, 256),
    output_len: Sequence[int] = (16, 64),
    vocab: int = VOCAB,
    arrival_rate: float | None = None,
    seed: int = 0,
) -> list[TraceRequest]:
    """Multimodal + cache salts + LoRA adapters on token-identical prompts.

    Prompt = ``prefix_len`` shared text tokens + ``image_len`` placeholders
    (id 0) at offset ``prefix_len`` + a unique suffix. Each request draws one of
    ``num_images`` image identifiers, ``num_salts`` salts and ``num_loras``
    adapters independently (``num_salts=0`` / ``num_loras=0``: none). Two
    requests may share blocks only when image, salt and adapter all agree: the
    salt and adapter key every block, the image keys the blocks it overlaps.

    Returns:
      ``num_requests`` requests, ids ``mm-IIII``.
    """
    num_requests = _positive("num_requests", num_requests)
    num_images = _positive("num_images", num_images)
    suffix_len, output_len = _range("suffix_len", suffix_len), _range("output_len", output_len)
    if num_salts < 0 or num_loras < 0:
        raise ValueError(f"num_salts/num_loras must be >= 0, got {num_salts}, {num_loras}")
    rng = _rng(seed, "mm_salt")
    images = [f"image-{k}" for k in range(num_images)]
    salts = [f"salt-{k}" for k in range(num_salts)]
    loras = [(f"lora-{chr(ord('a') + k)}", f"/adapters/lora-{chr(ord('a') + k)}")
             for k in range(num_loras)]
    prefix = _tokens(rng, prefix_len, vocab)
    reqs = []
    for i in range(num_requests):
        image = images[rng.integers(len(images))]
        salt = salts[rng.integers(len(salts))] if salts else None
        lora = loras[rng.integers(len(loras))] if loras else None
        suffix = _tokens(rng, _draw(rng, suffix_len), vocab)
        prompt = prefix + [MM_PLACEHOLDER_TOKEN] * image_len + suffix
        out = _draw(rng, output_len)
        reqs.append(_make(f"mm-{i:04d}", prompt, out, cache_salt=salt, lora=lora,
                          mm=[(image, prefix_len, image_len)]))
    return _maybe_poisson(reqs, arrival_rate, seed)


def rag(
    *,
    num_requests: int = 1000,
    num_documents: int = 200,
    doc_len: Sequence[int] = (256, 1024),
    docs_per_request: int = 2,
    zipf_a: float = 1.1,
    system_len: int = 256,
    question_len: Sequence[int] = (16, 64),
    output_len: Sequence[int] = (16, 128),
    sort_documents: bool = True,
    vocab: int = VOCAB,
    arrival_rate: float | None = None,
    seed: int = 0,
) -> list[TraceRequest]:
    """Retrieval-augmented prompts: system prompt + retrieved documents + question.

    Document ``d`` (rank ``d``, 0 = most popular) is retrieved with probability
    proportional to ``1 / (d + 1) ** zipf_a``; each request draws
    ``docs_per_request`` distinct documents. With ``sort_documents`` they are
    placed in rank order (a stable order lets requests that retrieved the same
    leading documents share those blocks); otherwise in draw order.

    Returns:
      ``num_requests`` requests, ids ``rag-IIIII``.
    """
    num_requests = _positive("num_requests", num_requests)
    num_documents = _positive("num_documents", num_documents)
    docs_per_request = _positive("docs_per_request", docs_per_request)
    if docs_per_request > num_documents:
        raise ValueError(f"docs_per_request={docs_per_request} > num_documents={num_documents}")
    if not zipf_a > 0:
        raise ValueError(f"zipf_a must be > 0, got {zipf_a!r}")
    doc_len = _range("doc_len", doc_len)
    question_len, output_len = _range("question_len", question_len), _range("output_len", output_len)
    rng = _rng(seed, "rag")
    system = _tokens(rng, system_len, vocab)
    docs = [_tokens(rng, _draw(rng, doc_len), vocab) for _ in range(num_documents)]
    popularity = 1.0 / np.arange(1, num_documents + 1) ** zipf_a
    popularity /= popularity.sum()
    reqs = []
    for i in range(num_requests):
        picked = rng.choice(num_documents, size=docs_per_request, replace=False, p=popularity)
        if sort_documents:
            picked = np.sort(picked)
        prompt = list(system)
        for d in picked:
            prompt += docs[int(d)]
        prompt += _tokens(rng, _draw(rng, question_len), vocab)
        reqs.append(_make(f"rag-{i:05d}", prompt, _draw(rng, output_len)))
    return _maybe_poisson(reqs, arrival_rate, seed)


# ----------------------------------------------------------------------------
# Mooncake-format (hash_ids) traces at scale
# ----------------------------------------------------------------------------


def mooncake_scale(
    *,
    num_requests: int = 20000,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    num_prefixes: int = 500,
    prefix_blocks: Sequence[int] = (1, 8),
    zipf_a: float = 1.0,
    continue_prob: float = 0.3,
    max_sessions: int = 2000,
    new_blocks: Sequence[int] = (5, 22),
    max_input_blocks: int = 96,
    output_len: Sequence[int] = (16, 1024),
    arrival_rate: float = 5.5,
    seed: int = 0,
) -> Iterator[dict[str, Any]]:
    """Streams a large synthetic Mooncake-format trace (``hash_ids`` per line).

    Shape of the Mooncake FAST'25 conversation trace: shared prefixes (system
    prompts / documents, Zipf popularity) and multi-turn sessions whose next
    turn keeps every *full* block of the previous turn and appends new ones.
    With the defaults (seed 0): 20,000 requests averaging 12,036 input tokens
    (p50 10,944, p99 32,733, max 48,787); ideal reuse with an infinite cache at
    512-token blocks is 44.4% of prompt tokens (the real conversation trace:
    37.3%).

    Each yielded line: ``{"timestamp": ms (int), "input_length": int,
    "output_length": int, "hash_ids": [int]}`` with ``len(hash_ids) ==
    ceil(input_length / block_size)``; equal ids mean equal prefixes up to that
    block (ids are assigned from a counter, so a reused id always continues the
    same prefix).

    Memory is bounded by ``max_sessions`` live sessions, not by the trace.

    Args:
      num_requests: lines to yield.
      block_size: tokens per hash id (512 in Mooncake).
      num_prefixes: distinct shared prefixes.
      prefix_blocks: inclusive range of a shared prefix's length in blocks.
      zipf_a: popularity exponent of the shared prefixes.
      continue_prob: probability that a request continues a live session
        (else it starts one on a shared prefix).
      max_sessions: live sessions kept (oldest dropped beyond this).
      new_blocks: inclusive range of blocks a turn appends.
      max_input_blocks: a session whose next turn would exceed this ends, and
        the request starts a new session instead.
      output_len: inclusive range of output tokens.
      arrival_rate: Poisson arrivals per second.
      seed: RNG seed.
    """
    num_requests = _positive("num_requests", num_requests)
    block_size = _positive("block_size", block_size)
    num_prefixes = _positive("num_prefixes", num_prefixes)
    max_sessions = _positive("max_sessions", max_sessions)
    prefix_blocks, new_blocks = _range("prefix_blocks", prefix_blocks), _range("new_blocks", new_blocks)
    output_len = _range("output_len", output_len)
    if new_blocks[0] < 1:
        raise ValueError(f"new_blocks must append at least one block, got {new_blocks!r}")
    if max_input_blocks < prefix_blocks[1] + new_blocks[1]:
        raise ValueError("max_input_blocks must exceed prefix_blocks[1] + new_blocks[1]")
    if not 0 <= continue_prob < 1:
        raise ValueError(f"continue_prob must be in [0, 1), got {continue_prob!r}")
    if not arrival_rate > 0:
        raise ValueError(f"arrival_rate must be > 0, got {arrival_rate!r}")
    return _mooncake_lines(num_requests, block_size, num_prefixes, prefix_blocks, zipf_a,
                           continue_prob, max_sessions, new_blocks, max_input_blocks,
                           output_len, arrival_rate, seed)


def _mooncake_lines(num_requests, block_size, num_prefixes, prefix_blocks, zipf_a,
                    continue_prob, max_sessions, new_blocks, max_input_blocks, output_len,
                    arrival_rate, seed) -> Iterator[dict[str, Any]]:
    rng = _rng(seed, "mooncake_scale")
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    prefixes = [fresh(_draw(rng, prefix_blocks)) for _ in range(num_prefixes)]
    popularity = 1.0 / np.arange(1, num_prefixes + 1) ** zipf_a
    popularity /= popularity.sum()
    # Live sessions: full-block ids of the latest turn (a partial last block is
    # rewritten by the next turn, so it never carries over).
    sessions: list[list[int]] = []
    t_ms = 0.0
    for _ in range(num_requests):
        t_ms += rng.exponential(1000.0 / arrival_rate)
        ids = None
        if sessions and rng.random() < continue_prob:
            k = int(rng.integers(len(sessions)))
            base = sessions[k]
            add = _draw(rng, new_blocks)
            if len(base) + add <= max_input_blocks:
                ids = base + fresh(add)
                del sessions[k]
        if ids is None:
            p = int(rng.choice(num_prefixes, p=popularity))
            ids = prefixes[p] + fresh(_draw(rng, new_blocks))
        # The last block is partial with probability (B-1)/B.
        input_length = (len(ids) - 1) * block_size + _draw(rng, (1, block_size))
        full = ids if input_length % block_size == 0 else ids[:-1]
        sessions.append(full)
        if len(sessions) > max_sessions:
            sessions.pop(0)
        yield {
            "timestamp": int(t_ms),
            "input_length": int(input_length),
            "output_length": _draw(rng, output_len),
            "hash_ids": ids,
        }


def write_mooncake_trace(path: str | os.PathLike, lines: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Writes Mooncake JSONL lines atomically (temp file + rename), streaming.

    Returns:
      ``{"requests", "input_tokens", "output_tokens", "max_input_length"}``.
    """
    path = os.fspath(path)
    tmp = f"{path}.partial"
    stats = {"requests": 0, "input_tokens": 0, "output_tokens": 0, "max_input_length": 0}
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
                stats["requests"] += 1
                stats["input_tokens"] += line["input_length"]
                stats["output_tokens"] += line["output_length"]
                stats["max_input_length"] = max(stats["max_input_length"], line["input_length"])
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return stats


def tenant_prefixes(
    *,
    num_requests: int = 3000,
    num_tenants: int = 150,
    prefix_len: int = 6000,
    question_len: Sequence[int] = (128, 1024),
    output_len: Sequence[int] = (64, 256),
    vocab: int = VOCAB,
    arrival_rate: float | None = 20.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """Many tenants, each with a long private prefix (llm-d's routing benchmark shape).

    Each request picks a tenant uniformly at random and sends the tenant's prefix
    (system prompt + shared documents) followed by a unique question; arrivals are
    Poisson by default. The prefixes of all tenants (``num_tenants * prefix_len``
    tokens) typically exceed one replica's cache, so routing decides the hit rate.

    Args:
      num_requests: requests (ids ``tp-00000`` ...).
      num_tenants: tenants, each with its own prefix.
      prefix_len: tokens of every tenant's prefix.
      question_len: inclusive range of the unique suffix length.
      output_len: inclusive range of output tokens.
      vocab: text token ids are in ``[1, vocab)``.
      arrival_rate: Poisson arrivals (req/s) as timestamps; ``None`` for none.
      seed: RNG seed.
    """
    num_requests = _positive("num_requests", num_requests)
    num_tenants = _positive("num_tenants", num_tenants)
    prefix_len = _positive("prefix_len", prefix_len)
    question_len, output_len = _range("question_len", question_len), _range("output_len", output_len)
    rng = _rng(seed, "tenant_prefixes")
    prefixes = [_tokens(rng, prefix_len, vocab) for _ in range(num_tenants)]
    reqs = []
    for i in range(num_requests):
        t = int(rng.integers(num_tenants))
        q = _tokens(rng, _draw(rng, question_len), vocab)
        reqs.append(_make(f"tp-{i:05d}", prefixes[t] + q, _draw(rng, output_len)))
    return _maybe_poisson(reqs, arrival_rate, seed)


def agentic(
    *,
    format: str = "agentx",  # noqa: A002 - the trace format's name, as configs spell it
    hints: bool = False,
    ttl_s: float = 300.0,
    seed: int = 0,
    **kwargs: Any,
) -> list[TraceRequest]:
    """Coding-agent sessions: tool-call loops with sub-agents (``prefixcache.sim.agentic``,
    calibrated to TraceLab's and AgentX's published statistics), as requests in arrival
    order with lazy 64-token hash-id prompts (replay at a block size dividing 64).

    Args:
      format: ``"agentx"`` (the sessions written in the AgentX / Weka format and read
        back by its reader: the main agent's and sub-agents' shared blocks are shared)
        or ``"tracelab"`` (written as TraceLab's normalized rounds and read back: each
        loop rebuilt from its prefix split, sub-agents as sessions of their own).
      hints: attach the retention hints the session structure gives (``RetentionHints``).
      ttl_s: the hints' TTL in seconds.
      seed: RNG seed.
      **kwargs: ``prefixcache.sim.agentic.agentic_sessions``'s arguments (session count,
        steps, token sizes, sub-agent fan-out, timing).
    """
    import tempfile  # noqa: PLC0415

    from prefixcache.sim import agentic as _agentic  # noqa: PLC0415
    from prefixcache.sim import trace_formats  # noqa: PLC0415

    if format not in ("agentx", "tracelab"):
        raise ValueError(f"format must be 'agentx' or 'tracelab', got {format!r}")
    sessions = _agentic.agentic_sessions(seed=seed, **kwargs)
    with tempfile.TemporaryDirectory(prefix="agentic-") as d:
        path = os.path.join(d, f"agentic.{format}.jsonl")
        if format == "agentx":
            # (start_s is not in the Weka format: read back with the sessions' starts)
            _agentic.write_agentx(path, sessions)
            starts = [s["start_s"] for s in sessions]
            objs = [obj for _, _, obj in trace_formats.json_objects(path)]
            for obj, start in zip(objs, starts, strict=True):
                obj["start_s"] = start
            return trace_formats.agentx_requests(objs, lazy=True, hints=hints, ttl_s=ttl_s,
                                                 where=path)
        _agentic.write_tracelab(path, sessions)
        return list(trace_formats.read_tracelab(path, lazy=True, hints=hints, ttl_s=ttl_s))


# ----------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------

WORKLOADS: dict[str, Callable[..., list[TraceRequest]]] = {
    # Order matters: the index seeds each workload's RNG stream and the first
    # four match make_traces.py's streams.
    "shared_system_prompt": shared_system_prompt,
    "multi_turn": multi_turn,
    "few_shot": few_shot,
    "mm_salt": mm_salt,
    "rag": rag,
    "tenant_prefixes": tenant_prefixes,
    "agentic": agentic,
}

_STREAMS = {name: i for i, name in enumerate(WORKLOADS)}
_STREAMS.update(mooncake_scale=100, poisson=101)


def generate(name: str, **kwargs: Any) -> list[TraceRequest]:
    """Runs the workload generator ``name`` (a key of ``WORKLOADS``)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
    return WORKLOADS[name](**kwargs)
