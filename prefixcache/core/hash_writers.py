"""The fast writers of block keys: byte tables and helpers behind `BlockHasher`'s hot path.

`prefixcache.core.hashing` holds the spec (what a block key is and how each serializer
writes it, `SERIALIZERS`); this module holds what makes writing those exact bytes cheap
for the two built-in serializers, pickle and canonical CBOR: per-token lookup tables
(the CBOR item / pickle opcode of every id < 2**17), the numpy row writers of the
vectorised path, the byte-stream helpers of the per-block writers, and the tuning
constants (measured crossovers, memo bounds). A serializer without a fast writer
(`HashSerializer.writer is None`) never reaches them: `BlockHasher` then writes every key
with the serializer's own ``dumps``.

Tests pin every byte these writers produce to ``pickle.dumps`` /
``cbor2.dumps(canonical=True)`` of the key tuple (tests/core/test_core_hashing.py).
"""

from __future__ import annotations

import pickle
import sys

import numpy as np

_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
# Largest pickle frame we assemble ourselves. pickle starts a new frame once a frame
# reaches 64 KiB (FRAME_SIZE_TARGET); bigger keys go through pickle.dumps itself.
_MAX_FAST_PICKLE_FRAME = 64 * 1024 - 64
# Below this many blocks the per-call numpy overhead (some 20 numpy calls) outweighs
# its per-block savings: serialize those blocks one by one. NOTE: measured inside the
# replay, not in isolation: in isolation CBOR's crossover is ~16 blocks, but inside the
# replay loop the numpy path (its tables and machinery) also evicts the manager's data
# from the caches; interleaved A/B in one process (session 2) put shared_system_prompt
# 6-20% and multi_turn 0-10% faster with 64 than with 16, few_shot within noise.
_MIN_VECTOR_BLOCKS_CBOR = 64
_MIN_VECTOR_BLOCKS_PICKLE = 64
# Up to this many blocks whose ids are all < 65536, CBOR's per-block writer (token
# arrays cut from one byte stream, session 3) beats the vectorised one: measured in
# isolation 1.3-1.9 vs 1.5-3.1 us per block at 64-256 blocks (vocab 32000); with ids
# >= 65536 (a 128K vocab) the per-block writer falls back to cbor2 per block and the
# vectorised one wins from 64 blocks (3.2-4.5 vs 6.4-8.5 us).
# NOTE (session 6): with the stream built by numpy from _NUMPY_STREAM_MIN_IDS ids on,
# the per-block writer also wins past 256 blocks (960 cold 16-token blocks of a
# Mooncake prompt: ~0.45 vs ~0.8 relative time): no upper bound any more.
_MAX_STREAM_BLOCKS_CBOR = 1 << 62
# Bound of the per-hasher cache of serialized extra keys (cleared when full).
_TAIL_CACHE_SIZE = 4096
_UNSPLICEABLE = object()  # plan-cache marker: extra keys only pickle.dumps can write
# Bound of the per-hasher memo of block digests (cleared when full): 32 Ki entries,
# 512 Ki tokens of prefixes at block size 16, about 10 MiB (+ the group entries, one
# per run of _MEMO_GROUP blocks, about 1.2 KiB each at block size 16).
_MEMO_SIZE = 1 << 15
# Blocks per group entry of the memo (one lookup per run of this many known blocks):
# _MEMO_GROUP, but runs of at most _MEMO_GROUP_TOKENS tokens (8 blocks up to block size
# 16, 2 at 64). NOTE: none from 128 tokens per block on (session 6): a block lookup is
# then amortised over as many tokens as a group's, and a group key only hashed the
# same token bytes again (siphash of 32 KiB per lookup and per insert at block size
# 512: ~4 ns per token).
_MEMO_GROUP = 8
_MEMO_GROUP_TOKENS = 128

