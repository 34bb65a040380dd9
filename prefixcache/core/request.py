"""Requests as the KV cache manager sees them: token ids, hash extra keys, block hashes.

A `Request` owns a copy of its prompt, the output tokens appended so far, the scheduler's
``num_computed_tokens`` and the digests of its full blocks. The digests are computed
incrementally by the `BlockHasher` bound to it (the KV cache manager binds its hasher on
first use): appending tokens hashes only blocks that became full, so a decode step costs
O(1) amortised and earlier blocks are never rehashed.
"""

from __future__ import annotations

import array
import operator
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixcache._validate import (
    ArgumentTypeError, check_int, check_int_sequence, check_path, check_token_array,
)
from prefixcache.core.hashing import BlockHasher, block_extra_keys

__all__ = ["LoRARequest", "MultiModalFeature", "ReadOnlyList", "Request", "RetentionHints"]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return int(v)


def _checked_priority(request_id: Any, value: Any) -> int:
    """A priority that is not a Python int: a numpy integer as ``int`` (the one rule for
    ints, ``_validate.check_int``); anything else (None, NaN, a float, a bool, a str)
    refused naming the request."""
    try:
        return check_int("priority", value)
    except ArgumentTypeError:
        raise ArgumentTypeError(
            f"request {request_id!r}: priority must be an int, got {value!r}") from None


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """One multimodal item (an image, an audio clip) in a prompt.

    Attributes:
      identifier: content hash of the item (vLLM's ``mm_hash``); enters the block keys.
      offset: position of the item's first placeholder token in the prompt, >= 0.
      length: number of placeholder tokens, > 0.
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self):
        if not isinstance(self.identifier, str) or not self.identifier:
            raise ValueError(
                f"MultiModalFeature.identifier must be a non-empty str, got {self.identifier!r}"
            )
        object.__setattr__(self, "offset", _check_int("MultiModalFeature.offset", self.offset, 0))
        object.__setattr__(self, "length", _check_int("MultiModalFeature.length", self.length, 1))

    @property
    def end(self) -> int:
        """One past the last placeholder token."""
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter. Name and path both enter every block key (vLLM 0.33): re-pointing
    a name at another adapter does not reuse KV computed with the previous one.

    ``int_id`` is vLLM's ``lora_int_id`` (an integer >= 1 its frontend assigns, unique
    per adapter): it does not enter block keys; KV events carry it as ``lora_id``
    (``None`` when not given).
    """

    name: str
    path: str
    int_id: int | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LoRARequest.name must be a non-empty str, got {self.name!r}")
        # The one path rule (_validate.check_path): a str or os.PathLike (pathlib.Path),
        # stored as its str -- the same block keys as the str path, as the adapter
        # loader reads it.
        object.__setattr__(self, "path", check_path("LoRARequest.path", self.path))
        i = self.int_id
        if i is not None:
            if type(i) is not int:  # numpy ints are ints (one rule: _validate)
                try:
                    i = check_int("LoRARequest.int_id", i)
                except ArgumentTypeError:
                    raise ArgumentTypeError(
                        f"LoRARequest.int_id must be None or an int >= 1, got {i!r}") from None
                object.__setattr__(self, "int_id", i)
            if i < 1:
                raise ValueError(f"LoRARequest.int_id must be None or an int >= 1, got {i!r}")


