"""Host -> device index arrays for one engine step (numpy only; never imports jax).

The scheduler hands over, per scheduled sequence, its block table, how many tokens of KV it
already holds and the token ids scheduled now (`ScheduledSeq`). `MetadataBuilder.build` turns
a list of them into the int32 arrays of the index-array contract (docs/DESIGN.md):

    page_indices  i32[S, P]   block table, row per sequence (rows in *sorted* order, below)
    kv_lens       i32[S]      tokens of KV each sequence attends to after this step
    cu_q_lens     i32[S + 1]  cumulative query lengths (ragged queries)
    num_seqs      i32[1]      live rows
    positions     i32[T]      absolute position of each scheduled token
    slot_mapping  i32[T]      page * block_size + offset where each new token's K/V goes
    distribution  i32[3]      cumulative group ends (decode, prefill, mixed), see below

plus the step's `input_ids: i32[T]` and `logits_indices: i32[S]`. `build_rows` builds the
same arrays from columns and one 2-D int32 block table (the engine's persistent-batch path:
no per-sequence objects per step).

Row order and `distribution` (the convention of the ragged paged attention v3 TPU kernel,
"(i, j, k): sequences[0:i] are decode-only, sequences[i:j] are chunked-prefill-only and
sequences[j:k] are mixed; k is the total number of sequences"):

  * group 0, decode:  q_len == 1 (whatever the prefix; a 1-token prompt counts as decode);
  * group 1, prefill: q_len > 1 and num_computed_tokens == 0 (a fresh prompt or its first
    chunk: no KV before this step);
  * group 2, mixed:   q_len > 1 and num_computed_tokens > 0 (a later chunk, or prefill over
    a cached prefix: new queries attend to KV already in the cache).

  Rows are sorted by group, stable within a group (caller order kept), and
  `distribution = [n_decode, n_decode + n_prefill, num_seqs]`. Token rows follow the same
  order. `logits_indices[i]` maps the caller's `seqs[i]` back to its last token row.

Padding (so that shapes come from a small set of buckets and a long run compiles a bounded
number of programs): the padding page id is `num_blocks` (block ids `0..num_blocks-1` are
allocatable; the KV array has `num_blocks + 1` pages). Everything that is padding points at
it: page-table entries past a sequence's last needed page, whole rows past `num_seqs`, and
the slots of padding tokens (`num_blocks * block_size`). Padding tokens get input id 0 and
position 0; padding rows get kv_len 0 and q_len 0 (`cu_q_lens` repeats the token total);
padding entries of `logits_indices` are 0.
"""
from __future__ import annotations

import array
import bisect
import collections.abc
import operator
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from prefixcache._validate import (ArgumentTypeError, check_count, check_host_memory,
                                   check_int_sequence)

__all__ = [
    "AttentionMetadata",
    "MetadataBuilder",
    "ScheduledSeq",
    "StepInputs",
    "pow2_buckets",
]

_I32_MAX = np.iinfo(np.int32).max
# ScheduledSeq field getters (tuple indexing in C; faster than attribute generators).
_BLOCK_IDS = operator.itemgetter(0)
_NUM_COMPUTED = operator.itemgetter(1)
_TOKEN_IDS = operator.itemgetter(2)


def _order_rows(q_lens: np.ndarray, computed: np.ndarray, columns: tuple):
    """Row order: decode (q_len 1), prefill (no prior KV), mixed (prior KV); stable.

    Args:
      q_lens: int[n] scheduled tokens per caller sequence.
      computed: int[n] tokens with KV before the step.
      columns: int[n] per-sequence columns to put in row order.

    Returns:
      ``(order, distribution, sorted_columns)``: ``order`` int[n] with sorted row
      ``r <- seqs[order[r]]``, or None when the caller order already is the row order;
      ``distribution`` i32[3] cumulative group ends; ``columns`` in row order.
    """
    group = (q_lens > 1) * (1 + (computed > 0))
    distribution = np.cumsum(np.bincount(group, minlength=3)).astype(np.int32)
    # NOTE: fast path: a caller that already lists decodes first (vLLM's running-first
    # order; any all-decode step) skips the permutation gathers.
    if bool((group[1:] >= group[:-1]).all()):
        return None, distribution, columns
    order = np.argsort(group, kind="stable")
    return order, distribution, tuple(c[order] for c in columns)


def _check_token_ids(tokens: np.ndarray, q_lens: np.ndarray) -> None:
    """ValueError naming the sequence of the first token id outside int32 (ids >= 0)."""
    if tokens.min() < 0 or tokens.max() > _I32_MAX:
        j = int(np.flatnonzero((tokens < 0) | (tokens > _I32_MAX))[0])
        i = int(np.searchsorted(np.cumsum(q_lens), j, side="right"))
        raise ValueError(f"seqs[{i}]: token id {int(tokens[j])} is not a valid int32 id")


# Containers of ids `build` converts at C speed (others: `check_int_sequence`).
_FAST_CONTAINERS = frozenset((list, tuple, np.ndarray, range, array.array))


def _check_containers(field: str, lists: list) -> set:
    """ArgumentTypeError naming ``seqs[i].<field>`` when it is a set, dict, str, a float
    array, ... (one C-level pass over the types; per-sequence checks only then).

    Returns:
      The set of container types (for `_flat_ints`).
    """
    types = set(map(type, lists))
    if types == _ARRAY_ONLY or (types <= _FAST_CONTAINERS and np.ndarray not in types):
        # (all-array tables: their dtype is checked once, after the concatenation in
        # `_flat_ints`; a per-array attribute pass cost ~20 us per 256 sequences)
        return types
    for i, x in enumerate(lists):
        check_int_sequence(f"seqs[{i}].{field}", x)
    return types


