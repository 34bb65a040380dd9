"""KV cache manager with automatic prefix caching (vLLM v1 semantics, one group).

The scheduler-facing API of vLLM's ``KVCacheManager`` for a single full-attention KV
cache group, with the seed design's block pool underneath:

    blocks, num_hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks)
    if new is None: ...             # does not fit; nothing changed
    request.num_computed_tokens = request.num_tokens   # the scheduler advances it
    ...
    manager.allocate_slots(request, 1)                  # each decode step
    manager.free(request)

Calls, block counts, caching points and free order follow vLLM 0.33's
``kv_cache_manager.py`` / ``single_type_kv_cache_manager.py`` / ``block_pool.py``
exactly, so a replay gives vLLM's hits and (shifted by vLLM's null block) its block
ids. See ``tests/core/test_core_manager*.py`` and the replay goldens.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import islice
from operator import attrgetter
from types import MappingProxyType
from typing import Any, Sequence

from prefixcache._validate import (ArgumentTypeError, check_arrival, check_bool, check_count,
                                   check_positive_int, check_release_inputs, held_state)
from prefixcache.core.block_pool import (
    FREE_ORDERS,
    BlockPool,
    InvariantError,
    KVCacheBlock,
)
from prefixcache.core.eviction import DEFAULT_POLICY, EvictionPolicy, get_policy_class, make_policy
from prefixcache.core.eviction.base import WaitingFanout
from prefixcache.core.events import KVCacheEvent
from prefixcache.core.groups.base import check_block_hash_list
from prefixcache.core.hashing import BlockHasher
from prefixcache.core.tiers import TierHit, build_lower_tiers, lower_tiers_requested
from prefixcache.core.tiers.host import (
    HostHit,
    HostTierAPI,
    check_tier_args,
    make_host_tier,
)
from prefixcache.core.indexes import (
    DEFAULT_INDEX,
    check_implementation,
    resolve_manager_class,
)
from prefixcache.core.kv_cache_blocks import KVCacheBlocks, empty_blocks, unwrap
from prefixcache.core.kv_groups import FULL_ATTENTION_LAYOUT
from prefixcache.core.request import Request
from prefixcache.core.stats import PrefixCacheStats

_new = object.__new__


# The managers' constructor keywords besides num_blocks / block_size, in the order
# ``manager_options`` returns them. Their defaults are ``CacheConfig``'s fields of the
# same names (one table), and two of the manager's own.
MANAGER_OPTION_NAMES = (
    "enable_caching", "hash_algo", "hash_seed", "free_order", "log_stats", "enable_events",
    "max_model_len", "int_event_hashes", "eviction", "eviction_options", "index",
    "kv_cache_groups", "num_host_blocks", "host_eviction", "host_eviction_options")
_OWN_DEFAULTS = {"log_stats": True, "int_event_hashes": True}


def _manager_defaults() -> MappingProxyType:
    import dataclasses  # noqa: PLC0415

    from prefixcache.core.cache_config import CacheConfig  # noqa: PLC0415

    fields = {f.name: f.default for f in dataclasses.fields(CacheConfig)}
    return MappingProxyType({name: _OWN_DEFAULTS[name] if name in _OWN_DEFAULTS
                             else fields[name] for name in MANAGER_OPTION_NAMES})


MANAGER_DEFAULTS = _manager_defaults()


def manager_options(manager, options: Mapping[str, Any], *, lower_tiers: bool,
                    checked: bool = False) -> tuple:
    """The constructor keywords of an index or layout class, defaults filled in
    (``MANAGER_DEFAULTS``; ``index`` defaults to the class's ``INDEX_NAME``): their
    values in ``MANAGER_OPTION_NAMES`` order, then the keywords of the tiers below the
    host (a dict; ``TypeError`` for any keyword when the class takes none, as for an
    unknown one). ``checked``: the one composition rule is applied first
    (``indexes.check_implementation``: an unknown index, a layout or tier the class
    does not serve -> ``ValueError`` naming why) and ``index`` is its name."""
    values = [options.get(name, default) for name, default in MANAGER_DEFAULTS.items()]
    i = MANAGER_OPTION_NAMES.index("index")
    if "index" not in options:
        values[i] = getattr(type(manager), "INDEX_NAME", DEFAULT_INDEX)
    rest = {k: v for k, v in options.items() if k not in MANAGER_DEFAULTS}
    if rest and not lower_tiers:
        raise TypeError(f"{type(manager).__name__}() got unexpected keyword arguments "
                        f"{sorted(rest)}")
    if checked:
        o = dict(zip(MANAGER_OPTION_NAMES, values))
        values[i] = check_implementation(manager, o["index"], o["kv_cache_groups"],
                                         o["eviction"], o["num_host_blocks"])
    return (*values, rest)


class _RequestState:
    """What the manager holds for a request that has blocks.

    Attributes:
        request: the request object.
        blocks: its block table (append-only while it runs).
        num_cached_blocks: leading blocks of ``blocks`` already in the hash map.
        idle_until: the decode fast path's bound: while the request's sequence
            (computed + new tokens) stays <= this, a step needs no new block, fills
            no block to cache and stays within max_model_len -- nothing to do. Set
            after every allocation (-1: unknown, take the full path).
    """

    __slots__ = ("request", "blocks", "num_cached_blocks", "idle_until")

    def __init__(self, request, blocks: list[KVCacheBlock], num_cached_blocks: int):
        self.request = request
        self.blocks = blocks
        self.num_cached_blocks = num_cached_blocks
        self.idle_until = -1


def _bad_num_computed_tokens(request) -> str | None:
    """Why ``request.num_computed_tokens`` (a plain attribute the scheduler sets) is not
    an int in ``[0, num_tokens]``, or None when it is."""
    nc = request.num_computed_tokens
    if type(nc) is int and 0 <= nc <= request.num_tokens:
        return None
    return (
        f"request {request.request_id!r}: num_computed_tokens={nc!r} is not an int in "
        f"[0, num_tokens={request.num_tokens}]"
    )


# NOTE: the checks below are called only when a cheap inline type test fails (the
# admission path is measured in instructions: a Python call costs ~600-1000).
def _check_request(request) -> None:
    if not isinstance(request, Request):
        raise ArgumentTypeError(
            f"request must be a prefixcache Request, got {type(request).__name__}")


def _int_counts(*named: tuple[str, Any]) -> list[int]:
    """The counts as ints (numpy ints converted); ``ArgumentTypeError`` naming a
    non-int one (a float such as ``np.float64(10.0)``, a bool), before any state
    changes."""
    return [check_count(name, value, min=-(2**63)) for name, value in named]


def _check_hit_container(new_computed_blocks) -> None:
    if not isinstance(new_computed_blocks, (list, tuple)):
        raise ArgumentTypeError(
            "new_computed_blocks must be the list of blocks get_computed_blocks returned, "
            f"got {type(new_computed_blocks).__name__}")


def _check_hit_positions(manager, request, computed) -> None:
    """Raise unless hit block #i is cached under the request's block hash #i (a list
    reordered, cut in front, duplicated or from another prompt is refused before any
    change: adopted, it would leave a table whose blocks hold other tokens)."""
    request.bind_hasher(manager.hasher, manager.block_size)
    hashes = request.block_hashes
    n = len(computed)
    if [b.block_hash for b in computed] != hashes[:n]:
        i = next((i for i, b in enumerate(computed)
                  if i >= len(hashes) or b.block_hash != hashes[i]), n)
        raise ValueError(
            f"new_computed_blocks #{i} ({computed[i]!r}) is not the cached block #{i} of "
            f"request {request.request_id!r}'s prefix: pass the list get_computed_blocks "
            "returned for this request, unchanged")


def _admission_checks(manager, request, num_new_tokens, num_new_computed_tokens,
                      new_computed_blocks, num_lookahead_tokens):
    """The checks ``allocate_slots`` makes on a call before changing anything, shared by
    every index (``KVCacheManager``, ``RadixKVCacheManager``): the request, the counts
    (converted to ints or rejected), ``num_computed_tokens``, the hit blocks' count
    against the hit tokens, ``max_model_len`` and the bound hasher.

    Returns:
        ``(st, computed, total, need, num_new_computed_tokens)``: the request's state
        (None for a new request), the hit blocks as a list, its sequence length after
        the step, the tokens that need slots (lookahead included, capped at
        max_model_len), and the hit-token count as an int.

    Raises:
        ValueError / TypeError naming the problem; nothing changed.
    """
    if type(request) is not Request:
        _check_request(request)
    if type(new_computed_blocks) is KVCacheBlocks:
        new_computed_blocks = unwrap(new_computed_blocks)
    rid = request.request_id
    st = manager._states.get(rid)
    if st is not None and st.request is not request:
        raise ValueError(f"request id {rid!r} is already running as another Request")
    if (type(num_new_tokens) is not int or type(num_new_computed_tokens) is not int
            or type(num_lookahead_tokens) is not int):
        num_new_tokens, num_new_computed_tokens, num_lookahead_tokens = _int_counts(
            ("num_new_tokens", num_new_tokens),
            ("num_new_computed_tokens", num_new_computed_tokens),
            ("num_lookahead_tokens", num_lookahead_tokens))
    HashKVCacheManager._check_counts(num_new_tokens, num_new_computed_tokens, num_lookahead_tokens)
    bad = _bad_num_computed_tokens(request)
    if bad:
        raise ValueError(bad)
    if type(request._priority) is not int:  # (what a policy reads when it caches)
        check_release_inputs(request)
    nc = request.num_computed_tokens
    if new_computed_blocks is not None and type(new_computed_blocks) is not list:
        _check_hit_container(new_computed_blocks)  # sets (unordered), generators, ...
    computed = list(new_computed_blocks) if new_computed_blocks else []
    bs = manager.block_size
    if st is not None and computed:
        raise ValueError(f"request {rid!r} is running: it cannot adopt prefix-hit blocks")
    if len(computed) * bs != num_new_computed_tokens:
        raise ValueError(
            f"num_new_computed_tokens={num_new_computed_tokens} does not match "
            f"{len(computed)} hit blocks of {bs} tokens"
        )
    if computed and not manager.enable_caching:
        raise ValueError("prefix caching is disabled: no computed blocks can be adopted")
    total = nc + num_new_computed_tokens + num_new_tokens
    if st is None and nc:
        # A Request re-used after free() (or preempted without the reset): it claims
        # KV it no longer holds; fresh blocks would be cached under its prompt's hashes.
        raise ValueError(
            f"request {rid!r} has num_computed_tokens={nc} but holds no blocks here "
            "(freed or preempted): set num_computed_tokens = 0 before admitting it again"
            + ("; it cannot adopt prefix-hit blocks" if computed else "")
        )
    mml = manager.max_model_len
    need = total + num_lookahead_tokens
    if mml is not None:
        if total > mml:
            raise ValueError(
                f"request {rid!r} needs {total} tokens, beyond max_model_len={mml}"
            )
        need = min(need, mml)
    hasher = request.hasher
    if manager.enable_caching and hasher is not None and (
        (hasher is not manager.hasher and hasher != manager.hasher) or request.block_size != bs
    ):
        raise ValueError(
            f"request {rid!r} is bound to {hasher!r} with block size "
            f"{request.block_size}, not this manager's {manager.hasher!r} / {bs}"
        )
    return st, computed, total, need, num_new_computed_tokens


# (``_check_sizes``'s "no free_order to check": the hybrid manager's pool checks it)
_UNCHECKED = object()


def _check_sizes(num_blocks, block_size, max_model_len, free_order=_UNCHECKED):
    """Every manager's constructor checks of its sizes (the one rule for sizes: numpy
    ints are ints, bools are not -- _validate), in this order: ``block_size``,
    ``num_blocks``, ``free_order`` (when given), ``max_model_len`` (``None``: no limit).

    Returns:
        ``(num_blocks, block_size, max_model_len)`` as ints (``max_model_len`` may be
        ``None``).
    """
    block_size = check_positive_int("block_size", block_size)
    num_blocks = check_positive_int("num_blocks", num_blocks)
    if free_order is not _UNCHECKED and free_order not in FREE_ORDERS:
        raise ValueError(f"unknown free_order {free_order!r}; expected one of {FREE_ORDERS}")
    max_model_len = check_positive_int("max_model_len", max_model_len, optional=True)
    return num_blocks, block_size, max_model_len


def _hash_eviction_options(eviction_options) -> dict:
    """The hash index's managers' ``eviction_options`` rule: a copy of the mapping
    (``None``: ``{}``); anything else raises ``TypeError``."""
    if eviction_options is None:
        return {}
    if not isinstance(eviction_options, Mapping):
        raise TypeError(
            f"eviction_options must be a mapping or None, got {type(eviction_options).__name__}"
        )
    return dict(eviction_options)


def _store_settings(manager, num_blocks, block_size, enable_caching, free_order, log_stats,
                    enable_events, max_model_len) -> None:
    """The constructor arguments every manager keeps as attributes (checked ones)."""
    manager.num_blocks = num_blocks
    manager.block_size = block_size
    manager.enable_caching = check_bool("enable_caching", enable_caching)
    manager.free_order = free_order
    manager.log_stats = check_bool("log_stats", log_stats)
    manager.enable_events = check_bool("enable_events", enable_events)
    manager.max_model_len = max_model_len


def _init_lookup_counters(manager) -> None:
    """Every manager's lookup statistics at construction: ``prefix_cache_stats``
    (``None`` without ``log_stats``) and the cumulative counters (never reset)."""
    manager.prefix_cache_stats = PrefixCacheStats() if manager.log_stats else None
    manager.num_lookups = 0
    manager.num_lookup_tokens = 0
    manager.num_hit_tokens = 0
    manager.num_failed_allocations = 0


def _make_prefix_cache_stats(self) -> PrefixCacheStats | None:
    """Return the stats since the last call and start a new interval.

    ``None`` when ``log_stats`` is off. (Every manager's ``make_prefix_cache_stats``:
    the classes bind this function, no extra call.)
    """
    if not self.log_stats:
        return None
    stats = self.prefix_cache_stats
    self.prefix_cache_stats = PrefixCacheStats()
    return stats


def _pop_held_state(manager, request):
    """The state ``manager`` (``_states``: id -> state, ``_states_by_request``) holds
    for ``request``, dropped from both: the one preamble of every manager's ``free``.

    As ``_validate.held_state`` (the admitted ``Request`` or its id), then
    ``check_release_inputs`` on an odd priority: raised before anything is dropped.
    """
    states = manager._states
    if isinstance(request, Request):  # (the admitted object: held_state's frame saved)
        rid = request.request_id
        st = states.get(rid)
    else:
        rid = st = None
    if st is None or st.request is not request:
        rid, st = held_state(states, request)
    req = st.request
    if type(req._priority) is not int:
        check_release_inputs(req)
    del states[rid]
    del manager._states_by_request[req]
    return st


class BlockPoolViews:
    """Read-only views of a manager's ``self.block_pool`` (a ``BlockPool``) and
    ``self._states`` (request id -> state, in allocation order), the counters, and the
    two calls the pool answers (reset, events); shared by the hash and radix indexes
    and the hybrid manager."""

    @property
    def running_request_ids(self) -> list[str]:
        """Ids of the requests holding blocks, in allocation order."""
        return list(self._states)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0.0 .. 1.0)."""
        return 1.0 - self.block_pool.free_block_queue.num_free_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """The free queue as block ids, head (reused next) first."""
        return self.block_pool.free_block_queue.block_ids()

    def cached_block_ids(self) -> list[int]:
        """Ids of all blocks currently in the hash map, ascending."""
        return sorted(b.block_id for b in self.block_pool.blocks if b.block_hash is not None)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the cache now (held or free), O(1)."""
        return self.block_pool.num_cached_blocks

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted (hash dropped to reuse the block), cumulative."""
        return self.block_pool.num_evictions

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after a weight update).

        Returns:
            ``True`` on success; ``False`` (nothing changed) while any block is held.
        """
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the queued KV cache events (``[]`` when disabled)."""
        return self.block_pool.take_events()

    def counters(self) -> dict[str, int]:
        """Cumulative counters since construction (never reset)."""
        pool = self.block_pool
        return {
            "lookups": self.num_lookups,
            "lookup_tokens": self.num_lookup_tokens,
            "hit_tokens": self.num_hit_tokens,
            "evictions": pool.num_evictions,
            "blocks_cached": pool.num_blocks_cached,
            "blocks_allocated": pool.num_blocks_allocated,
            "failed_allocations": self.num_failed_allocations,
        }


