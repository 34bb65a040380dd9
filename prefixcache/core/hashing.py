"""Block hashing: the prefix-cache key of every full KV block, byte-compatible with vLLM.

A block's digest is ``H(serialize((parent_digest, tuple(token_ids), extra_keys)))``
(vLLM 0.33's ``hash_block_tokens``):

- ``parent_digest`` is the digest of the previous block, or the chain root
  (``NONE_HASH``) for the first block; ``None`` or ``b""`` as a parent means the root.
- ``extra_keys`` is ``None`` or a tuple of labelled tuples, in this order:
  ``("lora", name, path)``, one ``("mm", identifier, item_offset - block_start)`` per
  multimodal item overlapping the block (offset order), ``("cache_salt", salt)`` on the
  first block only (an empty salt adds no key).
- ``serialize`` is a `HashSerializer` strategy object, registered by name in the
  read-only `SERIALIZERS`: ``pickle`` (``pickle.dumps(obj,
  protocol=pickle.HIGHEST_PROTOCOL)``, for ``sha256`` and ``xxhash``) or ``cbor``
  (``cbor2.dumps(obj, canonical=True)``, for ``sha256_cbor`` and ``xxhash_cbor``); ``H``
  is SHA-256 or ``xxhash.xxh3_128_digest`` (`DIGESTS`). An algorithm's name is the
  digest's plus the serializer's suffix (`HASH_ALGOS`, `split_hash_algo`).
- The root is ``H(serialize(seed))``. The seed is ``str(seed)`` when one is given; else
  ``PYTHONHASHSEED`` when set; else ``"vllm-none-hash"`` for the sha256 variants and 32
  fresh random bytes (hex) for the xxhash variants (a predictable seed would let an
  attacker precompute collisions of a non-cryptographic hash).

The spec, below in this order: the serializers and digests, the extra keys
(`block_extra_keys`, `canonical_extra_keys`), the token ids, then `BlockHasher`, whose
``hash_block`` is the spec itself. A serializer whose ``writer`` is None (any new one)
is written by its ``dumps`` only. For the two built-in serializers the hot path
(`BlockHasher.hash_token_blocks`, with the byte tables and helpers of
`prefixcache.core.hash_writers`) has two writers of the same bytes:

- vectorised (many blocks): the serialized keys of all blocks of a sequence are written
  at once with numpy, exactly as the serializers would (a constant head with a hole for
  the parent digest, each token's CBOR item / pickle opcode from a lookup table, the
  close of the token tuple and the extra keys); then the chain is walked: per block the
  parent digest is copied into the hole and a slice is hashed.
- per block (decode, short prompts): the serializer's C code per block; pickle gets the
  whole key (extra keys built once per request shape), CBOR the token array only, the
  extra keys serialized once per distinct value (cached on the hasher) spliced in.

Before either, a bounded per-hasher memo (parent digest, block tokens, serialized extra
keys) -> digest skips every block this hasher has already hashed: requests that share a
prefix (a system prompt, few-shot examples, an earlier turn) hash it once. Runs of 8
known blocks are also memoised whole, so a long shared prefix costs one lookup per run.

Tests pin every message of both writers byte for byte to ``pickle.dumps`` /
``cbor2.dumps(canonical=True)`` of the key tuple, and the digests to vLLM's own.
"""

from __future__ import annotations

import abc
import array
import hashlib
import operator
import os
import pickle
import struct
import sys
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Callable

import cbor2
import numpy as np

from prefixcache._validate import check_int_sequence, check_token_array
from prefixcache.core.hash_writers import (
    _MAX_STREAM_BLOCKS_CBOR,
    _MEMO_GROUP,
    _MEMO_GROUP_TOKENS,
    _MEMO_SIZE,
    _MIN_STREAM_BLOCKS_PICKLE,
    _MIN_STREAM_BS_PICKLE,
    _MIN_VECTOR_BLOCKS_CBOR,
    _PICKLE_PROTOCOL,
    FastWriters,
    _cbor_head,
    _has_high,
    _sha256_digest,
)

try:  # NOTE: optional, as in vLLM; only the xxhash algorithms need it.
    import xxhash as _xxhash

    if not hasattr(_xxhash, "xxh3_128_digest"):  # pragma: no cover - very old xxhash
        _xxhash = None
except ImportError:  # pragma: no cover - exercised only without xxhash installed
    _xxhash = None

__all__ = [
    "HASH_ALGOS",
    "DIGESTS",
    "SERIALIZERS",
    "CborSerializer",
    "HashSerializer",
    "PickleSerializer",
    "hash_algo_names",
    "register_serializer",
    "split_hash_algo",
    "DEFAULT_NONE_HASH_SEED",
    "LORA_LABEL",
    "MM_LABEL",
    "CACHE_SALT_LABEL",
    "PROMPT_EMBEDS_LABEL",
    "BlockHasher",
    "block_extra_keys",
    "canonical_extra_keys",
]