def _int_scalars(field: str, values: list) -> np.ndarray:
    """i64[n] of per-sequence ints ``seqs[i].<field>`` (numpy ints accepted; bools and
    floats -- even integral ones -- raise, naming the sequence)."""
    if set(map(type, values)) != _INT_ONLY:
        for i, v in enumerate(values):
            check_count(f"seqs[{i}].{field}", v, min=-(2**63))
    return np.fromiter(values, np.int64, len(values))


_INT_ONLY = {int}


def _flat_ints(field: str, lists: list, types: set) -> np.ndarray:
    """The concatenation of ``seqs[i].<field>`` as i64 (containers already checked).

    NOTE: ``array.fromlist`` converts a list at C speed and raises on a float or any
    non-int (numpy's ``fromiter`` would truncate 1.7 to 1 silently); measured faster
    than ``np.fromiter(chain(...), np.int32)`` for 256 x 32 block ids. Int arrays
    are copied as int64. ``types``: the containers' types (`_check_containers`).
    """
    if types == _ARRAY_ONLY:
        flat = np.concatenate(lists) if len(lists) > 1 else lists[0]
        if flat.ndim != 1 or flat.dtype.kind not in "iu":
            for i, x in enumerate(lists):
                check_int_sequence(f"seqs[{i}].{field}", x)
            raise ArgumentTypeError(f"seqs[*].{field} arrays do not concatenate to 1-D ints")
        return flat
    out = array.array("q")
    try:
        if types == _LIST_ONLY:
            fromlist = out.fromlist
            for x in lists:
                fromlist(x)
        else:
            for x in lists:
                if type(x) is np.ndarray:
                    out.frombytes(x.astype(np.int64).tobytes())
                else:
                    out.extend(x)
    except (TypeError, OverflowError):
        for i, x in enumerate(lists):
            for j, v in enumerate(x):
                try:
                    v = operator.index(v)
                except TypeError:
                    raise ArgumentTypeError(
                        f"seqs[{i}].{field}[{j}] = {v!r} is not an int") from None
                if not -(2**63) <= v < 2**63:
                    raise ValueError(f"seqs[{i}].{field}[{j}] = {v} is out of range") from None
        raise  # pragma: no cover - array rejected what the loop accepts
    return np.frombuffer(out, np.int64)


_LIST_ONLY = {list}
_ARRAY_ONLY = {np.ndarray}


def _int_column(name: str, values) -> np.ndarray:
    """A `build_rows` column as i64 (an int array is used as is; lists of ints converted).

    Raises:
      ArgumentTypeError: a set/dict/str, floats (numpy would truncate them), bools, or
        anything else that does not convert to an integer array.
    """
    if type(values) is list:
        # NOTE: the engine's columns: `fromlist` converts at C speed and raises on a
        # float (np.asarray(..., np.int64) would truncate it); bools enter as ints.
        out = array.array("q")
        try:
            out.fromlist(values)
            return np.frombuffer(out, np.int64)
        except (TypeError, OverflowError):
            pass  # below: numpy's view of it names the problem (dtype or shape)
    if type(values) is not np.ndarray:
        check_int_sequence(f"build_rows() column {name}", values)
        try:
            values = np.asarray(values)
        except (TypeError, ValueError, OverflowError) as e:
            raise ArgumentTypeError(
                f"build_rows() column {name} must hold ints: {e}") from None
    if values.dtype.kind not in "iu" and values.size:
        raise ArgumentTypeError(
            f"build_rows() column {name} must hold ints, got dtype {values.dtype}")
    return values.astype(np.int64, copy=False)


def _cu_and_logits(S: int, n: int, num_tokens: int, cu_s: np.ndarray, order):
    """``cu_q_lens`` i32[S+1] (padding rows empty) and ``logits_indices`` i32[S] (caller
    sequence ``order[r]`` ends at sorted row r; padding entries 0)."""
    cu_q_lens = np.full(S + 1, num_tokens, np.int32)
    cu_q_lens[: n + 1] = cu_s
    logits_indices = np.zeros(S, np.int32)
    if order is None:
        logits_indices[:n] = cu_s[1:] - 1
    else:
        logits_indices[order] = cu_s[1:] - 1
    return cu_q_lens, logits_indices


class ScheduledSeq(NamedTuple):
    """One sequence scheduled in a step (host side).

    Attributes:
      block_ids: the sequence's block table (ints in `0..num_blocks-1`), at least
        `ceil((num_computed_tokens + len(token_ids)) / block_size)` of them; extra trailing
        blocks (e.g. lookahead) are allowed and ignored.
      num_computed_tokens: tokens of KV already in the cache for this sequence (a cached
        prefix, earlier chunks, earlier decode steps).
      token_ids: the token ids scheduled now (q_len = len(token_ids) >= 1). After the step
        the sequence holds `num_computed_tokens + q_len` tokens of KV.
    """

    block_ids: Sequence[int]
    num_computed_tokens: int
    token_ids: Sequence[int]


_SEQ_ONLY = {ScheduledSeq}


def _check_seq_items(seqs) -> None:
    """ArgumentTypeError naming ``seqs[i]`` when it is not a ScheduledSeq (or a plain
    3-tuple ``(block_ids, num_computed_tokens, token_ids)``): a dict, an int, ..."""
    for i, seq in enumerate(seqs):
        if isinstance(seq, tuple) and len(seq) == 3:
            continue
        hint = (" (build it with ScheduledSeq(**that_dict))"
                if isinstance(seq, collections.abc.Mapping) else "")
        raise ArgumentTypeError(
            f"seqs[{i}] must be a ScheduledSeq(block_ids, num_computed_tokens, token_ids), "
            f"got {type(seq).__name__}{hint}")