class _OneGroupManager(HostTierAPI):
    """What the one-group indexes (the hash chain here, the radix tree) share: the
    scheduler's ``allocate_slots`` with its decode fast path, and the end of an
    admission. The index provides the request states (``_states_by_request``: each
    with ``request``, ``blocks``, ``num_cached_blocks`` and ``idle_until``),
    ``_allocate_checked`` (admission, lookahead, bad calls: past the shared checks),
    ``_num_available()`` (blocks
    it can hand out now), ``_take_blocks(n)`` and ``_cache(st, num_full, hashes)``
    (enter the request's blocks up to ``num_full`` into the index)."""

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | Sequence[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0) -> KVCacheBlocks | None:
        """``KVCacheManager.allocate_slots`` for one group (the contract, arguments and
        errors are documented there): adopted hit blocks get a reference (the radix
        tree also locks their nodes), new blocks come from the free blocks in the
        policy's order, and every block full after this step -- up to
        ``num_computed_tokens + num_new_computed_tokens + num_new_tokens`` tokens,
        capped at ``request.num_tokens`` -- is cached at once."""
        try:
            st = self._states_by_request[request]  # NOTE: a subscript, not a .get() call
        except (KeyError, TypeError):  # (TypeError: unhashable, not a Request at all)
            return self._allocate_slow(
                request, num_new_tokens, num_new_computed_tokens,
                new_computed_blocks, num_lookahead_tokens,
            )
        nc = request.num_computed_tokens
        if (
            type(nc) is not int
            or nc < 0
            or num_new_computed_tokens
            or new_computed_blocks
            or num_lookahead_tokens
            # NOTE: floats (np.float64(10.0) passes the idle bound below and would return
            # [] silently), numpy ints, bools: the slow path, which converts or raises.
            # Measured ~220 instructions per decode call (+1.1-1.4% of a decode-heavy
            # replay, cachegrind); folding both type tests into one `type(nc + n)` would
            # let bools through.
            or type(num_new_tokens) is not int
            or num_new_tokens <= 0
        ):
            return self._allocate_slow(
                request, num_new_tokens, num_new_computed_tokens,
                new_computed_blocks, num_lookahead_tokens,
            )
        # Fast path: a running request (a decode step or a later prefill chunk).
        total = nc + num_new_tokens
        if total <= st.idle_until:
            return self._empty  # most decode steps: the last block has room, nothing fills
        num_tokens = request.num_tokens
        if nc > num_tokens:
            raise ValueError(
                f"request {request.request_id!r}: num_computed_tokens={nc} > "
                f"num_tokens={num_tokens}"
            )
        if total > self._max_len:
            raise ValueError(
                f"request {request.request_id!r} needs {total} tokens, beyond "
                f"max_model_len={self.max_model_len}"
            )
        if type(request._priority) is not int:  # (the policy / tier read it when caching)
            check_release_inputs(request)
        num_new_blocks = -(-total // self.block_size) - len(st.blocks)
        if num_new_blocks > 0 and num_new_blocks > self._num_available():
            self.num_failed_allocations += 1
            return None
        return self._grow_and_cache(request, st, num_new_blocks, total)

    def _allocate_slow(
        self, request, num_new_tokens, num_new_computed_tokens,
        new_computed_blocks, num_lookahead_tokens,
    ):
        """``allocate_slots`` for a new request, lookahead slots, or any bad call: the
        admission checks every index shares, then the index's ``_allocate_checked``."""
        return self._allocate_checked(request, *_admission_checks(
            self, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
            num_lookahead_tokens))

    def _register(self, request, st, num_new_computed_tokens: int) -> None:
        """A new request is admitted with state ``st``: file it, and record its lookup
        (``log_stats``: its tokens and hit tokens, vLLM's record at admission)."""
        self._states[request.request_id] = st
        self._states_by_request[request] = st
        if self.log_stats and self.enable_caching:
            self.prefix_cache_stats.record(
                request.num_tokens, num_new_computed_tokens, request.num_preemptions > 0)

    def _idle_bound(self, st: _RequestState) -> int:
        """``st.idle_until`` for its current blocks and cached blocks (recomputed after
        every allocation)."""
        bs = self.block_size
        limit = len(st.blocks) * bs
        if self._max_len < limit:
            limit = self._max_len
        if self.enable_caching:
            # One more token than this fills the next uncached block: cache it.
            full = (st.num_cached_blocks + 1) * bs - 1
            if full < limit:
                limit = full
        return limit

    def _grow_and_cache(self, request, st, num_new_blocks: int, total: int):
        """The end of an admission (plain or tiered) and of a running request's growth:
        append ``num_new_blocks`` fresh blocks to the request's table, cache its full
        blocks up to ``total`` tokens, and return the new blocks."""
        bs = self.block_size
        if num_new_blocks > 0:
            new_blocks = self._take_blocks(num_new_blocks)
            st.blocks.extend(new_blocks)
        else:
            new_blocks = []
        # NOTE: total // bs bounds the full blocks; only when it passes the cached ones
        # are the hashes read (a request is bound to the hasher at its first).
        if total // bs > st.num_cached_blocks and self.enable_caching:
            if not st.num_cached_blocks:
                request.bind_hasher(self.hasher, bs)  # a no-op after get_computed_blocks
            hashes = request.block_hashes
            num_full = min(total, request.num_tokens, len(hashes) * bs) // bs
            if num_full > st.num_cached_blocks:
                self._cache(st, num_full, hashes)
        st.idle_until = self._idle_bound(st)
        if not new_blocks:
            return self._empty
        r = _new(KVCacheBlocks)
        r.blocks = (new_blocks,)
        return r


class HashKVCacheManager(_OneGroupManager, BlockPoolViews):
    """The hash index over one full-attention group (``KVCacheManager``'s default
    implementation): allocates KV cache blocks to requests and reuses cached prefixes.

    ``KEYS_BY_BLOCK_HASH``: the index finds blocks by ``request.block_hashes`` alone
    (True here), so a replay may key blocks by adopted hashes (Mooncake hash ids,
    ``Request.adopt_block_hashes``) without materialising their tokens.

    Invariants (``check_invariants`` verifies all of them):
        * Each block's ``ref_cnt`` equals the number of running requests' block
          tables that hold it; blocks with ``ref_cnt == 0`` are exactly the free
          queue, in eviction order (head first).
        * A request's first ``num_cached_blocks`` blocks are cached under its own
          block hashes ``request.block_hashes[i]``; its other blocks hold no hash.
        * Only full blocks are cached; a lookup hits at most ``num_tokens - 1``
          tokens (the last token is always recomputed to produce logits).
        * A call that raises or returns ``None`` changes no state.
        * A running request's ``num_computed_tokens`` (a plain attribute its scheduler
          advances) is an int in ``[0, num_tokens]`` covered by its blocks;
          ``allocate_slots`` raises ``ValueError`` on a value that is not, before it
          changes anything (a decode step that allocates and caches nothing does not
          compare it with ``num_tokens``).

    Args:
        num_blocks: allocatable blocks (ids ``0 .. num_blocks - 1``); > 0.
        block_size: tokens per block; > 0.
        enable_caching: prefix caching on (off: nothing is hashed or hit).
        hash_algo: ``sha256``, ``sha256_cbor``, ``xxhash`` or ``xxhash_cbor``.
        hash_seed: seed of the hash chain's root (see ``BlockHasher``).
        free_order: ``"append"`` (the seed's: freed blocks to the tail, in reverse
            block order) or ``"unhashed_first"`` (vLLM 0.33: never-cached freed
            blocks to the head).
        log_stats: collect ``PrefixCacheStats`` for ``make_prefix_cache_stats``: one
            record per admitted request (its tokens and prefix-hit tokens, at the
            ``allocate_slots`` that gives it its first blocks), as vLLM 0.33 records
            at admission; lookups that did not lead to an admission are not counted
            (``counters()`` counts every lookup).
        enable_events: queue KV cache events for ``take_events``.
        max_model_len: longest allowed sequence (tokens); ``None`` for no limit.
        int_event_hashes: events carry block hashes as vLLM publishes them by
            default (the digest's low 64 bits as an int); ``False``: raw digests.
        eviction: the eviction policy's name (``prefixcache.core.eviction.POLICIES``):
            ``"lru"`` (vLLM's order, the default: the pool's own free queue, no
            policy object), ``fifo``, ``lfu``, ``slru``, ``priority``, ``length``,
            ``cost``, or ``belady`` (offline: needs ``eviction_options={"future":
            ...}``, which the replay builds; see ``on_arrival``).
        eviction_options: the policy's own options (e.g. ``{"model": "llama_3_1_8b"}``
            for ``cost``); with ``"lru"``, ``{"fast_path": False}`` runs the keyed
            LRU policy through the policy pool instead (the radix index's form; a
            test pins it to the fast path).
        index: the prefix index (``prefixcache.core.indexes.INDEXES``): ``"hash"``
            (this class) or ``"radix"`` (``KVCacheManager(..., index="radix")``
            returns that class's manager, same API).
        kv_cache_groups: the model's KV cache groups (``prefixcache.core.kv_groups``);
            ``None`` or one full-attention group: this class. With a sliding-window
            group ``KVCacheManager(...)`` returns a ``hybrid.HybridKVCacheManager``
            (one block table per group; ``get_block_ids`` returns one list per group).
        num_host_blocks: host-memory tier slots (``prefixcache/core/host_tier.py``);
            0 (the default) = no tier: nothing changes. A non-negative int (bools,
            floats, strings rejected). With a tier, cached blocks the device evicts
            move to the host (exclusive tiers), lookups continue there block by
            block, and host hits appear in ``get_computed_blocks``' list as
            ``HostHit`` placeholders that ``allocate_slots`` loads into fresh device
            blocks (setting their ``block_id``); ``take_host_transfers()`` returns
            the page copies to make, in order. Needs ``enable_caching``.
        host_eviction: the host tier's policy (a ``POLICIES`` name but ``belady``).
        host_eviction_options: that policy's options.
        disk_bytes, disk_eviction, disk_eviction_options, page_bytes, remote_bytes,
            remote_eviction, remote, tiers: the tiers below the host
            (``prefixcache.core.tiers``; they need a host tier): a ``disk`` tier of
            ``disk_bytes // page_bytes`` blocks, tiers of one's own (``tiers``: mappings
            with a ``"tier"`` name or ``KeyTier`` subclass and its keywords), and a
            ``remote`` store (``remote``: a ``RemoteStore`` shared with other managers,
            or ``remote_bytes`` of this manager's own). A block the host evicts is
            demoted down the chain; a lookup continues there block by block, its hits
            are ``TierHit`` placeholders loaded like ``HostHit``s, and the copies are
            ``TierTransfer``s in ``take_host_transfers()``' list.

    Attributes:
        eviction, index: the names chosen.
        policy: the ``EvictionPolicy`` object, or ``None`` for the LRU fast path.
        host_tier: the ``HostTier`` (``None`` without one); ``num_host_blocks``,
            ``host_eviction``: as given.
        device_hit_tokens, host_hit_tokens: prefix-hit tokens adopted at admission
            (``allocate_slots``), by tier; cumulative. ``host_blocks_loaded``,
            ``host_blocks_stored``, ``num_host_cached_blocks``: properties (0 without
            a tier).
    """

    KEYS_BY_BLOCK_HASH = True
    INDEX_NAME = DEFAULT_INDEX

    def __init__(self, num_blocks: int, block_size: int, **options):
        (enable_caching, hash_algo, hash_seed, free_order, log_stats, enable_events,
         max_model_len, int_event_hashes, eviction, eviction_options, index,
         kv_cache_groups, num_host_blocks, host_eviction, host_eviction_options,
         lower_tiers) = manager_options(self, options, lower_tiers=True, checked=True)
        # (an unknown index, a layout or tier this class does not serve raised naming
        # why; KVCacheManager has applied that rule already)
        num_blocks, block_size, max_model_len = _check_sizes(
            num_blocks, block_size, max_model_len, free_order)
        policy_cls = get_policy_class(eviction)  # unknown name -> ValueError
        num_host_blocks, host_options = check_tier_args(
            num_host_blocks, host_eviction, host_eviction_options, enable_caching)
        options = _hash_eviction_options(eviction_options)
        fast_path = options.pop("fast_path", True) if eviction == DEFAULT_POLICY else True
        if policy_cls.needs_future and options.get("future") is None:
            raise ValueError(
                f"{eviction} needs the trace's future: run it through the replay "
                f"(prefixcache.sim.replay.replay(..., eviction={eviction!r})), which reads "
                "the trace once to index next uses; online serving has no future"
            )
        self.hasher = BlockHasher(hash_algo, hash_seed)  # unknown algo -> ValueError
        policy: EvictionPolicy | None = None
        if eviction != DEFAULT_POLICY or options or not fast_path:
            policy = make_policy(eviction, num_blocks=num_blocks, block_size=block_size, **options)
        host_tier = make_host_tier(num_host_blocks, host_eviction, host_options,
                                   block_size=block_size, num_device_blocks=num_blocks,
                                   enable_events=enable_events)
        lower = _build_lower_tiers(self, lower_tiers, num_host_blocks, block_size)
        self.eviction = eviction
        self.index = index
        self.policy = policy
        # A policy that reads the waiting queue (queue_aware): admission drops the
        # request from it (``on_waiting``); None for every other policy.
        self._waiting_policy = policy if policy is not None and policy.needs_waiting else None
        host_policy = host_tier.policy if host_tier is not None else None
        if host_policy is not None and host_policy.needs_waiting:
            # The host tier's policy reads the queue too (queue_aware): a host entry a
            # waiting request holds leaves the host last (its admission would load it).
            self._waiting_policy = WaitingFanout(self._waiting_policy, host_policy)
        _store_settings(self, num_blocks, block_size, enable_caching, free_order, log_stats,
                        enable_events, max_model_len)
        self._max_len = max_model_len if max_model_len is not None else 1 << 62
        pool_kwargs = dict(
            enable_caching=self.enable_caching,
            enable_events=self.enable_events,
            free_order=free_order,
            int_event_hashes=int_event_hashes,
        )
        # NOTE: LRU keeps vLLM's intrusive free queue (policy None: no work added to
        # the decode path, free or touch); any other policy is the pool's component.
        self.block_pool = BlockPool(num_blocks, policy=policy, **pool_kwargs)
        self._take_blocks = self.block_pool.get_new_blocks  # (no frame of ours)
        if host_tier is not None:
            self.block_pool.attach_tier(host_tier)
            # NOTE: instance attributes shadow the two methods that learn about host
            # hits (lookup and admission); the decode fast path is shared.
            self._hit_blocks = self._hit_blocks_tiered
            self._allocate_checked = self._allocate_checked_tiered
            if lower:
                pool = self.block_pool
                host_tier.attach_lower(lower, events_owner=pool if self.enable_events else None,
                                       event_hash=pool._event_hash, block_size=block_size)
                self._hit_blocks = self._hit_blocks_chain
        self.host_tier = host_tier
        # Hit tokens adopted at admission from each tier below the host, by name.
        self._lower_hit_tokens = {t.name: 0 for t in lower}
        self.num_host_blocks = num_host_blocks
        self.host_eviction = host_eviction
        self.kv_cache_groups = FULL_ATTENTION_LAYOUT
        self.num_groups = 1
        # NOTE: what a decode step that needs nothing returns: shared, immutable.
        self._empty = empty_blocks(1)
        self._empty_hit = self._empty  # what a lookup answers with caching off
        self._hit_blocks_class = KVCacheBlocks  # what get_computed_blocks wraps hits in
        self._states: dict[str, _RequestState] = {}
        # The same states keyed by the Request object (identity hash, C speed): the
        # decode fast path finds its state without calling the request_id property.
        self._states_by_request: dict[Any, _RequestState] = {}
        _init_lookup_counters(self)  # (see also block_pool.num_evictions)
        # Hit tokens adopted at admission, by tier (the host's stays 0 without a tier).
        self.device_hit_tokens = 0
        self.host_hit_tokens = 0

    # ------------------------------------------------------------------ helpers
    def _bind(self, request) -> None:
        request.bind_hasher(self.hasher, self.block_size)

    @property
    def hash_algo(self) -> str:
        return self.hasher.algo

    # -------------------------------------------------------------- scheduling
    def find_longest_cache_hit(self, request: Request) -> tuple[tuple[list, ...], int]:
        """The longest run of cached full blocks that starts the request (a device
        block, or with tiers a placeholder of the tier that holds it), as
        ``((blocks,), num_hit_tokens)``; changes nothing, counts nothing
        (``KVCacheManager.get_computed_blocks`` counts the lookup)."""
        computed = self._hit_blocks(request)
        return (computed,), len(computed) * self.block_size

    def _hit_blocks(self, request) -> list[KVCacheBlock]:
        """The longest run of cached full blocks that starts the request: at most
        ``num_tokens - 1`` tokens hit (all of them would leave nothing to compute logits
        from, so a whole block may be recomputed). Reads the hash map only."""
        request.bind_hasher(self.hasher, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        get = self.block_pool.cached_block_hash_to_block.get
        computed: list[KVCacheBlock] = []
        append = computed.append
        for h in islice(request.block_hashes, max_blocks):
            b = get(h)
            if b is None:
                break
            if type(b) is dict:
                b = next(iter(b.values()))
            append(b)
        return computed

    def _hit_blocks_tiered(self, request) -> list[KVCacheBlock | HostHit]:
        """``_hit_blocks`` with a host tier: block by block, a device hit, else a host
        hit (a ``HostHit`` placeholder), else stop."""
        request.bind_hasher(self.hasher, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        get = self.block_pool.cached_block_hash_to_block.get
        host_get = self.host_tier.hash_to_slot.get
        computed: list = []
        append = computed.append
        for h in islice(request.block_hashes, max_blocks):
            b = get(h)
            if b is None:
                slot = host_get(h)
                if slot is None:
                    break
                append(HostHit(h, slot.block_id))
                continue
            if type(b) is dict:
                b = next(iter(b.values()))
            append(b)
        return computed

    def _hit_blocks_chain(self, request) -> list:
        """``_hit_blocks_tiered`` with tiers below the host: block by block, a device
        hit, else a host hit, else a ``TierHit`` of the first lower tier holding the
        hash, else stop."""
        request.bind_hasher(self.hasher, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.host_tier.hit_run(request.block_hashes, 0, max_blocks,
                                      self.block_pool.cached_block_hash_to_block)

    def _num_available(self) -> int:
        return self.block_pool.free_block_queue.num_free_blocks

    def _cache(self, st: _RequestState, num_full: int, hashes) -> None:
        """Enter the request's blocks ``st.num_cached_blocks .. num_full - 1`` into the
        hash map."""
        self.block_pool.cache_full_blocks(
            st.request, st.blocks, hashes, st.num_cached_blocks, num_full, self.block_size)
        st.num_cached_blocks = num_full

    @staticmethod
    def _check_counts(num_new_tokens, num_new_computed_tokens, num_lookahead_tokens) -> None:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if num_new_computed_tokens < 0:
            raise ValueError(f"num_new_computed_tokens must be >= 0, got {num_new_computed_tokens}")
        if num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}")
        if num_new_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be > 0 when no computed tokens are adopted")

    def _allocate_checked(self, request, st, computed, total: int, need: int,
                          num_new_computed_tokens: int):
        """``_allocate_slow`` past the shared admission checks (``_admission_checks``'
        results): the hit blocks checked as this index's, then admitted."""
        bs = self.block_size
        # Hit blocks that sit in the free queue leave it when touched: they count
        # against the free blocks too (vLLM's num_evictable_computed_blocks).
        num_evictable = 0
        pool_blocks = self.block_pool.blocks
        try:
            for b in computed:
                if type(b) is not KVCacheBlock:
                    raise ArgumentTypeError(
                        f"new_computed_blocks must hold KVCacheBlock objects, got {b!r}")
                if b.block_hash is None or pool_blocks[b.block_id] is not b:
                    raise ValueError(f"block {b.block_id} is not a cached block of this manager")
                if b.ref_cnt == 0:
                    num_evictable += 1
        except IndexError:  # a block id past this pool's: another manager's block
            raise ValueError(
                f"block {b.block_id} is not a cached block of this manager") from None
        if computed:
            _check_hit_positions(self, request, computed)
        pool = self.block_pool
        num_held = len(st.blocks) if st is not None else 0
        num_new_blocks = max(-(-need // bs) - num_held - len(computed), 0)
        if num_new_blocks + num_evictable > pool.free_block_queue.num_free_blocks:
            self.num_failed_allocations += 1
            return None
        # --- state changes from here on -------------------------------------
        if st is None:
            if self._waiting_policy is not None:
                self._waiting_policy.drop_waiting(request.request_id)
            pool.touch(computed, request)
            st = _RequestState(request, computed, len(computed))
            self._register(request, st, num_new_computed_tokens)
            self.device_hit_tokens += num_new_computed_tokens
        return self._grow_and_cache(request, st, num_new_blocks, total)

    def _allocate_checked_tiered(self, request, st, computed, total: int, need: int,
                                 num_new_computed_tokens: int):
        """``_allocate_checked`` with a host tier: host hits among the computed blocks
        get fresh device blocks (loads recorded) before the new blocks are taken."""
        bs = self.block_size
        pool = self.block_pool
        tier = self.host_tier
        pool_blocks = pool.blocks
        num_evictable = 0
        loads: list[int] = []  # positions of host hits in ``computed``
        device_hits: list[KVCacheBlock] = []
        seen_slots: set[int] = set()
        hashes = None
        for i, b in enumerate(computed):
            t = type(b)
            if t is KVCacheBlock:
                if (b.block_hash is None or not 0 <= b.block_id < len(pool_blocks)
                        or pool_blocks[b.block_id] is not b):
                    raise ValueError(f"block {b.block_id} is not a cached block of this manager")
                if b.ref_cnt == 0:
                    num_evictable += 1
                device_hits.append(b)
            elif t is HostHit:
                if hashes is None:
                    request.bind_hasher(self.hasher, bs)
                    hashes = request.block_hashes
                _check_host_hit(tier, b, i, hashes, seen_slots, request)
                loads.append(i)
            elif t is TierHit and tier.lower is not None:
                if hashes is None:
                    request.bind_hasher(self.hasher, bs)
                    hashes = request.block_hashes
                _check_tier_hit(tier.lower, b, i, hashes, request)
                loads.append(i)
            else:
                raise ArgumentTypeError(
                    "new_computed_blocks must hold KVCacheBlock / HostHit objects, got "
                    f"{b!r} (TierHit too with tiers below the host)")
        if computed:
            _check_hit_positions(self, request, computed)
        num_held = len(st.blocks) if st is not None else 0
        num_new_blocks = max(-(-need // bs) - num_held - len(computed), 0)
        if num_new_blocks + len(loads) + num_evictable > pool.free_block_queue.num_free_blocks:
            self.num_failed_allocations += 1
            return None
        # --- state changes from here on -------------------------------------
        if st is None:
            if self._waiting_policy is not None:
                self._waiting_policy.drop_waiting(request.request_id)
            pool.touch(device_hits, request)
            table = computed
            lower_hits = None
            if loads:
                # NOTE: pin the entries to load first: the device blocks taken for them
                # may evict cached blocks, whose demotions then never pick these slots.
                for i in loads:
                    hit = computed[i]
                    if type(hit) is HostHit:
                        tier.pin(hit.host_slot)
                    else:
                        hit.tier.pin(hit.block_hash)
                        lower_hits = self._lower_hit_tokens
                fresh = pool.get_new_blocks(len(loads))
                table = list(computed)
                for i, blk in zip(loads, fresh):
                    hit = computed[i]
                    if type(hit) is HostHit:
                        tier.load(hit.host_slot, blk.block_id)
                    else:
                        tier.lower.load(hit, blk.block_id)
                        lower_hits[hit.tier.name] += bs
                    hit.block_id = blk.block_id
                    table[i] = blk
                request.bind_hasher(self.hasher, bs)
                hashes = request.block_hashes
                # Cache each run of loaded blocks under its hashes (GPU BlockStored).
                j = 0
                while j < len(loads):
                    k = j
                    while k + 1 < len(loads) and loads[k + 1] == loads[k] + 1:
                        k += 1
                    pool.cache_full_blocks(request, table, hashes, loads[j], loads[k] + 1, bs)
                    j = k + 1
            st = _RequestState(request, table, len(table))
            self._register(request, st, num_new_computed_tokens)
            self.device_hit_tokens += len(device_hits) * bs
            if lower_hits is None:
                self.host_hit_tokens += len(loads) * bs
            else:
                self.host_hit_tokens += sum(type(computed[i]) is HostHit for i in loads) * bs
        return self._grow_and_cache(request, st, num_new_blocks, total)

    def free(self, request) -> None:
        """Release a request's blocks (reverse order: its last block evicts first).

        Args:
            request: the ``Request`` or its id.

        Raises:
            ValueError: the request holds no blocks here (nothing changed).
        """
        # The one rule (_validate.held_state): the admitted Request or its id; and what
        # the release reads is checked first, so it cannot fail half way.
        st = _pop_held_state(self, request)
        blocks = st.blocks
        blocks.reverse()
        self.block_pool.free_blocks(blocks, st.request)

    # ------------------------------------------------------------- inspection
    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids. Unknown id -> ``ValueError``."""
        st = self._states.get(request_id)
        if st is None:
            raise ValueError(f"unknown request id {request_id!r}: it holds no blocks")
        return [b.block_id for b in st.blocks]

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block objects (a copy of the list)."""
        st = self._states.get(request_id)
        if st is None:
            raise ValueError(f"unknown request id {request_id!r}: it holds no blocks")
        return list(st.blocks)

    def num_stranded_blocks(self) -> int:
        """Cached blocks no lookup can reach (an earlier block of their chain is not
        cached). O(cached blocks): for summaries, not per step."""
        return len(self.block_pool.stranded_block_ids())

    def on_arrival(self, request, index: int) -> None:
        """Trace request number ``index`` arrives (before its first lookup): the
        offline ``belady`` policy advances its next uses; a no-op otherwise."""
        if type(index) is not int or index < 0 or not isinstance(request, Request):
            index = check_arrival(request, index)  # the one rule (every manager)
        if self.policy is not None:
            self._bind(request)
            self.policy.on_arrival(request, index)

    def on_waiting(self, request_id, block_hashes) -> None:
        """``request_id`` joined the waiting queue with the prompt block hashes it
        can hit (``request.block_hashes[:(request.num_tokens - 1) // block_size]``: a
        lookup adopts at most ``num_tokens - 1`` tokens). A policy with
        ``needs_waiting`` (``queue_aware``) keeps the cached blocks it will hit until it
        is admitted (``allocate_slots`` drops it) or leaves (``drop_waiting``); a no-op
        for every other policy."""
        if self._waiting_policy is not None:
            self._waiting_policy.on_waiting(request_id, block_hashes)

    def drop_waiting(self, request_id) -> None:
        """``request_id`` left the waiting queue without being admitted (aborted,
        failed); a no-op unless the policy reads the queue or the request waits."""
        if self._waiting_policy is not None:
            self._waiting_policy.drop_waiting(request_id)

    make_prefix_cache_stats = _make_prefix_cache_stats

    def check_invariants(self) -> None:
        """Verify pool and request bookkeeping; raise ``InvariantError`` if broken."""
        pool = self.block_pool
        pool.check_invariants()
        refs = [0] * self.num_blocks
        bs = self.block_size
        for rid, st, req in _held_states(self):
            blocks = st.blocks
            if st.num_cached_blocks > len(blocks):
                raise InvariantError(
                    f"request {rid!r}: {st.num_cached_blocks} cached blocks > "
                    f"{len(blocks)} held"
                )
            if len(set(map(id, blocks))) != len(blocks):
                raise InvariantError(
                    f"request {rid!r} holds a block twice: {[b.block_id for b in blocks]}"
                )
            want = self._idle_bound(st)
            if st.idle_until != want:
                raise InvariantError(
                    f"request {rid!r}: decode fast-path bound {st.idle_until} != {want} "
                    f"for {len(blocks)} blocks, {st.num_cached_blocks} cached"
                )
            hashes = req.block_hashes if self.enable_caching else ()
            for i, b in enumerate(blocks):
                if pool.blocks[b.block_id] is not b:
                    raise InvariantError(f"request {rid!r} holds a foreign block {b.block_id}")
                refs[b.block_id] += 1
                if i < st.num_cached_blocks:
                    if b.block_hash is None or i >= len(hashes) or b.block_hash != hashes[i]:
                        got = b.block_hash.hex() if b.block_hash is not None else None
                        raise InvariantError(
                            f"request {rid!r} block #{i} (id {b.block_id}) should be cached "
                            f"under its block hash but has hash {got}"
                        )
                elif b.block_hash is not None:
                    raise InvariantError(
                        f"request {rid!r} block #{i} (id {b.block_id}) is past its "
                        f"{st.num_cached_blocks} cached blocks but has hash "
                        f"{b.block_hash.hex()}"
                    )
            _check_computed_fit(rid, req, len(blocks), bs)
        for b in pool.blocks:
            if b.ref_cnt != refs[b.block_id]:
                raise InvariantError(
                    f"block {b.block_id} has ref_cnt {b.ref_cnt} but {refs[b.block_id]} "
                    "requests hold it"
                )
        if self.host_tier is not None:
            self.host_tier.check_invariants(pool.cached_block_hash_to_block)
        if self._waiting_policy is not None:  # admission drops a request's interest
            held = [r for r in self._waiting_policy.waiting_ids() if r in self._states]
            if held:
                raise InvariantError(f"requests {held[:5]} hold blocks but are still "
                                     "waiting for the queue-aware policy (a leak)")


def _build_lower_tiers(manager, lower_tiers: dict, num_host_blocks: int, block_size: int):
    """The tiers below the host asked for by the manager's keywords (``[]``: none);
    ``TypeError`` for an unknown keyword, ``ValueError`` naming a bad one."""
    from prefixcache.core.tiers import LOWER_TIER_DEFAULTS  # noqa: PLC0415

    unknown = sorted(set(lower_tiers) - set(LOWER_TIER_DEFAULTS) - {"remote"})
    if unknown:
        raise TypeError(f"{type(manager).__name__}() got unexpected keyword arguments "
                        f"{unknown}")
    if not lower_tiers_requested(lower_tiers):
        return []
    if not num_host_blocks:
        raise ValueError(
            "the tiers below the host (disk_bytes, remote_bytes, remote, tiers) need a host "
            "tier (num_host_blocks > 0): a block reaches them when the host evicts it")
    return build_lower_tiers(block_size=block_size, key_bytes=manager.hasher.digest_size,
                             **lower_tiers)


def _check_lower_tiers_served(cls: type) -> None:
    """``ValueError`` unless ``cls`` (the implementation ``KVCacheManager`` resolved)
    serves the tiers below the host: the hash and radix indexes over one full-attention
    group, and the hash index's multi-group manager (``HybridKVCacheManager``: every
    layout its host tier serves); a user's subclass of any of them too."""
    from prefixcache.core.hybrid import HybridKVCacheManager  # noqa: PLC0415
    from prefixcache.core.radix import RadixKVCacheManager  # noqa: PLC0415
    from prefixcache.core.radix_hybrid import RadixHybridKVCacheManager  # noqa: PLC0415

    if (not issubclass(cls, (HashKVCacheManager, RadixKVCacheManager, HybridKVCacheManager))
            or issubclass(cls, RadixHybridKVCacheManager)):
        raise ValueError(
            "the tiers below the host (disk_bytes, remote_bytes, remote, tiers) are "
            "served by the hash and radix indexes with one full-attention group and by "
            "the hash index with multi-group layouts; "
            f"{cls.__name__} does not demote past its host tier")


def _check_tier_hit(chain, b, i: int, hashes, request) -> None:
    """Both indexes' rule for a ``TierHit`` at position ``i`` of a hit list: a current
    entry of a tier of ``chain`` for the request's block ``i``; ``ValueError`` otherwise."""
    if not chain.check_hit(b) or i >= len(hashes) or hashes[i] != b.block_hash:
        raise ValueError(
            f"{b!r} is not a current tier hit of this manager for block #{i} of request "
            f"{request.request_id!r} (already promoted, reordered, or the entry changed "
            "since get_computed_blocks)")


def _check_host_hit(tier, b, i: int, hashes, seen: set, request) -> None:
    """Both indexes' rule for a ``HostHit`` at position ``i`` of a hit list: a current
    entry of ``tier`` for the request's block ``i``, its slot not ``seen`` before in the
    list (then added); ``ValueError`` otherwise."""
    sid = b.host_slot
    if (
        b.block_id != -1 or type(sid) is not int or not 0 <= sid < tier.num_host_blocks
        or tier.slots[sid].block_hash != b.block_hash or sid in seen
        # (a hit at another position would be cached under this one's hash)
        or i >= len(hashes) or hashes[i] != b.block_hash
    ):
        raise ValueError(
            f"{b!r} is not a current host-tier hit of this manager for block #{i} "
            f"of request {request.request_id!r} (already promoted, reordered, or "
            "the host entry changed since get_computed_blocks)")
    seen.add(sid)


def _held_states(manager):
    """``(request id, state, request)`` of each request holding blocks in ``manager``,
    after ``check_invariants``' filing rule of every manager: each state found by its
    id and by its request object, the request's counters sane."""
    states, by_request = manager._states, manager._states_by_request
    if len(by_request) != len(states):
        raise InvariantError(f"{len(by_request)} states by request object but "
                             f"{len(states)} by request id")
    for rid, st in states.items():
        req = st.request
        if req.request_id != rid or by_request.get(req) is not st:
            raise InvariantError(f"state of {rid!r} is filed wrongly")
        bad = _bad_num_computed_tokens(req)
        if bad:
            raise InvariantError(bad)
        yield rid, st, req


def _check_computed_fit(rid, req, num_slots: int, block_size: int) -> None:
    """``check_invariants``: the request's computed tokens fit its ``num_slots`` slots."""
    if -(-req.num_computed_tokens // block_size) > num_slots:
        raise InvariantError(f"request {rid!r} has {req.num_computed_tokens} computed tokens "
                             f"but only {num_slots} blocks")


def _public_methods(cls: type) -> list[str]:
    """Names of ``cls``'s public plain methods (properties and data excluded)."""
    out = []
    for name in dir(cls):
        if name.startswith("_"):
            continue
        for klass in cls.__mro__:
            if name in klass.__dict__:
                if callable(klass.__dict__[name]) and not isinstance(klass.__dict__[name], type):
                    out.append(name)
                break
    return out


def _read(name: str, doc: str) -> property:
    """A read-only attribute of the implementation, as a property of ``KVCacheManager``.

    NOTE: the getter is ``operator.attrgetter`` (C): a read costs no Python frame
    (forwarding through ``__getattr__`` would cost one per read)."""
    return property(attrgetter("_impl." + name), doc=doc)


class KVCacheManager:
    """The one KV cache manager: allocates KV cache blocks to requests and reuses
    cached prefixes, for every index, group layout, eviction policy and tier.

        blocks, num_hit = manager.get_computed_blocks(request)   # KVCacheBlocks, int
        new = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks)
        if new is None: ...             # does not fit; nothing changed
        request.num_computed_tokens = request.num_tokens   # the scheduler advances it
        manager.allocate_slots(request, 1)                  # each decode step
        manager.free(request)

    ``get_computed_blocks`` and ``allocate_slots`` answer ``KVCacheBlocks`` (one list
    of blocks per KV cache group: ``result.blocks[g]``; see ``kv_cache_blocks``) in
    every configuration.

    Construction resolves the implementation once (``indexes.resolve_manager_class``:
    the one rule that refuses a combination, with its reason): ``HashKVCacheManager``
    (hash index, one full-attention group; the keyword arguments are documented
    there), ``radix.RadixKVCacheManager`` (``index="radix"``),
    ``hybrid.HybridKVCacheManager`` (other group layouts) or
    ``radix_hybrid.RadixHybridKVCacheManager`` (the radix index with other layouts).
    Every public method and attribute of those is defined on this class (a test pins
    it); ``implementation`` is the object below, for inspection.

    NOTE (how a call reaches the implementation): the methods below are real,
    documented methods that call the implementation's, and ``__init__`` also binds
    the implementation's bound methods onto this object, where they shadow the class's
    (functions are non-data descriptors). So ``manager.allocate_slots(...)`` is the
    implementation's own method, no extra Python frame per call -- the engine and the
    replay call ``allocate_slots`` / ``get_computed_blocks`` every step, and a frame
    costs ~600-1000 instructions under 3.11 -- while ``help(KVCacheManager)`` and
    ``KVCacheManager.allocate_slots(manager, ...)`` see the class's. Attributes
    (``_ATTRIBUTES``, below the class) are read-only properties with a C getter
    (``operator.attrgetter``); there is no ``__getattr__``. An index class of a
    user's own may add public methods: they are bound too (``manager.my_method``);
    its other attributes are read through ``implementation``.

    Args:
        num_blocks, block_size: the pool (positional or keyword).
        index: a registered index name (``indexes.INDEXES``: ``"hash"``, ``"radix"``)
            or an index class of the user's own (``indexes.check_index_class``).
        kv_cache_groups: the model's KV cache groups (``kv_groups``); ``None``: one
            full-attention group.
        eviction: the eviction policy's name (``eviction.POLICIES``) or class.
        num_host_blocks: host-memory tier slots (0: no tier).
        **kwargs: ``enable_caching``, ``hash_algo``, ``hash_seed``, ``free_order``,
            ``log_stats``, ``enable_events``, ``max_model_len``, ``int_event_hashes``,
            ``eviction_options``, ``host_eviction``, ``host_eviction_options``, and the
            tiers below the host: ``disk_bytes``, ``disk_eviction``,
            ``disk_eviction_options``, ``page_bytes``, ``remote_bytes``,
            ``remote_eviction``, ``remote``, ``tiers`` (see ``HashKVCacheManager``).
    """

    def __init__(self, num_blocks: int, block_size: int, *, index: str | type = DEFAULT_INDEX,
                 kv_cache_groups=None, eviction: str | type = DEFAULT_POLICY,
                 num_host_blocks: int = 0, **kwargs):
        cls = resolve_manager_class(index, kv_cache_groups, eviction, num_host_blocks)
        if lower_tiers_requested(kwargs):
            _check_lower_tiers_served(cls)
        impl = cls(num_blocks, block_size, index=index, kv_cache_groups=kv_cache_groups,
                   eviction=eviction, num_host_blocks=num_host_blocks, **kwargs)
        self._impl = impl
        # The one fast path (the class NOTE): the implementation's bound methods as
        # instance attributes (instance-level overrides of the implementation included).
        d = self.__dict__
        for name in _public_methods(cls):
            d[name] = getattr(impl, name)

    @property
    def implementation(self):
        """The implementation object below (``HashKVCacheManager``,
        ``RadixKVCacheManager``, ``HybridKVCacheManager`` or
        ``RadixHybridKVCacheManager``, or a user's index class): for inspection."""
        return self._impl

    @classmethod
    def from_config(cls, cfg) -> "KVCacheManager":
        """A manager from a ``CacheConfig`` (``cfg.manager_kwargs()``: this
        constructor's keywords)."""
        return cls(**cfg.manager_kwargs())

    def __repr__(self) -> str:
        impl = self._impl
        return f"KVCacheManager({type(impl).__name__}: " + ", ".join(
            f"{k}={getattr(impl, k, None)!r}"
            for k in ("num_blocks", "block_size", "index", "eviction", "num_groups",
                      "num_host_blocks")) + ")"

    # ------------------------------------------------------------- scheduling
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of ``request`` valid for every KV cache group.

        Changes no block state (no ref counts, locks or queue order); only the lookup
        counters. With a host tier, blocks found there appear as ``HostHit``
        placeholders that ``allocate_slots`` loads.

        Args:
            request: a ``Request`` not yet holding blocks.

        Returns:
            ``(blocks, num_computed_tokens)``: the hit blocks per group and the hit
            tokens (a multiple of ``block_size``, at most ``request.num_tokens - 1``).
        """
        impl = self._impl
        if type(request) is not Request:
            _check_request(request)
        if not impl.enable_caching:
            return impl._empty_hit, 0
        blocks, num_hit = impl.find_longest_cache_hit(request)
        impl.num_lookups += 1
        impl.num_lookup_tokens += request.num_tokens
        impl.num_hit_tokens += num_hit
        # NOTE: the prefix-cache stats record admissions, not lookups (allocate_slots),
        # as vLLM 0.33's scheduler does: a lookup retried because the request did not
        # fit yet counts once there.
        r = _new(impl._hit_blocks_class)
        r.blocks = blocks
        return r, num_hit

    def find_longest_cache_hit(self, request: Request) -> tuple[tuple[list, ...], int]:
        """The index's answer below ``get_computed_blocks``: ``(hit blocks per group,
        hit tokens)``, counting no lookup (vLLM's coordinator
        ``find_longest_cache_hit``). The protocol an index class provides."""
        return self._impl.find_longest_cache_hit(request)

    def peek_computed_tokens(self, request: Request) -> int:
        """The prefix-hit tokens ``get_computed_blocks`` would return now; counts no
        lookup and changes nothing (a scheduler ordering its waiting queue by cached
        prefix calls it for every waiting request, every step)."""
        impl = self._impl
        if type(request) is not Request:
            _check_request(request)
        if not impl.enable_caching:
            return 0
        return impl.find_longest_cache_hit(request)[1]

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | Sequence[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Give ``request`` slots for ``num_new_tokens`` more tokens.

        For a new request, ``new_computed_blocks`` / ``num_new_computed_tokens`` are
        the prefix hit ``get_computed_blocks`` returned: those blocks start its block
        tables. New blocks come from the free blocks (evicting cached ones); every
        block full after this step is cached at once, so later requests of the same
        batch can hit it.

        Args:
            request: the request (``request.num_computed_tokens`` tokens already have
                KV; the caller advances it after the step).
            num_new_tokens: tokens to compute in this step (>= 0).
            num_new_computed_tokens: prefix-hit tokens (new requests only).
            new_computed_blocks: the prefix-hit blocks (new requests only): the
                ``KVCacheBlocks`` from ``get_computed_blocks`` (its legacy plain list
                of one group's blocks is accepted too).
            num_lookahead_tokens: extra slots to reserve (speculative tokens).

        Returns:
            The newly allocated blocks per group (possibly empty), or ``None`` when
            the free blocks do not suffice -- in which case nothing changed.

        Raises:
            ValueError / TypeError: bad counts, hit blocks that are not this
                request's prefix hit, hit blocks for a running request, a sequence
                beyond ``max_model_len``. Nothing changed.
        """
        return self._impl.allocate_slots(request, num_new_tokens, num_new_computed_tokens,
                                         new_computed_blocks, num_lookahead_tokens)

    def prefill_chunks(self, request: Request, num_computed_tokens: int) -> list[int]:
        """The chunk sizes a scheduler splits the rest of ``request``'s prompt into,
        from ``num_computed_tokens`` (the hit ``get_computed_blocks`` just returned).

        A layout with state-space groups stops chunks at checkpoint positions (vLLM's
        block-aligned split, ``HybridKVCacheManager.prefill_chunks``); every other
        configuration takes the rest at once: one chunk. Changes no block state.
        """
        split = getattr(self._impl, "prefill_chunks", None)
        if split is not None:
            return split(request, num_computed_tokens)
        if type(request) is not Request:
            _check_request(request)
        n = request.num_tokens
        if type(num_computed_tokens) is not int or not 0 <= num_computed_tokens < n:
            raise ValueError(
                f"num_computed_tokens must be an int in [0, {n}) for request "
                f"{request.request_id!r}, got {num_computed_tokens!r}")
        return [n - num_computed_tokens]

    def free(self, request: Request) -> None:
        """Release a request's blocks (its last block evicts first); cached blocks
        stay in the cache until evicted. ``request``: the admitted ``Request`` or its
        id; one that holds no blocks -> ``ValueError``."""
        return self._impl.free(request)

    # ----------------------------------------------------------- block tables
    def get_block_ids(self, request_id: str) -> list[int] | tuple[list[int], ...]:
        """The request's block table as block ids: one list (one full-attention
        group) or one list per group (other layouts; null slots are
        ``null_block_id``). Unknown id -> ``ValueError``."""
        return self._impl.get_block_ids(request_id)

    def get_blocks(self, request_id: str) -> list[KVCacheBlock] | tuple[list[KVCacheBlock], ...]:
        """The request's block objects (copies of the lists), shaped as
        ``get_block_ids``. Unknown id -> ``ValueError``."""
        return self._impl.get_blocks(request_id)

    def num_held_blocks(self, request_id: str) -> tuple[int, ...]:
        """Real (non-null) blocks the request holds, per group. Unknown id ->
        ``ValueError``."""
        held = getattr(self._impl, "num_held_blocks", None)
        if held is not None:
            return held(request_id)
        return (len(self._impl.get_blocks(request_id)),)  # one group: no null slots

    def free_block_ids(self) -> list[int]:
        """The free queue as block ids, head (reused next) first."""
        return self._impl.free_block_ids()

    def cached_block_ids(self) -> list[int]:
        """Ids of all blocks currently cached (held or free), ascending."""
        return self._impl.cached_block_ids()

    def num_stranded_blocks(self) -> int:
        """Cached blocks no lookup can reach (an earlier block of their chain is not
        cached). O(cached blocks): for summaries, not per step."""
        return self._impl.num_stranded_blocks()

    # ------------------------------------------------- policies' trace hooks
    def on_arrival(self, request: Request, index: int) -> None:
        """Trace request number ``index`` arrives (before its first lookup): the
        offline ``belady`` policy advances its next uses; a no-op otherwise."""
        return self._impl.on_arrival(request, index)

    def on_waiting(self, request_id: str, block_hashes: Sequence[bytes]) -> None:
        """``request_id`` joined the waiting queue with the prompt block hashes it can
        hit. A policy that reads the waiting queue (``queue_aware``) keeps the cached
        blocks it will hit until it is admitted or leaves (``drop_waiting``); a no-op
        for every other policy."""
        return self._impl.on_waiting(request_id, block_hashes)

    def drop_waiting(self, request_id: str) -> None:
        """``request_id`` left the waiting queue without being admitted (aborted,
        failed); a no-op unless the policy reads the queue."""
        return self._impl.drop_waiting(request_id)

    def waiting_keys(self, block_hashes: Sequence[bytes]) -> list:
        """The cache keys a waiting request holding the prompt blocks
        ``block_hashes`` would hit, as the cache is now: with one full-attention group
        the block hashes themselves (every prompt block); with other layouts the
        ``(block hash, group id)`` keys of each group's hit
        (``HybridKVCacheManager.waiting_keys``)."""
        keys = getattr(self._impl, "waiting_keys", None)
        if keys is not None:
            return keys(block_hashes)
        return check_block_hash_list(block_hashes)

    # ------------------------------------------------------- cache, events, stats
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after a weight update). ``True`` on
        success; ``False`` (nothing changed) while any block is held."""
        return self._impl.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the queued KV cache events (``[]`` when disabled)."""
        return self._impl.take_events()

    def take_host_transfers(self) -> list:
        """Return and clear the page copies between the tiers (``HostTransfer``)
        recorded since the last call, in order (``[]`` without a host tier)."""
        return self._impl.take_host_transfers()

    def take_tier_transfers(self) -> list:
        """``take_host_transfers``: the same list, every tier's copies in order
        (``HostTransfer`` device <-> host, ``TierTransfer`` for the tiers below)."""
        return self._impl.take_tier_transfers()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the stats since the last call and start a new interval (``None``
        when ``log_stats`` is off)."""
        return self._impl.make_prefix_cache_stats()

    def counters(self) -> dict[str, int]:
        """Cumulative counters since construction (never reset): lookups, hit
        tokens, evictions, blocks cached and allocated, failed allocations."""
        return self._impl.counters()

    def check_invariants(self) -> None:
        """Verify the index, pool and request bookkeeping; raise ``InvariantError``
        if broken."""
        return self._impl.check_invariants()


# The implementation's attributes, read-only on KVCacheManager (name -> what help()
# says; the implementation's own docstrings say more). An attribute the implementation
# lacks (the radix index has no ``block_pool``) raises AttributeError on read.
_ATTRIBUTES = MappingProxyType({
    "num_blocks": "Allocatable blocks (ids 0 .. num_blocks - 1).",
    "block_size": "Tokens per block.",
    "enable_caching": "Prefix caching on.",
    "enable_events": "KV cache events are queued for take_events.",
    "log_stats": "PrefixCacheStats are collected.",
    "free_order": "Where freed never-cached blocks go in the free queue.",
    "max_model_len": "Longest allowed sequence (None: no limit).",
    "hasher": "The BlockHasher requests are bound to.",
    "hash_algo": "The hash algorithm's name.",
    "index": "The prefix index's name.",
    "eviction": "The eviction policy's name.",
    "policy": "The EvictionPolicy object (None: the LRU fast path).",
    "kv_cache_groups": "The KV cache group layout.",
    "num_groups": "Number of KV cache groups.",
    "block_pool": ("The BlockPool (ids, ref counts, free queue, events, counters: "
                   "num_blocks_cached, num_blocks_allocated, evicted_by)."),
    "blocks": "Every KVCacheBlock by id (radix index only).",
    "null_block": "The padding block of null slots (group layouts only).",
    "null_block_id": "The id of null slots in get_block_ids (group layouts only).",
    "running_request_ids": "Ids of the requests holding blocks, in allocation order.",
    "num_free_blocks": "Blocks in the free queue now.",
    "num_available_blocks": ("Blocks an allocation may take now (radix index: free + "
                             "unlocked nodes)."),
    "usage": "Fraction of blocks held by requests (0.0 .. 1.0).",
    "num_cached_blocks": "Blocks in the cache now (held or free).",
    "num_nodes": "Nodes in the tree (radix index with group layouts).",
    "num_evictions": "Cached blocks evicted, cumulative.",
    "num_lookups": "Lookups (get_computed_blocks calls), cumulative.",
    "num_lookup_tokens": "Tokens looked up, cumulative.",
    "num_hit_tokens": "Prefix-hit tokens of lookups, cumulative.",
    "num_failed_allocations": "allocate_slots calls answered None, cumulative.",
    "prefix_cache_stats": ("The current interval's PrefixCacheStats (None without "
                           "log_stats)."),
    "evicted_group": "Miss accounting's per-group eviction record (radix group layouts).",
    "device_hit_tokens": "Prefix-hit tokens adopted from the device, cumulative.",
    "host_hit_tokens": "Prefix-hit tokens loaded from the host tier, cumulative.",
    "host_tier": "The host tier (None without one).",
    "num_host_blocks": "Host tier slots (0: no tier).",
    "host_eviction": "The host tier's eviction policy's name.",
    "num_host_cached_blocks": "Hashes held in the host tier now (0 without one).",
    "host_blocks_loaded": "Host entries promoted into device blocks, cumulative.",
    "host_blocks_stored": "Device blocks demoted into host slots, cumulative.",
    "tier_chain": "The tiers below the host (tiers.TierChain; None without any).",
    "hit_tokens_by_tier": ("Prefix-hit tokens adopted at admission by tier (device, host, "
                           "disk, remote, ...), cumulative."),
})
for _name, _doc in _ATTRIBUTES.items():
    setattr(KVCacheManager, _name, _read(_name, _doc))
del _name, _doc