# -- the spec: serializers and digests ------------------------------------------------
class HashSerializer(abc.ABC):
    """How a block key (and the seed of the chain root) becomes bytes: the strategy of
    the spec, ``digest = H(serializer.dumps((parent, tuple(token_ids), extra_keys)))``.

    A serializer is one small object registered by name in `SERIALIZERS`; the hash
    algorithms are every digest (`DIGESTS`) with every serializer, named
    ``digest + serializer.suffix`` (``sha256``, ``sha256_cbor``, ...: `HASH_ALGOS`).

    Attributes:
        name: the registry key.
        suffix: appended to the digest's name to make the algorithm's name (``"_" +
            name`` unless set; pickle's is "" as in vLLM).
        writer: the fast writer that reproduces ``dumps`` byte for byte for block keys
            (``"pickle"`` or ``"cbor"``, in `prefixcache.core.hash_writers`), or None:
            then every key is written by ``dumps`` itself (correct, slower). A new
            serializer leaves it None.
    """

    name: str = ""
    writer: str | None = None

    @property
    def suffix(self) -> str:
        return "_" + self.name

    @abc.abstractmethod
    def dumps(self, obj: Any) -> bytes:
        """The bytes of ``obj``: a str (the seed), or a key tuple of bytes, a tuple of
        ints and None or a tuple of tuples of str / int (the extra keys)."""


class PickleSerializer(HashSerializer):
    """``pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)`` (vLLM's ``sha256``)."""

    name = "pickle"
    writer = "pickle"
    suffix = ""  # vLLM's names: "sha256", "xxhash"

    def dumps(self, obj: Any) -> bytes:
        return pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)


class CborSerializer(HashSerializer):
    """``cbor2.dumps(obj, canonical=True)`` (vLLM's ``sha256_cbor``)."""

    name = "cbor"
    writer = "cbor"

    def dumps(self, obj: Any) -> bytes:
        return cbor2.dumps(obj, canonical=True)


# NOTE: read-only (no module-level mutable state). A new serializer: one class, one
# line here; from a user's own package, `register_serializer` (a new registry to pass
# as `BlockHasher(..., serializers=)`).
SERIALIZERS = MappingProxyType({"pickle": PickleSerializer(), "cbor": CborSerializer()})
# The digests H: SHA-256 (32 bytes) and xxHash's xxh3_128 (16 bytes, optional package).
DIGESTS = ("sha256", "xxhash")


def hash_algo_names(serializers: Mapping[str, HashSerializer] = SERIALIZERS) -> tuple[str, ...]:
    """Every algorithm name: each digest with each serializer, digest-major."""
    return tuple(d + s.suffix for d in DIGESTS for s in serializers.values())


def register_serializer(serializer: HashSerializer,
                        registry: Mapping[str, HashSerializer] = SERIALIZERS
                        ) -> MappingProxyType:
    """A new read-only registry: ``registry`` plus ``serializer`` (the given one is
    unchanged). ``ValueError`` for a non-serializer, a taken name or suffix."""
    if not isinstance(serializer, HashSerializer):
        raise ValueError(f"register_serializer takes a HashSerializer, got "
                         f"{type(serializer).__name__}")
    if not isinstance(serializer.name, str) or not serializer.name.isidentifier():
        raise ValueError(f"a serializer's name must be an identifier, got {serializer.name!r}")
    taken = {s.suffix for s in registry.values()}
    if serializer.name in registry or serializer.suffix in taken:
        raise ValueError(f"hash serializer {serializer.name!r} (suffix "
                         f"{serializer.suffix!r}) is already registered")
    return MappingProxyType({**registry, serializer.name: serializer})


def split_hash_algo(algo: str, serializers: Mapping[str, HashSerializer] = SERIALIZERS
                    ) -> tuple[str, HashSerializer]:
    """(digest name, serializer) of an algorithm name; ``ValueError`` naming the valid
    ones."""
    if isinstance(algo, str):
        for digest in DIGESTS:
            for ser in serializers.values():
                if algo == digest + ser.suffix:
                    return digest, ser
    raise ValueError(
        f"unknown hash algorithm {algo!r}; valid: {', '.join(hash_algo_names(serializers))}")


HASH_ALGOS = hash_algo_names()

# Seed of the chain root for the sha256 variants when PYTHONHASHSEED is unset (vLLM's
# DEFAULT_NONE_HASH_SEED): independent processes agree on every digest.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