class AttentionMetadata(NamedTuple):
    """The int32 index arrays of one step (a NamedTuple, hence a jax pytree).

    Shapes are bucketed: T = token bucket >= total scheduled tokens, S = seq bucket >=
    number of sequences, P = page bucket >= the most pages any sequence needs.

    Attributes:
      page_indices: i32[S, P] block table per (sorted) row; padding -> padding page.
      kv_lens: i32[S] KV length after the step; 0 for padding rows.
      cu_q_lens: i32[S + 1] cumulative query lengths; constant past `num_seqs`.
      num_seqs: i32[1] number of live rows.
      positions: i32[T] absolute position of each token; 0 for padding tokens.
      slot_mapping: i32[T] `page * block_size + offset` of each new token's K/V; padding
        tokens -> `num_blocks * block_size` (the padding page).
      distribution: i32[3] cumulative ends of the decode / prefill / mixed row groups.

    Invariant: query row i of sorted row s sits at position `kv_lens[s] - q_len[s] + i` with
    `q_len[s] = cu_q_lens[s + 1] - cu_q_lens[s]`.
    """

    page_indices: np.ndarray
    kv_lens: np.ndarray
    cu_q_lens: np.ndarray
    num_seqs: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    distribution: np.ndarray


class StepInputs(NamedTuple):
    """Everything the device step needs besides the weights and the KV caches.

    Attributes:
      input_ids: i32[T] token ids in sorted row order; 0 for padding tokens.
      metadata: the step's `AttentionMetadata`.
      logits_indices: i32[S] `logits_indices[i]` is the token row of the last scheduled
        token of the caller's `seqs[i]` (caller order, not sorted order); 0 past the number
        of sequences.
    """

    input_ids: np.ndarray
    metadata: AttentionMetadata
    logits_indices: np.ndarray


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from `lo` (rounded up to one) below `hi`, then `hi` itself.

    >>> pow2_buckets(8, 100)
    (8, 16, 32, 64, 100)
    """
    if lo < 1 or hi < 1:
        raise ValueError(f"bucket bounds must be positive, got lo={lo}, hi={hi}")
    lo = min(lo, hi)
    b = 1
    while b < lo:
        b *= 2
    out = []
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def _check_buckets(name: str, buckets, maximum: int) -> tuple[int, ...]:
    try:
        vals = tuple(int(b) for b in buckets)
    except TypeError as e:
        raise ValueError(f"{name} must be a sequence of ints, got {buckets!r}") from e
    if not vals:
        raise ValueError(f"{name} is empty")
    if any(b < 1 for b in vals):
        raise ValueError(f"{name} must be positive, got {vals}")
    if any(a >= b for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{name} must be strictly increasing, got {vals}")
    if vals[-1] != maximum:
        # NOTE: the largest bucket must equal the configured maximum so that every
        # schedule the maxima admit has a shape, and no shape exceeds the maxima.
        raise ValueError(f"{name} must end at the configured maximum {maximum}, got {vals}")
    return vals


class MetadataBuilder:
    """Builds `StepInputs` from scheduled sequences, padded to shape buckets.

    Invariants:
      * every array it returns is int32 with a shape from `shape_buckets`
        (`page_indices` [S, P], `kv_lens` [S], `cu_q_lens` [S+1], `logits_indices` [S],
        `input_ids`/`positions`/`slot_mapping` [T], `distribution` [3], `num_seqs` [1]);
      * every page id in `page_indices` and every slot's page is in `0..num_blocks`, with
        `num_blocks` (the padding page) used for all padding and never for live data;
      * it holds no per-step state: `build` is a pure function of its arguments.

    Args:
      block_size: tokens per block (page size), >= 1.
      num_blocks: allocatable blocks; ids `0..num_blocks-1`; `num_blocks` is the padding page.
      max_num_seqs: most sequences per step (the largest S).
      max_num_tokens: most scheduled tokens per step (the largest T).
      max_pages_per_seq: most pages one sequence may attend to (the largest P).
      token_buckets: allowed T values, strictly increasing, ending at `max_num_tokens`;
        default powers of two from 16 (`pow2_buckets(16, max_num_tokens)`).
      seq_buckets: allowed S values, ending at `max_num_seqs`; default powers of two from 4.
      page_buckets: allowed P values, ending at `max_pages_per_seq`; default powers of two
        from 4.
    """

    # NOTE: defaults start at 16 tokens / 4 seqs / 4 pages: tiny shapes are cheap to pad
    # and starting higher keeps the number of compiled programs small.
    DEFAULT_MIN_TOKENS = 16
    DEFAULT_MIN_SEQS = 4
    DEFAULT_MIN_PAGES = 4

    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        max_num_seqs: int,
        max_num_tokens: int,
        max_pages_per_seq: int,
        token_buckets: Sequence[int] | None = None,
        seq_buckets: Sequence[int] | None = None,
        page_buckets: Sequence[int] | None = None,
    ):
        for name, v in (
            ("block_size", block_size),
            ("num_blocks", num_blocks),
            ("max_num_seqs", max_num_seqs),
            ("max_num_tokens", max_num_tokens),
            ("max_pages_per_seq", max_pages_per_seq),
        ):
            check_count(name, v, min=1)
            if v > _I32_MAX:
                raise ValueError(f"{name}={v} does not fit the int32 index arrays")
        if (num_blocks + 1) * block_size > _I32_MAX:
            raise ValueError(
                f"(num_blocks + 1) * block_size = {(num_blocks + 1) * block_size} overflows "
                "int32 slot ids"
            )
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_tokens = int(max_num_tokens)
        self.max_pages_per_seq = int(max_pages_per_seq)
        self.token_buckets = _check_buckets(
            "token_buckets",
            pow2_buckets(self.DEFAULT_MIN_TOKENS, self.max_num_tokens)
            if token_buckets is None else token_buckets,
            self.max_num_tokens,
        )
        self.seq_buckets = _check_buckets(
            "seq_buckets",
            pow2_buckets(self.DEFAULT_MIN_SEQS, self.max_num_seqs)
            if seq_buckets is None else seq_buckets,
            self.max_num_seqs,
        )
        self.page_buckets = _check_buckets(
            "page_buckets",
            pow2_buckets(self.DEFAULT_MIN_PAGES, self.max_pages_per_seq)
            if page_buckets is None else page_buckets,
            self.max_pages_per_seq,
        )
        # 0, 1, 2, ... long enough for any row, token, or page index (`build_rows`).
        check_host_memory(
            "MetadataBuilder(max_num_tokens, max_num_seqs, max_pages_per_seq)",
            16 * max(self.max_num_tokens, self.max_num_seqs, self.max_pages_per_seq))
        self._iota = np.arange(max(self.max_num_tokens, self.max_num_seqs,
                                   self.max_pages_per_seq) + 1, dtype=np.int64)
        # NOTE: a decode-only step's distribution, cu_q_lens, logits_indices and num_seqs
        # depend on its number of sequences only: built once per count, read-only and
        # shared by the steps that return them (a memo, not per-step state).
        self._decode_consts: dict[int, tuple[np.ndarray, ...]] = {}
        self._token_arr = np.asarray(self.token_buckets)
        self._seq_arr = np.asarray(self.seq_buckets)
        self._page_arr = np.asarray(self.page_buckets)

    # ------------------------------------------------------------ construction
    @classmethod
    def from_manager(cls, manager, *, max_num_seqs: int, max_num_tokens: int,
                     max_pages_per_seq: int | None = None,
                     token_buckets: Sequence[int] | None = None,
                     seq_buckets: Sequence[int] | None = None,
                     page_buckets: Sequence[int] | None = None) -> MetadataBuilder:
        """A builder for a KV cache manager's pool: ``block_size`` and ``num_blocks`` are
        the manager's (so the KV arrays, the block tables and the index arrays agree).

        Args:
          manager: a ``prefixcache.core.KVCacheManager`` (any object with int
            ``num_blocks`` and ``block_size``; ``max_model_len`` read when present).
          max_num_seqs, max_num_tokens: the step's maxima (the largest S and T).
          max_pages_per_seq: the largest P; default ``ceil(max_model_len / block_size)``
            when the manager has a ``max_model_len``, else ``num_blocks`` (a sequence
            cannot hold more blocks than the pool).
          token_buckets, seq_buckets, page_buckets: as the constructor.

        Raises:
          TypeError: ``manager`` has no int ``num_blocks`` / ``block_size`` (an
            ``ArgumentTypeError``, also a ValueError).
        """
        for name in ("num_blocks", "block_size"):
            if not hasattr(manager, name):
                raise ArgumentTypeError(
                    f"manager must be a KV cache manager (with num_blocks and block_size), "
                    f"got {type(manager).__name__}")
        return cls._for_pool(manager.num_blocks, manager.block_size,
                             getattr(manager, "max_model_len", None), max_num_seqs=max_num_seqs,
                             max_num_tokens=max_num_tokens, max_pages_per_seq=max_pages_per_seq,
                             token_buckets=token_buckets, seq_buckets=seq_buckets,
                             page_buckets=page_buckets)

    @classmethod
    def from_cache_config(cls, cache_config, *, max_num_seqs: int, max_num_tokens: int,
                          max_pages_per_seq: int | None = None,
                          token_buckets: Sequence[int] | None = None,
                          seq_buckets: Sequence[int] | None = None,
                          page_buckets: Sequence[int] | None = None) -> MetadataBuilder:
        """A builder for a ``prefixcache.CacheConfig``'s pool (``num_blocks``,
        ``block_size``, ``max_model_len``), as `from_manager` for the manager
        ``KVCacheManager(**cache_config.manager_kwargs())`` builds.

        Raises:
          TypeError: ``cache_config`` is not a CacheConfig (an ``ArgumentTypeError``).
          ValueError: its pool is given in bytes only (resolve it with
            ``cache_config.with_pool_blocks(bytes_per_block)`` first).
        """
        from prefixcache.core.cache_config import CacheConfig  # noqa: PLC0415

        if not isinstance(cache_config, CacheConfig):
            raise ArgumentTypeError(
                f"cache_config must be a prefixcache.CacheConfig, got "
                f"{type(cache_config).__name__}")
        if cache_config.num_blocks is None:
            raise ValueError(
                "cache_config.num_blocks is not set (the pool is given as kv_cache_bytes="
                f"{cache_config.kv_cache_bytes!r}); resolve it with "
                "cache_config.with_pool_blocks(bytes_per_block) first")
        return cls._for_pool(cache_config.num_blocks, cache_config.block_size,
                             cache_config.max_model_len, max_num_seqs=max_num_seqs,
                             max_num_tokens=max_num_tokens, max_pages_per_seq=max_pages_per_seq,
                             token_buckets=token_buckets, seq_buckets=seq_buckets,
                             page_buckets=page_buckets)

    @classmethod
    def _for_pool(cls, num_blocks, block_size, max_model_len, *, max_pages_per_seq,
                  **kwargs) -> MetadataBuilder:
        num_blocks = check_count("num_blocks", num_blocks, min=1)
        block_size = check_count("block_size", block_size, min=1)
        if max_pages_per_seq is None:
            max_pages_per_seq = (num_blocks if max_model_len is None
                                 else -(-check_count("max_model_len", max_model_len, min=1)
                                        // block_size))
        return cls(block_size=block_size, num_blocks=num_blocks,
                   max_pages_per_seq=max_pages_per_seq, **kwargs)

    def kv_pages_shape(self, num_kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
        """The shape of one layer's KV array for this pool: ``(num_pages, block_size,
        2 * num_kv_heads, head_dim)`` with ``num_pages = num_blocks + 1`` (the padding
        page included), K of kv head h at slot 2h and V at 2h+1."""
        num_kv_heads = check_count("num_kv_heads", num_kv_heads, min=1)
        head_dim = check_count("head_dim", head_dim, min=1)
        return (self.num_pages, self.block_size, 2 * num_kv_heads, head_dim)

    def check_kv_pages(self, kv_pages, name: str = "kv_pages") -> None:
        """Raises ValueError unless ``kv_pages`` (any array with a ``.shape``) is a KV
        array of this pool: ``num_blocks + 1`` pages of ``block_size`` slots.

        Raises:
          TypeError: not an array (an ``ArgumentTypeError``).
          ValueError: a rank other than 4, no padding page, another page size.
        """
        shape = getattr(kv_pages, "shape", None)
        if shape is None:
            raise ArgumentTypeError(f"{name} must be an array, got {type(kv_pages).__name__}")
        if len(shape) != 4:
            raise ValueError(f"{name} must be [num_pages, block_size, 2*num_kv_heads, "
                             f"head_dim], got shape {tuple(shape)}")
        if shape[0] != self.num_pages:
            raise ValueError(
                f"{name} has {shape[0]} pages but needs num_blocks + 1 = {self.num_pages}: "
                f"blocks 0..{self.num_blocks - 1} and the padding page {self.num_blocks} "
                "that padding page indices and slots point at")
        if shape[1] != self.block_size:
            raise ValueError(f"{name} has pages of {shape[1]} slots, the pool's block_size "
                             f"is {self.block_size}")

    # ------------------------------------------------------------------ shapes
    @property
    def padding_page(self) -> int:
        """The reserved page id all padding points at (== num_blocks)."""
        return self.num_blocks

    @property
    def num_pages(self) -> int:
        """Pages the KV array must have: the allocatable blocks plus the padding page."""
        return self.num_blocks + 1

    @property
    def shape_buckets(self) -> tuple[tuple[int, int, int], ...]:
        """Every (T, S, P) the builder can emit.

        Each live row has >= 1 token, so seq bucket S (covering `s_prev < n <= S` sequences,
        `s_prev` the bucket below it or 0) is reachable under token bucket T iff `T > s_prev`.
        """
        prev = (0,) + self.seq_buckets[:-1]
        return tuple(
            (t, s, p)
            for t in self.token_buckets
            for s, s_prev in zip(self.seq_buckets, prev)
            if t > s_prev
            for p in self.page_buckets
        )

    @property
    def num_buckets(self) -> int:
        """Upper bound on distinct step shapes, i.e. on programs a step function compiles."""
        return len(self.shape_buckets)

    def bucket_shape(self, num_tokens: int, num_seqs: int, num_pages: int) -> tuple[int, int, int]:
        """The (T, S, P) bucket for the given totals (each within the configured maxima)."""
        if not 0 <= num_tokens <= self.max_num_tokens:
            raise ValueError(f"num_tokens {num_tokens} outside 0..{self.max_num_tokens}")
        if not 0 <= num_seqs <= self.max_num_seqs:
            raise ValueError(f"num_seqs {num_seqs} outside 0..{self.max_num_seqs}")
        if not 0 <= num_pages <= self.max_pages_per_seq:
            raise ValueError(f"num_pages {num_pages} outside 0..{self.max_pages_per_seq}")
        t = int(self._token_arr[np.searchsorted(self._token_arr, num_tokens)])
        s = int(self._seq_arr[np.searchsorted(self._seq_arr, num_seqs)])
        p = int(self._page_arr[np.searchsorted(self._page_arr, num_pages)])
        return t, s, p

    @staticmethod
    def shape_of(step: StepInputs) -> tuple[int, int, int]:
        """The (T, S, P) of built inputs (a key for counting compiled programs)."""
        return (
            int(step.input_ids.shape[0]),
            int(step.logits_indices.shape[0]),
            int(step.metadata.page_indices.shape[1]),
        )

    # ------------------------------------------------------------------- build
    def build(self, seqs: Sequence[ScheduledSeq]) -> StepInputs:
        """Builds the step's padded int32 arrays (see the module docstring for layout).

        Args:
          seqs: the scheduled sequences, in the caller's order (1..max_num_seqs of them).

        Returns:
          `StepInputs` of numpy int32 arrays with shapes from `shape_buckets`.

        Raises:
          ValueError: no sequences; too many sequences or tokens; a sequence with no
            scheduled tokens, a negative `num_computed_tokens`, too few block ids for its KV
            length, more pages than `max_pages_per_seq`, or a block id outside
            `0..num_blocks-1` (the message names `seqs[i]`).
          TypeError: `seqs` is not an ordered sequence (a mapping, a set, a str; its
            order is not the step's) -- an `ArgumentTypeError`, also a ValueError.
        """
        if isinstance(seqs, (collections.abc.Mapping, collections.abc.Set, str, bytes)) or (
                not isinstance(seqs, collections.abc.Sequence)):
            raise ArgumentTypeError(
                "seqs must be a sequence (list or tuple) of ScheduledSeq, got "
                f"{type(seqs).__name__}")
        n = len(seqs)
        if n == 0:
            raise ValueError("build() needs at least one scheduled sequence")
        if n > self.max_num_seqs:
            raise ValueError(f"{n} sequences scheduled, more than max_num_seqs={self.max_num_seqs}")
        if set(map(type, seqs)) != _SEQ_ONLY:
            _check_seq_items(seqs)
        bs = self.block_size

        # Per-sequence scalars: C-level iteration (map/itemgetter over the NamedTuples);
        # there is no per-token Python loop anywhere in `build`.
        try:
            block_lists = list(map(_BLOCK_IDS, seqs))
            token_lists = list(map(_TOKEN_IDS, seqs))
            block_types = _check_containers("block_ids", block_lists)
            token_types = _check_containers("token_ids", token_lists)
            q_lens = np.fromiter(map(len, token_lists), np.int64, n)
            computed = _int_scalars("num_computed_tokens", list(map(_NUM_COMPUTED, seqs)))
            num_blk = np.fromiter(map(len, block_lists), np.int64, n)
        except ArgumentTypeError:
            raise
        except (TypeError, IndexError, ValueError) as e:
            raise ValueError(
                "seqs must be ScheduledSeq(block_ids, num_computed_tokens, token_ids) "
                f"with int fields: {e}"
            ) from e
        kv_lens = computed + q_lens
        pages_needed = (kv_lens + (bs - 1)) // bs
        num_tokens = int(q_lens.sum())
        # NOTE: one combined check on the fast path; the slow path below names the culprit.
        if num_tokens > self.max_num_tokens or bool(
            ((q_lens < 1) | (computed < 0) | (pages_needed > num_blk)
             | (pages_needed > self.max_pages_per_seq)).any()
        ):
            self._raise_seq_error(q_lens, computed, num_blk, kv_lens, pages_needed, num_tokens)

        # NOTE: converting Python ints costs ~20-40 ns each, i.e. O(total pages) per step for
        # list block tables; a runner that keeps each request's block table as an append-only
        # numpy array (as vLLM's InputBatch does) takes the concatenate fast path instead.
        total_blk = int(num_blk.sum())
        flat_blocks = _flat_ints("block_ids", block_lists, block_types)
        if total_blk and (flat_blocks.min() < 0 or flat_blocks.max() >= self.num_blocks):
            j = int(np.flatnonzero((flat_blocks < 0) | (flat_blocks >= self.num_blocks))[0])
            i = int(np.searchsorted(np.cumsum(num_blk), j, side="right"))
            raise ValueError(
                f"seqs[{i}]: block id {int(flat_blocks[j])} out of range 0..{self.num_blocks - 1}"
            )
        flat_tokens = _flat_ints("token_ids", token_lists, token_types)
        _check_token_ids(flat_tokens, q_lens)

        blk_start = np.zeros(n, np.int64)  # where each caller seq's block ids start
        np.cumsum(num_blk[:-1], out=blk_start[1:])
        order, distribution, (q_s, pages_s, comp_s, kv_s, blk_start_s) = _order_rows(
            q_lens, computed, (q_lens, pages_needed, computed, kv_lens, blk_start))
        identity = order is None
        cu_s = np.zeros(n + 1, np.int64)
        np.cumsum(q_s, out=cu_s[1:])
        T, S, P = self.bucket_shape(num_tokens, n, int(pages_s.max()))
        pad_page = self.num_blocks

        # Token rows in sorted order: row r's i-th token comes from caller token
        # cu_in[order[r]] + i, sits at position comp_s[r] + i, and its K/V goes to block
        # ids[pos // bs] of that seq.
        input_ids = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slot_mapping = np.full(T, pad_page * bs, np.int32)
        if num_tokens == n:  # decode only: one token per row
            pos = comp_s
            blk_of_tok = blk_start_s
        else:
            row = np.repeat(np.arange(n), q_s)
            tok = np.arange(num_tokens)
            pos = tok + (comp_s - cu_s[:-1])[row]
            blk_of_tok = blk_start_s[row]
        if order is None:
            input_ids[:num_tokens] = flat_tokens
        else:
            cu_in = np.zeros(n + 1, np.int64)
            np.cumsum(q_lens, out=cu_in[1:])
            # (a permutation implies some q_len > 1, so `row` exists here)
            src = np.arange(num_tokens) + (cu_in[:-1][order] - cu_s[:-1])[row]
            input_ids[:num_tokens] = flat_tokens[src]
        positions[:num_tokens] = pos
        slot_mapping[:num_tokens] = flat_blocks[blk_of_tok + pos // bs] * bs + pos % bs

        # Page table: sorted row r holds its first pages_s[r] block ids (extra trailing block
        # ids are not needed by this step and stay padding). Boolean-mask assignment fills
        # True cells row-major, which is exactly the order of `sel`.
        page_indices = np.full((S, P), pad_page, np.int32)
        live = np.arange(P) < pages_s[:, None]
        if identity and bool((pages_needed == num_blk).all()):
            # NOTE: fast path (steady-state decode: caller order already sorted, tables
            # exactly as long as needed): the flat block ids are the cells in order.
            page_indices[:n][live] = flat_blocks
        else:
            page_cu = np.zeros(n, np.int64)
            np.cumsum(pages_s[:-1], out=page_cu[1:])
            sel = np.repeat(blk_start_s - page_cu, pages_s)
            sel += np.arange(sel.shape[0])
            page_indices[:n][live] = flat_blocks[sel]

        kv_out = np.zeros(S, np.int32)
        kv_out[:n] = kv_s
        cu_q_lens, logits_indices = _cu_and_logits(S, n, num_tokens, cu_s, order)

        metadata = AttentionMetadata(
            page_indices=page_indices,
            kv_lens=kv_out,
            cu_q_lens=cu_q_lens,
            num_seqs=np.array([n], np.int32),
            positions=positions,
            slot_mapping=slot_mapping,
            distribution=distribution,
        )
        return StepInputs(input_ids=input_ids, metadata=metadata, logits_indices=logits_indices)

    def build_rows(self, block_table: np.ndarray, rows, num_table_blocks, num_computed,
                   q_lens, token_ids, *, null_slots_ok: bool = False) -> StepInputs:
        """`build` from columnar inputs and one 2-D block table (the engine's path).

        NOTE: vLLM's persistent-batch layout: every running request owns a row of one int32
        table that the engine appends to in place as blocks arrive, so a step builds no
        per-sequence Python list or array, and the page table is one row gather. With
        `cu = [0, cumsum(q_lens)]`, the result equals, array for array,
        `build([ScheduledSeq(block_table[rows[i], :num_table_blocks[i]], num_computed[i],
        token_ids[cu[i]:cu[i + 1]]) for i in range(n)])` -- except that only the block ids
        a sequence needs in this step are read (and range-checked); cells past them are
        ignored.

        Args:
          block_table: i32[R, W] block tables, one row per request; row `rows[i]` starts
            with the `num_table_blocks[i]` block ids of sequence i.
          rows: int[n] table row of each scheduled sequence (caller order).
          num_table_blocks: int[n] block ids held in each sequence's row.
          num_computed: int[n] tokens of KV each sequence holds before this step.
          q_lens: int[n] tokens scheduled per sequence (>= 1).
          token_ids: int[sum(q_lens)] the scheduled token ids, concatenated in caller order.
          null_slots_ok: the table may hold the padding page id (`num_blocks`) in cells a
            sequence reads: a sliding-window KV group's released slots before the window
            (the kernels mask those keys; no new token is written there).

        Returns:
          `StepInputs`, as `build`.

        Raises:
          ValueError: what `build` raises (naming `seqs[i]`, the i-th sequence), plus a
            block table that is not a 2-D int32 array, a row outside it, more block ids
            than the row is wide, mis-shaped columns, or a token count that is not
            `sum(q_lens)`.
        """
        n = len(rows)
        if n == 0:
            raise ValueError("build_rows() needs at least one scheduled sequence")
        if n > self.max_num_seqs:
            raise ValueError(f"{n} sequences scheduled, more than max_num_seqs={self.max_num_seqs}")
        if (not isinstance(block_table, np.ndarray) or block_table.dtype != np.int32
                or block_table.ndim != 2):
            raise ValueError("block_table must be a 2-D int32 numpy array, got "
                             f"{getattr(block_table, 'dtype', type(block_table).__name__)} "
                             f"of shape {getattr(block_table, 'shape', None)}")
        rows = _int_column("rows", rows)
        num_blk = _int_column("num_table_blocks", num_table_blocks)
        computed = _int_column("num_computed", num_computed)
        q_lens = _int_column("q_lens", q_lens)
        tokens = _int_column("token_ids", token_ids)
        if not (rows.shape == num_blk.shape == computed.shape == q_lens.shape == (n,)
                and tokens.ndim == 1):
            raise ValueError(
                f"build_rows() columns must be 1-D: rows {rows.shape}, num_table_blocks "
                f"{num_blk.shape}, num_computed {computed.shape}, q_lens {q_lens.shape} "
                f"(n={n}), token_ids {tokens.shape}")
        bs = self.block_size
        R, W = block_table.shape
        kv_lens = computed + q_lens
        pages_needed = (kv_lens + (bs - 1)) // bs
        num_tokens = int(q_lens.sum())
        max_pages = int(pages_needed.max())
        # NOTE: reductions only (one numpy call per condition) on the fast path; the slow
        # path names the culprit.
        if (num_tokens > self.max_num_tokens or tokens.shape[0] != num_tokens
                or max_pages > self.max_pages_per_seq or q_lens.min() < 1
                or computed.min() < 0 or (num_blk - pages_needed).min() < 0
                or num_blk.max() > W or rows.min() < 0 or rows.max() >= R):
            self._raise_rows_error(R, W, rows, num_blk, tokens, q_lens, computed, kv_lens,
                                   pages_needed, num_tokens)
        _check_token_ids(tokens, q_lens)

        iota = self._iota
        if num_tokens == n:
            # NOTE: decode-only fast path (every q_len is 1): one group, caller order kept,
            # row i holds token i.
            order = None
            consts = self._decode_consts.get(n)
            if consts is None:
                consts = self._decode_consts[n] = self._make_decode_consts(n)
            distribution = consts[0]
            q_s, pages_s, comp_s, kv_s, rows_s = q_lens, pages_needed, computed, kv_lens, rows
        else:
            order, distribution, (q_s, pages_s, comp_s, kv_s, rows_s) = _order_rows(
                q_lens, computed, (q_lens, pages_needed, computed, kv_lens, rows))
            cu_s = np.zeros(n + 1, np.int64)
            np.cumsum(q_s, out=cu_s[1:])
        T = self.token_buckets[bisect.bisect_left(self.token_buckets, num_tokens)]
        S = self.seq_buckets[bisect.bisect_left(self.seq_buckets, n)]
        P = self.page_buckets[bisect.bisect_left(self.page_buckets, max_pages)]
        pad_page = self.num_blocks

        # Page table: one gather of the sorted rows' first w cells (w >= every row's need),
        # the cells past each row's need zeroed (a valid id) so that one max checks the live
        # ones (a negative id reads as a huge uint32), then masked to padding.
        w = min(P, W)
        live = iota[:w] < pages_s[:, None]
        g = np.where(live, block_table[rows_s, :w], 0)
        limit = self.num_blocks + 1 if null_slots_ok else self.num_blocks
        if g.view(np.uint32).max() >= limit:
            r, k = (int(x[0]) for x in np.nonzero(g.view(np.uint32) >= limit))
            i = r if order is None else int(order[r])
            raise ValueError(f"seqs[{i}]: block id {int(g[r, k])} out of range "
                             f"0..{self.num_blocks - 1}")
        page_indices = np.full((S, P), pad_page, np.int32)
        np.copyto(page_indices[:n, :w], g, where=live)

        # Token rows in sorted order (as `build`): row r's i-th token sits at position
        # comp_s[r] + i and its K/V goes to cell (pos // bs) of the row's gathered table.
        # NOTE: one allocation for the [T] arrays and kv_lens (views of one zeroed buffer).
        buf = np.zeros(3 * T + S, np.int32)
        input_ids, positions, slot_mapping, kv_out = (
            buf[:T], buf[T:2 * T], buf[2 * T:3 * T], buf[3 * T:])
        slot_mapping[num_tokens:] = pad_page * bs
        if num_tokens == n:
            pos = comp_s
            row_of_tok = iota[:n]
        else:
            row_of_tok = np.repeat(iota[:n], q_s)
            pos = iota[:num_tokens] + (comp_s - cu_s[:-1])[row_of_tok]
        if order is None:
            input_ids[:num_tokens] = tokens
        else:
            cu_in = np.zeros(n + 1, np.int64)
            np.cumsum(q_lens, out=cu_in[1:])
            src = iota[:num_tokens] + (cu_in[:-1][order] - cu_s[:-1])[row_of_tok]
            input_ids[:num_tokens] = tokens[src]
        positions[:num_tokens] = pos
        blk_col, offset = np.divmod(pos, bs)
        live_slots = slot_mapping[:num_tokens]
        np.multiply(g[row_of_tok, blk_col], bs, out=live_slots)
        live_slots += offset
        kv_out[:n] = kv_s
        if num_tokens == n:
            _, cu_q_lens, logits_indices, num_seqs = consts
        else:
            cu_q_lens, logits_indices = _cu_and_logits(S, n, num_tokens, cu_s, order)
            num_seqs = np.array([n], np.int32)
        metadata = AttentionMetadata(
            page_indices=page_indices,
            kv_lens=kv_out,
            cu_q_lens=cu_q_lens,
            num_seqs=num_seqs,
            positions=positions,
            slot_mapping=slot_mapping,
            distribution=distribution,
        )
        return StepInputs(input_ids=input_ids, metadata=metadata, logits_indices=logits_indices)

    def _make_decode_consts(self, n: int) -> tuple[np.ndarray, ...]:
        """(distribution, cu_q_lens, logits_indices, num_seqs) of n one-token rows."""
        S = self.seq_buckets[bisect.bisect_left(self.seq_buckets, n)]
        iota = self._iota[: S + 1]
        consts = (np.full(3, n, np.int32), np.minimum(iota, n).astype(np.int32),
                  np.where(iota[:S] < n, iota[:S], 0).astype(np.int32),
                  np.array([n], np.int32))
        for a in consts:
            a.flags.writeable = False
        return consts

    def _raise_rows_error(self, R, W, rows, num_blk, tokens, q_lens, computed, kv_lens,
                          pages_needed, num_tokens):
        """Raises the ValueError of a bad `build_rows` call (slow path)."""
        bad_row = (rows < 0) | (rows >= R)
        if bad_row.any():
            i = int(np.flatnonzero(bad_row)[0])
            raise ValueError(f"seqs[{i}]: row {int(rows[i])} outside the block table's "
                             f"{R} rows")
        too_wide = num_blk > W
        if too_wide.any():
            i = int(np.flatnonzero(too_wide)[0])
            raise ValueError(f"seqs[{i}]: {int(num_blk[i])} block ids but the block table "
                             f"is {W} wide")
        if num_tokens <= self.max_num_tokens and tokens.shape[0] != num_tokens and not (
                q_lens < 1).any():
            raise ValueError(f"{tokens.shape[0]} token ids given for {num_tokens} scheduled "
                             "tokens (sum of q_lens)")
        self._raise_seq_error(q_lens, computed, num_blk, kv_lens, pages_needed, num_tokens)

    def _raise_seq_error(self, q_lens, computed, num_blk, kv_lens, pages_needed, num_tokens):
        """Raises the ValueError for the first offending sequence (slow path of `build`)."""
        checks = (
            (q_lens < 1, lambda i: f"seqs[{i}]: no tokens scheduled (token_ids is empty)"),
            (computed < 0,
             lambda i: f"seqs[{i}]: negative num_computed_tokens {int(computed[i])}"),
            (pages_needed > self.max_pages_per_seq,
             lambda i: f"seqs[{i}]: {int(kv_lens[i])} tokens of KV need {int(pages_needed[i])} "
                       f"pages, more than max_pages_per_seq={self.max_pages_per_seq}"),
            (pages_needed > num_blk,
             lambda i: f"seqs[{i}]: {int(kv_lens[i])} tokens of KV (num_computed_tokens="
                       f"{int(computed[i])} + {int(q_lens[i])} scheduled) need "
                       f"{int(pages_needed[i])} blocks of size {self.block_size}, but only "
                       f"{int(num_blk[i])} block ids given"),
        )
        for bad, msg in checks:
            if bad.any():
                raise ValueError(msg(int(np.flatnonzero(bad)[0])))
        raise ValueError(
            f"{num_tokens} tokens scheduled, more than max_num_tokens={self.max_num_tokens}"
        )
