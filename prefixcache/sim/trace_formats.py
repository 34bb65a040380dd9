"""Readers for public hash-id traces beyond Mooncake's: Qwen-Bailian and Claude Code.

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
from typing import Iterator

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

BLOCK_TOKENS = {"bailian": 16, "claude_code": 64}
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
                     session_interval: float = 0.0, lazy: bool = False
                     ) -> Iterator[TraceRequest]:
    """Stream a Claude Code agent trace (module docstring), in order of arrival.

    Args:
        path: one session per JSON line (gzip when the name ends in ``.gz``).
        vocab_size: token ids of the expanded blocks lie in ``[1, vocab_size)``.
        session_interval: seconds between the starts of consecutive sessions (>= 0).
        lazy: prompts are ``MooncakePrompt``s of the session's ``block_size``-token ids
            (local ids already keyed by the session), not expanded.

    NOTE: the whole file is read before the first request is yielded (sessions overlap
    in time, so the first arrival may be in the last line): memory O(trace).
    """
    if isinstance(session_interval, bool) or not _is_time(session_interval) or session_interval < 0:
        raise ValueError(f"session_interval must be a finite number >= 0, "
                         f"got {session_interval!r}")
    return _read_claude_code(os.fspath(path), vocab_size, float(session_interval), bool(lazy))


def _read_claude_code(path: str, vocab_size: int, session_interval: float, lazy: bool
                      ) -> Iterator[TraceRequest]:
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
        for i, r in enumerate(reqs):
            rw = f"{where}: requests[{i}]"
            if not isinstance(r, dict):
                raise TraceError(f"{rw}: expected an object, got {type(r).__name__}")
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
            heapq.heappush(heap, (ts, order, i, TraceRequest(
                id=f"cc-{sid}-{i}", prompt=prompt, output_len=r["out"],
                timestamp=ts)))
            order += 1
    while heap:
        yield heapq.heappop(heap)[3]


READERS = {"bailian": read_bailian, "claude_code": read_claude_code}
