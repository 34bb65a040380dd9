"""Readers for public agent and hash-id traces beyond Mooncake's: Qwen-Bailian, Claude
Code, AgentX (``read_agentx``: SemiAnalysis' Weka-format sessions with nested sub-agents)
and TraceLab (``read_tracelab``: normalized rounds, no hash ids: 64-token ids rebuilt from
each round's cached-prefix split). The session formats can attach the retention hints
their structure gives (``hints=True``; ``agentx_hints``).

Both formats publish, per request, the lengths and one anonymised *hash id* per
fixed-size block of the prompt (equal ids = equal content). As for Mooncake
(``prefixcache.sim.trace``), a reader expands each hash id into a deterministic block
of token ids (``mooncake_tokens`` with the format's block size), cuts the last block to
the prompt's length and yields ``TraceRequest``s in arrival order. Replays should use
the format's block size (``BLOCK_TOKENS``): a hash id stands for exactly that many
tokens, so a larger block never matches more and a smaller one only splits ids.

* **Qwen-Bailian** (``format="bailian"``; alibaba-edu/qwen-bailian-usagetraces-anon,
  Apache-2.0: ``qwen_traceA_blksz_16.jsonl`` (to-C), ``qwen_traceB_blksz_16.jsonl``
  (to-B), ``qwen_coder_blksz_16.jsonl``, ``qwen_thinking_blksz_16.jsonl``): one JSON
  object per line ``{"chat_id": int, "parent_chat_id": int (-1 for a root),
  "timestamp": seconds, "input_length": int, "output_length": int, "type":
  "text"|"search"|"image"|"file", "turn": int, "hash_ids": [int]}``, 16 tokens per
  hash id (salted SipHash over the whole trace, so ids are shared across chats).
  Request ids are ``f"bl-{chat_id}"``.
* **Claude Code agent traces** (``format="claude_code"``; e.g. the 2026
  ``cc-traces-*-with-subagents`` sets): one JSON object per line per *session*
  ``{"id": str, "block_size": int (64), "hash_id_scope": "local"|"global",
  "requests": [{"t": seconds since the session started, "in": int, "out": int,
  "hash_ids": [int], "model": str, ...}]}``; sub-agent requests are requests of the
  session like the others. With ``hash_id_scope="local"`` the ids are numbered per
  session (id 0 of two sessions is different content), so each session's ids are
  keyed by the session id before expansion; ``"global"`` ids are shared. Sessions
  have no absolute start in the format: session ``k`` (file order) starts at
  ``k * session_interval`` seconds (default 0: all sessions start together), and the
  reader yields every request in order of its absolute arrival (ties: file order).
  Request ids are ``f"cc-{session}-{k}"``.

``lazy=True`` (``read_trace(..., mooncake_tokens="lazy")``) yields each prompt as a
``MooncakePrompt`` of the format's block size instead of the expanded list: the replay
then keys blocks by the hash ids (no tokens materialised), with the same hits,
evictions and records as the expanded path.

Every malformed field is a ``TraceError`` naming ``path:line`` and the field. Host
only: nothing here imports jax.
"""

from __future__ import annotations

import hashlib
import heapq
import os
from typing import Any, Iterator

from prefixcache.core.request import RetentionHints

from prefixcache.sim.trace import (
    DEFAULT_VOCAB_SIZE,
    MooncakePrompt,
    TraceError,
    TraceRequest,
    check_hash_id_blocks,
    _is_int,
    _is_time,
    json_objects,
    mooncake_tokens,
)

BLOCK_TOKENS = {"bailian": 16, "claude_code": 64, "agentx": 64, "tracelab": 64}
BAILIAN_TYPES = ("text", "search", "image", "file")
_MASK64 = (1 << 64) - 1