# Labels of the extra keys. NOTE: pickle memoises by object identity, so a label that
# appears twice in one key ("mm" for two images in one block) is written once and then
# back-referenced only when both occurrences are the same object. vLLM's labels are
# interned string literals; we canonicalise every label to these interned constants so
# our pickles (and digests) match vLLM's and depend on values only.
LORA_LABEL = sys.intern("lora")
MM_LABEL = sys.intern("mm")
CACHE_SALT_LABEL = sys.intern("cache_salt")
PROMPT_EMBEDS_LABEL = sys.intern("prompt_embeds")



def _fresh_str(s: str) -> str:
    """A str equal to ``s`` that shares no identity with it (exact ``str`` type).

    NOTE: values other than labels must not alias each other inside one key, or pickle
    would back-reference them. Strings of length <= 1 are interpreter-wide singletons
    in CPython (in vLLM's process too), so they cannot and need not be copied.
    """
    s = str.__str__(s)
    if len(s) <= 1:
        return s
    return s[:1] + s[1:]


def _canonical_value(value: Any) -> Any:
    """Canonical form of one element of an extra key (values-only semantics)."""
    if value is None or type(value) is bool or type(value) is float:
        return value
    if isinstance(value, str):
        return _fresh_str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (tuple, list)):
        return tuple(_canonical_value(v) for v in value)
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    try:
        return operator.index(value)  # Python int; numpy ints pickle differently
    except TypeError:
        pass
    if isinstance(value, (float, np.floating)):
        return float(value)
    raise ValueError(
        f"extra key value {value!r} of type {type(value).__name__} is not supported "
        "(use str, int, float, bool, bytes, None or tuples of them)"
    )


def canonical_extra_keys(extra_keys: Any) -> tuple | None:
    """Canonicalise extra keys so that digests depend on values only.

    Tuples instead of lists, labels (the first element of each labelled key, when a
    str) replaced by the interned module constants, every other string copied so no two
    values alias, numpy scalars replaced by Python scalars. ``None`` and empty give
    ``None`` (no extra keys).

    Args:
      extra_keys: None or a sequence of keys, each a sequence ``(label, *values)``.

    Returns:
      None or a tuple of tuples.
    """
    if extra_keys is None:
        return None
    if not isinstance(extra_keys, (tuple, list)):
        raise ValueError(
            f"extra_keys must be None or a tuple of labelled tuples, got {extra_keys!r}"
        )
    out = []
    for key in extra_keys:
        if isinstance(key, (tuple, list)):
            if key and isinstance(key[0], str):
                out.append(
                    (sys.intern(str.__str__(key[0])),)
                    + tuple(_canonical_value(v) for v in key[1:])
                )
            else:
                out.append(tuple(_canonical_value(v) for v in key))
        else:
            out.append(_canonical_value(key))
    return tuple(out) if out else None


def _mm_fields(feature: Any) -> tuple[str, int, int]:
    """(identifier, offset, length) of a multimodal item (object or 3-tuple)."""
    if isinstance(feature, (tuple, list)):
        identifier, offset, length = feature
    else:
        identifier, offset, length = feature.identifier, feature.offset, feature.length
    return identifier, int(offset), int(length)


def _lora_pair(lora: Any) -> tuple[str, str] | None:
    """(name, path) of a LoRA adapter (object with .name/.path, or a pair), or None."""
    if lora is None:
        return None
    if isinstance(lora, (tuple, list)):
        name, path = lora
    else:
        name, path = lora.name, lora.path
    return name, path


def _extras_from_parts(
    lora_pair: tuple[str, str] | None,
    mm: Sequence[tuple[str, int]],
    salt: str | None,
) -> tuple | None:
    """Canonical extra keys from their parts, in vLLM's order (lora, mm..., salt)."""
    keys = []
    if lora_pair is not None:
        keys.append((LORA_LABEL, _fresh_str(lora_pair[0]), _fresh_str(lora_pair[1])))
    for identifier, rel_offset in mm:
        keys.append((MM_LABEL, _fresh_str(identifier), rel_offset))
    if salt:
        keys.append((CACHE_SALT_LABEL, _fresh_str(salt)))
    return tuple(keys) if keys else None