# The vectorised writer lays every token out in one little-endian u64 "row": the bytes
# it writes, left-aligned (opcode / CBOR head byte, then up to 4 payload bytes) and zero
# padded, plus its length; one boolean compaction of all rows yields the stream.
# CBOR unsigned ints < 2**32 by class (v < 24, < 256, < 65536, < 2**32): the head byte
# is v itself, 0x18, 0x19 or 0x1a; then the last 0/1/2/4 big-endian bytes of v.
_CBOR_BOUNDS = np.array([24, 256, 65536], dtype=np.uint32)
_CBOR_PAYLOAD = np.array([0, 1, 2, 4], dtype=np.uint64)
# pickle ints < 2**31 by class (< 256, < 65536, < 2**31): BININT1 'K', BININT2 'M',
# BININT 'J', then 1/2/4 little-endian bytes of v.
_PICKLE_BOUNDS = np.array([256, 65536], dtype=np.uint32)
_PICKLE_OPCODE = np.array([0x4B, 0x4D, 0x4A], dtype=np.uint64)
_PICKLE_PAYLOAD = np.array([1, 2, 4], dtype=np.uint64)
# Row mask by length: the low L bytes set.
_MASK_BY_LEN = np.array(
    [int.from_bytes(b"\1" * n, "little") for n in range(9)], dtype="<u8"
)


