"""The fast writers of block keys: what makes `BlockHasher`'s hot path cheap.

`prefixcache.core.hashing` holds the spec (what a block key is and how each serializer
writes it, `SERIALIZERS`) and `BlockHasher`'s public methods; this module holds the
writers that produce those exact bytes without calling the serializer per key, for the
two built-in serializers, pickle and canonical CBOR:

- `FastWriters`, the mixin `BlockHasher` inherits its private writer methods from: the
  per-block writers (`_hash_blocks_small`, `_cbor_chain`, `_pickle_chain`), the
  vectorised one (`_hash_blocks_vectorised`, `_write_keys`) and the serialized extra
  keys spliced into every key (`_tail_plan` -> `_TailPlan`);
- per-token lookup tables (the CBOR item / pickle opcode of every id < 2**17), the
  numpy row writers, the byte-stream helpers, and the tuning constants (measured
  crossovers, memo bounds).

A serializer without a fast writer (`HashSerializer.writer is None`) never reaches
them: `BlockHasher` then writes every key with the serializer's own ``dumps``. This
module imports nothing of `hashing` (no cycle): the three extra-key helpers of the spec
the writers call (`_mm_fields`, `_lora_pair`, `_extras_from_parts`) are `BlockHasher`
class attributes.

Tests pin every byte these writers produce to ``pickle.dumps`` /
``cbor2.dumps(canonical=True)`` of the key tuple (tests/core/test_core_hashing.py).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
import sys

import cbor2
import numpy as np

_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
# Largest pickle frame we assemble ourselves. pickle starts a new frame once a frame
# reaches 64 KiB (FRAME_SIZE_TARGET); bigger keys go through pickle.dumps itself.
_MAX_FAST_PICKLE_FRAME = 64 * 1024 - 64
# Below this many blocks the per-call numpy overhead (some 20 numpy calls) outweighs
# its per-block savings: serialize those blocks one by one. NOTE: measured inside the
# replay, not in isolation: in isolation CBOR's crossover is ~16 blocks, but inside the
# replay loop the numpy path (its tables and machinery) also evicts the manager's data
# from the caches; interleaved A/B in one process put shared_system_prompt
# 6-20% and multi_turn 0-10% faster with 64 than with 16, few_shot within noise.
_MIN_VECTOR_BLOCKS_CBOR = 64
_MIN_VECTOR_BLOCKS_PICKLE = 64
# Up to this many blocks whose ids are all < 65536, CBOR's per-block writer (token
# arrays cut from one byte stream) beats the vectorised one: measured in
# isolation 1.3-1.9 vs 1.5-3.1 us per block at 64-256 blocks (vocab 32000); with ids
# >= 65536 (a 128K vocab) the per-block writer falls back to cbor2 per block and the
# vectorised one wins from 64 blocks (3.2-4.5 vs 6.4-8.5 us).
# NOTE: with the stream built by numpy from _NUMPY_STREAM_MIN_IDS ids on,
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
# 16, 2 at 64). NOTE: none from 128 tokens per block on: a block lookup is
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
# pickle.dumps per block or the vectorised writer (measured at block size 512: 14 vs 21
# (per block) and 33 (vectorised) ns per token, sha256 included).
_MIN_STREAM_BS_PICKLE = 64
# ... and at any block size >= 4 from this many new blocks on, instead of the vectorised
# writer (measured: 960 cold 16-token blocks, ids < 65536: ~0.65x its time).
_MIN_STREAM_BLOCKS_PICKLE = 64
_ONE_TO.flags.writeable = False
_PICKLE_TUPLE_N = {1: b"\x85", 2: b"\x86", 3: b"\x87"}  # TUPLE1..TUPLE3


# From this many ids on, the per-block writers build their byte streams with numpy (a
# dozen calls of fixed cost, then ~1-2 instructions per id) instead of strided bytes
# slicing (~9 instructions per byte written, five strided passes). NOTE:
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


def _splice_small_ids(pieces, stream, b0, b1, bs, open_, sfx, small_item, run_op, skip=()):
    """Rewrite in place each block of ``pieces`` that holds an id < 256 (its byte 1 is
    zero): such an id's item is shorter than the 3 bytes ``stream`` holds for it, so the
    block is joined again from ``open_``, the slices of ``stream`` between those ids,
    their items and the block's suffix ``sfx[k]``. Shared by the CBOR and the pickle
    chain (one call per chain, no call per block).

    Args:
      pieces: list of the ``len(b1) // bs`` blocks' messages (``open_`` + the block's
        slice of ``stream`` + ``sfx[k]``), rewritten in place.
      stream: 3 bytes per id (see `_stream16`).
      b0, b1: the ids' bytes 0 / 1 (``packed[_BYTE0::8]`` / ``packed[_BYTE1::8]``).
      bs: ids per block.
      small_item: the item of each id < 256, indexed by the id.
      run_op: the opcode written before each id's byte in a run of ids < 256 (pickle's
        ``K``); None: CBOR, where a run of ids < 24 (multimodal placeholders,
        typically) is its own items, i.e. the ids' low bytes: one slice of ``b0``.
      skip: the indexes of blocks not to touch (CBOR's blocks with ids >= 65536, which
        cbor2 writes).
    """
    i = b1.find(0)
    while i >= 0:
        k = i // bs
        end = (k + 1) * bs
        if k in skip:
            i = b1.find(0, end)
            continue
        parts = [open_]
        a = k * bs
        while 0 <= i < end:
            if a < i:
                parts.append(stream[3 * a : 3 * i])
            a = i + 1
            if a < end and not b1[a]:
                a = end - len(b1[i:end].lstrip(b"\0"))  # end of the run of ids < 256
                low = b0[i:a]
                if run_op is not None:
                    run = bytearray(2 * (a - i))
                    run[0::2] = run_op * (a - i)
                    run[1::2] = low
                    parts.append(run)
                elif max(low) < 24:
                    parts.append(low)
                else:
                    parts += map(small_item.__getitem__, low)
            else:  # a single id < 256 (scattered among larger ids: most of them)
                parts.append(small_item[b0[i]])
            i = b1.find(0, a)
        if a < end:
            parts.append(stream[3 * a : 3 * end])
        parts.append(sfx[k])
        pieces[k] = b"".join(parts)


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


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# NOTE: the same object as `hashing.MM_LABEL` (interned): pickle memoises by identity.
_MM_LABEL = sys.intern("mm")


class FastWriters:
    """The private writer methods of `BlockHasher` (a mixin: no state of its own).

    They read the hasher's attributes (``_is_cbor``, ``_digest``, ``_digest_size``, the
    caches) and its spec helpers ``_mm_fields``, ``_lora_pair``, ``_extras_from_parts``
    (class attributes of `BlockHasher`).
    """

    __slots__ = ()

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
            and (not mm_features
                 or all(f[1] + f[2] <= lo for f in map(self._mm_fields, mm_features)))
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
        # Ids < 256 (byte 1 zero) have shorter items: spliced into their blocks.
        _splice_small_ids(pieces, stream, b0, b1, bs, arr, sfx, _CBOR_SMALL_ITEM, None, big)
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
        _splice_small_ids(pieces, stream, b0, b1, bs, open_, sfx, _PICKLE_SMALL_ITEM, b"K")
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
            extra = self._extras_from_parts(*key)
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
        lora_pair = self._lora_pair(lora)
        salt = cache_salt if (cache_salt and start_block == 0) else None
        lo = start_block * bs
        if not mm_features:
            feats = ()
        elif len(mm_features) == 1:  # the common case: nothing to sort
            f = self._mm_fields(mm_features[0])
            feats = (f,) if f[1] + f[2] > lo else ()
        else:
            feats = tuple(
                sorted(
                    (f for f in map(self._mm_fields, mm_features) if f[1] + f[2] > lo),
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
            mm_label = _MM_LABEL
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
