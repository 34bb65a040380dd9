"""Block hashing: the prefix-cache key of every full KV block, byte-compatible with vLLM.

A block's digest is ``H(serialize((parent_digest, tuple(token_ids), extra_keys)))``
(vLLM 0.33's ``hash_block_tokens``):

- ``parent_digest`` is the digest of the previous block, or the chain root
  (``NONE_HASH``) for the first block; ``None`` or ``b""`` as a parent means the root.
- ``extra_keys`` is ``None`` or a tuple of labelled tuples, in this order:
  ``("lora", name, path)``, one ``("mm", identifier, item_offset - block_start)`` per
  multimodal item overlapping the block (offset order), ``("cache_salt", salt)`` on the
  first block only (an empty salt adds no key).
- ``serialize`` is ``pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)`` for ``sha256``
  and ``xxhash``, ``cbor2.dumps(obj, canonical=True)`` for ``sha256_cbor`` and
  ``xxhash_cbor``; ``H`` is SHA-256 or ``xxhash.xxh3_128_digest``.
- The root is ``H(serialize(seed))``. The seed is ``str(seed)`` when one is given; else
  ``PYTHONHASHSEED`` when set; else ``"vllm-none-hash"`` for the sha256 variants and 32
  fresh random bytes (hex) for the xxhash variants (a predictable seed would let an
  attacker precompute collisions of a non-cryptographic hash).

The hot path (`BlockHasher.hash_token_blocks`) does not build Python tuples and call the
generic serializers per block: it encodes all token ids of a sequence at once with numpy
into the exact bytes those serializers would write, then per block only glues a
constant header, the parent digest, the block's slice of token bytes and the
(per-request cached) extra-keys bytes together and hashes them. Tests pin these
encoders byte for byte to ``pickle.dumps`` / ``cbor2.dumps(canonical=True)``.
"""

from __future__ import annotations

import array
import hashlib
import operator
import os
import pickle
import sys
from collections.abc import Sequence
from typing import Any, Callable

import cbor2
import numpy as np

try:  # NOTE: optional, as in vLLM; only the xxhash algorithms need it.
    import xxhash as _xxhash

    if not hasattr(_xxhash, "xxh3_128_digest"):  # pragma: no cover - very old xxhash
        _xxhash = None
except ImportError:  # pragma: no cover - exercised only without xxhash installed
    _xxhash = None

__all__ = [
    "HASH_ALGOS",
    "DEFAULT_NONE_HASH_SEED",
    "LORA_LABEL",
    "MM_LABEL",
    "CACHE_SALT_LABEL",
    "PROMPT_EMBEDS_LABEL",
    "BlockHasher",
    "block_extra_keys",
    "canonical_extra_keys",
]

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

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

_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
# Largest pickle frame we assemble ourselves. pickle starts a new frame once a frame
# reaches 64 KiB (FRAME_SIZE_TARGET); bigger keys go through pickle.dumps itself.
_MAX_FAST_PICKLE_FRAME = 64 * 1024 - 64

# Class boundaries of unsigned ints by encoded width (used with searchsorted).
_CBOR_BOUNDS = np.array([24, 256, 65536, 2**32], dtype=np.uint64)
_CBOR_HEADER = np.array([0, 0x18, 0x19, 0x1A, 0x1B], dtype=np.uint8)
_CBOR_PAYLOAD = np.array([0, 1, 2, 4, 8], dtype=np.int64)
# pickle: BININT1 (<256), BININT2 (<65536), BININT (<2**31), then LONG1 with 5..9 bytes
# (little-endian two's complement, minimal length, so a sign byte when the top bit is set).
_PICKLE_BOUNDS = np.array(
    [256, 65536, 2**31, 2**39, 2**47, 2**55, 2**63], dtype=np.uint64
)
_PICKLE_OPCODE = np.array([0x4B, 0x4D, 0x4A, 0x8A, 0x8A, 0x8A, 0x8A, 0x8A], np.uint8)
_PICKLE_PAYLOAD = np.array([1, 2, 4, 5, 6, 7, 8, 9], dtype=np.int64)
_PICKLE_IS_LONG1 = np.array([0, 0, 0, 1, 1, 1, 1, 1], dtype=bool)
_PICKLE_TUPLE_N = {1: b"\x85", 2: b"\x86", 3: b"\x87"}  # TUPLE1..TUPLE3
_MAX_UINT64 = 2**64 - 1


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
    if isinstance(extra_keys, (str, bytes)) or not isinstance(
        extra_keys, (tuple, list)
    ):
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
    return identifier, offset, length