def _cbor_token_rows(u32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CBOR items of ``u32[n]`` as (rows <u8[n], lengths i64[n])."""
    cls = np.searchsorted(_CBOR_BOUNDS, u32, side="right")
    payload = _CBOR_PAYLOAD[cls]
    first = np.where(u32 < 24, u32, cls + 0x17).astype(np.uint64)  # v, 0x18 .. 0x1a
    # Big-endian bytes read as little-endian: v with its 4 bytes reversed (any host).
    swapped = u32.astype(">u4").view("<u4").astype(np.uint64)
    rows = first | ((swapped >> (np.uint64(32) - np.uint64(8) * payload)) << np.uint64(8))
    return rows.astype("<u8"), (payload + 1).astype(np.int64)


def _pickle_token_rows(u32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """pickle int opcodes of ``u32[n]`` (all < 2**31) as (rows <u8[n], lengths i64[n])."""
    cls = np.searchsorted(_PICKLE_BOUNDS, u32, side="right")
    rows = _PICKLE_OPCODE[cls] | (u32.astype(np.uint64) << np.uint64(8))
    return rows.astype("<u8"), (_PICKLE_PAYLOAD[cls] + 1).astype(np.int64)


def _token_tables(bits: int) -> tuple[np.ndarray, ...]:
    """Read-only rows and lengths of every id < 2**bits, for both serializers."""
    ids = np.arange(1 << bits, dtype=np.uint32)
    tables = (*_cbor_token_rows(ids), *_pickle_token_rows(ids))
    for t in tables:
        t.flags.writeable = False
    return tables


# NOTE: immutable lookup tables (4 MiB, built once at import): one gather per token
# instead of a dozen numpy calls, which dominate for prompts of a few dozen blocks.
# Ids beyond the table (vocabularies over 2**17) take the arithmetic path.
_TABLE_BITS = 17
_CBOR_ROW, _CBOR_ROW_LEN, _PICKLE_ROW, _PICKLE_ROW_LEN = _token_tables(_TABLE_BITS)
_ONE_TO = np.arange(1, 1 << 12, dtype=np.int64)  # 1, 2, ... (block counts)
# The per-block CBOR writer (`BlockHasher._cbor_chain`) reads native u64 ids bytewise:
# byte 0 / byte 1 of an id.
_BYTE0, _BYTE1 = (0, 1) if sys.byteorder == "little" else (7, 6)
# CBOR items of the ids below 256 (canonical: the id itself below 24, else 0x18 and it).
_CBOR_SMALL_ITEM = tuple(bytes([v]) if v < 24 else bytes([0x18, v]) for v in range(256))
# pickle's opcode of the ids below 256 (BININT1 'K' and the byte).
_PICKLE_SMALL_ITEM = tuple(b"K" + bytes([v]) for v in range(256))
# From this many tokens per block on, pickle keys are written by `_pickle_chain` (token
# items cut from one byte stream, as CBOR's) instead of unpacking the ids to ints for
# pickle.dumps per block or the vectorised writer (session 6, block size 512: 14 vs 21
# (per block) and 33 (vectorised) ns per token, sha256 included).
_MIN_STREAM_BS_PICKLE = 64
# ... and at any block size >= 4 from this many new blocks on, instead of the vectorised
# writer (session 6: 960 cold 16-token blocks, ids < 65536: ~0.65x its time).
_MIN_STREAM_BLOCKS_PICKLE = 64
_ONE_TO.flags.writeable = False
_PICKLE_TUPLE_N = {1: b"\x85", 2: b"\x86", 3: b"\x87"}  # TUPLE1..TUPLE3


# From this many ids on, the per-block writers build their byte streams with numpy (a
# dozen calls of fixed cost, then ~1-2 instructions per id) instead of strided bytes
# slicing (~9 instructions per byte written, five strided passes). NOTE (session 6):
# strided slicing was 27 instructions per token of a 512-token-block replay.
_NUMPY_STREAM_MIN_IDS = 1024


def _stream16(packed: bytes, n: int, cbor: bool) -> tuple[bytes, bytes, bytes, bool]:
    """(stream, b0, b1, high) of ``n`` native u64 ids: ``stream`` holds 3 bytes per id,
    the item of its low 16 bits as CBOR's uint16 (``0x19``, byte 1, byte 0) or pickle's
    BININT2 (``M``, byte 0, byte 1); ``b0`` / ``b1`` the ids' bytes 0 / 1 (as
    ``packed[_BYTE0::8]`` / ``packed[_BYTE1::8]``); ``high``: some id is >= 65536."""
    high = bool(np.frombuffer(packed, dtype=np.uint64, count=n).max() >= 65536)
    v = np.frombuffer(packed, dtype=np.uint8, count=8 * n).reshape(n, 8)
    lo, hi = v[:, _BYTE0], v[:, _BYTE1]
    # NOTE: three 1-D strided column copies; a 2-D copy (e.g. u32 words cut to their
    # first 3 bytes) runs numpy's generic N-d loop: ~10x slower.
    out = np.empty((n, 3), dtype=np.uint8)
    out[:, 0] = 0x19 if cbor else 0x4D
    out[:, 1] = hi if cbor else lo
    out[:, 2] = lo if cbor else hi
    stream, b0, b1 = out.tobytes(), lo.tobytes(), hi.tobytes()
    return stream, b0, b1, high


def _has_high(packed: bytes) -> bool:
    """Whether some of the native u64 ids in ``packed`` is >= 65536."""
    if len(packed) >= 8 * _NUMPY_STREAM_MIN_IDS:
        return bool(np.frombuffer(packed, dtype=np.uint64).max() >= 65536)
    return _low_u16s(packed, packed[_BYTE0::8], packed[_BYTE1::8]) != packed


def _low_u16s(packed: bytes, b0: bytes, b1: bytes) -> bytearray:
    """``packed`` (native u64 ids) with every id cut to its low 16 bits: equal to
    ``packed`` exactly where every id is < 65536 (``b0`` / ``b1``: ``packed[_BYTE0::8]`` /
    ``packed[_BYTE1::8]``).

    NOTE: a zeroed buffer, two strided copies and one memcmp: ~10x fewer instructions
    than masking ``int.from_bytes(packed)`` or counting zero bytes (cachegrind), which
    walk the bytes one by one.
    """
    low = bytearray(len(packed))
    low[_BYTE0::8] = b0
    low[_BYTE1::8] = b1
    return low


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


def _cbor_int(v: int) -> bytes:
    """Canonical CBOR item of an int in [-2**64, 2**64)."""
    return _cbor_head(0, v) if v >= 0 else _cbor_head(1, -1 - v)


def _pickle_int(v: int) -> bytes:
    """pickle's opcodes for an int in [-2**31, 2**31) (protocol >= 1): BININT1,
    BININT2 or BININT."""
    if 0 <= v < 256:
        return b"K" + bytes((v,))
    if 0 <= v < 65536:
        return b"M" + v.to_bytes(2, "little")
    return b"J" + v.to_bytes(4, "little", signed=True)


# CBOR array heads of block sizes < 256 (the per-block writer's, looked up, not built).
_CBOR_ARRAY_HEAD = tuple(_cbor_head(4, n) for n in range(256))