def block_extra_keys(
    start: int,
    end: int,
    *,
    lora: Any = None,
    mm_features: Sequence[Any] = (),
    cache_salt: str | None = None,
    is_first_block: bool | None = None,
) -> tuple | None:
    """The extra keys of the block holding tokens ``[start, end)`` (vLLM's order).

    Args:
      start, end: token range of the block.
      lora: None, an object with ``.name`` and ``.path`` (LoRARequest) or a pair.
      mm_features: multimodal items (objects with ``.identifier``, ``.offset``,
        ``.length`` or 3-tuples), sorted by offset and not overlapping each other.
      cache_salt: the request's salt; None or "" adds no key.
      is_first_block: whether this is the first block of the sequence (the salt goes
        there only); None means ``start == 0``.

    Returns:
      None when there are no keys, else a tuple: ``("lora", name, path)``, then
      ``("mm", identifier, offset - start)`` for each item with ``offset < end`` and
      ``offset + length > start``, then ``("cache_salt", salt)``.
    """
    if is_first_block is None:
        is_first_block = start == 0
    mm = []
    for feature in mm_features:
        identifier, offset, length = _mm_fields(feature)
        if offset >= end:
            break  # sorted by offset: nothing later overlaps either
        if offset + length > start:
            mm.append((identifier, offset - start))
    return _extras_from_parts(
        _lora_pair(lora), mm, cache_salt if is_first_block else None
    )


def _first_bad_token(token_ids: Any) -> str:
    """Why a token sequence is invalid (message), or "" when every id is an int >= 0."""
    for i, t in enumerate(token_ids):
        try:
            v = operator.index(t)
        except TypeError:
            return f"token ids must be ints, got [{i}] = {t!r}"
        if v < 0:
            return f"negative token id [{i}] = {v}"
    return ""


def _canonical_tokens(token_ids: Any) -> tuple[int, ...]:
    """Token ids as a tuple of Python ints (the generic path), validated.

    NOTE: values only: numpy ints (and bools, an int subclass) enter as the Python int
    of the same value, since pickle would write them differently.
    """
    if isinstance(token_ids, array.array) and token_ids.typecode in "BHILQ":
        return tuple(token_ids)
    if isinstance(token_ids, np.ndarray):
        check_token_array("token_ids", token_ids)
        return tuple(token_ids.tolist())
    check_int_sequence("token ids", token_ids)  # sets, dicts, str: ArgumentTypeError
    n = len(token_ids)
    try:
        # struct checks every id at C speed and unpacks to exact Python ints.
        return struct.unpack(f"<{n}Q", struct.pack(f"<{n}Q", *token_ids))
    except (struct.error, TypeError):
        pass
    bad = _first_bad_token(token_ids)
    if bad:
        raise ValueError(bad)
    return tuple(int(operator.index(t)) for t in token_ids)  # ids >= 2**64


def _pack_tokens(token_ids: Any) -> bytes | None:
    """Validated token ids as native u64 bytes (8 per id); None when some id is >= 2**64
    (valid, but only the generic path writes those).

    Accepts a list/tuple of ints, an ``array.array`` of ints or an integer numpy array;
    numpy ints (and bools) enter by value.

    Raises:
      ValueError: a negative or non-integer token id.
    """
    if isinstance(token_ids, array.array) and token_ids.typecode in "QLI":
        return token_ids.tobytes() if token_ids.itemsize == 8 else (
            np.frombuffer(token_ids, dtype=token_ids.typecode).astype("=u8").tobytes()
        )
    if isinstance(token_ids, array.array):
        if token_ids.typecode not in "bBhHiIlLqQ":
            raise ValueError(f"token ids must be integers, got array of {token_ids.typecode!r}")
        token_ids = np.frombuffer(token_ids, dtype=token_ids.typecode)
    if isinstance(token_ids, np.ndarray):
        check_token_array("token_ids", token_ids)
        return token_ids.astype("=u8").tobytes()
    try:
        # NOTE: struct.pack checks every id at C speed: ints (and __index__ types such
        # as numpy ints) in [0, 2**64) pass; floats, str, None and negatives fail.
        return struct.pack(f"={len(token_ids)}Q", *token_ids)
    except (struct.error, TypeError):
        bad = _first_bad_token(token_ids)
        if bad:
            raise ValueError(bad) from None
        return None  # only ids >= 2**64


