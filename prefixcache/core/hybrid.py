"""KV cache manager for sliding-window, state-space and hybrid models (vLLM 0.33's
``HybridKVCacheCoordinator``).

``KVCacheManager(num_blocks, block_size, kv_cache_groups=groups)`` builds this class
when the layout is anything but one full-attention group (``prefixcache.core.kv_groups``);
a single full-attention group keeps the default ``KVCacheManager``, untouched.

This class is the coordinator: the scheduler-facing API, the shared pool, the
per-request tables and the alignment of hits across groups (``_lookup_hit``, vLLM's
fixed-point ``find_longest_cache_hit``). Everything that depends on a group's kind --
its longest hit, its skipped tokens and their release to the null block, the blocks a
step needs, the decode fast path's bound, its null-slot invariant -- is a call on the
group's single-type manager (``prefixcache.core.groups``, one per group, built from
``kv_groups.GROUP_KINDS``); there is no per-kind branch here.

One block table per KV cache group, one shared block pool, blocks cached under
``(block hash, group id)`` keys (vLLM's ``BlockHashWithGroupId``: the digest followed
by the group id as 4 big-endian bytes). The calls, counts, caching points and free
order follow vLLM 0.33's ``KVCacheManager.allocate_slots`` /
``HybridKVCacheCoordinator`` (``UnitaryKVCacheCoordinator`` for one group) /
``FullAttentionManager`` / ``SlidingWindowManager`` / ``BlockPool`` for the
configuration our replay drives (one block size for every group, hash block = block,
no EAGLE, no KV connector, dense retention); see ``tests/core/test_hybrid_manager.py``
and the hybrid replay goldens.

NOTE: not modelled, and why it does not change the replay: vLLM's
``full_sequence_must_fit`` pre-check (for a new request given its whole prompt it is the
same count as the main check; its per-request cap ``max_admission_blocks_per_request``
is ``ceil(max_model_len / block_size) + 1`` with the manager's default
``max_in_flight_tokens = max_model_len``, never below the prompt's blocks),
``num_in_flight_tokens`` (0 in a synchronous step), partial-block hash hits (off
unless Mamba groups hash finer than a block), EAGLE drops, external (connector) tokens,
sparse retention. With a state-space group the pre-check IS modelled (a prefill is then
split, ``prefill_chunks``, so its first chunk is not the whole sequence).

    blocks, num_hit = manager.get_computed_blocks(request)     # one list per group
    new = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks)
    if new is None: ...                 # does not fit (see NOTE on allocate_slots)
    manager.get_block_ids(request.request_id)   # ([ids of group 0], [ids of group 1], ...)

Host tier (``num_host_blocks=N``; full-attention, sliding-window and state-space groups,
``indexes.TIER_GROUP_KINDS``). The pool (``BlockPool`` with the tier attached)
demotes each evicted
``(hash, group)`` key to a ``host_tier.GroupHostTier`` (one slot = one block of one
group) and drops a host copy when the device caches the key again; each group's
single-type manager counts a host entry of its group as a hit (a ``HostHit`` in its
hit list; the fixed-point alignment ``_lookup_hit`` is unchanged), and admission
(``_promote_host_hits``) loads the host hits the groups keep into fresh device blocks
(``GroupHostTransfer("load", ..., group)``) after touching the device hits, exactly as
the one-group manager does. ``device_hit_tokens`` / ``host_hit_tokens`` split each
admitted hit by block position (a position loaded in any group is a host hit).

Tiers below the host (``disk_bytes``, ``remote_bytes`` / ``remote``, ``tiers``; any layout
the host tier serves). The host tier's chain (``tiers.TierChain``) holds the same
``(hash, group)`` keys: a key the host evicts is demoted down it, each group's lookup
falls through device -> host -> the chain (a ``TierHit``), admission loads the tier hits
with the host hits (pinned first, ``TierTransfer`` naming the group) and the device
caching a key drops the exclusive tiers' copies. ``hit_tokens_by_tier`` attributes each
admitted block position to the slowest tier any group loaded it from (host before
disk before remote), device if none did; they sum to the hit.

Null slots. A sliding-window table slot whose block fell wholly before the window
(or was skipped by a prefix hit) holds ``manager.null_block``, whose ``block_id`` is
``num_blocks``: the metadata builder's padding page (``MetadataBuilder(num_blocks=...)``
pads with page ``num_blocks``). It plays vLLM's null block (vLLM reserves block 0 for
it and numbers real blocks 1..N-1; ours are 0..N-1 with the null one past the end, so
vLLM id ``k > 0`` is our ``k - 1`` and vLLM's ``0`` is our ``num_blocks``). It is
never in the pool, the free queue or the hash map, and its ``ref_cnt`` is not kept.
The kernels mask keys before the window, so the padding page is never attended.
"""

from __future__ import annotations

from typing import Sequence

from prefixcache._validate import ArgumentTypeError, check_arrival
from prefixcache.core.block_pool import BlockPool, InvariantError, KVCacheBlock