def read_bailian(path: str | os.PathLike, *, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 lazy: bool = False) -> Iterator[TraceRequest]:
    """Stream a Qwen-Bailian trace (module docstring) as ``TraceRequest``s, file order.

    ``lazy``: prompts are ``MooncakePrompt``s of 16-token ids (not expanded; the replay
    keys blocks by the ids)."""
    path = os.fspath(path)
    bt = BLOCK_TOKENS["bailian"]
    seen: set[int] = set()
    for _, where, obj in json_objects(path):
        for field in ("chat_id", "timestamp", "input_length", "output_length", "hash_ids"):
            if field not in obj:
                raise TraceError(f"{where}: missing field {field!r} (Bailian line)")
        chat_id = obj["chat_id"]
        if not _is_int(chat_id) or chat_id < 0:
            raise TraceError(f"{where}: field 'chat_id' must be an int >= 0, got {chat_id!r}")
        if chat_id in seen:
            raise TraceError(f"{where}: duplicate chat_id {chat_id}")
        seen.add(chat_id)
        parent = obj.get("parent_chat_id", -1)
        if not _is_int(parent) or parent < -1:
            raise TraceError(f"{where}: field 'parent_chat_id' must be an int >= -1, "
                             f"got {parent!r}")
        turn = obj.get("turn", 1)
        if not _is_int(turn) or turn < 1:
            raise TraceError(f"{where}: field 'turn' must be an int >= 1, got {turn!r}")
        kind = obj.get("type", "text")
        if kind not in BAILIAN_TYPES:
            raise TraceError(f"{where}: field 'type' must be one of {BAILIAN_TYPES}, "
                             f"got {kind!r}")
        ts = obj["timestamp"]
        if not _is_time(ts) or ts < 0:
            raise TraceError(f"{where}: field 'timestamp' must be a finite number of "
                             f"seconds >= 0, got {ts!r}")
        n_in, n_out, ids = obj["input_length"], obj["output_length"], obj["hash_ids"]
        check_hash_id_blocks(where, n_in, n_out, ids, bt)
        prompt = (MooncakePrompt(ids, n_in, vocab_size, block_tokens=bt) if lazy else
                  mooncake_tokens(ids, block_tokens=bt, vocab_size=vocab_size)[:n_in].tolist())
        yield TraceRequest(id=f"bl-{chat_id}", prompt=prompt, output_len=n_out,
                           timestamp=float(ts))


def _session_key(session: str) -> int:
    return int.from_bytes(hashlib.blake2b(session.encode(), digest_size=8).digest(), "little")


def read_claude_code(path: str | os.PathLike, *, vocab_size: int = DEFAULT_VOCAB_SIZE,
                     session_interval: float = 0.0, lazy: bool = False, hints: bool = False,
                     ttl_s: float = 300.0) -> Iterator[TraceRequest]:
    """Stream a Claude Code agent trace (module docstring), in order of arrival.

    Args:
        path: one session per JSON line (gzip when the name ends in ``.gz``).
        vocab_size: token ids of the expanded blocks lie in ``[1, vocab_size)``.
        session_interval: seconds between the starts of consecutive sessions (>= 0).
        lazy: prompts are ``MooncakePrompt``s of the session's ``block_size``-token ids
            (local ids already keyed by the session), not expanded.
        hints: attach retention hints from the session structure (``agentx_hints``: a
            live session keeps its context for ``ttl_s``; its last request ends it,
            keeping the first ``system_tokens + tool_tokens`` tokens when the session
            gives them). A session with nested sub-agent entries (``"type":
            "subagent"``) is the AgentX format: read it with ``format="agentx"``.
        ttl_s: the hints' TTL in seconds.

    NOTE: the whole file is read before the first request is yielded (sessions overlap
    in time, so the first arrival may be in the last line): memory O(trace).
    """
    if isinstance(session_interval, bool) or not _is_time(session_interval) or session_interval < 0:
        raise ValueError(f"session_interval must be a finite number >= 0, "
                         f"got {session_interval!r}")
    if isinstance(ttl_s, bool) or not _is_time(ttl_s) or ttl_s <= 0:
        raise ValueError(f"ttl_s must be a finite number > 0, got {ttl_s!r}")
    return _read_claude_code(os.fspath(path), vocab_size, float(session_interval), bool(lazy),
                             float(ttl_s) if hints else None)