class BlockHasher(FastWriters):
    """Computes vLLM-compatible block digests for one algorithm and chain root.

    Invariants: ``root == H(serialize(seed))`` is fixed at construction; every digest is
    a pure function of (algo, root, parent digest, token ids, extra key values), so two
    hashers with equal ``algo`` and ``root`` are interchangeable (they compare equal).
    The only other state is bounded caches of pure functions: serialized extra keys and
    a memo of block digests (see `hash_token_blocks`, `clear_caches`).

    Attributes:
      algo: one of HASH_ALGOS.
      seed: the resolved seed string the root was derived from.
      root: the chain root (vLLM's NONE_HASH), ``digest_size`` bytes.
      digest_size: 32 (sha256 variants) or 16 (xxhash variants).
    """

    __slots__ = (
        "_algo",
        "_seed",
        "_root",
        "_digest",
        "_is_cbor",
        "_serializer",
        "_spec_only",
        "_digest_size",
        "_tail_cache",
        "_plan_cache",
        "_cbor_key_head",
        "_memo",
    )

    # The extra-key spec the fast writers (`hash_writers.FastWriters`) call.
    _mm_fields = staticmethod(_mm_fields)
    _lora_pair = staticmethod(_lora_pair)
    _extras_from_parts = staticmethod(_extras_from_parts)

    def __init__(self, algo: str = "sha256", seed: Any = None, *,
                 serializers: Mapping[str, HashSerializer] = SERIALIZERS):
        """Args:
        algo: "sha256" | "sha256_cbor" | "xxhash" | "xxhash_cbor" (`HASH_ALGOS`), or
          a digest with another serializer of ``serializers``.
        seed: None, a str, an int or bytes; used as ``str(seed)``. None: PYTHONHASHSEED
          when set, else "vllm-none-hash" (sha256 variants) or random (xxhash variants).
        serializers: the serializer registry (`SERIALIZERS`, or one from
          `register_serializer`).

        Raises:
          ValueError: unknown algorithm. TypeError: any other seed (an object's str
            carries its address: not reproducible across processes).
          ImportError: an xxhash algorithm without the ``xxhash`` package.
        """
        digest_name, serializer = split_hash_algo(algo, serializers)
        from prefixcache._validate import check_hash_seed  # noqa: PLC0415

        check_hash_seed(seed)
        if digest_name == "xxhash":
            if _xxhash is None:
                raise ImportError(
                    f"hash algorithm {algo!r} needs the 'xxhash' package "
                    "(>= 3.0, with xxh3_128_digest): pip install xxhash"
                )
            self._digest: Callable[[Any], bytes] = _xxhash.xxh3_128_digest
            self._digest_size = 16
        else:
            self._digest = _sha256_digest
            self._digest_size = 32
        self._algo = algo
        self._serializer = serializer
        # NOTE: the fast writers know two serializers byte for byte; any other writes
        # every key with its own dumps (`_spec_only`), so no branch below ever takes
        # "not CBOR" to mean pickle for a serializer it does not know.
        if serializer.writer not in (None, "pickle", "cbor"):
            raise ValueError(f"hash serializer {serializer.name!r}: unknown writer "
                             f"{serializer.writer!r} (None, 'pickle' or 'cbor')")
        self._spec_only = serializer.writer is None
        self._is_cbor = serializer.writer == "cbor"
        # A CBOR key's head up to its parent: array(3), bytes(digest_size).
        self._cbor_key_head = b"\x83" + _cbor_head(2, self._digest_size)
        if seed is None:
            env_seed = os.environ.get("PYTHONHASHSEED")
            if env_seed is not None:
                seed_str = env_seed
            elif digest_name == "xxhash":
                seed_str = os.urandom(32).hex()
            else:
                seed_str = DEFAULT_NONE_HASH_SEED
        else:
            seed_str = str(seed)
        self._seed = seed_str
        self._root = self._digest(self.serialize(seed_str))
        # Bounded caches of serialized extra keys (pure functions of values).
        self._tail_cache: dict = {}
        self._plan_cache: dict = {}
        self._memo: dict = {}  # block key -> digest, see hash_token_blocks

    # -- identity -------------------------------------------------------------------
    @property
    def algo(self) -> str:
        return self._algo

    @property
    def seed(self) -> str:
        return self._seed

    @property
    def root(self) -> bytes:
        return self._root

    @property
    def digest_size(self) -> int:
        return self._digest_size

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockHasher):
            return NotImplemented
        return self._algo == other._algo and self._root == other._root

    def __hash__(self) -> int:
        return hash((self._algo, self._root))

    def __repr__(self) -> str:
        return f"BlockHasher(algo={self._algo!r}, root={self._root.hex()[:16]}...)"

    # -- generic (reference) path ---------------------------------------------------
    @property
    def serializer(self) -> HashSerializer:
        return self._serializer

    def serialize(self, obj: Any) -> bytes:
        """The algorithm's serializer (`HashSerializer.dumps`): pickle
        (HIGHEST_PROTOCOL), canonical CBOR or a registered one."""
        return self._serializer.dumps(obj)

    def hash_object(self, obj: Any) -> bytes:
        """``H(serialize(obj))`` — vLLM's ``hash_fn(obj)``."""
        return self._digest(self.serialize(obj))

    def clear_caches(self) -> None:
        """Forget memoised digests and serialized extra keys (results do not change;
        benchmarks call this to time cold hashing)."""
        self._memo.clear()
        self._tail_cache.clear()
        self._plan_cache.clear()

    def _parent_bytes(self, parent: Any) -> bytes:
        if parent is None:
            return self._root
        if not isinstance(parent, (bytes, bytearray, memoryview)):
            raise ValueError(
                f"parent must be bytes or None, got {type(parent).__name__}"
            )
        parent = bytes(parent)
        return parent if parent else self._root

    def block_key(
        self, parent: bytes | None, token_ids: Sequence[int], extra_keys: Any = None
    ) -> tuple:
        """The canonical key tuple ``(parent_or_root, tuple(token_ids), extra_keys)``."""
        return (
            self._parent_bytes(parent),
            _canonical_tokens(token_ids),
            canonical_extra_keys(extra_keys),
        )

    def hash_block(
        self,
        parent: bytes | None,
        token_ids: Sequence[int],
        extra_keys: Any = None,
    ) -> bytes:
        """Digest of one block (vLLM's ``hash_block_tokens``).

        Args:
          parent: digest of the previous block; None or b"" for the first block.
          token_ids: the block's token ids (ints >= 0; numpy ints enter by value).
          extra_keys: None or labelled tuples, see ``block_extra_keys``; canonicalised
            (tuples, interned labels, Python scalars) so the digest depends on values.

        Returns:
          ``digest_size`` bytes.
        """
        return self._digest(self.serialize(self.block_key(parent, token_ids, extra_keys)))

    # -- one block past the per-position keys (the decode path) ----------------------
    def plain_block_tag(self, block_size: int, lora: Any = None) -> tuple | None:
        """What `hash_plain_block` needs for blocks whose only extra key is the LoRA's.

        Such blocks (past every multimodal item, not the salted block 0) all carry the
        same extra keys: ``(("lora", name, path),)``, or None without LoRA.

        Args:
          block_size: tokens per block, > 0.
          lora: None, a LoRARequest (``.name``, ``.path``) or a (name, path) pair.

        Returns:
          An opaque tag ``(memo suffix, extra keys)`` -- the suffix is the serialized
          bytes after the token items, the memo key part `hash_token_blocks` uses for
          such blocks, so both share the memo -- or None when those extra keys cannot
          be spliced (then only `hash_token_blocks` hashes such blocks).

        Raises:
          ValueError: block_size not an int > 0.
        """
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
            raise ValueError(f"block_size must be an int, got {block_size!r}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if self._spec_only:  # no fast writer: every block through hash_token_blocks
            return None
        plan = self._tail_plan(int(block_size), 1, lora, (), None)
        if plan is None:
            return None
        return plan.suffixes[0], plan.extras[0]

    def hash_plain_block(self, parent: bytes, block: array.array, tag: tuple) -> bytes:
        """Digest of one block whose extra keys are at most the LoRA's, from
        already-validated tokens.

        The decode hot path of `Request`: a block that just became full, past every
        multimodal item and not the salted first block. Equal to ``hash_block(parent,
        block, tag's extra keys)``; shares the memo of `hash_token_blocks`.

        NOTE: no validation here -- the caller guarantees ``block`` is an
        ``array('Q')`` (ids in [0, 2**64) by construction) holding exactly the block's
        tokens, ``parent`` a digest of this hasher (or its root) and ``tag`` its
        `plain_block_tag` for ``len(block)``; public callers use `hash_token_blocks`.

        Args:
          parent: digest of the previous block (``digest_size`` bytes).
          block: ``array('Q')`` of the block's token ids.
          tag: ``plain_block_tag(len(block), lora)`` (not None).

        Returns:
          ``digest_size`` bytes.
        """
        key = (parent, block.tobytes(), tag[0])  # a block key (see hash_token_blocks)
        memo = self._memo
        d = memo.get(key)
        if d is None:
            # The spec itself: serialize (parent, tuple(ids), extra keys) and hash it.
            extra = tag[1]
            if self._is_cbor:
                # array(3), the parent's bytes, the token array (cbor2's default
                # encoding of a list of non-negative ints is the canonical one), then
                # the tag's serialized extra keys (0xf6 for None; canonical, cached).
                # NOTE: ~17% fewer instructions than cbor2 writing the whole key from a
                # tuple of the ids (measured with cachegrind).
                head = (
                    self._cbor_key_head if len(parent) == self._digest_size
                    else b"\x83" + _cbor_head(2, len(parent))
                )
                msg = head + parent + cbor2.dumps(block.tolist()) + tag[0]
                d = (
                    hashlib.sha256(msg).digest() if self._digest is _sha256_digest
                    else self._digest(msg)
                )
            elif extra is not None:
                d = self._digest(self.serialize((parent, tuple(block), extra)))
            elif self._digest is _sha256_digest:
                d = hashlib.sha256(
                    pickle.dumps((parent, tuple(block), None), _PICKLE_PROTOCOL)
                ).digest()
            else:
                d = self._digest(pickle.dumps((parent, tuple(block), None), _PICKLE_PROTOCOL))
            if len(memo) >= _MEMO_SIZE:
                memo.clear()
            memo[key] = d
        return d

    # -- blocks known by ids, not tokens ---------------------------------------------
    def hash_keyed_blocks(self, keys: Sequence[bytes], parent: bytes | None = None) -> list[bytes]:
        """Chained digests of blocks identified by caller-given keys instead of token ids:
        ``d[i] = H(b"\\0key" + d[i - 1] + keys[i])``, from ``parent`` (None: the root).

        NOT vLLM's block digests: a key space of its own for traces whose blocks are
        known only by ids (Mooncake's hash ids, see ``prefixcache.sim.replay``). Where
        equal keys at equal chain positions mean equal token blocks, prefix matches are
        exactly those of the token digests. The leading zero byte keeps these messages
        apart from every token block's (pickle's start with PROTO 0x80, CBOR's with
        array(3) 0x83).

        Args:
          keys: one bytes key per block, in order (a fixed-length encoding, so that
            ``parent + key`` splits one way only).
          parent: digest of the block before the first; None for the root.

        Returns:
          One ``digest_size``-byte digest per key.
        """
        parent = self._parent_bytes(parent)
        if len(parent) != self._digest_size:
            raise ValueError(f"parent must be a {self._digest_size}-byte digest of this hasher")
        head = b"\0key"
        if self._digest is _sha256_digest:
            sha256 = hashlib.sha256
            return [parent := sha256(head + parent + k).digest() for k in keys]
        digest = self._digest
        return [parent := digest(head + parent + k) for k in keys]

    # -- whole sequences ------------------------------------------------------------
    def hash_token_blocks(
        self,
        token_ids: Sequence[int] | np.ndarray,
        block_size: int,
        *,
        lora: Any = None,
        mm_features: Sequence[Any] = (),
        cache_salt: str | None = None,
        parent: bytes | None = None,
        start_block: int = 0,
    ) -> list[bytes]:
        """Digests of the full blocks ``start_block, start_block + 1, ...`` of a sequence.

        A pure function: equal to chaining ``hash_block`` with ``block_extra_keys`` over
        the blocks. Tokens after the last full block are ignored (but validated). Blocks
        met before (same parent, tokens and extra keys) come from the hasher's memo.

        Args:
          token_ids: the whole sequence (list/tuple of ints, ``array.array`` or integer
            numpy array ``int[n]``); only ``token_ids[start_block * block_size:]`` is
            read, so hashing new blocks of a long sequence costs O(new tokens).
          block_size: tokens per block, > 0.
          lora: None, a LoRARequest (``.name``, ``.path``) or a (name, path) pair.
          mm_features: multimodal items (``.identifier``, ``.offset``, ``.length`` or
            3-tuples) in absolute token positions, not overlapping each other.
          cache_salt: enters block 0's key only.
          parent: digest of block ``start_block - 1``; None for the root.
          start_block: index of the first block to hash.

        Returns:
          One ``digest_size``-byte digest per full block from ``start_block`` on.

        Raises:
          ValueError: block_size <= 0, start_block < 0, negative or non-int token ids.
        """
        if type(block_size) is not int or type(start_block) is not int:
            for name, v in (("block_size", block_size), ("start_block", start_block)):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise ValueError(f"{name} must be an int, got {v!r}")
            block_size, start_block = int(block_size), int(start_block)
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if start_block < 0:
            raise ValueError(f"start_block must be >= 0, got {start_block}")
        if type(token_ids) is array.array and token_ids.typecode == "Q":
            # A Request's own tokens (valid by construction): one copy of the new part.
            packed = memoryview(token_ids)[start_block * block_size :].tobytes()
            num_blocks = len(packed) // (8 * block_size)
        else:
            if type(token_ids) is not list and not isinstance(
                    token_ids, (np.ndarray, array.array)):
                check_int_sequence("token_ids", token_ids)  # sets, dicts, str
            tokens = token_ids[start_block * block_size :]
            num_blocks = len(tokens) // block_size
            packed = _pack_tokens(tokens)  # validates every id, the partial block's too
        if type(parent) is not bytes or not parent:
            parent = self._parent_bytes(parent)
        if not num_blocks:
            return []
        if packed is None or self._spec_only:
            # ids >= 2**64, or a serializer without a fast writer: the spec path.
            return self._hash_blocks_generic(
                _canonical_tokens(token_ids[start_block * block_size :]), num_blocks,
                block_size, start_block, parent, lora, mm_features, cache_salt,
            )
        # NOTE: block digests are pure functions of (parent, tokens, extra keys), and
        # prompts share prefixes (that is what a prefix cache is for): a bounded memo
        # skips serializing and hashing blocks this hasher has seen. Keys are the parent
        # digest, the block's token ids (8 bytes each) and its serialized extra keys.
        memo = self._memo
        width = 8 * block_size
        plan = None
        if len(parent) == self._digest_size:
            plan = self._tail_plan(block_size, start_block, lora, mm_features, cache_salt)
        n_hit = 0
        hits: list[bytes] = []
        if plan is None:
            return self._hash_blocks(
                packed[: num_blocks * width], num_blocks, block_size, start_block,
                parent, lora, mm_features, cache_salt,
            )
        # Block keys: (parent, the block's token bytes, its suffix) -> its digest. Group
        # keys, for runs of `group` blocks aligned to start_block: (the run's token
        # bytes, parent, its suffix(es)) -> the run's digests; one lookup per run makes
        # long shared prefixes cheap. The two never collide: a block key starts with a
        # digest (digest_size bytes), a group key with at least 64 bytes of tokens.
        # A block's / run's byte length fixes the block size. NOTE: tuples, not
        # parent + tokens: no concatenation, and a chunk looked up then inserted is
        # hashed once (bytes cache their hash).
        get = memo.get
        suffix0 = plan.suffixes[0]
        tails = None
        if plan.id_of:
            tails = plan.tails_for(num_blocks)
        group = min(_MEMO_GROUP, _MEMO_GROUP_TOKENS // block_size)
        gw = group * width
        n_groups = num_blocks // group if group > 1 else 0
        parent0 = parent
        g = 0
        while g < n_groups:
            lo = g * group
            run = get((
                packed[lo * width : lo * width + gw], parent,
                tuple(tails[lo : lo + group]) if tails else suffix0,
            ))
            if run is None:
                break
            hits.extend(run)
            parent = run[-1]
            g += 1
        first = g * group
        chunks = [packed[j : j + width] for j in range(first * width, num_blocks * width, width)]
        btails = tails[first:] if tails else [suffix0] * len(chunks)
        for chunk, tail in zip(chunks, btails):
            d = get((parent, chunk, tail))
            if d is None:
                break
            hits.append(d)
            parent = d
        n_hit = len(hits)
        rest: list[bytes] = []
        if n_hit < num_blocks:
            n_new = num_blocks - n_hit
            new = packed[n_hit * width : num_blocks * width]
            high = None
            if self._is_cbor and (
                n_new < _MIN_VECTOR_BLOCKS_CBOR
                or n_new <= _MAX_STREAM_BLOCKS_CBOR
                and not (high := _has_high(new))
            ):
                # The per-block CBOR writer straight from the plan (the parent is one
                # of our digests: the plan exists).
                rest = self._cbor_chain(
                    new, n_new, block_size, parent, btails[n_hit - first :], high
                )
            elif self._is_cbor or (
                block_size < _MIN_STREAM_BS_PICKLE and n_new < _MIN_STREAM_BLOCKS_PICKLE
            ) or (
                rest := self._pickle_chain(
                    new, n_new, block_size, parent, btails[n_hit - first :]
                )
            ) is None:
                rest = self._hash_blocks(
                    new, n_new, block_size, start_block + n_hit, parent,
                    lora, mm_features, cache_salt, plan, n_hit,
                )
        if len(memo) + len(rest) + n_groups - g > _MEMO_SIZE:
            memo.clear()
        if rest:
            # Block entries of the new digests: (parent, the block's bytes, suffix).
            k = n_hit - first
            parents = [parent]
            parents += rest[:-1]
            memo.update(zip(zip(parents, chunks[k:], btails[k:]), rest))
        out = hits + rest if rest else hits
        for gg in range(g, n_groups):
            lo = gg * group
            memo[
                packed[lo * width : lo * width + gw],
                out[lo - 1] if lo else parent0,
                tuple(tails[lo : lo + group]) if tails else suffix0,
            ] = tuple(out[lo : lo + group])
        return out

    def _hash_blocks_generic(
        self, tokens, num_blocks, block_size, start_block, parent,
        lora, mm_features, cache_salt,
    ) -> list[bytes]:
        """The spec, block by block: serialize the key tuple and hash it."""
        ids = _canonical_tokens(tokens)  # validates the partial tail too
        features = sorted((_mm_fields(f) for f in mm_features), key=lambda f: f[1])
        digest, serialize = self._digest, self.serialize
        out = []
        for i in range(num_blocks):
            b = start_block + i
            start = b * block_size
            extra = block_extra_keys(
                start, start + block_size, lora=lora, mm_features=features,
                cache_salt=cache_salt, is_first_block=b == 0,
            )
            parent = digest(
                serialize((parent, ids[i * block_size : (i + 1) * block_size], extra))
            )
            out.append(parent)
        return out