from prefixcache.core.eviction import DEFAULT_POLICY, get_policy_class, make_policy
from prefixcache.core.eviction.base import WaitingFanout
from prefixcache.core.hashing import BlockHasher
from prefixcache.core.tiers.base import TierHit
from prefixcache.core.tiers.host import (
    GroupHostTier,
    HostHit,
    HostTierAPI,
    check_tier_args,
    make_host_tier,
)
from prefixcache.core.indexes import check_implementation
from prefixcache.core.kv_cache_manager import (
    _build_lower_tiers,
    manager_options,
    BlockPoolViews,
    _admission_checks,
    _check_request,
    _check_sizes,
    _init_lookup_counters,
    _make_prefix_cache_stats,
    _hash_eviction_options,
    _held_states,
    _pop_held_state,
    _store_settings,
)
from prefixcache.core.groups.base import (
    _KEY_BYTES,
    SingleTypeManager,
    check_block_hash_list,
    check_group_hits,
)
from prefixcache.core.groups.base import group_suffix as _group_suffix
from prefixcache.core.kv_groups import (
    check_kv_cache_groups,
    spec_manager_class,
    lookup_groups,
)
from prefixcache.core.request import Request
from prefixcache.core.kv_cache_blocks import KVCacheBlocks, PerGroupKVCacheBlocks, empty_blocks

_new = object.__new__


def _overrides(kind, name: str) -> bool:
    """Whether ``kind``'s class overrides ``SingleTypeManager.<name>``."""
    return getattr(type(kind), name) is not getattr(SingleTypeManager, name)


class _HybridState:
    """A running request's tables.

    Attributes:
        tables: ``tables[g]`` is group g's block table (null slots included; all
            tables have the same length).
        num_cached: ``num_cached[g]``, group g's leading slots already cached (or null).
        num_null: ``num_null[g]``, the length of group g's leading run of null slots.
        idle_until / idle_nc: the decode fast path's bounds: a step with
            ``num_computed_tokens + num_new_tokens <= idle_until`` and
            ``num_computed_tokens <= idle_nc`` needs no block, caches none and
            releases none -- nothing to do. Set after every allocation.
    """

    __slots__ = ("request", "tables", "num_cached", "num_null", "idle_until", "idle_nc")

    def __init__(self, request, tables, num_cached, num_null):
        self.request = request
        self.tables = tables
        self.num_cached = num_cached
        self.num_null = num_null
        self.idle_until = -1
        self.idle_nc = -1


def is_idle_step(st, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                 num_lookahead_tokens) -> bool:
    """The multi-group managers' decode fast path (hash and radix index): a step of the
    running request of state ``st`` that needs no block, caches none and releases none
    (``st.idle_until`` / ``st.idle_nc``, set after every allocation). Odd types, hits
    and lookahead answer False (the checked path)."""
    nc = st.request.num_computed_tokens
    return (
        type(nc) is int and nc >= 0
        and type(num_new_tokens) is int and num_new_tokens > 0
        and not num_new_computed_tokens and not new_computed_blocks
        and not num_lookahead_tokens
        and nc + num_new_tokens <= st.idle_until and nc <= st.idle_nc
    )