def _lora_key(lora: Any) -> tuple | None:
    if lora is None:
        return None
    if isinstance(lora, (tuple, list)):
        name, path = lora
    else:
        name, path = lora.name, lora.path
    return (LORA_LABEL, _fresh_str(name), _fresh_str(path))


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
    keys = []
    lora_key = _lora_key(lora)
    if lora_key is not None:
        keys.append(lora_key)
    for feature in mm_features:
        identifier, offset, length = _mm_fields(feature)
        if offset >= end:
            break  # sorted by offset: nothing later overlaps either
        if offset + length > start:
            keys.append((MM_LABEL, _fresh_str(identifier), int(offset) - start))
    if is_first_block and cache_salt:
        keys.append((CACHE_SALT_LABEL, _fresh_str(cache_salt)))
    return tuple(keys) if keys else None


def _as_token_array(token_ids: Any) -> np.ndarray | None:
    """Validated token ids as ``u64[n]``, or None when some id is >= 2**63.

    Raises:
      ValueError: a negative or non-integer token id.
    """
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {token_ids.shape}")
        if token_ids.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {token_ids.dtype}")
        if token_ids.size and token_ids.dtype.kind == "i" and token_ids.min() < 0:
            raise ValueError(f"negative token id {int(token_ids.min())}")
        return token_ids.astype(np.uint64, copy=False)
    try:
        # NOTE: array.array rejects floats, strings and None at C speed; bool is an int
        # subclass and enters by value (values-only semantics, like numpy ints).
        arr = np.frombuffer(array.array("q", token_ids), dtype=np.int64)
    except OverflowError:
        return None  # ids beyond int64 (or hugely negative): generic path decides
    except TypeError as e:
        bad = next((t for t in token_ids if not _is_int(t)), None)
        raise ValueError(f"token ids must be ints, got {bad!r}") from e
    if arr.size and arr.min() < 0:
        raise ValueError(f"negative token id {int(arr.min())}")
    return arr.view(np.uint64)