def _read_claude_code(path: str, vocab_size: int, session_interval: float, lazy: bool,
                      ttl_s: float | None = None) -> Iterator[TraceRequest]:
    heap: list[tuple[float, int, int, TraceRequest]] = []
    seen: set[str] = set()
    order = 0
    for k, (_, where, obj) in enumerate(json_objects(path)):
        for field in ("id", "requests"):
            if field not in obj:
                raise TraceError(f"{where}: missing field {field!r} (Claude Code session)")
        sid = obj["id"]
        if not isinstance(sid, str) or not sid:
            raise TraceError(f"{where}: field 'id' must be a non-empty str, got {sid!r}")
        if sid in seen:
            raise TraceError(f"{where}: duplicate session id {sid!r}")
        seen.add(sid)
        bt = obj.get("block_size", BLOCK_TOKENS["claude_code"])
        if not _is_int(bt) or bt <= 0:
            raise TraceError(f"{where}: field 'block_size' must be a positive int, got {bt!r}")
        scope = obj.get("hash_id_scope", "local")
        if scope not in ("local", "global"):
            raise TraceError(f"{where}: field 'hash_id_scope' must be 'local' or 'global', "
                             f"got {scope!r}")
        reqs = obj["requests"]
        if not isinstance(reqs, list):
            raise TraceError(f"{where}: field 'requests' must be a list")
        start = k * session_interval
        key = _session_key(sid) if scope == "local" else 0
        last_t = 0.0
        fork = 0
        if ttl_s is not None:
            for field in ("system_tokens", "tool_tokens"):
                v = obj.get(field, 0)
                fork += v if _is_int(v) and v > 0 else 0
        for i, r in enumerate(reqs):
            rw = f"{where}: requests[{i}]"
            if not isinstance(r, dict):
                raise TraceError(f"{rw}: expected an object, got {type(r).__name__}")
            if r.get("type") == "subagent":
                raise TraceError(f"{rw}: a nested sub-agent entry: this is the AgentX "
                                 "(Weka) format; read it with format='agentx'")
            for field in ("t", "in", "out", "hash_ids"):
                if field not in r:
                    raise TraceError(f"{rw}: missing field {field!r}")
            t = r["t"]
            if not _is_time(t) or t < 0:
                raise TraceError(f"{rw}: field 't' must be a finite number of seconds >= 0, "
                                 f"got {t!r}")
            if t < last_t:
                raise TraceError(f"{rw}: field 't' goes back in time ({t} < {last_t})")
            last_t = t
            check_hash_id_blocks(rw, r["in"], r["out"], r["hash_ids"], bt, ("in", "out", "hash_ids"))
            ids = r["hash_ids"]
            if key:
                # Local ids: the same number in two sessions is different content.
                ids = [((h * 0x9E3779B97F4A7C15) ^ key) & _MASK64 for h in ids]
            prompt = (MooncakePrompt(ids, r["in"], vocab_size, block_tokens=bt) if lazy else
                      mooncake_tokens(ids, block_tokens=bt, vocab_size=vocab_size)[: r["in"]]
                      .tolist())
            ts = start + float(t)
            hint = (None if ttl_s is None else
                    agentx_hints(main=True, last=i == len(reqs) - 1, fork_tokens=fork or None,
                                 ttl_s=ttl_s))
            heapq.heappush(heap, (ts, order, i, TraceRequest(
                id=f"cc-{sid}-{i}", prompt=prompt, output_len=r["out"],
                timestamp=ts, retention=hint)))
            order += 1
    while heap:
        yield heapq.heappop(heap)[3]




# ----------------------------------------------------------------------------
# AgentX (SemiAnalysis' Weka-format Claude Code traces, with sub-agents) and TraceLab
# ----------------------------------------------------------------------------

AGENTX_REQUEST_TYPES = ("n", "s")  # normal and streaming API calls


def agentx_hints(*, main: bool, last: bool, fork_tokens: int | None, ttl_s: float
                 ) -> RetentionHints:
    """The retention hints an agent session's structure gives one of its requests.

    A live loop's request keeps its whole context for ``ttl_s`` (the next call follows
    within seconds to minutes); the main agent ranks above its sub-agents (priority 1 vs
    0). The last request of a sub-agent (or of the session) ends it: its blocks outside
    the shared system prompt + tools (``keep_range=(0, fork_tokens)``) go first once it
    finishes."""
    keep = (0, fork_tokens) if (last and fork_tokens) else None
    return RetentionHints(priority=1 if main else 0, ttl_s=ttl_s, keep_range=keep,
                          session_end=last)


