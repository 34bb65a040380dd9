"""Request traces: the JSONL format shared with ``experiments/peers/`` and Mooncake traces.

Our format (JSON lines, arrival order, one request per line)::

    {"id": str, "prompt": [int], "output_len": int, "cache_salt": str | null,
     "lora": [name, path] | null, "mm": [[identifier, offset, length], ...],
     "timestamp": float (seconds, optional), "priority": int (optional, default 0),
     "retention": {"priority", "ttl_s", "ttl_steps", "keep_range", "session_end"}
                  (optional: the client's retention hints, ``RetentionHints``)}

Mooncake format (``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``):
each hash id stands for a 512-token block; ``len(hash_ids) == ceil(input_length /
512)``. ``read_trace`` expands every hash id into a deterministic block of token ids
(equal ids give equal blocks, different ids different blocks with overwhelming
probability), truncates the last block to ``input_length``, names the request
``f"mc-{line_number}"`` and converts the timestamp to seconds. With
``mooncake_tokens="lazy"`` the prompt is a `MooncakePrompt` instead of a list: the same
token ids, expanded only where read, and its ``hash_ids``; the replay then keys the
prompt's blocks by the hash ids themselves (see ``prefixcache.sim.replay``). The
Qwen-Bailian (16 tokens per id) and Claude Code (64) readers of
``prefixcache.sim.trace_formats`` take the same option (the prompt's ``block_tokens``).

Decode tokens are a function of the request id: step ``k`` of request ``id`` emits
``output_token(id, k) = 1 + crc32(f"{id}:{k}") % 1000``, so multi-turn traces can embed
an earlier turn's output in the next prompt.
"""

from __future__ import annotations

import array
import dataclasses
import gzip
import json
import math
import operator
import os
import tempfile
import zlib
from collections.abc import Sequence
from typing import Any, Iterable, Iterator

import numpy as np

from prefixcache._validate import check_int_sequence, check_path
from prefixcache.core.request import RetentionHints, check_retention

MOONCAKE_BLOCK_TOKENS = 512
DEFAULT_VOCAB_SIZE = 32000
TRACE_FORMATS = ("auto", "jsonl", "mooncake", "bailian", "claude_code", "agentx", "tracelab")


class TraceError(ValueError):
    """A malformed trace line; the message names the file, line and field."""