def _is_int(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _canonical_tokens(token_ids: Any) -> tuple[int, ...]:
    """Token ids as a tuple of Python ints (the generic path), validated."""
    out = []
    for t in token_ids:
        try:
            v = operator.index(t)
        except TypeError:
            raise ValueError(f"token ids must be ints, got {t!r}") from None
        if v < 0:
            raise ValueError(f"negative token id {v}")
        out.append(int(v))
    return tuple(out)


def encode_tokens_cbor(tokens: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Canonical CBOR encodings of unsigned ints, concatenated.

    Args:
      tokens: u64[n] token ids.

    Returns:
      (data, offsets): ``data[offsets[i]:offsets[i+1]] == cbor2.dumps(int(tokens[i]),
      canonical=True)``; ``offsets: i64[n + 1]``.
    """
    n = tokens.shape[0]
    cls = np.searchsorted(_CBOR_BOUNDS, tokens, side="right")
    payload = _CBOR_PAYLOAD[cls]
    rows = np.empty((n, 9), dtype=np.uint8)
    rows[:, 1:] = tokens.astype(">u8").view(np.uint8).reshape(n, 8)
    rows[:, 0] = np.where(cls == 0, tokens.astype(np.uint8), _CBOR_HEADER[cls])
    cols = np.arange(9)
    mask = cols[None, :] >= (9 - payload)[:, None]
    mask[:, 0] = True
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(payload + 1, out=offsets[1:])
    return rows[mask].tobytes(), offsets


def encode_tokens_pickle(tokens: np.ndarray) -> tuple[bytes, np.ndarray]:
    """pickle opcodes of non-negative ints (< 2**64) as ``pickle.dumps`` writes them.

    Args:
      tokens: u64[n] token ids.

    Returns:
      (data, offsets) with ``offsets: i64[n + 1]``: token i's opcode bytes (BININT1,
      BININT2, BININT or LONG1) are ``data[offsets[i]:offsets[i+1]]``.
    """
    n = tokens.shape[0]
    cls = np.searchsorted(_PICKLE_BOUNDS, tokens, side="right")
    payload = _PICKLE_PAYLOAD[cls]
    is_long = _PICKLE_IS_LONG1[cls]
    rows = np.zeros((n, 11), dtype=np.uint8)
    rows[:, 0] = _PICKLE_OPCODE[cls]
    rows[:, 1] = payload  # LONG1's byte count; dropped for the BININT opcodes
    rows[:, 2:10] = tokens.astype("<u8").view(np.uint8).reshape(n, 8)
    cols = np.arange(11)
    mask = (cols[None, :] >= 2) & (cols[None, :] < (2 + payload)[:, None])
    mask[:, 0] = True
    mask[:, 1] = is_long
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(1 + payload + is_long, out=offsets[1:])
    return rows[mask].tobytes(), offsets


def _cbor_head(major: int, n: int) -> bytes:
    """Canonical CBOR head (major type, argument n)."""
    m = major << 5
    if n < 24:
        return bytes([m | n])
    if n < 256:
        return bytes([m | 24, n])
    if n < 65536:
        return bytes([m | 25]) + n.to_bytes(2, "big")
    if n < 2**32:
        return bytes([m | 26]) + n.to_bytes(4, "big")
    return bytes([m | 27]) + n.to_bytes(8, "big")


class BlockHasher:
    """Computes vLLM-compatible block digests for one algorithm and chain root.

    Invariants: ``root == H(serialize(seed))`` is fixed at construction; every digest is
    a pure function of (algo, root, parent digest, token ids, extra key values), so two
    hashers with equal ``algo`` and ``root`` are interchangeable (they compare equal).

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
        "_digest_size",
        "_pickle_parent_head",
        "_cbor_parent_head",
    )

    def __init__(self, algo: str = "sha256", seed: Any = None):
        """Args:
        algo: "sha256" | "sha256_cbor" | "xxhash" | "xxhash_cbor".
        seed: any value; used as ``str(seed)``. None: PYTHONHASHSEED when set, else
          "vllm-none-hash" (sha256 variants) or random (xxhash variants).

        Raises:
          ValueError: unknown algorithm.
          ImportError: an xxhash algorithm without the ``xxhash`` package.
        """
        if algo not in HASH_ALGOS:
            raise ValueError(
                f"unknown hash algorithm {algo!r}; valid: {', '.join(HASH_ALGOS)}"
            )
        if algo.startswith("xxhash"):
            if _xxhash is None:
                raise ImportError(
                    f"hash algorithm {algo!r} needs the 'xxhash' package "
                    "(>= 3.0, with xxh3_128_digest): pip install xxhash"
                )
            self._digest: Callable[[bytes], bytes] = _xxhash.xxh3_128_digest
            self._digest_size = 16
        else:
            self._digest = _sha256_digest
            self._digest_size = 32
        self._algo = algo
        self._is_cbor = algo.endswith("_cbor")
        if seed is None:
            env_seed = os.environ.get("PYTHONHASHSEED")
            if env_seed is not None:
                seed_str = env_seed
            elif algo.startswith("xxhash"):
                seed_str = os.urandom(32).hex()
            else:
                seed_str = DEFAULT_NONE_HASH_SEED
        else:
            seed_str = str(seed)
        self._seed = seed_str
        self._root = self._digest(self.serialize(seed_str))
        ds = self._digest_size
        self._pickle_parent_head = b"C" + bytes([ds])  # SHORT_BINBYTES
        self._cbor_parent_head = _cbor_head(2, ds)

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
    def serialize(self, obj: Any) -> bytes:
        """The algorithm's serializer: pickle (HIGHEST_PROTOCOL) or canonical CBOR."""
        if self._is_cbor:
            return cbor2.dumps(obj, canonical=True)
        return pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)

    def hash_object(self, obj: Any) -> bytes:
        """``H(serialize(obj))`` — vLLM's ``hash_fn(obj)``."""
        return self._digest(self.serialize(obj))

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

    # -- fast path ------------------------------------------------------------------
    def _extra_tail(self, extra: tuple | None) -> bytes | None:
        """Bytes of the key after the token tuple, or None when not assemblable.

        pickle: the extra keys' opcodes + TUPLE3 + MEMOIZE + STOP; cbor: the extra keys'
        encoding. NOTE (pickle): the extra keys' memo indices only depend on how many
        objects were memoised before them (always 2: the parent bytes and the token
        tuple), so their opcodes are cut out of a key with a dummy parent and a one-token
        tuple and reused verbatim.
        """
        if self._is_cbor:
            return b"\xf6" if extra is None else cbor2.dumps(extra, canonical=True)
        if extra is None:
            return b"N\x87\x94."
        dummy = pickle.dumps(
            (bytes(self._digest_size), (0,), extra), protocol=_PICKLE_PROTOCOL
        )
        frame_len = int.from_bytes(dummy[3:11], "little")
        if dummy[:3] != b"\x80" + bytes([_PICKLE_PROTOCOL]) + b"\x95" or frame_len != len(
            dummy
        ) - 11:
            return None  # several frames or out-of-band data: no splicing
        head = 11 + 2 + self._digest_size + 1 + 4  # frame, C+len, parent, MEMOIZE, K\0\x85\x94
        assert dummy[head - 4 : head] == b"K\x00\x85\x94", dummy
        return dummy[head:]

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
        the blocks. Tokens after the last full block are ignored.

        Args:
          token_ids: the whole sequence (list of ints or ``int[n]`` array); only
            ``token_ids[start_block * block_size:]`` is read.
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
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
            raise ValueError(f"block_size must be an int, got {block_size!r}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if start_block < 0:
            raise ValueError(f"start_block must be >= 0, got {start_block}")
        block_size = int(block_size)
        lo = start_block * block_size
        num_blocks = max(0, (len(token_ids) - lo) // block_size)
        if num_blocks == 0:
            # Still validate what was given (the ids are part of the contract).
            if not isinstance(token_ids, np.ndarray):
                _canonical_tokens(token_ids[lo:])
            else:
                _as_token_array(token_ids[lo:])
            return []
        hi = lo + num_blocks * block_size
        tokens = _as_token_array(token_ids[lo:hi])
        # Validate what is beyond the last full block too (cheap, keeps errors uniform).
        rest = token_ids[hi:]
        if len(rest):
            if isinstance(rest, np.ndarray):
                _as_token_array(rest)
            else:
                _canonical_tokens(rest)
        parent_bytes = self._parent_bytes(parent)
        extras = self._extra_keys_per_block(
            num_blocks, block_size, start_block, lora, mm_features, cache_salt
        )
        if tokens is None:  # ids >= 2**63: generic path
            return self._hash_blocks_generic(
                token_ids[lo:hi], block_size, parent_bytes, extras
            )
        if self._is_cbor:
            return self._hash_blocks_cbor(tokens, block_size, parent_bytes, extras)
        return self._hash_blocks_pickle(tokens, block_size, parent_bytes, extras)

    def _extra_keys_per_block(
        self, num_blocks, block_size, start_block, lora, mm_features, cache_salt
    ) -> list[tuple | None] | None:
        """Extra keys of each block, or None when no block has any."""
        if lora is None and not mm_features and not (cache_salt and start_block == 0):
            return None
        features = sorted((_mm_fields(f) for f in mm_features), key=lambda f: f[1])
        out = []
        for b in range(start_block, start_block + num_blocks):
            start = b * block_size
            out.append(
                block_extra_keys(
                    start,
                    start + block_size,
                    lora=lora,
                    mm_features=features,
                    cache_salt=cache_salt,
                    is_first_block=b == 0,
                )
            )
        return out

    def _hash_blocks_generic(self, tokens, block_size, parent, extras) -> list[bytes]:
        digest, serialize = self._digest, self.serialize
        ids = _canonical_tokens(tokens)
        out = []
        for i in range(len(ids) // block_size):
            extra = None if extras is None else extras[i]
            parent = digest(
                serialize((parent, ids[i * block_size : (i + 1) * block_size], extra))
            )
            out.append(parent)
        return out

    def _tails(self, extras: list | None, num_blocks: int) -> list[bytes | None]:
        """Per-block tail bytes (see `_extra_tail`), one encoding per distinct key."""
        if extras is None:
            return [self._extra_tail(None)] * num_blocks
        cache: dict = {}
        out = []
        for extra in extras:
            tail = cache.get(extra, cache)
            if tail is cache:
                tail = cache[extra] = self._extra_tail(extra)
            out.append(tail)
        return out

    def _hash_blocks_cbor(self, tokens, block_size, parent, extras) -> list[bytes]:
        data, offsets = encode_tokens_cbor(tokens)
        starts = offsets[::block_size].tolist()
        num_blocks = len(starts) - 1
        tails = self._tails(extras, num_blocks)
        digest = self._digest
        parent_head = b"\x83" + self._cbor_parent_head  # array(3), bytes(digest_size)
        array_head = _cbor_head(4, block_size)
        out = []
        if len(parent) != self._digest_size:  # a foreign parent: generic first block
            parent = digest(
                b"\x83"
                + _cbor_head(2, len(parent))
                + parent
                + array_head
                + data[starts[0] : starts[1]]
                + tails[0]
            )
            out.append(parent)
            first = 1
        else:
            first = 0
        for i in range(first, num_blocks):
            parent = digest(
                parent_head
                + parent
                + array_head
                + data[starts[i] : starts[i + 1]]
                + tails[i]
            )
            out.append(parent)
        return out

    def _hash_blocks_pickle(self, tokens, block_size, parent, extras) -> list[bytes]:
        data, offsets = encode_tokens_pickle(tokens)
        starts = offsets[::block_size].tolist()
        num_blocks = len(starts) - 1
        tails = self._tails(extras, num_blocks)
        digest = self._digest
        if block_size <= 3:
            tup_open, tup_close = b"", _PICKLE_TUPLE_N[block_size] + b"\x94"
        else:
            tup_open, tup_close = b"(", b"t\x94"  # MARK ... TUPLE, MEMOIZE
        proto = b"\x80" + bytes([_PICKLE_PROTOCOL]) + b"\x95"  # PROTO, FRAME
        parent_head = self._pickle_parent_head
        # Frame payload bytes besides the token opcodes and the tail:
        # C, len, parent, MEMOIZE, tuple open/close.
        fixed = 2 + self._digest_size + 1 + len(tup_open) + len(tup_close)
        mid = b"\x94" + tup_open
        out = []
        for i in range(num_blocks):
            tail = tails[i]
            body = data[starts[i] : starts[i + 1]]
            frame_len = fixed + len(body) + (0 if tail is None else len(tail))
            if (
                tail is None
                or frame_len > _MAX_FAST_PICKLE_FRAME
                or len(parent) != self._digest_size
            ):
                extra = None if extras is None else extras[i]
                key = (parent, _canonical_tokens(tokens[i * block_size : (i + 1) * block_size]), extra)
                parent = digest(pickle.dumps(key, protocol=_PICKLE_PROTOCOL))
            else:
                parent = digest(
                    proto
                    + frame_len.to_bytes(8, "little")
                    + parent_head
                    + parent
                    + mid
                    + body
                    + tup_close
                    + tail
                )
            out.append(parent)
        return out


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()
