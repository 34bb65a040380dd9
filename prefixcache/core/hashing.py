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

from prefixcache._validate import check_int_sequence
from prefixcache.core.hash_writers import (  # noqa: F401  (the fast writers' tables)
    _PICKLE_PROTOCOL,
    _MAX_FAST_PICKLE_FRAME,
    _MIN_VECTOR_BLOCKS_CBOR,
    _MIN_VECTOR_BLOCKS_PICKLE,
    _MAX_STREAM_BLOCKS_CBOR,
    _TAIL_CACHE_SIZE,
    _UNSPLICEABLE,
    _MEMO_SIZE,
    _MEMO_GROUP,
    _MEMO_GROUP_TOKENS,
    _CBOR_BOUNDS,
    _CBOR_PAYLOAD,
    _PICKLE_BOUNDS,
    _PICKLE_OPCODE,
    _PICKLE_PAYLOAD,
    _MASK_BY_LEN,
    _cbor_token_rows,
    _pickle_token_rows,
    _token_tables,
    _TABLE_BITS,
    _CBOR_ROW,
    _CBOR_ROW_LEN,
    _PICKLE_ROW,
    _PICKLE_ROW_LEN,
    _ONE_TO,
    _BYTE0,
    _BYTE1,
    _CBOR_SMALL_ITEM,
    _PICKLE_SMALL_ITEM,
    _MIN_STREAM_BS_PICKLE,
    _MIN_STREAM_BLOCKS_PICKLE,
    _PICKLE_TUPLE_N,
    _NUMPY_STREAM_MIN_IDS,
    _stream16,
    _has_high,
    _low_u16s,
    _cbor_head,
    _cbor_int,
    _pickle_int,
    _CBOR_ARRAY_HEAD,
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
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise ValueError(
                f"token ids must be a 1-D array of integers, got dtype {token_ids.dtype} "
                f"shape {token_ids.shape}"
            )
        if token_ids.size and token_ids.dtype.kind == "i" and token_ids.min() < 0:
            raise ValueError(f"negative token id {int(token_ids.min())}")
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
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {token_ids.shape}")
        if token_ids.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {token_ids.dtype}")
        if token_ids.size and token_ids.dtype.kind == "i" and token_ids.min() < 0:
            raise ValueError(f"negative token id {int(token_ids.min())}")
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


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class BlockHasher:
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

    def _hash_blocks(
        self, packed, num_blocks, block_size, start_block, parent,
        lora, mm_features, cache_salt, plan=None, plan_offset=0,
    ) -> list[bytes]:
        """Digests of ``num_blocks`` full blocks given as native u64 bytes: picks the
        writer. ``plan``: the `_TailPlan` for block ``start_block - plan_offset`` if
        already at hand (block ``start_block + i`` takes the plan's block
        ``plan_offset + i``), so a request hashed after a run of memo hits reuses its
        plan instead of planning from the first missing block."""
        n = num_blocks * block_size
        if num_blocks >= (
            _MIN_VECTOR_BLOCKS_CBOR if self._is_cbor else _MIN_VECTOR_BLOCKS_PICKLE
        ):
            u64 = np.frombuffer(packed, dtype="=u8", count=n)
            if u64.max() < 2**32:
                u32 = u64.astype(np.uint32)
                out: list[bytes] = []
                if len(parent) != self._digest_size:
                    # A parent of foreign length (not one of our digests): first block
                    # apart.
                    out = self._hash_blocks_small(
                        tuple(u32[:block_size].tolist()), 1, block_size, start_block,
                        parent, lora, mm_features, cache_salt,
                    )
                    parent = out[0]
                    u32 = u32[block_size:]
                    num_blocks -= 1
                    start_block += 1
                fast = self._hash_blocks_vectorised(
                    u32, num_blocks, block_size, start_block,
                    parent, lora, mm_features, cache_salt,
                    None if out else plan, plan_offset,
                ) if num_blocks else []
                if fast is not None:
                    return out + fast
                # Else pickle ids >= 2**31, huge frames or odd extra keys: per block.
                return out + self._hash_blocks_small(
                    tuple(u32.tolist()), num_blocks, block_size, start_block, parent,
                    lora, mm_features, cache_salt,
                )
        packed = packed[: 8 * n]
        # CBOR writes from the packed bytes; pickle takes the ids as ints.
        ids = None if self._is_cbor else struct.unpack(f"={n}Q", packed)
        return self._hash_blocks_small(
            ids, num_blocks, block_size, start_block, parent, lora, mm_features, cache_salt,
            plan, plan_offset, packed,
        )

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

    def _frame(self, block_size: int) -> tuple[bytes, int, bytes]:
        """(head, hole, close) of a block key for parents of ``digest_size`` bytes.

        ``head`` precedes the token items and has a zero hole of ``digest_size`` bytes at
        offset ``hole`` for the parent; ``close`` follows the token items, before the
        extra keys. pickle: PROTO 5, FRAME len8 (zero here), SHORT_BINBYTES, MEMOIZE,
        MARK ... TUPLE MEMOIZE (TUPLE1-3 without MARK for 1-3 tokens); the extra keys'
        suffix ends with TUPLE3 MEMOIZE STOP. cbor: array(3), bytes(digest_size),
        array(block_size).
        """
        ds = self._digest_size
        if self._is_cbor:
            head = b"\x83" + _cbor_head(2, ds)
            return head + bytes(ds) + _cbor_head(4, block_size), len(head), b""
        head = bytes([0x80, _PICKLE_PROTOCOL, 0x95]) + bytes(8) + b"C" + bytes([ds])
        if block_size <= 3:
            return head + bytes(ds) + b"\x94", len(head), _PICKLE_TUPLE_N[block_size] + b"\x94"
        return head + bytes(ds) + b"\x94(", len(head), b"t\x94"

    def _hash_blocks_small(
        self, ids, num_blocks, block_size, start_block, parent,
        lora, mm_features, cache_salt, plan=None, plan_offset=0, packed=None,
    ) -> list[bytes]:
        """Block by block (decode, short prompts).

        pickle: the key tuple goes to the serializer whole (extra keys from the plan).
        CBOR: `_cbor_chain` writes the token arrays and splices in the cached serialized
        extra keys. ``ids``: the blocks' ids as ints (may be None when ``packed``, the
        same ids as native u64 bytes, is given).
        """
        if packed is None and self._is_cbor:
            packed = struct.pack(f"={num_blocks * block_size}Q", *ids[: num_blocks * block_size])
        lo = start_block * block_size
        if (
            lora is None
            and not (cache_salt and start_block == 0)
            and (not mm_features or all(f[1] + f[2] <= lo for f in map(_mm_fields, mm_features)))
        ):
            # No block has extra keys: exactly vLLM's computation, minus its overhead.
            out = []
            if self._digest is _sha256_digest and not self._is_cbor:
                sha256, dumps = hashlib.sha256, pickle.dumps
                for i in range(0, num_blocks * block_size, block_size):
                    parent = sha256(
                        dumps((parent, ids[i : i + block_size], None), _PICKLE_PROTOCOL)
                    ).digest()
                    out.append(parent)
            elif self._is_cbor:
                return self._cbor_chain(
                    packed, num_blocks, block_size, parent, [b"\xf6"] * num_blocks
                )
            else:
                digest, dumps = self._digest, pickle.dumps
                for i in range(0, num_blocks * block_size, block_size):
                    parent = digest(
                        dumps((parent, ids[i : i + block_size], None), _PICKLE_PROTOCOL)
                    )
                    out.append(parent)
            return out
        off = plan_offset
        if plan is None:
            plan, off = self._tail_plan(block_size, start_block, lora, mm_features, cache_salt), 0
        if plan is None:
            if ids is None:
                ids = struct.unpack(f"={num_blocks * block_size}Q", packed)
            return self._hash_blocks_generic(
                ids, num_blocks, block_size, start_block, parent,
                lora, mm_features, cache_salt,
            )
        suffixes, id_of = plan.suffixes, plan.id_of
        digest = self._digest
        out = []
        if not self._is_cbor:
            # NOTE: pickle the whole key with the plan's canonical extra keys (the spec
            # itself): measured faster per block than pickling the token tuple alone
            # and splicing the cached extra-key opcodes around it.
            extras, dumps = plan.extras, pickle.dumps
            if digest is _sha256_digest:
                sha256 = hashlib.sha256
                for i in range(num_blocks):
                    extra = extras[id_of.get(off + i, 0)] if id_of else extras[0]
                    parent = sha256(dumps(
                        (parent, ids[i * block_size : (i + 1) * block_size], extra),
                        _PICKLE_PROTOCOL,
                    )).digest()
                    out.append(parent)
            else:
                for i in range(num_blocks):
                    extra = extras[id_of.get(off + i, 0)] if id_of else extras[0]
                    parent = digest(dumps(
                        (parent, ids[i * block_size : (i + 1) * block_size], extra),
                        _PICKLE_PROTOCOL,
                    ))
                    out.append(parent)
            return out
        return self._cbor_chain(
            packed, num_blocks, block_size, parent,
            plan.tails_for(off + num_blocks)[off:] if id_of else [suffixes[0]] * num_blocks,
        )

    def _cbor_chain(self, packed, num_blocks, bs, parent, sfx, high=None) -> list[bytes]:
        """CBOR block by block: ``0x83``, the parent's bytes, the token array, the suffix
        (serialized extra keys) of each block (``sfx[i]``, one per block).

        ``packed``: the blocks' ids as native u64 bytes (8 per id, ``num_blocks * bs``
        ids). Token arrays of blocks whose ids all lie in [256, 65536) -- most blocks of
        a real vocabulary -- are cut from one stream written for all ids at once with
        C-level byte slicing: CBOR's canonical item for such an id is ``0x19`` and its
        two big-endian bytes, i.e. the id's byte 1 then byte 0. Runs of ids < 256 are
        spliced in (ids < 24: their low bytes, one slice per run). Blocks with an id
        >= 65536 go through ``cbor2.dumps`` (its default encoding is the canonical one
        for non-negative ints and arrays; canonical mode only reorders maps and shortens
        floats). Tests pin the bytes to ``cbor2.dumps(key, canonical=True)``. ``high``:
        whether some id is >= 65536, if the caller knows (None: checked here).
        """
        n = num_blocks * bs
        ds = self._digest_size
        digest = self._digest
        arr = _CBOR_ARRAY_HEAD[bs] if bs < len(_CBOR_ARRAY_HEAD) else _cbor_head(4, bs)
        low16 = None
        if n >= _NUMPY_STREAM_MIN_IDS:
            stream, b0, b1, high_ = _stream16(packed, n, True)
            if high is None:
                high = high_
        else:
            b0 = packed[_BYTE0::8]
            b1 = packed[_BYTE1::8]
            if high is None:
                low16 = _low_u16s(packed, b0, b1)
                high = low16 != packed
            stream = bytearray(3 * n)
            stream[0::3] = b"\x19" * n
            stream[1::3] = b1
            stream[2::3] = b0
        w = 3 * bs
        pieces = [arr + stream[j : j + w] + t for j, t in zip(range(0, 3 * n, w), sfx)]
        # Ids >= 65536 make their block's items longer: cbor2 writes those blocks.
        big = ()
        if high:
            if low16 is None:
                low16 = _low_u16s(packed, b0, b1)
            full = 8 * bs
            big = {
                k for k in range(num_blocks)
                if low16[k * full : (k + 1) * full] != packed[k * full : (k + 1) * full]
            }
            ids = memoryview(packed).cast("Q")
            for k in big:
                pieces[k] = cbor2.dumps(ids[k * bs : (k + 1) * bs].tolist()) + sfx[k]
        # Ids < 256 (byte 1 zero) have shorter items: each run of them is spliced into
        # the block's stream; a run of ids < 24 (multimodal placeholders, typically) is
        # its own CBOR items, i.e. the ids' low bytes: one slice of the packed bytes.
        i = b1.find(0)
        while i >= 0:
            k = i // bs
            end = (k + 1) * bs
            if k in big:
                i = b1.find(0, end)
                continue
            parts = [arr]
            a = k * bs
            while 0 <= i < end:
                if a < i:
                    parts.append(stream[3 * a : 3 * i])
                a = i + 1
                if a < end and not b1[a]:
                    a = end - len(b1[i:end].lstrip(b"\0"))  # end of the run of ids < 256
                    low = packed[8 * i + _BYTE0 : 8 * a : 8]
                    if max(low) < 24:
                        parts.append(low)
                    else:
                        parts += map(_CBOR_SMALL_ITEM.__getitem__, low)
                else:  # a single id < 256 (scattered among larger ids: most of them)
                    parts.append(_CBOR_SMALL_ITEM[packed[8 * i + _BYTE0]])
                i = b1.find(0, a)
            if a < end:
                parts.append(stream[3 * a : 3 * end])
            parts.append(sfx[k])
            pieces[k] = b"".join(parts)
        head = self._cbor_key_head
        out = []
        if len(parent) != ds:  # a foreign parent (not one of our digests): its own head
            parent = digest(b"\x83" + _cbor_head(2, len(parent)) + parent + pieces[0])
            out.append(parent)
            pieces = pieces[1:]
        # NOTE: the chain is sequential; one concatenation and one digest call per block
        # (SHA-256 called directly, no Python-level wrapper frame).
        if digest is _sha256_digest:
            sha256 = hashlib.sha256
            out += [parent := sha256(head + parent + x).digest() for x in pieces]
        else:
            out += [parent := digest(head + parent + x) for x in pieces]
        return out

    def _pickle_chain(self, packed, num_blocks, bs, parent, sfx) -> list[bytes] | None:
        """pickle block by block from the ids' bytes, as `_cbor_chain` writes CBOR: each
        message is PROTO, FRAME (its length), SHORT_BINBYTES + the parent, MEMOIZE, MARK,
        the token items, then the block's suffix ``sfx[i]`` (TUPLE, MEMOIZE, the extra
        keys' opcodes, TUPLE3, MEMOIZE, STOP; see `_frame` / `_extra_tail`).

        For ids in [256, 65536) pickle writes BININT2: ``M``, byte 0, byte 1 -- ONE
        bytearray for all ids, written with three strided slice assignments, and each
        block's items are a slice of it; ids < 256 (BININT1: ``K`` and the byte) are
        spliced in. NOTE: no Python int per token (unpacking the ids for pickle.dumps
        cost as much as pickling them, ~9 ns per token each at block size 512).

        Returns:
          The digests, or None when some id is >= 65536 or the block size is < 4
          (TUPLE1-3 keys), or a frame would exceed what one pickle frame holds: then
          the caller's other writers.
        """
        n = num_blocks * bs
        ds = self._digest_size
        if bs < 4 or len(parent) != ds:
            return None
        if n >= _NUMPY_STREAM_MIN_IDS:
            stream, b0, b1, high = _stream16(packed, n, False)
            if high:
                return None
        else:
            b0 = packed[_BYTE0::8]
            b1 = packed[_BYTE1::8]
            if _low_u16s(packed, b0, b1) != packed:
                return None
            stream = bytearray(3 * n)
            stream[0::3] = b"M" * n
            stream[1::3] = b0
            stream[2::3] = b1
        w = 3 * bs
        open_ = b"\x94("  # MEMOIZE (the parent), MARK
        pieces = [open_ + stream[j : j + w] + t for j, t in zip(range(0, 3 * n, w), sfx)]
        # Ids < 256 (byte 1 zero): BININT1, one byte shorter; spliced per block.
        i = b1.find(0)
        while i >= 0:
            k = i // bs
            end = (k + 1) * bs
            parts = [open_]
            a = k * bs
            while 0 <= i < end:
                if a < i:
                    parts.append(stream[3 * a : 3 * i])
                a = i + 1
                if a < end and not b1[a]:
                    a = end - len(b1[i:end].lstrip(b"\0"))  # end of the run of ids < 256
                    run = bytearray(2 * (a - i))
                    run[0::2] = b"K" * (a - i)
                    run[1::2] = b0[i:a]
                    parts.append(run)
                else:
                    parts.append(_PICKLE_SMALL_ITEM[b0[i]])
                i = b1.find(0, a)
            if a < end:
                parts.append(stream[3 * a : 3 * end])
            parts.append(sfx[k])
            pieces[k] = b"".join(parts)
        # PROTO, FRAME + the frame's length (all after these 11 bytes), SHORT_BINBYTES.
        heads: dict[int, bytes] = {}
        tag = b"C" + bytes((ds,))
        lens = [2 + ds + len(x) for x in pieces]
        for m in lens:
            if m not in heads:
                if m > _MAX_FAST_PICKLE_FRAME:
                    return None
                heads[m] = b"\x80" + bytes((_PICKLE_PROTOCOL,)) + b"\x95" + m.to_bytes(8, "little") + tag
        digest = self._digest
        if digest is _sha256_digest:
            sha256 = hashlib.sha256
            return [
                parent := sha256(heads[m] + parent + x).digest() for m, x in zip(lens, pieces)
            ]
        return [parent := digest(heads[m] + parent + x) for m, x in zip(lens, pieces)]

    # -- vectorised path ------------------------------------------------------------
    def _extra_tail(self, extra: tuple | None) -> bytes | None:
        """Serialized bytes of the key after the token tuple, or None if not spliceable.

        cbor: the extra keys' encoding (``0xf6`` for None). pickle: the extra keys'
        opcodes + TUPLE3 + MEMOIZE + STOP. NOTE (pickle): the extra keys' memo indices
        only depend on how many objects were memoised before them (always 2: the parent
        bytes and the token tuple), so their opcodes are cut out of a key with a dummy
        parent and a one-token tuple and reused verbatim.
        """
        if self._is_cbor:
            return b"\xf6" if extra is None else cbor2.dumps(extra, canonical=True)
        if extra is None:
            return b"N\x87\x94."
        dummy = pickle.dumps(
            (bytes(self._digest_size), (0,), extra), protocol=_PICKLE_PROTOCOL
        )
        frame_len = int.from_bytes(dummy[3:11], "little")
        if dummy[:3] != bytes([0x80, _PICKLE_PROTOCOL, 0x95]) or frame_len != len(dummy) - 11:
            return None  # several frames or out-of-band data: no splicing
        head = 11 + 2 + self._digest_size + 1 + 4  # frame, C+len, parent, MEMOIZE, K\0\x85\x94
        assert dummy[head - 4 : head] == b"K\x00\x85\x94", dummy
        return dummy[head:]

    def _tail(self, lora_pair, mm: tuple, salt) -> tuple[bytes | None, tuple | None]:
        """(`_extra_tail`, canonical extra keys) of the extra keys built from their
        parts; cached."""
        key = (lora_pair, mm, salt or None)
        cache = self._tail_cache
        got = cache.get(key)
        if got is None:
            if len(cache) >= _TAIL_CACHE_SIZE:
                cache.clear()
            extra = _extras_from_parts(*key)
            got = cache[key] = (self._extra_tail(extra), extra)
        return got

    def _tail_plan(self, bs, start_block, lora, mm_features, cache_salt) -> _TailPlan | None:
        """What follows the token items in each block's key (see `_TailPlan`).

        The plan for a request's shape (LoRA, multimodal items, salt, block size) is
        cached on the hasher, so requests that share it (the same image and adapter at
        the same place) skip all per-block Python work.

        Returns:
          None when some extra keys cannot be spliced (the generic path must write them).
        """
        lora_pair = _lora_pair(lora)
        salt = cache_salt if (cache_salt and start_block == 0) else None
        lo = start_block * bs
        if not mm_features:
            feats = ()
        elif len(mm_features) == 1:  # the common case: nothing to sort
            f = _mm_fields(mm_features[0])
            feats = (f,) if f[1] + f[2] > lo else ()
        else:
            feats = tuple(
                sorted(
                    (f for f in map(_mm_fields, mm_features) if f[1] + f[2] > lo),
                    key=lambda f: f[1],
                )
            )
        # Without items or salt the plan does not depend on where the blocks start.
        key = (lora_pair, feats, salt, start_block if (feats or salt) else -1, bs)
        cache = self._plan_cache
        plan = cache.get(key)
        if plan is None:
            plan = self._make_tail_plan(lora_pair, feats, salt, start_block, bs)
            if len(cache) >= _TAIL_CACHE_SIZE:
                cache.clear()
            cache[key] = plan
        return None if plan is _UNSPLICEABLE else plan

    def _make_tail_plan(self, lora_pair, feats, salt, start_block, bs):
        if len(feats) == 1:
            plan = self._one_item_plan(lora_pair, feats[0], salt, start_block, bs)
            if plan is not None:
                return plan
        special: dict[int, list] = {}
        for identifier, offset, length in feats:
            for b in range(max(offset // bs, start_block), (offset + length - 1) // bs + 1):
                special.setdefault(b, []).append((identifier, offset - b * bs))
        if salt is not None:
            special.setdefault(0, [])
        tail, extra = self._tail(lora_pair, (), None)
        tails, extras = [tail], [extra]
        index: dict = {tail: 0}
        positions, ids = [], []
        for b, mm in sorted(special.items()):
            tail, extra = self._tail(lora_pair, tuple(mm), salt if b == 0 else None)
            k = index.get(tail)
            if k is None:
                k = index[tail] = len(tails)
                tails.append(tail)
                extras.append(extra)
            positions.append(b - start_block)
            ids.append(k)
        if None in tails:
            return _UNSPLICEABLE
        head, hole, close = self._frame(bs)
        return _TailPlan(
            head, hole, close, bs, [close + t for t in tails], extras, positions, ids
        )

    def _one_item_plan(self, lora_pair, feat, salt, start_block, bs):
        """`_make_tail_plan` for one multimodal item, or None (then the generic one).

        NOTE: every block the item overlaps has its own extra keys -- the item's offset
        relative to the block differs -- so a new image, adapter or salt used to cost
        one serialization per block (~2-9 us each, dozens per image). Those keys differ
        only in that int, the last value before the keys' closing opcodes (pickle) or
        the last item (CBOR): their bytes are one template around the int's encoding,
        cut once per (adapter, item) from two serializations (`_item_template`). Only
        block 0 with a salt goes through `_tail`. Tests pin every suffix and extra
        key to the generic builder's.
        """
        identifier, offset, length = feat
        b0 = max(offset // bs, start_block)
        b1 = (offset + length - 1) // bs
        rels = range(offset - b0 * bs, offset - (b1 + 1) * bs, -bs)
        if not -(2**31) <= rels[-1] <= rels[0] < 2**31:  # pickle: BININT at most
            return None
        template = self._item_template(lora_pair, identifier)
        if template is None:
            return None
        plain, plain_extra = self._tail(lora_pair, (), None)
        if plain is None:
            return None
        head, hole, close = self._frame(bs)
        suffixes, extras = [close + plain], [plain_extra]
        positions: list[int] = []
        # Block i (from start_block) takes suffix lead + [plain] * pad + items (and plain
        # past them): tails_for's list, materialized on first use.
        lead: list[bytes] = []
        pad, item_sfx = 0, []
        if salt is not None:  # block 0's key also carries the salt (start_block is 0)
            mm = ((identifier, offset),) if b0 == 0 else ()
            tail, extra = self._tail(lora_pair, mm, salt)
            if tail is None:
                return None
            suffixes.append(close + tail)
            extras.append(extra)
            positions.append(0)
            lead.append(suffixes[-1])
            if b0 == 0:
                rels = rels[1:]
                b0 = 1
        if rels:
            item_sfx, item_extras = self._item_suffixes(template, rels, close)
            suffixes += item_sfx
            extras += item_extras
            positions += range(b0 - start_block, b1 + 1 - start_block)
            pad = b0 - start_block - len(lead)
        return _TailPlan(
            head, hole, close, bs, suffixes, extras, positions, range(1, len(suffixes)),
            (lead, pad, item_sfx),
        )

    def _item_suffixes(self, template, rels: range, close: bytes) -> tuple[list, list]:
        """(suffixes, extra keys) of the blocks an item overlaps at relative offsets
        ``rels``: ``close + pre + enc(r) + post`` and its key; cached per (adapter, item,
        rels), so plans that differ only in the salt (block 0) or in the position of
        the same run of blocks share them."""
        key = ("item-suffixes", template, rels.start, rels.stop, rels.step, close)
        cache = self._tail_cache
        got = cache.get(key)
        if got is None:
            pre, post, lora_key, ident = template
            enc = _cbor_int if self._is_cbor else _pickle_int
            pre = close + pre
            mm_label = MM_LABEL
            if lora_key is None:
                extras = [((mm_label, ident, r),) for r in rels]
            else:
                extras = [(lora_key, (mm_label, ident, r)) for r in rels]
            if len(cache) >= _TAIL_CACHE_SIZE:
                cache.clear()
            got = cache[key] = ([pre + enc(r) + post for r in rels], extras)
        return got

    def _item_template(self, lora_pair, identifier):
        """(pre, post, LoRA key, identifier) such that ``pre + enc(r) + post`` is the
        `_extra_tail` of ``_extras_from_parts(lora_pair, ((identifier, r),), None)``
        (``enc``: `_cbor_int` / `_pickle_int`) and its extra keys are ``((MM_LABEL,
        identifier, r),)`` after the LoRA key; cached. None when the serialization is
        not of that form (then the generic builder)."""
        key = ("item", lora_pair, identifier)
        cache = self._tail_cache
        got = cache.get(key, self)
        if got is not self:
            return got
        got = None
        t0, e0 = self._tail(lora_pair, ((identifier, 0),), None)
        t1, _ = self._tail(lora_pair, ((identifier, 1),), None)
        if t0 is not None and t1 is not None and len(t0) == len(t1):
            # The int's encoding: its last byte is the only one that differs (0 / 1).
            p = next((i for i, (x, y) in enumerate(zip(t0, t1)) if x != y), -1)
            zero = b"\0" if self._is_cbor else b"K\0"
            if p >= 0 and t0[p + 1 - len(zero) : p + 1] == zero and t0[p + 1 :] == t1[p + 1 :]:
                got = (
                    t0[: p + 1 - len(zero)], t0[p + 1 :],
                    e0[0] if lora_pair is not None else None, e0[-1][1],
                )
        if len(cache) >= _TAIL_CACHE_SIZE:
            cache.clear()
        cache[key] = got
        return got

    def _hash_blocks_vectorised(
        self, u32, num_blocks, block_size, start_block, parent,
        lora, mm_features, cache_salt, plan=None, plan_offset=0,
    ) -> list[bytes] | None:
        """All full blocks at once; None when only the generic path can write them.
        ``plan``, ``plan_offset``: as in `_hash_blocks`."""
        if not self._is_cbor and u32.size and u32.max() >= 2**31:
            return None  # LONG1 opcodes: generic path
        if plan is None:
            plan = self._tail_plan(block_size, start_block, lora, mm_features, cache_salt)
            plan_offset = 0
        if plan is None:
            return None
        buf, ends = self._write_keys(u32, num_blocks, block_size, plan.tables(), plan_offset)
        if buf is None:
            return None
        hole = plan.hole
        ds = self._digest_size
        mv = memoryview(buf)
        out = []
        append = out.append
        a = 0
        # NOTE: the chain is inherently sequential; each step is one slice assignment
        # and one digest call over a precomputed message. SHA-256 is called directly
        # (no Python-level wrapper frame) since this loop is the hot path.
        if self._digest is _sha256_digest:
            sha256 = hashlib.sha256
            for b in ends:
                h = a + hole
                mv[h : h + ds] = parent
                parent = sha256(mv[a:b]).digest()
                append(parent)
                a = b
        else:
            digest = self._digest
            for b in ends:
                h = a + hole
                mv[h : h + ds] = parent
                parent = digest(mv[a:b])
                append(parent)
                a = b
        return out

    def _write_keys(self, u32, nb, bs, plan, off=0):
        """Serialized keys of ``nb`` blocks, back to back, parent holes zero.

        Args:
          u32: u32[nb * bs] token ids (< 2**31 for pickle).
          plan: the blocks' `_TailPlan` (head, suffixes); block i takes the plan's
            block ``off + i``.

        Returns:
          (buf, ends): a bytearray and the end offset of each block's message (list of
          nb ints; block i spans ``ends[i-1]:ends[i]``); (None, None) when a pickle frame
          would be too long to assemble ourselves.
        """
        if u32.max() < (1 << _TABLE_BITS):
            if self._is_cbor:
                tok, tok_len = _CBOR_ROW[u32], _CBOR_ROW_LEN[u32]
            else:
                tok, tok_len = _PICKLE_ROW[u32], _PICKLE_ROW_LEN[u32]
        elif self._is_cbor:
            tok, tok_len = _cbor_token_rows(u32)
        else:
            tok, tok_len = _pickle_token_rows(u32)
        p = plan.head_rows
        # NOTE: explicit little-endian rows: byte 0 of a row is its lowest byte.
        rows = plan.template.repeat(nb, axis=0)
        mask = plan.template_mask.repeat(nb, axis=0)
        rows[:, p : p + bs] = tok.reshape(nb, bs)
        mask[:, p : p + bs] = _MASK_BY_LEN[tok_len].reshape(nb, bs)
        # Message ends: token bytes up to each block's end + per-block fixed bytes.
        ends = tok_len.cumsum()[bs - 1 :: bs]
        ends += plan.fixed_len * (_ONE_TO[:nb] if nb < _ONE_TO.shape[0] else np.arange(1, nb + 1))
        adjust = None
        if plan.positions is not None and plan.positions[-1] >= off:
            pos = plan.positions
            if off:
                sel = (pos >= off) & (pos < off + nb)
                blocks, ids = pos[sel] - off, plan.ids[sel]
            else:
                sel = pos < nb
                blocks, ids = pos[sel], plan.ids[sel]
            rows[blocks, p + bs :] = plan.suffix_rows[ids]
            mask[blocks, p + bs :] = plan.suffix_mask[ids]
            adjust = np.zeros(nb, dtype=np.int64)
            adjust[blocks] = plan.suffix_lens[ids] - plan.suffix_lens[0]
            ends += adjust.cumsum()
        if not self._is_cbor:
            lens = tok_len.reshape(nb, bs).sum(axis=1) + plan.fixed_len
            if adjust is not None:
                lens += adjust
            frame = lens - 11  # everything after PROTO and the FRAME header
            if frame.max() > _MAX_FAST_PICKLE_FRAME:
                return None, None
            # FRAME's length: bytes 3..10 of row 0 (< 2**16, so bytes 3 and 4).
            rows[:, 0] |= (frame << 24).astype(np.uint64)
        buf = bytearray(np.compress(mask.view(bool).reshape(-1), rows.view(np.uint8).reshape(-1)))
        return buf, ends.tolist()


class _TailPlan:
    """How the blocks of one request shape serialize around their token items.

    Built once per request shape and cached on the hasher; the numpy tables for the
    vectorised writer are built on its first use (the per-block writer needs none).

    Attributes:
      head: bytes before a block's token items, with a zero hole for the parent at
        offset ``hole``; close_len: bytes of the token tuple's close, which starts
        every suffix.
      suffixes: the U distinct suffixes (close + serialized extra keys) as bytes;
        extras: the U extra keys themselves (canonical tuples or None), same order.
      id_of: block ``start_block + i`` takes suffix ``id_of.get(i, 0)``; positions,
        ids: intp[k] the same map as arrays (None when every block takes suffix 0);
        may reach past the last block.
      After `tables()`: template, template_mask <u8[1, head_rows + block_size + t] one
        block's rows (head, zero token rows, suffix 0) and byte masks; head_rows;
        fixed_len (bytes of head + suffix 0); suffix_rows, suffix_mask <u8[U, t] the
        suffixes zero padded and their byte masks; suffix_lens i64[U].
    """

    __slots__ = (
        "head", "hole", "close_len", "block_size", "suffixes", "extras", "id_of", "positions",
        "ids", "template", "template_mask", "head_rows", "fixed_len", "suffix_rows",
        "suffix_mask", "suffix_lens", "_tail_seq",
    )

    def __init__(
        self, head, hole, close, block_size, suffixes, extras, positions, ids, tail_seq=None
    ):
        self.head, self.hole, self.close_len = head, hole, len(close)
        self.block_size = block_size
        self.suffixes = suffixes
        self.extras = extras
        self.id_of = dict(zip(positions, ids))
        # NOTE: the arrays only serve the vectorised writer: built by tables().
        self.positions = positions if positions else None
        self.ids = ids
        self.template = None
        # tails_for's list; the builder may give it as (lead, pad, items): lead + pad
        # times suffix 0 + items, built on first use.
        self._tail_seq = tail_seq

    def tails_for(self, n: int) -> list[bytes]:
        """The suffix of each of the first ``n`` blocks (a fresh list)."""
        seq = self._tail_seq
        if type(seq) is tuple:
            lead, pad, items = seq
            seq = self._tail_seq = lead + [self.suffixes[0]] * pad + items
        elif seq is None:
            get, suffixes = self.id_of.get, self.suffixes
            last = max(self.id_of, default=-1)
            seq = self._tail_seq = [suffixes[get(i, 0)] for i in range(last + 1)]
        if n <= len(seq):
            return seq[:n]
        return seq + [self.suffixes[0]] * (n - len(seq))

    def tables(self) -> "_TailPlan":
        """Build (once) the numpy rows the vectorised writer copies; returns self."""
        if self.template is not None:
            return self
        if self.positions is not None:
            self.positions = np.array(self.positions, dtype=np.intp)
            self.ids = np.array(self.ids, dtype=np.intp)
            self.positions.flags.writeable = self.ids.flags.writeable = False
        head, suffixes, bs = self.head, self.suffixes, self.block_size
        width = 8 * max(-(-len(x) // 8) for x in suffixes)
        self.suffix_rows = np.frombuffer(
            b"".join(x.ljust(width, b"\0") for x in suffixes), dtype="<u8"
        ).reshape(len(suffixes), width // 8)
        self.suffix_mask = np.frombuffer(
            b"".join(b"\1" * len(x) + b"\0" * (width - len(x)) for x in suffixes),
            dtype="<u8",
        ).reshape(len(suffixes), width // 8)
        self.suffix_lens = np.array([len(x) for x in suffixes], dtype=np.int64)
        self.suffix_lens.flags.writeable = False
        self.head_rows = -(-len(head) // 8)
        self.fixed_len = len(head) + len(suffixes[0])
        # One block's rows: head, bs token rows (zero), suffix 0.
        self.template_mask = np.frombuffer(
            (b"\1" * len(head)).ljust(8 * self.head_rows, b"\0") + bytes(8 * bs)
            + (b"\1" * len(suffixes[0])).ljust(width, b"\0"),
            dtype="<u8",
        ).reshape(1, -1)
        self.template = np.frombuffer(
            head.ljust(8 * self.head_rows, b"\0") + bytes(8 * bs)
            + suffixes[0].ljust(width, b"\0"),
            dtype="<u8",
        ).reshape(1, -1)
        return self