def _finite_positive(name: str, value: Any) -> float | None:
    """``None``, or ``value`` as a float when it is a finite real number > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ArgumentTypeError(f"RetentionHints.{name} must be a number > 0 or None, "
                                f"got {value!r}")
    v = float(value)
    if not (v > 0 and v != float("inf")):
        raise ValueError(f"RetentionHints.{name} must be a finite number > 0 or None, "
                         f"got {value!r}")
    return v


@dataclass(frozen=True, slots=True)
class RetentionHints:
    """What a client says about keeping a request's KV cache (agent retention hints).

    An agent loop re-sends its context after every tool call; the client knows what a
    cache cannot: that the next call comes in a few seconds (keep this), that a
    sub-agent is done (drop its private blocks), that the system prompt and tools are
    worth keeping beyond the session. The ``hinted`` eviction policy reads these;
    every other policy ignores them, and a request without hints (``None``, the
    default) is cached exactly as before.

    Attributes:
      priority: an int, larger = kept longer (among blocks whose hint is in force).
      ttl_s: seconds after the request's last use of a block during which the hint
        holds (``None``: no limit in seconds).
      ttl_steps: the same in the driver's steps (the replay's requests, the
        scheduler's steps); ``None``: no limit in steps. The policy reads the TTL of
        its own clock (``unit``).
      keep_range: ``(start, end)`` prompt token positions the hint applies to (a
        block is covered when its tokens lie inside the range); ``None``: the whole
        request. Blocks outside the range get no protection.
      session_end: this is the session's (or sub-agent's) last request: once it
        releases them, its blocks outside ``keep_range`` are evicted before any
        other block.
    """

    priority: int = 0
    ttl_s: float | None = None
    ttl_steps: float | None = None
    keep_range: tuple[int, int] | None = None
    session_end: bool = False

    def __post_init__(self):
        p = self.priority
        if type(p) is not int:
            try:
                p = check_int("RetentionHints.priority", p)
            except ArgumentTypeError:
                raise ArgumentTypeError(
                    f"RetentionHints.priority must be an int, got {p!r}") from None
            object.__setattr__(self, "priority", p)
        object.__setattr__(self, "ttl_s", _finite_positive("ttl_s", self.ttl_s))
        object.__setattr__(self, "ttl_steps", _finite_positive("ttl_steps", self.ttl_steps))
        kr = self.keep_range
        if kr is not None:
            if isinstance(kr, (str, bytes)) or not isinstance(kr, Sequence) or len(kr) != 2:
                raise ArgumentTypeError(
                    f"RetentionHints.keep_range must be a (start, end) pair of ints or "
                    f"None, got {kr!r}")
            start = _check_int("RetentionHints.keep_range start", kr[0], 0)
            end = _check_int("RetentionHints.keep_range end", kr[1], 0)
            if end <= start:
                raise ValueError(f"RetentionHints.keep_range must satisfy 0 <= start < end, "
                                 f"got {tuple(kr)!r}")
            object.__setattr__(self, "keep_range", (start, end))
        if not isinstance(self.session_end, (bool, np.bool_)):
            raise ArgumentTypeError(f"RetentionHints.session_end must be True or False, "
                                    f"got {self.session_end!r}")
        object.__setattr__(self, "session_end", bool(self.session_end))

    @classmethod
    def from_dict(cls, d: Any) -> RetentionHints:
        """From a JSON object (the server's ``retention`` field, a trace line): the field
        names above; an unknown name is a ``ValueError`` naming it."""
        if not isinstance(d, dict):
            raise ArgumentTypeError(f"retention must be an object (a dict), got {d!r}")
        unknown = sorted(set(d) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise ValueError(f"retention: unknown field(s) {unknown}; expected some of "
                             f"{sorted(cls.__dataclass_fields__)}")
        return cls(**d)

    def to_dict(self) -> dict:
        """The fields that differ from the defaults, as a JSON object."""
        out: dict[str, Any] = {}
        if self.priority:
            out["priority"] = self.priority
        if self.ttl_s is not None:
            out["ttl_s"] = self.ttl_s
        if self.ttl_steps is not None:
            out["ttl_steps"] = self.ttl_steps
        if self.keep_range is not None:
            out["keep_range"] = list(self.keep_range)
        if self.session_end:
            out["session_end"] = True
        return out


def check_retention(request_id: Any, value: Any) -> RetentionHints | None:
    """``None``, a `RetentionHints`, or one built from a dict; anything else refused
    naming the request."""
    if value is None or isinstance(value, RetentionHints):
        return value
    if isinstance(value, dict):
        return RetentionHints.from_dict(value)
    raise ArgumentTypeError(f"request {request_id!r}: retention must be a RetentionHints, "
                            f"a dict or None, got {value!r}")


class ReadOnlyList(Sequence):
    """A read-only view of a list or array (vLLM's ConstantList): O(1) to create, follows
    the underlying sequence.

    Slicing returns a plain list copy; iteration and ``len`` run at list speed.
    """

    __slots__ = ("_x",)

    def __init__(self, x: Sequence):
        self._x = x

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self._x[index])
        return self._x[index]

    def __len__(self) -> int:
        return len(self._x)

    def __iter__(self) -> Iterator:
        return iter(self._x)

    def __reversed__(self) -> Iterator:
        return reversed(self._x)

    def __contains__(self, value) -> bool:
        return value in self._x

    def __eq__(self, other) -> bool:
        if isinstance(other, ReadOnlyList):
            other = other._x
        elif not isinstance(other, (list, tuple)):
            return NotImplemented
        return len(self._x) == len(other) and all(a == b for a, b in zip(self._x, other))

    __hash__ = None  # mutable underneath

    def copy(self) -> list:
        return list(self._x)

    tolist = copy

    def __repr__(self) -> str:
        return f"ReadOnlyList({self._x!r})"


def _validated_tokens(name: str, token_ids: Any) -> array.array:
    """A fresh ``array('Q')`` of the token ids, or ValueError naming the first bad id.

    NOTE: values only: numpy ints (and bools, an int subclass) are stored as the int of
    the same value. Ids must lie in [0, 2**64).
    """
    if type(token_ids) is list:
        # The common case: array checks every id at C speed; NOTE: fromlist reads the
        # list directly (~30% faster than array("Q", list), which goes through the
        # generic sequence protocol per item) and appends nothing on error.
        out = array.array("Q")
        try:
            out.fromlist(token_ids)
            return out
        except (OverflowError, TypeError):
            pass  # below: the error names the first bad id
    if isinstance(token_ids, np.ndarray):
        check_token_array(name, token_ids)
        out = array.array("Q")
        out.frombytes(token_ids.astype(np.uint64).tobytes())
        return out
    # Sets, dicts, strings, non-iterables: ArgumentTypeError (a ValueError) naming `name`.
    check_int_sequence(name, token_ids)
    if not hasattr(token_ids, "__len__") or isinstance(token_ids, bytearray):
        token_ids = list(token_ids)  # (array() would read a bytearray's raw bytes)
    try:
        # NOTE: array checks every id at C speed (int or __index__, 0 <= id < 2**64:
        # OverflowError or TypeError otherwise); measured ~15% faster than packing the
        # ids with struct and copying the bytes.
        out = array.array("Q", token_ids)
    except (OverflowError, TypeError):
        for i, t in enumerate(token_ids):
            try:
                v = operator.index(t)
            except TypeError:
                raise ValueError(f"{name}[{i}] = {t!r} is not an int token id") from None
            if v < 0:
                raise ValueError(f"{name}[{i}] = {v} is a negative token id") from None
            if v >= 2**64:
                raise ValueError(f"{name}[{i}] = {v} is not below 2**64") from None
        raise  # pragma: no cover - array rejected something the loop accepts
    return out


class Request:
    """A request's tokens, hash extra keys and block hashes.

    Invariants:
      - ``all_token_ids == prompt_token_ids + output_token_ids``; all ids are ints >= 0;
        the prompt is non-empty and a private copy.
      - ``mm_features`` are sorted by offset, lie inside the prompt and do not overlap.
      - ``num_preemptions >= 0``.
      - ``num_computed_tokens`` is a plain attribute (vLLM's): the scheduler advances
        it and keeps it an int in ``[0, num_tokens]``; the KV cache manager checks it
        whenever it acts on it (a bad value: ``ValueError``, nothing changed).
      - once a hasher is bound: ``block_hashes[i]`` is the digest of tokens
        ``[i * block_size, (i + 1) * block_size)`` chained from block 0, for every full
        block (computed lazily, never recomputed); the binding never changes.
    """

    __slots__ = (
        "_request_id",
        "_tokens",
        "_num_prompt_tokens",
        "num_computed_tokens",
        "_num_preemptions",
        "_mm_features",
        "_lora",
        "_cache_salt",
        "_cache_salt_offset",
        "_hasher",
        "_block_size",
        "_block_hashes",
        "_plain_from",
        "_plain_tag",
        "_tokens_view",
        "_hashes_view",
        "_priority",
        "_retention",
    )

    def __init__(
        self,
        request_id: Any,
        prompt_token_ids: Sequence[int],
        *,
        mm_features: Sequence[MultiModalFeature] = (),
        lora: LoRARequest | None = None,
        cache_salt: str | None = None,
        cache_salt_offset: int = 0,
        hasher: BlockHasher | None = None,
        block_size: int | None = None,
        priority: int = 0,
        retention: RetentionHints | None = None,
    ):
        """Args:
        request_id: hashable id, unique among live requests of a manager.
        prompt_token_ids: the prompt, non-empty, ints >= 0 (copied).
        mm_features: multimodal items within the prompt (any order; stored sorted).
        lora: the LoRA adapter, or None.
        cache_salt: isolates this request's cache (enters block 0's key); "" = none.
        cache_salt_offset: the first prompt position the salt protects (not vLLM; 0,
          the default, is vLLM's behaviour bit for bit). The salt then enters the key
          of the block holding this token instead of block 0's, and reaches later
          blocks through the parent chain: the blocks before it (a public system
          prompt) stay shareable across salts; no block from it on is. Needs a
          non-empty salt when > 0 and must be < the prompt length.
        hasher, block_size: bind a hasher now (else the manager binds its own).
        priority: the request's priority (an int; larger = more important), read by
          the ``priority`` eviction policy (SGLang's: blocks of lower-priority requests
          are evicted first). Settable later (``request.priority = 3``); the setter
          refuses a non-int (None, NaN, a bool, a float) before anything changes, so a
          policy never reads a value it cannot order.
        retention: the client's `RetentionHints` (or a dict of their fields), read
          by the ``hinted`` eviction policy; ``None`` (the default): no hints.

        Raises:
          ValueError: empty prompt, bad token ids, bad multimodal ranges, bad salt,
            lora or hasher/block size, a priority that is not an int.
        """
        try:
            hash(request_id)
        except TypeError:
            raise ValueError(f"request_id must be hashable, got {request_id!r}") from None
        tokens = _validated_tokens("prompt_token_ids", prompt_token_ids)
        if not tokens:
            raise ValueError(f"request {request_id!r}: empty prompt")
        n = len(tokens)
        features = []
        for f in mm_features or ():
            if not isinstance(f, MultiModalFeature):
                raise ValueError(
                    f"request {request_id!r}: mm_features items must be MultiModalFeature, got {f!r}"
                )
            features.append(f)
        if len(features) > 1:
            features.sort(key=lambda f: f.offset)
        for f in features:
            if f.offset + f.length > n:
                raise ValueError(
                    f"request {request_id!r}: multimodal item {f.identifier!r} covers tokens "
                    f"[{f.offset}, {f.offset + f.length}) beyond the {n}-token prompt"
                )
        for a, b in zip(features, features[1:]):
            if b.offset < a.offset + a.length:
                raise ValueError(
                    f"request {request_id!r}: multimodal items {a.identifier!r} "
                    f"[{a.offset}, {a.end}) and {b.identifier!r} [{b.offset}, {b.end}) overlap"
                )
        if lora is not None and not isinstance(lora, LoRARequest):
            raise ValueError(f"request {request_id!r}: lora must be a LoRARequest, got {lora!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"request {request_id!r}: cache_salt must be a str, got {cache_salt!r}")
        cache_salt_offset = _check_int("cache_salt_offset", cache_salt_offset, 0)
        if cache_salt_offset and not cache_salt:
            raise ValueError(
                f"request {request_id!r}: cache_salt_offset={cache_salt_offset} needs a "
                "non-empty cache_salt"
            )
        if cache_salt_offset >= n:
            raise ValueError(
                f"request {request_id!r}: cache_salt_offset={cache_salt_offset} is not "
                f"inside the {n}-token prompt"
            )
        if type(priority) is not int:
            priority = _checked_priority(request_id, priority)
        self._priority = priority
        self._retention = check_retention(request_id, retention)
        if (hasher is None) != (block_size is None):
            raise ValueError(
                f"request {request_id!r}: pass hasher and block_size together (or neither)"
            )
        self._request_id = request_id
        self._tokens = tokens
        self._num_prompt_tokens = n
        # NOTE: a plain attribute, not a validated property: the decode loop reads and
        # writes it every step, and a property's Python frame per access cost ~7% of
        # a whole replay's instructions (multi_turn, cachegrind). The manager checks it.
        self.num_computed_tokens = 0
        self._num_preemptions = 0
        self._mm_features = tuple(features)
        self._lora = lora
        self._cache_salt = cache_salt
        self._cache_salt_offset = cache_salt_offset
        self._hasher: BlockHasher | None = None
        self._block_size: int | None = None
        self._block_hashes: list[bytes] = []
        self._plain_from = sys.maxsize  # see bind_hasher
        self._plain_tag: tuple | None = None
        self._tokens_view = ReadOnlyList(self._tokens)
        self._hashes_view = ReadOnlyList(self._block_hashes)
        if hasher is not None:
            self.bind_hasher(hasher, block_size)

    # -- identity and tokens --------------------------------------------------------
    @property
    def request_id(self) -> Any:
        return self._request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        """A copy of the prompt (ints)."""
        return self._tokens[: self._num_prompt_tokens].tolist()

    @property
    def priority(self) -> int:
        """The request's priority (an int; larger = more important)."""
        return self._priority

    @priority.setter
    def priority(self, value) -> None:
        # NOTE: validated where the value enters: a None or NaN priority set
        # after construction made free() raise halfway under the priority policy.
        if type(value) is not int:
            value = _checked_priority(self._request_id, value)
        self._priority = value

    @property
    def retention(self) -> RetentionHints | None:
        """The client's retention hints (``None``: none)."""
        return self._retention

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the output tokens appended so far."""
        return self._tokens[self._num_prompt_tokens :].tolist()

    @property
    def num_output_tokens(self) -> int:
        return len(self._tokens) - self._num_prompt_tokens

    @property
    def all_token_ids(self) -> ReadOnlyList:
        """Prompt + output tokens: a read-only view (O(1)), follows later appends."""
        return self._tokens_view

    def token_bytes(self, start: int = 0, end: int | None = None) -> bytes:
        """Tokens ``[start, end)`` as their native u64 bytes (8 per id, as stored).

        An exact, injective encoding of the ids (equal bytes iff equal ids) that costs
        one copy and no per-id Python ints: the radix index keys blocks by it.
        """
        return self._tokens[start:end].tobytes()

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def num_preemptions(self) -> int:
        """Times the scheduler preempted this request (by recompute); 0 for a new one.

        The scheduler increments it when it preempts; the manager's prefix-cache stats
        count lookups of requests with ``num_preemptions > 0`` as ``preempted``.
        """
        return self._num_preemptions

    @num_preemptions.setter
    def num_preemptions(self, value: int) -> None:
        self._num_preemptions = _check_int("num_preemptions", value, 0)

    @property
    def mm_features(self) -> tuple[MultiModalFeature, ...]:
        """Sorted by offset."""
        return self._mm_features

    @property
    def lora(self) -> LoRARequest | None:
        return self._lora

    @property
    def cache_salt(self) -> str | None:
        return self._cache_salt

    @property
    def cache_salt_offset(self) -> int:
        """The first prompt position the salt protects (0: all of it, vLLM's)."""
        return self._cache_salt_offset

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append sampled token(s). Validates all before appending any.

        Raises:
          ValueError: a negative or non-int id (nothing appended).
        """
        if type(token_ids) is int and 0 <= token_ids < 2**64:  # the decode fast path
            self._tokens.append(token_ids)
            return
        try:
            single = operator.index(token_ids)
        except TypeError:
            new = _validated_tokens("output token ids", token_ids)
        else:
            new = _validated_tokens("output token ids", [single])
        self._tokens.extend(new)

    # -- hashing --------------------------------------------------------------------
    @property
    def hasher(self) -> BlockHasher | None:
        return self._hasher

    @property
    def block_size(self) -> int | None:
        """Block size of the bound hasher (None before binding)."""
        return self._block_size

    def bind_hasher(self, hasher: BlockHasher, block_size: int) -> None:
        """Bind the hasher and block size the block hashes are computed with.

        Binding the same (equal hasher, same block size) again is a no-op.

        Raises:
          ValueError: not a BlockHasher, block_size <= 0, or already bound to a different
            hasher or block size (the digests would silently change meaning).
        """
        if hasher is self._hasher and block_size == self._block_size:
            return  # the manager's per-call re-bind: nothing to check
        if not isinstance(hasher, BlockHasher):
            raise ValueError(f"hasher must be a BlockHasher, got {hasher!r}")
        block_size = _check_int("block_size", block_size, 1)
        if self._hasher is not None:
            if self._hasher == hasher and self._block_size == block_size:
                return
            raise ValueError(
                f"request {self._request_id!r} is bound to {self._hasher!r} with block size "
                f"{self._block_size}; cannot rebind to {hasher!r} with block size {block_size}"
            )
        # NOTE: the decode fast path (`block_hashes`): blocks from _plain_from on carry
        # at most the LoRA key -- past every multimodal item and the salted block.
        tag = hasher.plain_block_tag(block_size, self._lora)
        plain_from = sys.maxsize
        if tag is not None:
            feats = self._mm_features
            mm_end = (
                feats[-1].offset + feats[-1].length if feats else 0  # sorted, disjoint
            )
            salted = self._cache_salt_offset // block_size + 1 if self._cache_salt else 0
            plain_from = max(-(-mm_end // block_size), salted)
        self._plain_tag = tag
        self._plain_from = plain_from
        self._hasher = hasher
        self._block_size = block_size

    @property
    def block_hashes(self) -> ReadOnlyList:
        """Digests of all full blocks of ``all_token_ids`` (read-only view).

        Computed lazily on access: only blocks that became full since the last access are
        hashed, chained from the last known digest.

        Raises:
          ValueError: no hasher bound yet.
        """
        if self._hasher is None:
            raise ValueError(
                f"request {self._request_id!r}: no hasher bound (bind_hasher or pass "
                "hasher= and block_size=)"
            )
        hashes = self._block_hashes
        bs = self._block_size
        n = len(hashes)
        end = (n + 1) * bs
        tokens = self._tokens
        if end <= len(tokens):
            if end + bs > len(tokens) and n >= self._plain_from:
                # Decode: exactly one new full block, no per-position extra keys; its
                # tokens are already valid (array('Q')): straight to serializer + digest.
                hashes.append(
                    self._hasher.hash_plain_block(
                        hashes[-1] if n else self._hasher.root,
                        tokens[end - bs : end],
                        self._plain_tag,
                    )
                )
            else:
                self._hash_new_blocks()
        return self._hashes_view

    @property
    def num_block_hashes(self) -> int:
        """Number of full blocks (== len(block_hashes)); needs a bound hasher."""
        return len(self.block_hashes)

    def adopt_block_hashes(self, hashes: Sequence[bytes]) -> None:
        """Take given digests for the first ``len(hashes)`` full blocks instead of hashing
        their tokens (whose ids are then never read for hashing).

        For callers that key blocks by something other than token ids: the replay of a
        Mooncake trace keys them by its hash ids (`BlockHasher.hash_keyed_blocks`); the
        manager matches prefixes by these digests, and later blocks (decode) are hashed
        from their tokens as usual, chained from the last adopted digest.

        Raises:
          ValueError: no hasher bound, some block already hashed, more hashes than full
            blocks, or an item that is not bytes of the hasher's digest size.
        """
        if self._hasher is None or self._block_hashes:
            raise ValueError(
                f"request {self._request_id!r}: adopt_block_hashes needs a bound hasher "
                "and no block hashed yet"
            )
        hashes = list(hashes)
        ds = self._hasher.digest_size
        if len(hashes) * self._block_size > len(self._tokens):
            raise ValueError(
                f"request {self._request_id!r}: {len(hashes)} hashes for "
                f"{len(self._tokens) // self._block_size} full blocks"
            )
        if not all(type(h) is bytes and len(h) == ds for h in hashes):
            raise ValueError(f"request {self._request_id!r}: hashes must be {ds}-byte bytes")
        self._block_hashes.extend(hashes)

    def _hash_new_blocks(self) -> None:
        hashes = self._block_hashes
        bs = self._block_size
        start = len(hashes)
        salt_block = self._cache_salt_offset // bs
        if salt_block and start <= salt_block < len(self._tokens) // bs:
            self._hash_through_salt_block(start, salt_block)
            start = salt_block + 1
        # NOTE: only the new full blocks' tokens are read (the hasher slices from
        # start * bs), so this is O(new tokens), not O(all tokens).
        hashes.extend(
            self._hasher.hash_token_blocks(
                self._tokens,
                bs,
                lora=self._lora,
                mm_features=self._mm_features,
                cache_salt=None if salt_block else self._cache_salt,
                parent=hashes[-1] if hashes else None,
                start_block=start,
            )
        )

    def _hash_through_salt_block(self, start: int, salt_block: int) -> None:
        """Hashes blocks ``start .. salt_block`` when the salt sits past block 0.

        NOTE: blocks before the salted one are hashed unsalted (they match every
        other request's); the salted block's key is the spec's -- ``block_extra_keys``
        with the salt, as vLLM writes block 0's -- built by the reference path (once
        per request); later blocks chain from it unsalted.
        """
        hashes = self._block_hashes
        bs = self._block_size
        hasher = self._hasher
        tokens = self._tokens
        if start < salt_block:
            hashes.extend(
                hasher.hash_token_blocks(
                    tokens[: salt_block * bs],
                    bs,
                    lora=self._lora,
                    mm_features=self._mm_features,
                    parent=hashes[-1] if hashes else None,
                    start_block=start,
                )
            )
        lo = salt_block * bs
        keys = block_extra_keys(
            lo, lo + bs, lora=self._lora, mm_features=self._mm_features,
            cache_salt=self._cache_salt, is_first_block=True,
        )
        hashes.append(hasher.hash_block(hashes[-1], tokens[lo : lo + bs], keys))

    def __repr__(self) -> str:
        return (
            f"Request(id={self._request_id!r}, num_prompt_tokens={self._num_prompt_tokens}, "
            f"num_tokens={len(self._tokens)}, num_computed_tokens={self.num_computed_tokens!r})"
        )