def _agentx_call(where: str, r: Any, bt: int) -> None:
    if not isinstance(r, dict):
        raise TraceError(f"{where}: expected an object, got {type(r).__name__}")
    for field in ("t", "in", "out", "hash_ids"):
        if field not in r:
            raise TraceError(f"{where}: missing field {field!r}")
    t = r["t"]
    if not _is_time(t) or t < 0:
        raise TraceError(f"{where}: field 't' must be a finite number of seconds >= 0, "
                         f"got {t!r}")
    check_hash_id_blocks(where, r["in"], r["out"], r["hash_ids"], bt, ("in", "out", "hash_ids"))


def agentx_requests(sessions, *, vocab_size: int = DEFAULT_VOCAB_SIZE, lazy: bool = True,
                    hints: bool = False, ttl_s: float = 300.0, session_interval: float = 0.0,
                    where: str = "session") -> list[TraceRequest]:
    """AgentX / Weka sessions (dicts, see ``read_agentx``) as requests in arrival order.

    Args:
      sessions: iterable of ``(where, session dict)`` pairs or of session dicts.
      vocab_size, lazy: as ``read_agentx``.
      hints: attach ``agentx_hints`` to every request.
      ttl_s: the hints' TTL (seconds).
      session_interval: session ``k`` starts at ``k * session_interval`` s, unless the
        dict carries ``start_s`` (the generator's).
      where: how messages name a session given without its ``where``.
    """
    if isinstance(session_interval, bool) or not _is_time(session_interval) \
            or session_interval < 0:
        raise ValueError(f"session_interval must be a finite number >= 0, "
                         f"got {session_interval!r}")
    if isinstance(ttl_s, bool) or not _is_time(ttl_s) or ttl_s <= 0:
        raise ValueError(f"ttl_s must be a finite number > 0, got {ttl_s!r}")
    heap: list = []
    seen: set[str] = set()
    order = 0
    for k, item in enumerate(sessions):
        w, obj = item if isinstance(item, tuple) else (f"{where} {k}", item)
        if not isinstance(obj, dict):
            raise TraceError(f"{w}: expected a session object, got {type(obj).__name__}")
        for field in ("id", "requests"):
            if field not in obj:
                raise TraceError(f"{w}: missing field {field!r} (AgentX session)")
        sid = obj["id"]
        if not isinstance(sid, str) or not sid:
            raise TraceError(f"{w}: field 'id' must be a non-empty str, got {sid!r}")
        if sid in seen:
            raise TraceError(f"{w}: duplicate session id {sid!r}")
        seen.add(sid)
        bt = obj.get("block_size", BLOCK_TOKENS["agentx"])
        if not _is_int(bt) or bt <= 0:
            raise TraceError(f"{w}: field 'block_size' must be a positive int, got {bt!r}")
        scope = obj.get("hash_id_scope", "local")
        if scope not in ("local", "global"):
            raise TraceError(f"{w}: field 'hash_id_scope' must be 'local' or 'global', "
                             f"got {scope!r}")
        fork = 0
        for field in ("system_tokens", "tool_tokens"):
            v = obj.get(field, 0)
            if not _is_int(v) or v < 0:
                raise TraceError(f"{w}: field {field!r} must be an int >= 0, got {v!r}")
            fork += v
        reqs = obj["requests"]
        if not isinstance(reqs, list):
            raise TraceError(f"{w}: field 'requests' must be a list")
        start = obj.get("start_s", k * session_interval)
        if not _is_time(start) or start < 0:
            raise TraceError(f"{w}: field 'start_s' must be a finite number >= 0, got {start!r}")
        key = _session_key(sid) if scope == "local" else 0
        # Streams: the main agent's calls, then each sub-agent's (their own loops).
        streams: list[tuple[str, bool, list[tuple[str, dict]]]] = [(f"ax-{sid}", True, [])]
        for i, r in enumerate(reqs):
            rw = f"{w}: requests[{i}]"
            kind = r.get("type", "n") if isinstance(r, dict) else None
            if kind == "subagent":
                for field in ("agent_id", "requests"):
                    if field not in r:
                        raise TraceError(f"{rw}: missing field {field!r} (sub-agent)")
                aid = r["agent_id"]
                if not isinstance(aid, str) or not aid or not isinstance(r["requests"], list):
                    raise TraceError(f"{rw}: a sub-agent needs a non-empty str 'agent_id' "
                                     "and a list 'requests'")
                inner = []
                for j, q in enumerate(r["requests"]):
                    qw = f"{rw}.requests[{j}]"
                    if isinstance(q, dict) and q.get("type", "n") not in AGENTX_REQUEST_TYPES:
                        raise TraceError(f"{qw}: field 'type' must be one of "
                                         f"{AGENTX_REQUEST_TYPES} inside a sub-agent, "
                                         f"got {q.get('type')!r}")
                    _agentx_call(qw, q, bt)
                    inner.append((qw, q))
                streams.append((f"ax-{sid}-{aid}", False, inner))
            elif kind in AGENTX_REQUEST_TYPES or kind is None:
                _agentx_call(rw, r, bt)
                streams[0][2].append((rw, r))
            else:
                raise TraceError(f"{rw}: field 'type' must be 'n', 's' or 'subagent', "
                                 f"got {kind!r}")
        for prefix, main, calls in streams:
            for j, (rw, r) in enumerate(calls):
                ids = r["hash_ids"]
                if key:
                    ids = [((h * 0x9E3779B97F4A7C15) ^ key) & _MASK64 for h in ids]
                n_in = r["in"]
                prompt = (MooncakePrompt(ids, n_in, vocab_size, block_tokens=bt) if lazy else
                          mooncake_tokens(ids, block_tokens=bt, vocab_size=vocab_size)[:n_in]
                          .tolist())
                hint = (agentx_hints(main=main, last=j == len(calls) - 1,
                                     fork_tokens=fork or None, ttl_s=ttl_s)
                        if hints else None)
                ts = float(start) + float(r["t"])
                heapq.heappush(heap, (ts, order, TraceRequest(
                    id=f"{prefix}-{j}", prompt=prompt, output_len=r["out"], timestamp=ts,
                    retention=hint)))
                order += 1
    return [heapq.heappop(heap)[2] for _ in range(len(heap))]