class HybridKVCacheManager(HostTierAPI, BlockPoolViews):
    """Block tables per KV cache group over one shared pool (vLLM's hybrid manager).

    Invariants (``check_invariants``):
        * Each block's ``ref_cnt`` equals the number of table slots (over all running
          requests and groups) that hold it; ``ref_cnt == 0`` blocks are exactly the
          free queue. A block sits in at most one group's tables.
        * Null slots (``null_block``, id ``num_blocks``) follow each group kind's
          rule (``SingleTypeManager.check_slots``): none in full attention, a
          leading run in a sliding window, all but the running state block and the
          previous step's in a state-space group.
        * A request's first ``num_cached[g]`` non-null slots of group g are cached
          under ``hash + group id``; its later blocks hold no key.
        * A sliding-window table holds, after each ``allocate_slots``, real blocks
          only from the first block overlapping the window of the next token on
          (the rest are null): at most ``ceil(W / block_size) + 1`` in decode (a
          prefill allocates all of its chunk first). Checked by the property test:
          ``num_computed_tokens`` moves on after the call, so not here.
        * With a host tier: a ``(hash, group)`` key is cached on the device or held
          on the host, never both; every host entry is a key of a group that caches
          blocks; no host entry is pinned between calls; each pending transfer names
          one group (``HostTier.check_invariants`` + ``_check_host_invariants``).
        * A call that raises changes no state. NOTE: one that returns ``None`` may
          have released a running request's blocks that fell before its window, as
          vLLM does ("we can do this even if we cannot schedule this request") --
          the free queue order that follows is vLLM's, so block ids stay equal.

    Args:
        num_blocks, block_size, enable_caching, hash_algo, hash_seed, free_order,
        log_stats, enable_events, max_model_len, int_event_hashes: as
            ``KVCacheManager`` (``free_order="unhashed_first"`` is vLLM's order).
        kv_cache_groups: the layout (``kv_groups.KVCacheGroup`` list).
        eviction, eviction_options: any registered policy (``"lru"`` keeps vLLM's
            free queue; others run through the policy pool); index: only ``"hash"``
            (others raise ``ValueError``).
        num_host_blocks, host_eviction, host_eviction_options: the per-group host tier
            (as ``KVCacheManager``'s; the group kinds of ``indexes.TIER_GROUP_KINDS``,
            ``indexes.refusal``).
        disk_bytes, disk_eviction, disk_eviction_options, page_bytes, remote_bytes,
            remote_eviction, remote, tiers: the tiers below the host, per group key
            (as ``HashKVCacheManager``'s; they need a host tier).

    Attributes:
        kv_cache_groups: the checked groups (tuple); ``num_groups``.
        null_block: the null slot's block (``block_id == num_blocks``).
    """

    def __init__(self, num_blocks: int, block_size: int, **options):
        (enable_caching, hash_algo, hash_seed, free_order, log_stats, enable_events,
         max_model_len, int_event_hashes, eviction, eviction_options, index,
         kv_cache_groups, num_host_blocks, host_eviction, host_eviction_options,
         lower_tiers) = manager_options(self, options, lower_tiers=True)
        groups = check_kv_cache_groups(kv_cache_groups)
        num_host_blocks, host_options = check_tier_args(
            num_host_blocks, host_eviction, host_eviction_options, enable_caching)
        # (free_order: BlockPool checks it, after the policy's checks)
        num_blocks, block_size, max_model_len = _check_sizes(
            num_blocks, block_size, max_model_len)
        options = _hash_eviction_options(eviction_options)
        policy_cls = get_policy_class(eviction)  # unknown name -> ValueError
        if policy_cls.needs_future and options.get("future") is None:
            raise ValueError(
                f"{eviction} needs the trace's future: run it through the replay "
                f"(prefixcache.sim.replay.replay(..., eviction={eviction!r}))")
        # The one rule (indexes.check_implementation): the hash index's layout class,
        # or the LAYOUT_CLASS an index class declares (a subclass of this one).
        index = check_implementation(self, index, groups, eviction, num_host_blocks)
        self.hasher = BlockHasher(hash_algo, hash_seed)  # unknown algo -> ValueError
        # The tiers below the host (disk, remote, a user's), built before any state.
        lower = _build_lower_tiers(self, lower_tiers, num_host_blocks, block_size)
        self.kv_cache_groups = groups
        self.num_groups = len(groups)
        # NOTE: "lru" keeps vLLM's intrusive free queue (policy None, the goldens'
        # order); any other policy (or lru options) is the pool's component.
        policy = None
        if eviction != DEFAULT_POLICY or options:
            policy = make_policy(eviction, num_blocks=num_blocks, block_size=block_size,
                                 **options)
        # The per-group host tier (``GroupHostTier``: one slot = one block of one
        # group), built before any state (a bad host policy option raises here).
        host_tier = make_host_tier(num_host_blocks, host_eviction, host_options,
                                   block_size=block_size, num_device_blocks=num_blocks,
                                   enable_events=enable_events, tier_class=GroupHostTier)
        if policy is not None and policy.needs_groups:
            policy.set_groups(groups)  # (before any block is cached)
        self.eviction = eviction
        self.index = index
        self.policy = policy
        # A policy that reads the waiting queue (queue_aware): the per-group waiting
        # hooks (on_waiting) feed it; admission drops the request. None otherwise.
        self._waiting_policy = policy if policy is not None and policy.needs_waiting else None
        _store_settings(self, num_blocks, block_size, enable_caching, free_order, log_stats,
                        enable_events, max_model_len)
        pool_kwargs = dict(
            groups=groups, enable_caching=self.enable_caching,
            enable_events=self.enable_events, free_order=free_order,
            int_event_hashes=int_event_hashes)  # bad free_order -> ValueError
        self.block_pool = BlockPool(num_blocks, policy=policy, **pool_kwargs)
        if host_tier is not None:
            pool = self.block_pool
            pool.attach_tier(host_tier)
            if lower:  # (the same (hash, group) keys: TierChain(group_bytes=4))
                host_tier.attach_lower(lower, events_owner=pool if self.enable_events else None,
                                       event_hash=pool._event_hash, block_size=block_size,
                                       layout=groups)
            self.host_eviction = host_eviction
            # Hit tokens adopted at admission, by tier (``_promote_host_hits``).
            self.device_hit_tokens = 0
            self.host_hit_tokens = 0
            self._lower_hit_tokens = {t.name: 0 for t in lower}
        self.host_tier = host_tier
        self.num_host_blocks = num_host_blocks
        host_policy = host_tier.policy if host_tier is not None else None
        if host_policy is not None and host_policy.needs_waiting:
            # The host tier's policy reads the queue too (queue_aware), keyed as the
            # device policy by (block hash, group id): one fan-out feeds both.
            self._waiting_policy = WaitingFanout(self._waiting_policy, host_policy)
        self.null_block = self.block_pool.null_block
        self._suffix = [_group_suffix(g) for g in range(self.num_groups)]
        # One single-type manager per group (kv_groups.GROUP_KINDS): every per-kind
        # rule below is a call on ``self._kinds[g]``.
        self._kinds = [spec_manager_class(g.spec)(g.spec, i, self)
                       for i, g in enumerate(groups)]
        # vLLM's SpecGroups: (the first group's manager, the group ids), full first.
        self._lookup = [(self._kinds[ids[0]], ids) for _, ids in lookup_groups(groups)]
        self._no_lookahead = [k for k in self._kinds if not k.supports_lookahead]
        self._aligned = [k for k in self._kinds if k.aligned_prefill]
        # NOTE: the step's hot loops call a kind only where it overrides the base
        # (full attention's) rule; the base rules are inlined below (same result).
        self._releasing = [k.remove_skipped_blocks for k in self._kinds
                           if _overrides(k, "remove_skipped_blocks")]
        self._limits = [k.idle_limit for k in self._kinds if _overrides(k, "idle_limit")]
        self._own_counts = any(_overrides(k, "blocks_to_allocate") for k in self._kinds)
        self._own_allocs = [k if _overrides(k, "allocate_new_blocks") else None
                            for k in self._kinds]
        self._caching = [k.caches_blocks for k in self._kinds]
        self._own_caches = [k if _overrides(k, "cache_blocks") else None for k in self._kinds]
        # NOTE: what the decode fast path returns: immutable, shared (no allocation).
        self._no_new_blocks = empty_blocks(len(groups), per_group=True)
        self._empty_hit = self._no_new_blocks  # what a lookup answers with caching off
        self._hit_blocks_class = PerGroupKVCacheBlocks  # what get_computed_blocks wraps
        self._states: dict[str, _HybridState] = {}
        self._states_by_request: dict = {}  # the same states keyed by Request object
        _init_lookup_counters(self)

    @property
    def hash_algo(self) -> str:
        return self.hasher.algo

    @property
    def null_block_id(self) -> int:
        """The id of null slots in ``get_block_ids`` (the padding page, ``num_blocks``)."""
        return self.num_blocks

    # ---------------------------------------------------------------- lookups
    def _longest_hit(self, request) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """vLLM's coordinator ``find_longest_cache_hit`` (hit <= num_tokens - 1)."""
        return self._lookup_hit(request)[:2]

    def _lookup_hit(self, request):
        """``(blocks per group, hit tokens, longest single-spec hit)``; the last is
        vLLM's ``hit_length + num_uncached_common_prefix_tokens``."""
        request.bind_hasher(self.hasher, self.block_size)
        return self._hit_of_hashes(request.block_hashes, request.num_tokens - 1)

    def _hit_of_hashes(self, hashes, max_len: int):
        """``_lookup_hit`` of a prompt given by its block hashes, at most ``max_len``
        hit tokens."""
        n_groups = self.num_groups
        suffixes = self._suffix
        if n_groups == 1:  # UnitaryKVCacheCoordinator: one search
            kind, ids = self._lookup[0]
            blocks, hit = kind.find_longest_cache_hit(hashes, max_len, ids, suffixes)
            return (blocks[0],), hit, hit
        # HybridKVCacheCoordinator: each spec accepts the candidate length or lowers
        # it; repeat until none lowers it (one pass for full + one other spec).
        lookup = self._lookup
        simple = len(lookup) == 2 and lookup[0][0].downward_closed
        hit_length = max_len
        longest = 0
        by_group: list[list[KVCacheBlock] | None] = [None] * n_groups
        len_by_group = [0] * n_groups
        while True:
            curr = hit_length
            for kind, ids in lookup:
                if kind.downward_closed and by_group[ids[0]] is not None:
                    # Downward-closed: looked up once, trimmed to the final length.
                    if len_by_group[ids[0]] < curr:
                        curr = len_by_group[ids[0]]
                    continue
                blocks, curr = kind.find_longest_cache_hit(hashes, curr, ids, suffixes)
                for g, b in zip(ids, blocks):
                    by_group[g] = b
                    len_by_group[g] = curr
                if curr > longest:
                    longest = curr
            if curr >= hit_length:
                break
            hit_length = curr
            if simple:
                break
        num_blocks = -(-hit_length // self.block_size)
        for kind, ids in lookup:
            if kind.downward_closed:
                for g in ids:
                    del by_group[g][num_blocks:]
        return tuple(b if b is not None else [] for b in by_group), hit_length, longest

    def find_longest_cache_hit(self, request: Request) -> tuple[tuple[list, ...], int]:
        """The longest prefix hit valid for every group, as ``(blocks per group,
        num_hit_tokens)``: ``blocks[g]`` is group g's hit slots
        (``num_hit_tokens // block_size`` of them; a sliding-window group's slots
        before its window are ``null_block``). Changes nothing, counts nothing."""
        return self._longest_hit(request)

    def prefill_chunks(self, request, num_computed_tokens: int) -> list[int]:
        """The chunk sizes a scheduler splits the rest of ``request``'s prompt into,
        from ``num_computed_tokens`` (the hit ``get_computed_blocks`` just returned):
        vLLM's ``Scheduler._mamba_block_aligned_split``, each chunk ending at the
        earliest stop any group kind asks for (``SingleTypeManager.prefill_stops``:
        a state-space group stops at the prompt's last block boundary and at the
        junction, the longest single-group hit). One chunk when no kind asks.

        Call it before ``allocate_slots`` (the junction is read from the cache as it
        is then); it changes no block state (a kind that keeps a state at the
        junction notes it: ``SingleTypeManager.note_junction``).
        """
        if type(request) is not Request:
            _check_request(request)
        n = request.num_tokens
        if (type(num_computed_tokens) is not int or not 0 <= num_computed_tokens < n):
            raise ValueError(
                f"num_computed_tokens must be an int in [0, {n}) for request "
                f"{request.request_id!r}, got {num_computed_tokens!r}")
        if not self._aligned:
            return [n - num_computed_tokens]
        junction = 0
        if self.enable_caching:
            _, hit, longest = self._lookup_hit(request)
            if longest > hit:
                junction = longest
        for k in self._aligned:
            k.note_junction(request, junction)
        bs = self.block_size
        chunks = []
        start = num_computed_tokens
        while start < n:
            stops = [(start // bs + 1) * bs] if start % bs else []
            for k in self._aligned:
                stops.extend(k.prefill_stops(request, start, junction))
            end = min((s for s in stops if start < s < n), default=n)
            chunks.append(end - start)
            start = end
        return chunks

    # ------------------------------------------------------------- allocation
    def _check_hit_blocks(self, new_computed_blocks):
        """The per-group hit lists as a list of lists (validated), or None."""
        if new_computed_blocks is None:
            return None
        if not isinstance(new_computed_blocks, (tuple, list)) or len(new_computed_blocks) != (
                self.num_groups):
            raise ArgumentTypeError(
                f"new_computed_blocks must be the tuple of {self.num_groups} per-group block "
                f"lists get_computed_blocks returned, got {new_computed_blocks!r}")
        out = []
        null = self.null_block
        kinds = self._kinds
        is_cached = self._is_cached_hit
        is_host_hit = ((HostHit, TierHit), self._is_host_hit) if self.host_tier is not None else None
        for g, blocks in enumerate(new_computed_blocks):
            if not isinstance(blocks, (list, tuple)):
                raise ArgumentTypeError(
                    f"new_computed_blocks[{g}] must be a list of blocks, got "
                    f"{type(blocks).__name__}")
            out.append(check_group_hits(blocks, g, len(out[0]) if out else len(blocks), null,
                                        kinds[g].allows_null_hits, is_cached, is_host_hit))
        return out

    def _is_host_hit(self, b: HostHit | TierHit, g: int) -> bool:
        """``b`` is a current (unpromoted) entry of group ``g`` in this manager's host
        tier (a ``HostHit``) or in a tier below it (a ``TierHit``)."""
        tier = self.host_tier
        key = b.block_hash
        if type(key) is not bytes or key[-_KEY_BYTES:] != self._suffix[g]:
            return False
        if type(b) is TierHit:
            return tier.lower is not None and tier.lower.check_hit(b)
        sid = b.host_slot
        return (b.block_id == -1 and type(sid) is int and 0 <= sid < tier.num_host_blocks
                and tier.hash_to_slot.get(key) is tier.slots[sid])

    def _is_cached_hit(self, b: KVCacheBlock, g: int) -> bool:
        """``b`` is this manager's block, cached under group ``g``'s keys."""
        bid = b.block_id
        return (b.block_hash is not None and 0 <= bid < self.num_blocks
                and self.block_pool.blocks[bid] is b
                and b.block_hash[-_KEY_BYTES:] == self._suffix[g])

    def _check_hit_positions(self, request, hits) -> None:
        """Raise unless each group's hit slot #i holds the request's block #i (as
        ``check_invariants`` requires): a list reordered, cut in front or duplicated
        is refused before any change."""
        request.bind_hasher(self.hasher, self.block_size)
        hashes = request.block_hashes
        null = self.null_block
        for g, blocks in enumerate(hits):
            if not self._kinds[g].caches_blocks:
                continue
            suffix = self._suffix[g]
            for i, b in enumerate(blocks):
                if b is not null and (i >= len(hashes) or b.block_hash != hashes[i] + suffix):
                    raise ValueError(
                        f"new_computed_blocks[{g}] #{i} (block {b.block_id}) is not the cached "
                        f"block #{i} of request {request.request_id!r}'s prefix: pass the "
                        "tuple get_computed_blocks returned for this request, unchanged")

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | Sequence[Sequence[KVCacheBlock]] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Give ``request`` slots for ``num_new_tokens`` more tokens in every group.

        As ``KVCacheManager.allocate_slots``, with per-group hit blocks (the tuple
        ``get_computed_blocks`` returned). Before counting, a running request's
        sliding-window blocks that lie wholly before the window of its next token
        (``num_computed_tokens - W + 1`` tokens) are released and their slots nulled
        (vLLM's ``remove_skipped_blocks``); a new request's hit slots before the
        window become null slots without being touched.

        Returns:
            The newly allocated blocks per group (a tuple with one sequence per group:
            a list, or a shared empty tuple when a step allocates nothing), or
            ``None`` when the free blocks do not suffice (see the class NOTE).

        Raises:
            ValueError / TypeError as ``KVCacheManager.allocate_slots``, or hit blocks
            that are not this manager's per-group hits. Nothing changed.
        """
        try:
            st = self._states_by_request[request]
        except (KeyError, TypeError):
            st = None
        # Fast path: a decode step that needs nothing (most of them). Anything
        # else -- odd types, hits, lookahead -- takes the checked path below.
        # NOTE: ``is_idle_step`` inlined: its frame per decode step was 2.4% of the
        # hybrid replay's instructions (cachegrind).
        if st is not None:
            nc = request.num_computed_tokens
            if (type(nc) is int and type(num_new_tokens) is int and 0 <= nc <= st.idle_nc
                    and 0 < num_new_tokens and nc + num_new_tokens <= st.idle_until
                    and not (num_new_computed_tokens or new_computed_blocks
                             or num_lookahead_tokens)):
                return self._no_new_blocks
        if isinstance(new_computed_blocks, KVCacheBlocks):  # (every group, even one)
            new_computed_blocks = tuple(list(g) for g in new_computed_blocks.blocks)
        hits = self._check_hit_blocks(new_computed_blocks)
        flat = hits[0] if hits is not None else None
        st, computed, total, need, num_new_computed_tokens = _admission_checks(
            self, request, num_new_tokens, num_new_computed_tokens, flat,
            num_lookahead_tokens)
        if flat:
            self._check_hit_positions(request, hits)
        if num_lookahead_tokens and self._no_lookahead:
            raise ValueError(
                f"num_lookahead_tokens={num_lookahead_tokens} with a "
                f"{type(self._no_lookahead[0].spec).__name__} group: lookahead slots are not "
                "modelled for it (vLLM allocates none in its 'align' mode)")
        # --- validated: vLLM's allocate_slots from here on --------------------
        bs = self.block_size
        pool = self.block_pool
        kinds = self._kinds
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        if st is not None:  # vLLM's remove_skipped_blocks (may precede a None)
            for remove_skipped_blocks in self._releasing:
                remove_skipped_blocks(st, num_local_computed)
        num_required = -(-need // bs)
        free_blocks = pool.free_block_queue.num_free_blocks
        if st is None and self._aligned and total < request.num_tokens:
            # vLLM's full_sequence_must_fit (scheduler_reserve_full_isl, its default):
            # a first chunk of a split prefill is admitted only if the whole
            # sequence's blocks would fit too.
            full = request.num_tokens
            if self.max_model_len is not None and self.max_model_len < full:
                full = self.max_model_len
            num_full_required = -(-full // bs)
            if self._num_to_allocate(None, hits, num_full_required,
                                     num_local_computed) > free_blocks:
                self.num_failed_allocations += 1
                return None
        num_alloc = 0
        if st is not None and not self._own_counts:  # (the base rule, inlined)
            for table in st.tables:
                if num_required > len(table):
                    num_alloc += num_required - len(table)
        else:
            num_alloc = self._num_to_allocate(st, hits, num_required, num_local_computed)
        if num_alloc > free_blocks:
            self.num_failed_allocations += 1
            return None
        if st is None:
            tables = []
            num_null = []
            for k in kinds:
                table, skipped = k.add_hit_blocks(
                    request, hits[k.group_id] if hits is not None else None,
                    num_local_computed)
                tables.append(table)
                num_null.append(skipped)
            if self.host_tier is not None:
                self._promote_host_hits(request, tables, num_new_computed_tokens)
            else:
                self.device_hit_tokens += num_new_computed_tokens
            st = _HybridState(request, tables, [len(t) for t in tables], num_null)
            if self._waiting_policy is not None:  # admitted: no longer waiting
                self._waiting_policy.drop_waiting(request.request_id)
            self._states[request.request_id] = st
            self._states_by_request[request] = st
            if self.log_stats and self.enable_caching:
                self.prefix_cache_stats.record(
                    request.num_tokens, num_new_computed_tokens, request.num_preemptions > 0)
        new_blocks = []
        for own, table in zip(self._own_allocs, st.tables):
            if own is not None:
                new_blocks.append(own.allocate_new_blocks(st, num_required))
                continue
            n = num_required - len(table)  # (the base rule, inlined)
            if n > 0:
                got = pool.get_new_blocks(n)
                table.extend(got)
                new_blocks.append(got)
            else:
                new_blocks.append([])
        if self.enable_caching:
            request.bind_hasher(self.hasher, bs)
            hashes = request.block_hashes
            num_full = min(total, request.num_tokens, len(hashes) * bs) // bs
            caching = self._caching
            own_caches = self._own_caches
            for g, table in enumerate(st.tables):
                done = st.num_cached[g]
                if done >= num_full:
                    continue
                if own_caches[g] is not None:
                    own_caches[g].cache_blocks(request, table, hashes, done, num_full)
                elif caching[g]:
                    pool.cache_group_blocks(request, table, hashes, done, num_full, bs, g)
                st.num_cached[g] = num_full
        self._set_idle_bounds(st)
        r = _new(PerGroupKVCacheBlocks)
        r.blocks = tuple(new_blocks)
        return r

    def _num_to_allocate(self, st, hits, num_required: int, num_local_computed: int) -> int:
        """The new blocks the groups' rules take for ``num_required`` slots each (``st``
        None: a new request with per-group ``hits``).

        NOTE: a method, not a generator in ``allocate_slots``: a generator's free
        variables are cells made on every call of the enclosing function (the decode
        fast path's too; 2.1% of the hybrid replay's instructions)."""
        n = 0
        for k in self._kinds:
            n += k.blocks_to_allocate(st, hits[k.group_id] if hits is not None else None,
                                      num_required, num_local_computed)
        return n

    def _promote_host_hits(self, request, tables, num_hit_tokens: int) -> None:
        """Admission with a host tier: every ``HostHit`` (and ``TierHit`` of a tier
        below the host) left in the new request's tables (the ones its groups keep: a
        sliding window's slots before the window are null already, never loaded) gets
        a fresh device block, a recorded ``load`` of its group, its ``block_id`` set,
        and the block cached under its key (``BlockStored(medium="GPU")``); the tier's
        entry is freed (kept by an inclusive tier). The device hits were touched first
        (out of the free queue), and the entries are pinned while the device blocks
        are taken, so the demotions those evictions cause never pick them
        (``host_tier`` module docstring). Capacity was counted (``ref_cnt`` 0).

        Counts the hit's tokens by tier, per block position: a position is
        attributed to the slowest tier any group loaded it from (the chain's order:
        host, then each tier below), device if none did."""
        # (a table holds blocks, the null block, and the HostHit / TierHit placeholders)
        loads = [(g, i) for g, table in enumerate(tables)
                 for i, b in enumerate(table) if type(b) is not KVCacheBlock]
        bs = self.block_size
        if not loads:
            self.device_hit_tokens += num_hit_tokens
            return
        tier = self.host_tier
        chain = tier.lower
        pool = self.block_pool
        for g, i in loads:
            hit = tables[g][i]
            if type(hit) is HostHit:
                tier.pin(hit.host_slot)
            else:
                hit.tier.pin(hit.block_hash)
        fresh = pool.get_new_blocks(len(loads))
        # Per block position loaded from a tier below the host: the index in the chain
        # of the slowest tier loaded there (None: none was).
        lower_at: dict[int, int] | None = None
        for (g, i), blk in zip(loads, fresh):
            hit = tables[g][i]
            if type(hit) is HostHit:
                tier.load(hit.host_slot, blk.block_id)
            else:
                chain.load(hit, blk.block_id)
                j = chain.tiers.index(hit.tier)
                if lower_at is None:
                    lower_at = {}
                if lower_at.get(i, -1) < j:
                    lower_at[i] = j
            hit.block_id = blk.block_id
            tables[g][i] = blk
        request.bind_hasher(self.hasher, bs)
        hashes = request.block_hashes
        # Cache each group's runs of loaded blocks under their keys.
        j = 0
        while j < len(loads):
            g, start = loads[j]
            k = j
            while k + 1 < len(loads) and loads[k + 1] == (g, loads[k][1] + 1):
                k += 1
            pool.cache_group_blocks(request, tables[g], hashes, start, loads[k][1] + 1, bs, g)
            j = k + 1
        loaded = len({i for _, i in loads}) * bs
        host = loaded
        if lower_at is not None:
            lower = self._lower_hit_tokens
            for j in lower_at.values():
                lower[chain.tiers[j].name] += bs
            host -= len(lower_at) * bs
        self.host_hit_tokens += host
        self.device_hit_tokens += num_hit_tokens - loaded

    def _idle_bounds(self, st: _HybridState) -> tuple[int, int]:
        """``(idle_until, idle_nc)`` for the state's tables now."""
        bs = self.block_size
        total = len(st.tables[0]) * bs
        if self.max_model_len is not None and self.max_model_len < total:
            total = self.max_model_len
        if self.enable_caching:
            # One more token than this fills the next uncached block: cache it.
            full = (min(st.num_cached) + 1) * bs - 1
            if full < total:
                total = full
        nc = 1 << 62
        for idle_limit in self._limits:
            limit = idle_limit(st)
            if limit < nc:
                nc = limit
        return total, nc

    def _set_idle_bounds(self, st: _HybridState) -> None:
        st.idle_until, st.idle_nc = self._idle_bounds(st)

    def free(self, request) -> None:
        """Release a request's blocks: group by group, each table reversed (its last
        block evicts first), null slots skipped.

        Raises:
            ValueError: the request holds no blocks here (nothing changed).
        """
        # The one rule (_validate.held_state): the admitted Request or its id; and what
        # the release reads is checked first, so it cannot fail half way.
        st = _pop_held_state(self, request)
        for k in self._kinds:
            k.free(st)

    def _check_host_invariants(self) -> None:
        """The host tier's invariants with the device's (exclusive per group key),
        and each host entry's key names a group of the layout that caches blocks;
        the pending transfers name one group each, that of the key they moved."""
        tier = self.host_tier
        tier.check_invariants(self.block_pool.cached_block_hash_to_block)
        for key, slot in tier.hash_to_slot.items():
            g = int.from_bytes(key[-_KEY_BYTES:], "big")
            if g >= self.num_groups or not self._caching[g]:
                raise InvariantError(
                    f"host slot {slot.block_id} holds key {key.hex()} of group {g}, which "
                    "caches no blocks in this layout")
        if len(tier.transfer_groups) * 2 != len(tier.transfers):
            raise InvariantError(
                f"{len(tier.transfers) // 2} pending host transfers but "
                f"{len(tier.transfer_groups)} transfer groups")
        if any(not 0 <= g < self.num_groups for g in tier.transfer_groups):
            raise InvariantError(f"a host transfer of an unknown group: {tier.transfer_groups}")
        for lower in (tier.lower.tiers if tier.lower is not None else ()):
            for key in lower.entries:
                g = int.from_bytes(key[-_KEY_BYTES:], "big")
                if g >= self.num_groups or not self._caching[g]:
                    raise InvariantError(
                        f"the {lower.name} tier holds key {key.hex()} of group {g}, which "
                        "caches no blocks in this layout")

    # ------------------------------------------------------------- inspection
    def _state(self, request_id) -> _HybridState:
        st = self._states.get(request_id)
        if st is None:
            raise ValueError(f"unknown request id {request_id!r}: it holds no blocks")
        return st

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block tables as ids, one list per group (vLLM's shape); null
        slots are ``null_block_id`` (``num_blocks``, the padding page)."""
        return tuple([b.block_id for b in t] for t in self._state(request_id).tables)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's block objects per group (copies of the lists)."""
        return tuple(list(t) for t in self._state(request_id).tables)

    def num_held_blocks(self, request_id: str) -> tuple[int, ...]:
        """Real (non-null) blocks the request holds, per group."""
        null = self.null_block
        return tuple(sum(b is not null for b in t) for t in self._state(request_id).tables)

    def num_stranded_blocks(self) -> int:
        """Cached blocks whose chain (in their group) has an evicted earlier block.
        NOTE: a sliding-window lookup does not need the chain, so for those groups this
        counts blocks a full-attention-style lookup could not reach."""
        return len(self.block_pool.stranded_block_ids())

    def on_arrival(self, request, index: int) -> None:
        """Trace request number ``index`` arrives: the offline ``belady`` policy
        advances its next uses; a no-op without a policy."""
        index = check_arrival(request, index)  # the one rule (every manager)
        if self.policy is not None:
            request.bind_hasher(self.hasher, self.block_size)
            self.policy.on_arrival(request, index)

    # ------------------------------------------------------- the waiting queue
    def on_waiting(self, request_id, block_hashes) -> None:
        """``request_id`` joined the waiting queue with the prompt block hashes it can
        hit (``request.block_hashes[:(request.num_tokens - 1) // block_size]``, as
        ``HashKVCacheManager.on_waiting``). A policy with ``needs_waiting``
        (``queue_aware``) then keeps, per group, the cached blocks the request's hit
        would use (``waiting_keys``) until it is admitted (``allocate_slots`` drops it)
        or leaves (``drop_waiting``); a no-op for every other policy.

        Raises:
            ArgumentTypeError: a hash is not ``bytes``. ValueError: the request is
            already waiting. Nothing changed.
        """
        if self._waiting_policy is not None:
            self._waiting_policy.on_waiting(request_id, self.waiting_keys(block_hashes))

    def drop_waiting(self, request_id) -> None:
        """``request_id`` left the waiting queue without being admitted (aborted,
        failed); a no-op unless the policy reads the queue and the request waits."""
        if self._waiting_policy is not None:
            self._waiting_policy.drop_waiting(request_id)

    def waiting_keys(self, block_hashes) -> list[tuple[bytes, int]]:
        """The ``(block hash, group id)`` keys a waiting request holding the prompt
        blocks ``block_hashes`` would hit, per group, as the cache is now: the aligned
        hit ``L`` (the coordinator's fixed point over the groups, at most
        ``len(block_hashes) * block_size`` tokens) is looked up once, then

        * a downward-closed group (full attention) keeps every prompt block (the
          one-group rule, ``queue_aware``'s NOTE: deeper blocks are the ones a chain
          extension reuses);
        * any other group keeps the blocks its hit of ``L`` tokens holds past its
          skipped tokens (``num_skipped_tokens(L)``, as ``add_hit_blocks`` keeps them):
          a sliding window's blocks inside the window ending at ``L``, a state group's
          one state block at ``L``; none when ``L == 0``.

        NOTE: ``L`` is the hit at the announcement; blocks cached later that would
        lengthen it are protected only in downward-closed groups (a sliding window's
        or state's blocks at a longer hit are not known until a lookup).
        """
        hashes = check_block_hash_list(block_hashes)
        n = len(hashes)
        bs = self.block_size
        hit = self._hit_of_hashes(hashes, n * bs)[1] if n and self.enable_caching else 0
        keys = []
        for k in self._kinds:
            if not k.caches_blocks:
                continue
            g = k.group_id
            if k.downward_closed:
                lo, hi = 0, n
            else:
                lo, hi = k.num_skipped_tokens(hit) // bs, -(-hit // bs)
            keys.extend((hashes[i], g) for i in range(lo, hi))
        return keys

    # (reset_prefix_cache, take_events: BlockPoolViews')
    # Without a host tier (``HostTierAPI`` answers [] / 0): the hash index's counters.
    num_host_blocks = 0
    host_hit_tokens = 0
    host_tier = None
    device_hit_tokens = 0  # (an instance attribute from the first admission on)

    make_prefix_cache_stats = _make_prefix_cache_stats

    def check_invariants(self) -> None:
        """Verify pool and per-group table bookkeeping; ``InvariantError`` if broken."""
        pool = self.block_pool
        pool.check_invariants()
        null = self.null_block
        if null.block_hash is not None or null.prev_free_block or null.next_free_block:
            raise InvariantError("the null block was cached or queued")
        if self.host_tier is not None:
            self._check_host_invariants()
        refs = [0] * self.num_blocks
        owner: dict[int, int] = {}  # block id -> group
        bs = self.block_size
        for rid, st, req in _held_states(self):  # (the filing rule of every manager)
            hashes = req.block_hashes if self.enable_caching else ()
            if len({len(t) for t in st.tables}) != 1:
                raise InvariantError(
                    f"request {rid!r}: tables of different lengths {st.tables}")
            total, nc = self._idle_bounds(st)
            # NOTE: after a None return the window bound may lag (conservative).
            if st.idle_until != total or st.idle_nc > nc:
                raise InvariantError(
                    f"request {rid!r}: fast-path bounds ({st.idle_until}, {st.idle_nc}) "
                    f"vs ({total}, {nc})")
            for g, table in enumerate(st.tables):
                kind = self._kinds[g]
                kind.check_slots(st, rid)  # the kind's rule on null slots
                if -(-req.num_computed_tokens // bs) > len(table):
                    raise InvariantError(
                        f"request {rid!r} group {g}: {req.num_computed_tokens} computed "
                        f"tokens but {len(table)} slots")
                if st.num_cached[g] > len(table):
                    raise InvariantError(
                        f"request {rid!r} group {g}: {st.num_cached[g]} cached > {len(table)}")
                suffix = self._suffix[g]
                for i, b in enumerate(table):
                    if b is null:
                        continue
                    if pool.blocks[b.block_id] is not b:
                        raise InvariantError(f"request {rid!r} holds a foreign block {b.block_id}")
                    if owner.setdefault(b.block_id, g) != g:
                        raise InvariantError(
                            f"block {b.block_id} is in the tables of groups {owner[b.block_id]} "
                            f"and {g}")
                    refs[b.block_id] += 1
                    if i < st.num_cached[g] and kind.caches_blocks and (
                            kind.dense_caching or b.block_hash is not None):
                        if i >= len(hashes) or b.block_hash != hashes[i] + suffix:
                            raise InvariantError(
                                f"request {rid!r} group {g} slot {i} (block {b.block_id}) "
                                "should be cached under its hash and group")
                    elif b.block_hash is not None:
                        raise InvariantError(
                            f"request {rid!r} group {g} slot {i} (block {b.block_id}) is past "
                            f"its {st.num_cached[g]} cached slots but has a key")
        for b in pool.blocks:
            if b.ref_cnt != refs[b.block_id]:
                raise InvariantError(
                    f"block {b.block_id} has ref_cnt {b.ref_cnt} but {refs[b.block_id]} slots "
                    "hold it")
            if b.block_hash is not None:
                g = int.from_bytes(b.block_hash[-_KEY_BYTES:], "big")
                if g >= self.num_groups or owner.get(b.block_id, g) != g:
                    raise InvariantError(
                        f"block {b.block_id} is cached for group {g} but held by group "
                        f"{owner.get(b.block_id)}")
        if self._waiting_policy is not None:  # admission drops a request's interest
            held = [r for r in self._waiting_policy.waiting_ids() if r in self._states]
            if held:
                raise InvariantError(f"requests {held[:5]} hold blocks but are still "
                                     "waiting for the queue-aware policy (a leak)")


__all__ = ["HybridKVCacheManager"]