@dataclasses.dataclass(slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        id: unique request id (also seeds its decode tokens).
        prompt: prompt token ids (non-negative ints, at least one).
        output_len: tokens to generate (>= 0; a replay samples at least one).
        cache_salt: per-tenant salt of the first block's key, or ``None``.
        lora: ``(name, path)`` of the LoRA adapter, or ``None``.
        mm: multimodal items ``(identifier, offset, length)``, sorted by offset,
            inside the prompt and not overlapping.
        timestamp: arrival time in seconds, or ``None``.
        retention: the client's retention hints (``RetentionHints``; the ``hinted``
            eviction policy reads them), or ``None``.
        priority: the request's priority (larger = more important; the ``priority``
            eviction policy reads it), default 0.
    """

    id: str
    prompt: list[int]
    output_len: int
    cache_salt: str | None = None
    lora: tuple[str, str] | None = None
    mm: tuple[tuple[str, int, int], ...] = ()
    timestamp: float | None = None
    priority: int = 0
    retention: RetentionHints | None = None

    def __post_init__(self):
        # NOTE: only the cheap checks (the readers validate every field; generators and
        # hand-built requests get these): a float or str output_len would otherwise
        # fail inside a replay after the request was admitted. Token ids are checked
        # by `Request` before any manager state changes.
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"TraceRequest.id must be a non-empty str, got {self.id!r}")
        check_int_sequence(f"TraceRequest {self.id!r} prompt", self.prompt)
        # numpy ints are ints (the one rule, prefixcache._validate), stored as int.
        if type(self.output_len) is not int and isinstance(self.output_len, np.integer):
            self.output_len = int(self.output_len)
        if type(self.priority) is not int and isinstance(self.priority, np.integer):
            self.priority = int(self.priority)
        if not _is_int(self.output_len) or self.output_len < 0:
            raise ValueError(f"TraceRequest {self.id!r}: output_len must be an int >= 0, "
                             f"got {self.output_len!r}")
        if self.timestamp is not None and (not _is_time(self.timestamp)
                                           or self.timestamp < 0):
            raise ValueError(f"TraceRequest {self.id!r}: timestamp must be a finite number "
                             f">= 0 (seconds) or None, got {self.timestamp!r}")
        if not _is_int(self.priority):
            raise ValueError(f"TraceRequest {self.id!r}: priority must be an int, "
                             f"got {self.priority!r}")
        if self.retention is not None and not isinstance(self.retention, RetentionHints):
            self.retention = check_retention(self.id, self.retention)

    def to_json(self) -> dict[str, Any]:
        """The JSONL object of this request (our format)."""
        d: dict[str, Any] = {
            "id": self.id,
            "prompt": self.prompt if type(self.prompt) is list else list(self.prompt),
            "output_len": self.output_len,
            "cache_salt": self.cache_salt,
            "lora": list(self.lora) if self.lora is not None else None,
            "mm": [list(m) for m in self.mm],
        }
        if self.timestamp is not None:
            d["timestamp"] = self.timestamp
        if self.priority:
            d["priority"] = self.priority  # only when set: older readers see no change
        if self.retention is not None:
            d["retention"] = self.retention.to_dict()
        return d


def output_token(req_id: str, step: int) -> int:
    """Token emitted by request ``req_id`` at decode step ``step`` (0-based), in [1, 1000].

    Identical to ``output_token`` in ``experiments/peers/make_traces.py`` and
    ``vllm_replay.py`` (CRC32: stable across processes, unlike ``hash()``).
    """
    return 1 + (zlib.crc32(f"{req_id}:{step}".encode()) % 1000)


def output_tokens(req_id: str, n: int) -> list[int]:
    """``[output_token(req_id, k) for k in range(n)]``."""
    crc = zlib.crc32
    prefix = f"{req_id}:"
    return [1 + crc(f"{prefix}{k}".encode()) % 1000 for k in range(n)]


# ----------------------------------------------------------------------------- Mooncake
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mooncake_block_tokens(
    hash_id: int, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> np.ndarray:
    """The token ids a Mooncake hash id stands for: ``i64[block_tokens]`` in [1, vocab).

    splitmix64 of ``(hash_id, position)``: deterministic on every platform, equal ids
    give equal blocks, distinct ids give unrelated blocks.
    """
    return mooncake_tokens([hash_id], block_tokens=block_tokens, vocab_size=vocab_size)


def mooncake_tokens(
    hash_ids, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> np.ndarray:
    """``mooncake_block_tokens`` of every id, concatenated: ``i64[len(hash_ids) * block_tokens]``.

    NOTE: one vectorised splitmix64 over the whole prompt (elementwise, so equal to the
    blocks one by one); a call per block was a fifth of a Mooncake policy cell's time.
    """
    ids = np.fromiter((h & 0xFFFFFFFFFFFFFFFF for h in hash_ids), dtype=np.uint64)
    pos = np.arange(block_tokens, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = ((ids * np.uint64(block_tokens))[:, None] + pos[None, :]).ravel() * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(vocab_size - 1) + np.uint64(1)).astype(np.int64)


class MooncakePrompt(Sequence):
    """A hash-id prompt as its hash ids: the token ids a reader would expand them to,
    computed only where read (``mooncake_block_tokens`` of each id, the last block cut
    to the prompt's length). Any block size: Mooncake's 512 tokens per id, Qwen-Bailian's
    16, Claude Code's 64 (``block_tokens``; ``HashIdPrompt`` is the same class).

    Compares equal to the expanded list. The replay reads only ``hash_ids``,
    ``block_tokens`` and ``len()`` (the blocks' keys come from the ids; see
    ``prefixcache.sim.replay``).

    Attributes:
        hash_ids: the hash ids, one per ``block_tokens``-token block (the last may be
            partial).
        vocab_size: token ids lie in [1, vocab_size).
        block_tokens: tokens per hash id.
    """

    __slots__ = ("hash_ids", "vocab_size", "block_tokens", "_len")

    def __init__(self, hash_ids: Sequence[int], length: int, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 block_tokens: int = MOONCAKE_BLOCK_TOKENS):
        if not _is_int(block_tokens) or block_tokens <= 0:
            raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
        if length <= 0 or len(hash_ids) != math.ceil(length / block_tokens):
            raise ValueError(
                f"{len(hash_ids)} hash ids do not cover {length} tokens in "
                f"{block_tokens}-token blocks"
            )
        self.hash_ids = tuple(hash_ids)
        self.vocab_size = vocab_size
        self.block_tokens = block_tokens
        self._len = length

    def __len__(self) -> int:
        return self._len

    def block(self, k: int) -> np.ndarray:
        """Token ids of the k-th block (cut at the prompt's end): i64[<= block_tokens]."""
        bt = self.block_tokens
        toks = mooncake_block_tokens(self.hash_ids[k], block_tokens=bt,
                                     vocab_size=self.vocab_size)
        return toks[: self._len - k * bt]

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1 or start >= stop:
                return [self[i] for i in range(start, stop, step)]
            bt = self.block_tokens
            lo, hi = start // bt, (stop - 1) // bt + 1
            toks = np.concatenate([self.block(k) for k in range(lo, hi)])
            return toks[start - lo * bt : stop - lo * bt].tolist()
        i = operator.index(index)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("MooncakePrompt index out of range")
        return int(self.block(i // self.block_tokens)[i % self.block_tokens])

    def __iter__(self) -> Iterator[int]:
        for k in range(len(self.hash_ids)):
            yield from self.block(k).tolist()

    def tolist(self) -> list[int]:
        return self[:]

    def __eq__(self, other) -> bool:
        if isinstance(other, MooncakePrompt):
            return self.hash_ids == other.hash_ids and self._len == other._len and (
                self.vocab_size == other.vocab_size and self.block_tokens == other.block_tokens
            )
        if isinstance(other, (list, tuple)):
            return len(other) == self._len and self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # compares equal to lists

    def __repr__(self) -> str:
        return (f"MooncakePrompt({len(self.hash_ids)} hash ids of {self.block_tokens} "
                f"tokens, {self._len} tokens)")


HashIdPrompt = MooncakePrompt  # the general name: a prompt of any hash-id format


def check_hash_id_blocks(where: str, n_in, n_out, hash_ids, block_tokens: int,
                         names=("input_length", "output_length", "hash_ids")) -> None:
    """The checks every hash-id format shares (Mooncake, Bailian, Claude Code): a positive
    input length, an output length >= 0, and one non-negative int hash id per
    ``block_tokens``-token block of the input; a ``TraceError`` naming the field."""
    f_in, f_out, f_ids = names
    if not _is_int(n_in) or n_in <= 0:
        raise TraceError(f"{where}: field {f_in!r} must be a positive int, got {n_in!r}")
    if not _is_int(n_out) or n_out < 0:
        raise TraceError(f"{where}: field {f_out!r} must be an int >= 0, got {n_out!r}")
    if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
        raise TraceError(f"{where}: field {f_ids!r} must be a list of ints >= 0")
    need = math.ceil(n_in / block_tokens)
    if len(hash_ids) != need:
        raise TraceError(f"{where}: field {f_ids!r} has {len(hash_ids)} ids but {f_in}={n_in} "
                         f"needs ceil({n_in}/{block_tokens}) = {need}")


def _mooncake_request(
    obj: dict, where: str, lineno: int, vocab_size: int, lazy: bool = False
) -> TraceRequest:
    for field in ("input_length", "output_length", "hash_ids"):
        if field not in obj:
            raise TraceError(f"{where}: missing field {field!r} (Mooncake line)")
    n_in, n_out, hash_ids = obj["input_length"], obj["output_length"], obj["hash_ids"]
    check_hash_id_blocks(where, n_in, n_out, hash_ids, MOONCAKE_BLOCK_TOKENS)
    ts = obj.get("timestamp")
    if ts is not None and (not _is_time(ts) or ts < 0):
        raise TraceError(f"{where}: field 'timestamp' must be a finite number >= 0 (ms), "
                         f"got {ts!r}")
    if lazy:  # mooncake_tokens="lazy"
        return TraceRequest(
            id=f"mc-{lineno}",
            prompt=MooncakePrompt(hash_ids, n_in, vocab_size),
            output_len=int(n_out),
            timestamp=ts / 1000.0 if ts is not None else None,
        )
    prompt = mooncake_tokens(hash_ids, vocab_size=vocab_size)[:n_in].tolist()
    return TraceRequest(
        id=f"mc-{lineno}",
        prompt=prompt,
        output_len=int(n_out),
        timestamp=ts / 1000.0 if ts is not None else None,
    )


# ---------------------------------------------------------------------------- our JSONL
def _is_int(v: Any) -> bool:
    return type(v) is int


_INT_TYPE = {int}


def _is_time(v: Any) -> bool:
    """A finite number (not a bool): JSON admits NaN and Infinity."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _parse_request(obj: dict, where: str) -> TraceRequest:
    for field in ("id", "prompt", "output_len"):
        if field not in obj:
            raise TraceError(f"{where}: missing field {field!r}")
    rid = obj["id"]
    if not isinstance(rid, str) or not rid:
        raise TraceError(f"{where}: field 'id' must be a non-empty string, got {rid!r}")
    prompt = obj["prompt"]
    if not isinstance(prompt, list) or not prompt:
        raise TraceError(f"{where}: field 'prompt' must be a non-empty list of token ids")
    try:
        # NOTE: array.array rejects floats, strings and None at C speed (bools -- JSON
        # true/false -- pass it: the type set catches them).
        arr = array.array("q", prompt)
        if set(map(type, prompt)) != _INT_TYPE:
            raise TypeError
    except (TypeError, OverflowError):
        bad = next((t for t in prompt if not _is_int(t) or not 0 <= t < 2**63), None)
        raise TraceError(
            f"{where}: field 'prompt' holds a non-integer token id or one beyond 2**63: "
            f"{bad!r}") from None
    if min(arr) < 0:
        raise TraceError(f"{where}: field 'prompt' holds a negative token id {min(arr)}")
    output_len = obj["output_len"]
    if not _is_int(output_len) or output_len < 0:
        raise TraceError(f"{where}: field 'output_len' must be an int >= 0, got {output_len!r}")
    salt = obj.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise TraceError(f"{where}: field 'cache_salt' must be a string or null, got {salt!r}")
    lora = obj.get("lora")
    if lora is not None:
        if (
            not isinstance(lora, list)
            or len(lora) != 2
            or not all(isinstance(x, str) and x for x in lora)
        ):
            raise TraceError(f"{where}: field 'lora' must be [name, path] or null, got {lora!r}")
        lora = (lora[0], lora[1])
    mm_raw = obj.get("mm") or []
    if not isinstance(mm_raw, list):
        raise TraceError(f"{where}: field 'mm' must be a list of [identifier, offset, length]")
    mm = []
    n = len(prompt)
    for k, item in enumerate(mm_raw):
        if (
            not isinstance(item, list)
            or len(item) != 3
            or not isinstance(item[0], str)
            or not item[0]
            or not _is_int(item[1])
            or not _is_int(item[2])
        ):
            raise TraceError(
                f"{where}: field 'mm[{k}]' must be [identifier: str, offset: int, length: int], "
                f"got {item!r}"
            )
        ident, off, length = item
        if off < 0 or length <= 0 or off + length > n:
            raise TraceError(
                f"{where}: field 'mm[{k}]' range [{off}, {off + length}) is outside the "
                f"prompt of {n} tokens (or empty)"
            )
        mm.append((ident, off, length))
    mm.sort(key=lambda x: x[1])
    for a, b in zip(mm, mm[1:]):
        if b[1] < a[1] + a[2]:
            raise TraceError(
                f"{where}: field 'mm': items {a[0]!r} [{a[1]}, {a[1] + a[2]}) and {b[0]!r} "
                f"[{b[1]}, {b[1] + b[2]}) overlap"
            )
    ts = obj.get("timestamp")
    if ts is not None and (not _is_time(ts) or ts < 0):
        raise TraceError(f"{where}: field 'timestamp' must be a finite number >= 0 (seconds), got {ts!r}")
    priority = obj.get("priority", 0)
    if not _is_int(priority):
        raise TraceError(f"{where}: field 'priority' must be an int, got {priority!r}")
    retention = parse_retention(where, obj.get("retention"))
    return TraceRequest(
        id=rid,
        prompt=prompt,
        output_len=output_len,
        cache_salt=salt,
        lora=lora,
        mm=tuple(mm),
        timestamp=float(ts) if ts is not None else None,
        priority=priority,
        retention=retention,
    )


def parse_retention(where: str, value: Any) -> RetentionHints | None:
    """A trace line's ``retention`` object as `RetentionHints` (``None`` when absent); a
    bad one is a ``TraceError`` naming ``where`` and the field."""
    if value is None:
        return None
    try:
        return RetentionHints.from_dict(value)
    except (TypeError, ValueError) as e:
        raise TraceError(f"{where}: field 'retention': {e}") from None


def read_trace(
    path: str | os.PathLike,
    *,
    format: str = "auto",
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    mooncake_tokens: str = "expand",
) -> Iterator[TraceRequest]:
    """Stream the requests of a JSONL trace, validating each line.

    Args:
        path: the trace file (gzip-compressed when its name ends in ``.gz``).
        format: ``"jsonl"`` (ours), ``"mooncake"``, or ``"auto"`` (per line: a line
            with ``hash_ids`` is Mooncake); ``"bailian"`` / ``"claude_code"`` /
            ``"agentx"`` / ``"tracelab"``: the Qwen-Bailian, Claude Code, AgentX and
            TraceLab formats of ``prefixcache.sim.trace_formats`` (never guessed by
            ``"auto"``).
        vocab_size: token ids of expanded Mooncake blocks lie in ``[1, vocab_size)``.
        mooncake_tokens: ``"expand"`` (a hash-id prompt -- Mooncake, Bailian, Claude
            Code -- is the list of its token ids) or ``"lazy"`` (a `MooncakePrompt`:
            the same ids, expanded only where read, and the hash ids; the replay then
            keys blocks by hash ids -- same hits, evictions and records, no token
            hashing).

    Yields:
        ``TraceRequest`` per non-blank line, in file order (memory O(1) in the trace).

    Raises:
        TraceError: (a ``ValueError``) naming ``path:line`` and the bad field, when
            the line is reached.
        ValueError: unknown ``format``. FileNotFoundError: no such file.
    """
    if format not in TRACE_FORMATS:
        raise ValueError(f"unknown trace format {format!r}; expected one of {TRACE_FORMATS}")
    if not _is_int(vocab_size) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    if mooncake_tokens not in ("expand", "lazy"):
        raise ValueError(f"mooncake_tokens must be 'expand' or 'lazy', got {mooncake_tokens!r}")
    path = check_path("path", path)  # a str or os.PathLike (the one path rule)
    if format in ("bailian", "claude_code", "agentx", "tracelab"):  # formats of their own
        from prefixcache.sim.trace_formats import READERS  # noqa: PLC0415 (imports us)

        return READERS[format](path, vocab_size=vocab_size, lazy=mooncake_tokens == "lazy")
    return _read(path, format, vocab_size, mooncake_tokens == "lazy")


def json_objects(path: str) -> Iterator[tuple[int, str, dict]]:
    """``(line number, "path:line", object)`` per non-blank line of a JSONL file (gzip
    when the name ends in ``.gz``); every unreadable line is a ``TraceError`` naming it.

    NOTE: bytes, decoded line by line: a stray non-UTF-8 byte (or a corrupt gzip stream)
    is a TraceError naming its line, not a UnicodeDecodeError / OSError from the file
    iterator with no position. Shared by every reader (``trace_formats`` too).
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        lineno = 0
        lines = enumerate(f, start=1)
        while True:
            try:
                lineno, raw = next(lines)
            except StopIteration:
                return
            except (OSError, EOFError, zlib.error) as e:
                raise TraceError(
                    f"{path}:{lineno + 1}: unreadable ({type(e).__name__}: {e})") from None
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TraceError(
                    f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                    f"{e.start + 1})") from None
            obj = _loads(line, where)
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, where, obj


def _read(path: str, format: str, vocab_size: int, lazy: bool = False) -> Iterator[TraceRequest]:
    for lineno, where, obj in json_objects(path):
        if format == "mooncake" or (format == "auto" and "hash_ids" in obj):
            yield _mooncake_request(obj, where, lineno, vocab_size, lazy)
        else:
            yield _parse_request(obj, where)


def _loads(line: str, where: str) -> Any:
    """``json.loads`` with every failure as a TraceError naming the line."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from None
    except ValueError as e:  # e.g. an integer literal beyond int()'s digit limit
        raise TraceError(f"{where}: malformed JSON: {e}") from None
    except RecursionError:
        raise TraceError(f"{where}: malformed JSON: nested too deeply") from None


def write_trace(path: str | os.PathLike, requests: Iterable[TraceRequest | dict]) -> int:
    """Write requests as our JSONL format, atomically (temp file + rename).

    Args:
        path: destination; only replaced once every line was written.
        requests: ``TraceRequest`` objects or dicts already in the JSONL shape.

    Returns:
        The number of requests written.
    """
    path = check_path("path", path)  # a str or os.PathLike (the one path rule)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".trace-", suffix=".jsonl.tmp", dir=d)
    n = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in requests:
                obj = r.to_json() if isinstance(r, TraceRequest) else r
                f.write(json.dumps(obj, separators=(",", ":")) + "\n")
                n += 1
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return n