def _agentx_sessions(path: str):
    if path.endswith(".json"):  # one trace per file (AIPerf's directory layout)
        import json  # noqa: PLC0415

        try:
            with open(path, encoding="utf-8") as f:
                yield f"{path}", json.load(f)
        except (UnicodeDecodeError, ValueError) as e:
            raise TraceError(f"{path}: not a JSON trace ({e})") from None
        return
    for _, where, obj in json_objects(path):
        yield where, obj


def read_agentx(path: str | os.PathLike, *, vocab_size: int = DEFAULT_VOCAB_SIZE,
                lazy: bool = False, hints: bool = False, ttl_s: float = 300.0,
                session_interval: float = 0.0) -> Iterator[TraceRequest]:
    """Stream an AgentX trace (SemiAnalysis' Weka-format Claude Code sessions), in order
    of arrival.

    Format (the schema of AIPerf's ``weka_trace`` loader, ``weka_trace_models.py``;
    ``semianalysisai/cc-traces-weka-062126`` is one session per JSONL line, AIPerf also
    reads one ``.json`` file per session): ``{"id", "models", "block_size": 64,
    "hash_id_scope": "local", "tool_tokens", "system_tokens", "requests": [...]}``;
    ``requests`` interleaves API calls ``{"t", "type": "n"|"s", "model", "in", "out",
    "hash_ids", "api_time", "think_time", "stop", ...}`` and sub-agents ``{"t", "type":
    "subagent", "agent_id", "subagent_type", "duration_ms", "status", "requests":
    [calls], ...}``. ``"local"`` ids are numbered per session, and a sub-agent shares its
    parent's namespace (the blocks it forks from the parent are the parent's ids): ids
    are keyed by the session id here, as in ``read_claude_code``.

    Each call is a request: ``ax-<session>-<k>`` (the main agent's k-th call) or
    ``ax-<session>-<agent_id>-<k>``. Times: a call's ``t`` is read as seconds since the
    session started, inside sub-agents too (the Weka models say the nested calls' basis
    is "corpus-selected"; the sources do not say more); session ``k`` starts at
    ``k * session_interval``.

    Args:
      path: JSONL (gzip when ``.gz``) or one ``.json`` session.
      vocab_size: token ids of expanded blocks lie in ``[1, vocab_size)``.
      lazy: prompts as ``MooncakePrompt`` of the session's block size (not expanded).
      hints: attach the retention hints the structure gives (``agentx_hints``).
      ttl_s: the hints' TTL in seconds.
      session_interval: seconds between session starts (>= 0).

    NOTE: the whole file is read first (sessions overlap in time): memory O(trace).
    """
    path = os.fspath(path)
    return iter(agentx_requests(_agentx_sessions(path), vocab_size=vocab_size, lazy=lazy,
                                hints=hints, ttl_s=ttl_s, session_interval=session_interval))


_TRACELAB_FIELDS = ("session_id", "input_tokens_total", "output_tokens")


def _epoch_s(where: str, value: Any) -> float:
    import datetime  # noqa: PLC0415

    if not isinstance(value, str):
        raise TraceError(f"{where}: field 'timestamp' must be an ISO-8601 str, got {value!r}")
    try:
        t = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise TraceError(f"{where}: field 'timestamp' is not ISO-8601: {value!r}") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)  # (TraceLab's DB: naive UTC)
    return t.timestamp()


def read_tracelab(path: str | os.PathLike, *, vocab_size: int = DEFAULT_VOCAB_SIZE,
                  lazy: bool = False, block_tokens: int = 64, hints: bool = False,
                  ttl_s: float = 300.0) -> Iterator[TraceRequest]:
    """Stream a TraceLab trace (uw-syfi/TraceLab's normalized round JSONL,
    ``syfi_coding_trace.jsonl.gz``), in order of arrival.

    Format (TraceLab's README "Data format" and ``artifacts/utils/DB_SCHEMA.md``; the
    release's DuckDB holds the same rows): one LLM round per line with ``provider``
    (``claude`` / ``codex``), ``session_id``, ``round_index``, ``model``,
    ``input_tokens_total = prefix_tokens + newly_append_tokens`` (the provider's cached
    prefix and the rest), ``output_tokens``, ``timing_events`` (``[{"event_type",
    "timestamp": ISO-8601, ...}]``) and ``tools``; other fields are ignored. The format
    has **no block hashes**: this reader rebuilds each session's context from the
    prefix split -- round k's prompt is the first ``prefix_tokens`` tokens of the
    session's context so far (the previous round's prompt and output) and
    ``newly_append_tokens`` fresh ones -- as ``block_tokens``-token hash ids (64 by
    default, AgentX's; no block size is the format's own), so a replay at that block
    size reuses exactly the provider-reported prefixes (a prefix the provider missed,
    e.g. after its cache TTL, counts as new content: a lower bound on the sessions'
    reuse; nothing is shared between sessions). Sessions are ``(provider,
    session_id)``, rounds ordered by ``(round_index, file order)``; a round arrives at
    its earliest timing event (a round without one: its predecessor's time), times
    relative to the trace's first. Rounds with ``input_tokens_total == 0`` are
    skipped. Request ids: ``tl-<session>-<k>``.

    Args:
      path: the JSONL (gzip when ``.gz``).
      vocab_size, lazy: as the other hash-id readers.
      block_tokens: tokens per rebuilt hash id.
      hints: attach retention hints (a live session keeps its context for ``ttl_s``;
        its last round ends it).
      ttl_s: the hints' TTL in seconds.

    NOTE: the whole file is read first: memory O(trace).
    """
    if not _is_int(block_tokens) or block_tokens <= 0:
        raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
    if isinstance(ttl_s, bool) or not _is_time(ttl_s) or ttl_s <= 0:
        raise ValueError(f"ttl_s must be a finite number > 0, got {ttl_s!r}")
    path = os.fspath(path)
    sessions: dict[tuple, list] = {}
    for order, (_, where, obj) in enumerate(json_objects(path)):
        for field in _TRACELAB_FIELDS:
            if field not in obj:
                raise TraceError(f"{where}: missing field {field!r} (TraceLab round)")
        sid = obj["session_id"]
        if not isinstance(sid, str) or not sid:
            raise TraceError(f"{where}: field 'session_id' must be a non-empty str, "
                             f"got {sid!r}")
        n_in, n_out = obj["input_tokens_total"], obj["output_tokens"]
        if not _is_int(n_in) or n_in < 0:
            raise TraceError(f"{where}: field 'input_tokens_total' must be an int >= 0, "
                             f"got {n_in!r}")
        if n_out is None:
            n_out = 0
        if not _is_int(n_out) or n_out < 0:
            raise TraceError(f"{where}: field 'output_tokens' must be an int >= 0, got {n_out!r}")
        prefix = obj.get("prefix_tokens") or 0
        if not _is_int(prefix) or not 0 <= prefix <= n_in:
            raise TraceError(f"{where}: field 'prefix_tokens' must be an int in [0, "
                             f"input_tokens_total={n_in}], got {prefix!r}")
        ri = obj.get("round_index", 0)
        if not _is_int(ri):
            raise TraceError(f"{where}: field 'round_index' must be an int, got {ri!r}")
        events = obj.get("timing_events") or []
        if not isinstance(events, list):
            raise TraceError(f"{where}: field 'timing_events' must be a list")
        times = [_epoch_s(f"{where}: timing_events[{i}]", e.get("timestamp"))
                 for i, e in enumerate(events) if isinstance(e, dict) and e.get("timestamp")]
        if n_in == 0:
            continue
        provider = obj.get("provider", "")
        sessions.setdefault((str(provider), sid), []).append(
            (ri, order, n_in, n_out, prefix, min(times) if times else None))
    reqs: list[tuple[float, int, str, MooncakePrompt | list, int, bool]] = []
    bt = block_tokens
    t0 = None
    for (provider, sid), rounds in sessions.items():
        rounds.sort(key=lambda x: (x[0], x[1]))
        key = _session_key(f"{provider}/{sid}")
        next_id = 0
        ctx: list[int] = []
        ctx_len = 0
        t_prev = None
        for k, (_, order, n_in, n_out, prefix, t) in enumerate(rounds):
            shared = min(prefix, ctx_len) // bt
            need = -(-n_in // bt)
            ids = ctx[:shared] + list(range(next_id, next_id + need - shared))
            next_id += need - shared
            # The context after this round: its prompt + output (a partial block of the
            # prompt is rewritten when the output lands in it).
            full = n_in // bt
            total = n_in + n_out
            extra = -(-total // bt) - full
            ctx = ids[:full] + list(range(next_id, next_id + extra))
            next_id += extra
            ctx_len = total
            t = t if t is not None else (t_prev if t_prev is not None else None)
            t_prev = t
            hashed = [((h * 0x9E3779B97F4A7C15) ^ key) & _MASK64 for h in ids]
            reqs.append((t, order, f"tl-{sid}-{k}", hashed, n_in, n_out,
                         k == len(rounds) - 1))
            if t is not None and (t0 is None or t < t0):
                t0 = t
    base = t0 or 0.0
    reqs.sort(key=lambda x: ((x[0] if x[0] is not None else base) - base, x[1]))
    out = []
    for t, _, rid, ids, n_in, n_out, last in reqs:
        prompt = (MooncakePrompt(ids, n_in, vocab_size, block_tokens=bt) if lazy else
                  mooncake_tokens(ids, block_tokens=bt, vocab_size=vocab_size)[:n_in].tolist())
        hint = RetentionHints(ttl_s=ttl_s, session_end=last) if hints else None
        out.append(TraceRequest(id=rid, prompt=prompt, output_len=n_out,
                                timestamp=max(0.0, (t if t is not None else base) - base),
                                retention=hint))
    return iter(out)


READERS = {"bailian": read_bailian, "claude_code": read_claude_code, "agentx": read_agentx,
           "tracelab": read_tracelab}
