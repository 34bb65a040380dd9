"""The radix index for sliding-window and hybrid layouts (SGLang 0.5's SWA radix cache).

``KVCacheManager(num_blocks, block_size, index="radix", kv_cache_groups=groups)`` builds
``RadixHybridKVCacheManager`` when the layout has a sliding-window group (or several
full-attention groups): the radix tree of ``core/radix.py`` (same keys, namespaces,
lookup walk, lock counts), with one block per KV cache group on every node, answering
exactly what the hash index's hybrid manager answers (per-group ``KVCacheBlocks``, block
tables with null slots, ``get_block_ids`` as one list per group).

    blocks, num_hit = manager.get_computed_blocks(request)   # blocks.blocks[g]
    new = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, blocks)
    manager.get_block_ids(request.request_id)   # ([ids of group 0], [ids of group 1], ...)

Nodes. A node is one block position of a cached prefix (the tree key of
``radix.block_keys``); ``node.blocks[g]`` is group g's cached block there or ``None``
(a *tombstone*: that group's KV was evicted; SGLang's ``swa_tombstone``). Full-attention
groups hold a block on every node (SGLang: full KV on every node); sliding-window groups
may be tombstoned on any node; a ``W == 1`` group is never cached (vLLM's reachable
mask: no block is ever needed). A node with no block left is kept while it has children
or a running path through it (its key still leads a walk to deeper cached blocks), and
dropped otherwise.

Hit rule (vLLM 0.33's hybrid coordinator, which the hash index follows): walk the tree
by the request's keys (at most ``(num_tokens - 1) // block_size`` blocks), then on that
path full attention takes the longest prefix whose full blocks are all present (every
node: the whole path), and each sliding-window spec the longest prefix ending in a run
of ``ceil((W - 1) / block_size)`` present blocks (or the present run at the start),
looping until every spec agrees. On a cache that never evicts this gives the hash
index's hits, block for block (``tests/core/test_radix_hybrid.py``).

Locks and release (SGLang's ``full_lock_ref`` / ``swa_lock_ref``). A running request
locks every node of its path (the path lock: a locked node is never removed). Its
sliding-window blocks that fall wholly before the window of its next token are released
and their table slots nulled (vLLM's ``remove_skipped_blocks``): held by nobody, such a
block stays cached and becomes evictable on its own -- the window's lock is the block's
``ref_cnt``. At admission the hit's slots before the window become null slots without
being touched.

Eviction, one pool (vLLM's: every group draws from one shared pool of blocks, so one
policy orders every group's victims). Candidates: every free cached sliding-window block
(tombstoned where it is evicted, interior nodes included), and the full-attention blocks
of unlocked leaves (a leaf is evicted whole: its full blocks and any sliding blocks left),
so full KV is evicted leaf by leaf and nothing strands. Free blocks without a hash are
reused first. Available blocks = free unhashed + free cached sliding-window blocks +
full blocks of unlocked nodes.

Waiting queue (a policy with ``needs_waiting``: ``queue_aware``). ``on_waiting`` announces
a waiting request's prompt blocks to the policy as ``(hash, group id)`` keys, per group
the blocks its hit would use (``waiting_keys``, the hash coordinator's rule: every
full-attention prompt block, a sliding window's blocks inside the window at the aligned
hit); admission drops the request. The path a prompt's hashes lead to is found through a
hash -> node index the tree keeps only with such a policy (``_node_by_hash``: no cost on
the hot paths otherwise).

Invariants (``check_invariants``):
    * Every cached block is exactly one node's ``blocks[g]`` (its group), with a hash
      (the request's chained digest at the node's depth); every node is reachable; a
      node without blocks has children or a lock; full groups never tombstone.
    * ``node.lock`` = running paths through it (locks never grow with depth); a block
      held by a request that is a node's sits on a locked node.
    * Each ``ref_cnt`` = the table slots holding the block; the free queue is exactly
      the ``ref_cnt == 0`` blocks, unhashed ones first.
    * Tables: one per group, equal lengths; null slots only as a leading run of a
      sliding-window table; a slot on the path is null, the node's block, or an uncached
      duplicate; slots past the path hold no hash.
    * The policy's candidates are exactly the free cached sliding-window blocks and the
      full blocks of unlocked leaves.
    * With a waiting-queue policy: the hash index is exactly the tree's nodes, each
      under its blocks' hash; no request that holds blocks is still waiting.
    * A call that raises changes nothing. NOTE: one that returns ``None`` may have
      released a running request's blocks before its window, as vLLM does (and the hash
      index's hybrid manager).

NOTE: the host tier is not served by this index with sliding-window layouts (demoting
per-group node values is not built: ``indexes.COMBINATION_RULES[("layout index",
"tier")]``); the hash index's hybrid manager serves it (``core/hybrid.py``).
"""

from __future__ import annotations

from typing import Any, Sequence

from prefixcache._validate import ArgumentTypeError
from prefixcache.core.block_pool import BlockPool, InvariantError, KVCacheBlock
from prefixcache.core.events import (
    MEDIUM_GPU,
    BlockRemoved,
    device_block_stored,
)
from prefixcache.core.hybrid import is_idle_step
from prefixcache.core.tiers.host import check_host_args
from prefixcache.core.kv_cache_blocks import KVCacheBlocks, PerGroupKVCacheBlocks, empty_blocks
from prefixcache.core.kv_cache_manager import (
    manager_options,
    _admission_checks,
    _check_sizes,
    _held_states,
    _init_lookup_counters,
    _pop_held_state,
    _store_settings,
)
from prefixcache.core.groups.base import check_block_hash_list, check_group_hits
from prefixcache.core.groups.sliding_window import check_leading_nulls, longest_window_hit
from prefixcache.core.kv_groups import (
    FullAttentionSpec,
    check_kv_cache_groups,
    lookup_groups,
)
from prefixcache.core.radix import (
    RadixKVCacheManager,
    _namespace,
    _num_unlocked_suffix,
    _RadixState,
    _radix_hasher_and_policy,
    _tree_edges,
    block_keys,
)
from prefixcache.core.request import Request

_new = object.__new__

INDEX_NAME = "radix"


class _HybridNode:
    """One cached block position (a root: ``blocks is None``, ``key`` = namespace).

    Attributes:
        key: the position's child key under ``parent`` (``radix.block_keys``).
        parent: the parent node (a root for a request's block 0).
        children: child key -> node.
        blocks: per group, the cached ``KVCacheBlock`` or ``None`` (a tombstone).
        lock: running requests whose path holds this node.
        block_hash: the chained block hash of the position; set (and read) only while
            the manager keeps its hash index (a waiting-queue policy: ``_node_by_hash``).
    """

    __slots__ = ("key", "parent", "children", "blocks", "lock", "block_hash")

    def __init__(self, key, parent: "_HybridNode | None", blocks: list | None):
        self.key = key
        self.parent = parent
        self.children: dict[Any, _HybridNode] = {}
        self.blocks = blocks
        self.lock = 0

    def __repr__(self) -> str:
        ids = None if self.blocks is None else [
            b.block_id if b is not None else None for b in self.blocks]
        return f"_HybridNode(blocks={ids}, lock={self.lock}, children={len(self.children)})"


def _node_blocks(node: _HybridNode, ids) -> list | None:
    """The node's blocks of groups ``ids``, or ``None`` when any is a tombstone (the
    "present" rule of ``longest_window_hit`` on a tree path)."""
    bl = node.blocks
    got = [bl[g] for g in ids]
    return None if None in got else got


class _HybridRadixState(_RadixState):
    """A running request: ``radix._RadixState`` (``blocks`` is group 0's table) plus

    Attributes:
        tables: one block table per group (null slots included; equal lengths).
        num_null: per group, the length of the table's leading run of null slots.
        idle_nc: with ``idle_until``, the decode fast path's bounds (as the hybrid
            manager's ``idle_until`` / ``idle_nc``; ``hybrid.is_idle_step``).
    """

    __slots__ = ("tables", "num_null", "idle_nc")

    def __init__(self, request, tables, path, ns, bs: int, num_null):
        super().__init__(request, tables[0], path, ns, bs)
        self.tables = tables
        self.num_null = num_null
        self.idle_nc = -1


class RadixHybridKVCacheManager(RadixKVCacheManager):
    """Block tables per KV cache group over one shared pool, found in a radix tree.

    Same constructor keywords, calls, return values and errors as the hash index's
    hybrid manager (``kv_groups.HYBRID_MANAGER``): ``get_computed_blocks`` answers
    ``PerGroupKVCacheBlocks`` (null slots are ``null_block``, id ``num_blocks``), and
    every eviction policy runs (module docstring, "Eviction"). Inherits the radix
    index's lookup walk, keys, counters and event queue.

    Args:
        num_blocks, block_size, enable_caching, hash_algo, hash_seed, free_order,
        log_stats, enable_events, max_model_len, int_event_hashes, eviction,
        eviction_options: as ``RadixKVCacheManager`` (``free_order`` is validated; the
            tree always reuses unhashed free blocks first).
        kv_cache_groups: the layout (``kv_groups.KVCacheGroup`` list; a sliding-window
            group or more than one group).
        index: must be ``"radix"``.
        num_host_blocks: must be 0 (refused by ``indexes.refusal`` otherwise).

    Attributes:
        kv_cache_groups: the checked groups (tuple); ``num_groups``.
        null_block: the null slot's block (``block_id == num_blocks``).
        policy: the ``EvictionPolicy`` object (over every group's blocks).
    """

    KEYS_BY_BLOCK_HASH = False
    _NODE = _HybridNode

    def __init__(self, num_blocks: int, block_size: int, **options):
        (enable_caching, hash_algo, hash_seed, free_order, log_stats, enable_events,
         max_model_len, int_event_hashes, eviction, eviction_options, index,
         kv_cache_groups, num_host_blocks, host_eviction, host_eviction_options,
         _) = manager_options(self, options, lower_tiers=False, checked=True)
        # (a host tier was refused with its reason; one full-attention group is
        # RadixKVCacheManager's)
        groups = check_kv_cache_groups(kv_cache_groups)
        check_host_args(num_host_blocks, host_eviction, host_eviction_options)  # (0 here)
        num_blocks, block_size, max_model_len = _check_sizes(
            num_blocks, block_size, max_model_len, free_order)
        self.hasher, self.policy = _radix_hasher_and_policy(
            hash_algo, hash_seed, eviction, eviction_options, num_blocks, block_size)
        # A policy that reads each block's group (marconi) hears the layout first and
        # each cached block's group (``on_cached_group``), as the hash index's pool.
        self._grouped_policy = self.policy.needs_groups
        if self._grouped_policy:
            self.policy.set_groups(groups)  # (before any block is cached)
        # A policy that reads the waiting queue (queue_aware): the per-group waiting
        # hooks (on_waiting -> waiting_keys) feed it and admission drops the request.
        # It needs the path a prompt's block hashes lead to, so the tree then keeps a
        # hash -> node index (``_node_by_hash``: set in ``_cache``, cleared in
        # ``_drop_node``); None otherwise, and the hot paths pay one check per call.
        self._waiting_policy = self.policy if self.policy.needs_waiting else None
        self._node_by_hash: dict[bytes, _HybridNode] | None = (
            {} if self._waiting_policy is not None else None)
        self.eviction = eviction
        self.index = index
        self.kv_cache_groups = groups
        self.num_groups = len(groups)
        _store_settings(self, num_blocks, block_size, enable_caching, free_order, log_stats,
                        enable_events, max_model_len)
        self._max_len = max_model_len if max_model_len is not None else 1 << 62
        # Per group: the window W (None: full attention), whether its blocks are cached.
        self._windows = [g.spec.sliding_window for g in groups]
        self._cacheable = [w is None or w > 1 for w in self._windows]
        self._full_ids = [g for g, w in enumerate(self._windows) if w is None]
        self._sw_ids = [g for g, w in enumerate(self._windows) if w is not None]
        self._is_full = [w is None for w in self._windows]
        self._num_full = len(self._full_ids)
        self._specs = lookup_groups(groups)
        # The one pool (radix.py's "One pool"): ids, ref counts, the free queue (its
        # unhashed head counted by ``num_free_unhashed``), events and counters; this
        # tree evicts its candidates into the queue's head before it allocates.
        self.block_pool = BlockPool(
            num_blocks, enable_caching=self.enable_caching, enable_events=self.enable_events,
            free_order=free_order, int_event_hashes=int_event_hashes, policy=self.policy,
            on_evict=self._unlink_leaf, on_reset=self._forget_all)
        self.blocks: list[KVCacheBlock] = self.block_pool.blocks
        # NOTE: the padding page (hybrid.py's convention): never pooled, queued or cached.
        self.null_block = KVCacheBlock(num_blocks)
        self._num_free_sw = 0  # free cached sliding-window blocks (all candidates)
        self._num_unlocked_full = 0  # full-attention blocks of unlocked nodes
        self._owner: list[_HybridNode | None] = [None] * num_blocks  # block id -> node
        self._owner_group = [0] * num_blocks  # block id -> its group (while cached)
        self._roots: dict[Any, _HybridNode] = {}
        self._num_nodes = 0
        self._epoch = 0  # tree changes that can invalidate _lookup (evictions, resets)
        self._lookup: tuple | None = None  # (request, nodes, hit lists, epoch)
        self._extras_memo: dict[tuple, dict[int, tuple]] = {}
        self._states: dict[Any, _HybridRadixState] = {}
        self._states_by_request: dict[Any, _HybridRadixState] = {}
        self._no_new_blocks = empty_blocks(len(groups), per_group=True)
        self._empty = self._no_new_blocks
        self._empty_hit = self._no_new_blocks  # what a lookup answers with caching off
        self._hit_blocks_class = PerGroupKVCacheBlocks  # what get_computed_blocks wraps
        _init_lookup_counters(self)
        self.device_hit_tokens = 0
        self.host_tier = None
        self.num_host_blocks = 0
        self.host_eviction = host_eviction
        self.host_hit_tokens = 0
        # Miss accounting's hook (``misses.GroupProbeAccountant``): each eviction of
        # group ``evicted_group``'s blocks sets ``block_pool.evicted_by[digest] =
        # "device"`` (the other groups' are not recorded; the pool's reset replaces the
        # dict).
        self.evicted_group: int | None = None

    @property
    def null_block_id(self) -> int:
        """The id of null slots in ``get_block_ids`` (the padding page, ``num_blocks``)."""
        return self.num_blocks

    # ---------------------------------------------------------------- lookups
    def _find(self, spec, ids, nodes, max_n: int):
        """One spec's hit on the path ``nodes[:max_n]`` (vLLM's single-type managers'
        ``find_longest_cache_hit``): ``(per-group lists, blocks)``."""
        if isinstance(spec, FullAttentionSpec):  # every node holds its full blocks
            return [[node.blocks[g] for node in nodes[:max_n]] for g in ids], max_n
        computed = longest_window_hit(
            nodes, max_n, -(-(spec.sliding_window - 1) // self.block_size), self.null_block,
            len(ids), _node_blocks, ids)
        return computed, len(computed[0])

    def _longest_hit(self, nodes) -> tuple[list[list[KVCacheBlock]], int]:
        """vLLM's coordinator ``find_longest_cache_hit`` over the tree path ``nodes``
        (blocks past the path are misses in every group): per-group hit lists and the
        hit in blocks."""
        specs = self._specs
        n_groups = self.num_groups
        by_group: list = [None] * n_groups
        if len(specs) == 1:
            spec, ids = specs[0]
            hit = len(nodes)
            while True:  # groups of one spec: repeat until the length is stable
                blocks, curr = self._find(spec, ids, nodes, hit)
                if curr >= hit:
                    break
                hit = curr
            for g, b in zip(ids, blocks):
                by_group[g] = b
            return by_group, curr
        simple = len(specs) == 2 and isinstance(specs[0][0], FullAttentionSpec)
        hit = len(nodes)
        len_by_group = [0] * n_groups
        while True:
            curr = hit
            for spec, ids in specs:
                if isinstance(spec, FullAttentionSpec) and by_group[ids[0]] is not None:
                    if len_by_group[ids[0]] < curr:
                        curr = len_by_group[ids[0]]
                    continue
                blocks, curr = self._find(spec, ids, nodes, curr)
                for g, b in zip(ids, blocks):
                    by_group[g] = b
                    len_by_group[g] = curr
            if curr >= hit:
                break
            hit = curr
            if simple:
                break
        for g in self._full_ids:
            del by_group[g][hit:]
        return [b if b is not None else [] for b in by_group], hit

    def find_longest_cache_hit(self, request: Request) -> tuple[tuple[list, ...], int]:
        """The longest prefix hit valid for every group (module docstring, "Hit
        rule"), as ``(blocks per group, num_hit_tokens)`` (a sliding-window group's
        slots before its window are ``null_block``). Changes no block state; counts
        nothing."""
        nodes = self._lookup_nodes(request)  # (checks the request, binds the hasher)
        lists, hit = self._longest_hit(nodes)
        # NOTE: allocate_slots adopts these nodes without walking again while the tree
        # has changed no block since (the epoch counts evictions).
        self._lookup = (request, nodes[:hit], self._epoch)
        return tuple(lists), hit * self.block_size

    # ------------------------------------------------------- the waiting queue
    def on_waiting(self, request_id, block_hashes) -> None:
        """``request_id`` joined the waiting queue with the prompt block hashes it can
        hit (``request.block_hashes[:(request.num_tokens - 1) // block_size]``), as
        ``HybridKVCacheManager.on_waiting``: a policy with ``needs_waiting``
        (``queue_aware``) then keeps, per group, the cached blocks the request's hit
        would use (``waiting_keys``) until it is admitted (``allocate_slots`` drops it)
        or leaves (``drop_waiting``, inherited); a no-op for every other policy.

        Raises:
            ArgumentTypeError: a hash is not ``bytes``. ValueError: the request is
            already waiting. Nothing changed.
        """
        if self._waiting_policy is not None:
            self._waiting_policy.on_waiting(request_id, self.waiting_keys(block_hashes))

    def waiting_keys(self, block_hashes) -> list[tuple[bytes, int]]:
        """The ``(block hash, group id)`` keys a waiting request holding the prompt
        blocks ``block_hashes`` would hit, per group, as the tree is now -- the hash
        index's rule (``HybridKVCacheManager.waiting_keys``): the aligned hit ``L``
        over the tree path those hashes lead to (``_longest_hit``), then

        * a full-attention group keeps every prompt block (``queue_aware``'s NOTE:
          deeper blocks are the ones a chain extension reuses);
        * a sliding-window group keeps the blocks its hit of ``L`` tokens holds past
          its skipped tokens (``_skipped_tokens(g, L)``, as admission keeps them): the
          blocks inside the window ending at ``L``; none when ``L == 0``;
        * a ``W == 1`` group caches no block: no key.

        NOTE: ``L`` is the hit at the announcement (as the hash index): sliding-window
        blocks cached later that would lengthen it are not protected.
        """
        hashes = check_block_hash_list(block_hashes)
        n = len(hashes)
        hit = 0
        if n and self.enable_caching:
            nodes = self._path_of_hashes(hashes)
            if nodes:
                hit = self._longest_hit(nodes)[1]
        num_hit = hit * self.block_size
        bs = self.block_size
        keys = []
        for g, w in enumerate(self._windows):
            if not self._cacheable[g]:
                continue
            if w is None:
                lo, hi = 0, n
            else:
                lo, hi = self._skipped_tokens(g, num_hit) // bs, hit
            keys.extend((hashes[i], g) for i in range(lo, hi))
        return keys

    def _path_of_hashes(self, hashes: list[bytes]) -> list[_HybridNode]:
        """The tree path (from a namespace's root) whose positions carry the chained
        block hashes ``hashes[:len(path)]``, as long as the tree holds it: the deepest
        ``hashes[i]`` found at depth ``i``, with its ancestors. (Block hashes chain the
        LoRA adapter, items and salt, so one map over every root suffices.)

        With a waiting-queue policy the hash index answers (every node, tombstones
        included); without one the tree keeps no index (the hot paths pay nothing for
        it), so this maps the present blocks' hashes first (O(tree)) -- the same path
        up to trailing all-tombstone nodes, which no group's hit ends in."""
        by_hash = self._node_by_hash
        if by_hash is None:
            by_hash = {}
            for _, child in _tree_edges(self._roots, "blocks"):
                for b in child.blocks:
                    if b is not None:
                        by_hash[b.block_hash] = child
                        break
        for i in range(len(hashes) - 1, -1, -1):
            node = by_hash.get(hashes[i])
            if node is None:
                continue
            path = []
            while node.blocks is not None:  # up to the root
                path.append(node)
                node = node.parent
            if len(path) == i + 1:  # (else a hash collision across depths: skip it)
                path.reverse()
                return path
        return []

    # ------------------------------------------------------------- allocation
    def _check_hit_blocks(self, new_computed_blocks):
        """The per-group hit lists as a list of lists (structure checked), or None."""
        if new_computed_blocks is None:
            return None
        if isinstance(new_computed_blocks, KVCacheBlocks):
            new_computed_blocks = new_computed_blocks.blocks
        if not isinstance(new_computed_blocks, (tuple, list)) or len(new_computed_blocks) != (
                self.num_groups) or not all(isinstance(g, (list, tuple))
                                            for g in new_computed_blocks):
            raise ArgumentTypeError(
                f"new_computed_blocks must be the tuple of {self.num_groups} per-group block "
                f"lists get_computed_blocks returned, got {new_computed_blocks!r}")
        null = self.null_block
        n = len(new_computed_blocks[0])
        is_full = self._is_full
        is_cached = self._is_cached_hit
        return [check_group_hits(blocks, g, n, null, not is_full[g], is_cached)
                for g, blocks in enumerate(new_computed_blocks)]

    def _is_cached_hit(self, b: KVCacheBlock, g: int) -> bool:
        """``b`` is this manager's block, cached in the tree for group ``g``."""
        bid = b.block_id
        return (0 <= bid < self.num_blocks and self.blocks[bid] is b
                and self._owner[bid] is not None and self._owner_group[bid] == g)

    def _hit_path(self, request, hits, num_local_computed: int) -> list[_HybridNode]:
        """The path nodes of the hit lists ``hits``; ``ValueError`` unless hit slot #i
        of group g is null or node #i's block of group g, with no null slot inside the
        window (what ``get_computed_blocks`` returned for this request)."""
        n = len(hits[0])
        lk = self._lookup
        if lk is not None and lk[0] is request and lk[2] == self._epoch and n <= len(lk[1]):
            nodes = lk[1][:n]
        else:
            nodes = self._lookup_nodes(request)[:n]
        null = self.null_block
        bs = self.block_size
        for g, blocks in enumerate(hits):
            skipped = self._skipped_tokens(g, num_local_computed) // bs
            for i, b in enumerate(blocks):
                if i >= len(nodes) or (b is not null and nodes[i].blocks[g] is not b) or (
                        b is null and i >= skipped):
                    raise ValueError(
                        f"new_computed_blocks[{g}] #{i} is not the cached block #{i} of "
                        f"request {request.request_id!r}'s prefix in its window: pass the "
                        "tuple get_computed_blocks returned for this request, unchanged")
        return nodes

    def _skipped_tokens(self, group_id: int, num_computed_tokens: int) -> int:
        """vLLM's ``get_num_skipped_tokens``: tokens before the window of the next token
        (0 for full attention)."""
        w = self._windows[group_id]
        if w is None:
            return 0
        s = num_computed_tokens - w + 1
        return s if s > 0 else 0

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | Sequence[Sequence[KVCacheBlock]] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Give ``request`` slots for ``num_new_tokens`` more tokens in every group.

        As the hash index's hybrid manager's ``allocate_slots`` (same arguments, counts
        and errors; per-group hit lists): a running request's sliding-window blocks
        wholly before the window of its next token are released first (they stay
        cached, evictable); a new request locks its hit path, touches its hit blocks
        from the window on (earlier slots become null), and every block full after the
        step enters the tree (a duplicate key: the node's block is kept, a tombstoned
        group slot takes the request's block).

        Returns:
            The new blocks per group (``PerGroupKVCacheBlocks``), or ``None`` when the
            available blocks do not suffice (see the module docstring's NOTE).
        """
        try:
            st = self._states_by_request[request]
        except (KeyError, TypeError):
            st = None
        if st is not None and is_idle_step(st, num_new_tokens, num_new_computed_tokens,
                                           new_computed_blocks, num_lookahead_tokens):
            return self._no_new_blocks  # a decode step that needs nothing
        hits = self._check_hit_blocks(new_computed_blocks)
        flat = hits[0] if hits is not None else None
        st, computed, total, need, num_new_computed_tokens = _admission_checks(
            self, request, num_new_tokens, num_new_computed_tokens, flat,
            num_lookahead_tokens)
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        nodes = self._hit_path(request, hits, num_local_computed) if computed else []
        # --- validated from here on --------------------------------------------
        bs = self.block_size
        null = self.null_block
        n_groups = self.num_groups
        if st is not None:
            self._remove_skipped(st, num_local_computed)  # (may precede a None)
        num_required = -(-need // bs)
        num_alloc = 0
        if st is not None:
            for table in st.tables:
                if num_required > len(table):
                    num_alloc += num_required - len(table)
        else:
            # Locking the path takes its unlocked nodes' full blocks out of the
            # available ones; touching a free sliding-window hit block takes it.
            num_alloc += self._num_full * _num_unlocked_suffix(nodes)
            for g in range(n_groups):
                hit = hits[g] if hits is not None else ()
                skipped = self._skipped_tokens(g, num_local_computed) // bs
                num_alloc += max(num_required - max(skipped, len(hit)), 0)
                if not self._is_full[g]:
                    num_alloc += sum(1 for b in hit[skipped:] if b.ref_cnt == 0)
        if num_alloc > self.num_available_blocks:
            self.num_failed_allocations += 1
            return None
        if st is None:
            for node in nodes:
                self._lock(node)
            touch = self.block_pool.touch
            tables = []
            num_null = []
            for g in range(n_groups):
                hit = hits[g] if hits is not None else []
                skipped = self._skipped_tokens(g, num_local_computed) // bs
                kept = hit[skipped:]
                if not self._is_full[g]:  # (free cached sliding blocks are candidates)
                    for b in kept:
                        if b.ref_cnt == 0:
                            self._num_free_sw -= 1
                            self.policy.discard(b)
                touch(kept, request)
                tables.append([null] * skipped + kept)
                num_null.append(skipped)
            st = _HybridRadixState(request, tables, list(nodes), _namespace(request), bs,
                                   num_null)
            if self._waiting_policy is not None:  # admitted: no longer waiting
                self._waiting_policy.drop_waiting(request.request_id)
            self._lookup = None  # NOTE: holds no request past its admission
            self._register(request, st, num_new_computed_tokens)
            self.device_hit_tokens += num_new_computed_tokens
        new_blocks = []
        for table in st.tables:  # (each grows to num_required slots)
            n = num_required - len(table)
            got = self._take_blocks(n) if n > 0 else []
            table.extend(got)
            new_blocks.append(got)
        if self.enable_caching:
            request.bind_hasher(self.hasher, bs)
            hashes = request.block_hashes
            num_full = min(total, request.num_tokens, len(hashes) * bs) // bs
            if num_full > len(st.path):
                self._cache(st, num_full, hashes)
        st.idle_until, st.idle_nc = self._idle_bounds(st)
        r = _new(PerGroupKVCacheBlocks)
        r.blocks = tuple(new_blocks)
        return r

    def _idle_bounds(self, st: _HybridRadixState) -> tuple[int, int]:
        """``(idle_until, idle_nc)`` for the state's tables now (the hybrid manager's
        rule): past them a step needs a block, caches one or releases one."""
        bs = self.block_size
        total = len(st.tables[0]) * bs
        if self._max_len < total:
            total = self._max_len
        if self.enable_caching:
            full = (len(st.path) + 1) * bs - 1
            if full < total:
                total = full
        nc = 1 << 62
        for g, w in enumerate(self._windows):
            if w is not None:
                limit = (st.num_null[g] + 1) * bs + w - 2
                if limit < nc:
                    nc = limit
        return total, nc

    # ------------------------------------------------------------ tree state
    def _lock(self, node: _HybridNode) -> None:
        """One more running path through ``node``."""
        if not node.lock:
            self._num_unlocked_full -= self._num_full
            if not node.children:
                discard = self.policy.discard
                for g in self._full_ids:
                    discard(node.blocks[g])
        node.lock += 1

    def _unlock(self, node: _HybridNode, request, position: int) -> None:
        """One running path less through ``node`` (its blocks already released)."""
        node.lock -= 1
        if node.lock:
            return
        policy = self.policy
        for g in self._full_ids:
            policy.on_release(node.blocks[g], request, position)
        self._num_unlocked_full += self._num_full
        if not node.children:
            if self._num_full:
                for g in self._full_ids:
                    policy.add(node.blocks[g])
            elif all(b is None for b in node.blocks):
                self._drop_node(node)

    def _drop_node(self, node: _HybridNode) -> None:
        """Remove the unlocked, blockless leaf ``node``; then any parent left an
        unlocked blockless leaf (an unlocked full leaf becomes a candidate)."""
        by_hash = self._node_by_hash  # (None: no waiting-queue policy, no index)
        while True:
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            if by_hash is not None and by_hash.get(node.block_hash) is node:
                del by_hash[node.block_hash]
            self._num_nodes -= 1
            self._epoch += 1
            if parent.blocks is None:  # a root
                if not parent.children:
                    del self._roots[parent.key]
                return
            if parent.lock or parent.children:
                return
            if self._num_full:
                for g in self._full_ids:
                    self.policy.add(parent.blocks[g])
                return
            if any(b is not None for b in parent.blocks):
                return
            node = parent

    def _uncache(self, b: KVCacheBlock, g: int) -> None:
        """Drop the free cached block ``b`` of group ``g`` from the tree's bookkeeping:
        it becomes a free unhashed block at the queue's head."""
        if b.ref_cnt:
            raise InvariantError(f"evicting block {b.block_id} with ref_cnt {b.ref_cnt}")
        pool = self.block_pool
        if self.enable_events:
            pool.events.append(BlockRemoved(
                block_hashes=[pool._event_hash(b.block_hash)], medium=MEDIUM_GPU,
                group_idx=g))
        if pool.evicted_by is not None and g == self.evicted_group:
            pool.evicted_by[b.block_hash] = "device"  # miss accounting's hook: the digest
        b.block_hash = None
        self._owner[b.block_id] = None
        pool.num_evictions += 1
        self.policy.on_evicted(b)
        q = pool.free_block_queue
        q.remove(b)
        q.prepend_n((b,))
        pool.num_free_unhashed += 1

    def _evict(self, b: KVCacheBlock) -> None:
        """Evict the candidate ``b`` (just popped from the policy): a sliding-window
        block is tombstoned on its node; a full block takes its whole leaf."""
        bid = b.block_id
        node = self._owner[bid]
        g = self._owner_group[bid]
        self._epoch += 1
        if not self._is_full[g]:
            self._num_free_sw -= 1
            node.blocks[g] = None
            self._uncache(b, g)
            if not node.lock and not node.children and all(x is None for x in node.blocks):
                self._drop_node(node)
            return
        if node.lock or node.children:
            raise InvariantError(
                f"evicting full-attention block {bid}: lock {node.lock}, "
                f"{len(node.children)} children")
        discard = self.policy.discard
        for g2, b2 in enumerate(node.blocks):
            if b2 is None:
                continue
            if b2 is not b:
                discard(b2)
            if self._is_full[g2]:
                self._num_unlocked_full -= 1
            else:
                self._num_free_sw -= 1
            node.blocks[g2] = None
            self._uncache(b2, g2)
        self._drop_node(node)

    def _take_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks (caller checked availability): the policy's victims are
        evicted into the queue's head until ``n`` free blocks hold no hash, then the
        pool hands out its head (no victim of its own: ``_unlink_leaf``)."""
        pool = self.block_pool
        while pool.num_free_unhashed < n:
            self._evict(self.policy.pop())
        return pool.get_new_blocks(n)

    def _unlink_leaf(self, block: KVCacheBlock):
        """Never called: ``_take_blocks`` leaves the pool enough unhashed blocks (a
        node's blocks are evicted together, into the queue's head)."""
        raise InvariantError(
            f"the pool evicted block {block.block_id}: this tree evicts before it allocates")

    def _release(self, st: _HybridRadixState, slots) -> None:
        """Drop one reference from each table slot ``(group, position)`` of ``slots``
        (in that order, null slots skipped): cached blocks that become free go to the
        queue's tail (a sliding-window one becomes a candidate), unhashed ones to its
        head."""
        tables = st.tables
        null = self.null_block
        held = [(g, i, tables[g][i]) for g, i in slots if tables[g][i] is not null]
        self.block_pool.free_blocks([b for _, _, b in held])
        is_full = self._is_full
        policy = self.policy
        request = st.request
        for g, i, b in held:
            if not b.ref_cnt and not is_full[g] and b.block_hash is not None:
                self._num_free_sw += 1
                policy.on_release(b, request, i)
                policy.add(b)

    def _remove_skipped(self, st: _HybridRadixState, num_computed_tokens: int) -> None:
        """vLLM's ``remove_skipped_blocks``: release each sliding-window table's blocks
        wholly before the window (last slot first, stopping at a null one); their slots
        become null."""
        bs = self.block_size
        null = self.null_block
        for g, table in enumerate(st.tables):
            if self._is_full[g]:
                continue
            n = self._skipped_tokens(g, num_computed_tokens) // bs
            if n > len(table):
                n = len(table)
            first = n
            while first > 0 and table[first - 1] is not null:
                first -= 1
            if first < n:
                self._release(st, [(g, i) for i in range(n - 1, first - 1, -1)])
                for i in range(first, n):
                    table[i] = null
                st.num_null[g] = n

    def _cache(self, st: _HybridRadixState, num_full: int, hashes: Sequence[bytes]) -> None:
        """Enter the request's positions ``len(st.path) .. num_full - 1`` into the tree."""
        request = st.request
        path = st.path
        tables = st.tables
        first = len(path)
        parent, keys = self._cache_start(st, first, num_full)
        null = self.null_block
        cacheable = self._cacheable
        owner = self._owner
        owner_group = self._owner_group
        on_cached = self.policy.on_cached
        grouped = self._grouped_policy
        on_cached_group = self.policy.on_cached_group
        events = self.enable_events
        stored: list[list[int]] = [[] for _ in tables]
        for i, key in enumerate(keys, first):
            h = hashes[i]
            child = parent.children.get(key)
            if child is None:
                child = _HybridNode(key, parent, [None] * len(tables))
                child.lock = 1
                parent.children[key] = child
                self._num_nodes += 1
            else:
                self._lock(child)
            cb = child.blocks
            for g, table in enumerate(tables):
                b = table[i]
                if cb[g] is not None or b is null or not cacheable[g]:
                    continue  # (a duplicate stays uncached: block tables are append-only)
                if b.block_hash is not None:
                    raise InvariantError(
                        f"group {g} block {b.block_id} is being cached but already has a hash")
                b.block_hash = h
                cb[g] = b
                owner[b.block_id] = child
                owner_group[b.block_id] = g
                self.block_pool.num_blocks_cached += 1
                if grouped:
                    on_cached_group(b, h, request, i, g)
                else:
                    on_cached(b, h, request, i)
                if events:
                    stored[g].append(i)
            path.append(child)
            parent = child
        by_hash = self._node_by_hash
        if by_hash is not None:  # the hash index (a waiting-queue policy only)
            for i in range(first, num_full):
                node = path[i]
                node.block_hash = h = hashes[i]
                by_hash[h] = node
        if events:
            for g, positions in enumerate(stored):
                self._stored_events(request, hashes, positions, g)

    def _stored_events(self, request, hashes, positions: list[int], g: int) -> None:
        """``BlockStored`` for group ``g``'s newly cached positions, one per run."""
        spec = self.kv_cache_groups[g].spec
        bs = self.block_size
        pool = self.block_pool
        eh = pool._event_hash
        k = 0
        while k < len(positions):
            j = k
            while j + 1 < len(positions) and positions[j + 1] == positions[j] + 1:
                j += 1
            a, b = positions[k], positions[j] + 1
            pool.events.append(device_block_stored(
                request, list(map(eh, hashes[a:b])), eh(hashes[a - 1]) if a else None,
                a * bs, b * bs, bs, group_idx=g, spec_kind=spec.kind,
                sliding_window=spec.sliding_window))
            k = j + 1

    def free(self, request) -> None:
        """Release a request's blocks (null slots skipped) and unlock its path deepest
        first (see the NOTE for the order).

        Raises:
            ValueError: the request holds no blocks here (nothing changed).
        """
        # The one rule (_validate.held_state): the admitted Request or its id; and what
        # the release reads is checked first, so it cannot fail half way.
        st = _pop_held_state(self, request)
        # NOTE: the order the policy learns of releases: full blocks (stamped when their
        # node unlocks), the uncached tail, then position by position from the deepest,
        # each position's sliding-window blocks before its node -- so with LRU the
        # blocks released before the window go first, then the request's positions
        # deepest first (as the radix index frees its last block first).
        req = st.request
        num_slots = len(st.tables[0])
        path = st.path
        full_ids = self._full_ids
        sw_ids = self._sw_ids
        self._release(st, [(g, i) for g in full_ids for i in range(num_slots - 1, -1, -1)])
        if sw_ids:
            self._release(st, [(g, i) for i in range(num_slots - 1, len(path) - 1, -1)
                               for g in sw_ids])
        # (slots before every sliding table's window are null: only unlock there)
        lo = min(st.num_null[g] for g in sw_ids) if sw_ids else len(path)
        for i in range(len(path) - 1, -1, -1):
            if i >= lo:
                self._release(st, [(g, i) for g in sw_ids])
            self._unlock(path[i], req, i)

    # ------------------------------------------------------------- inspection
    def _state(self, request_id) -> _HybridRadixState:
        st = self._states.get(request_id)
        if st is None:
            raise ValueError(f"unknown request id {request_id!r}: it holds no blocks")
        return st

    def get_block_ids(self, request_id) -> tuple[list[int], ...]:
        """The request's block tables as ids, one list per group; null slots are
        ``null_block_id``."""
        return tuple([b.block_id for b in t] for t in self._state(request_id).tables)

    def get_blocks(self, request_id) -> tuple[list[KVCacheBlock], ...]:
        """The request's block objects per group (copies of the lists)."""
        return tuple(list(t) for t in self._state(request_id).tables)

    def num_held_blocks(self, request_id) -> tuple[int, ...]:
        """Real (non-null) blocks the request holds, per group."""
        null = self.null_block
        return tuple(sum(b is not null for b in t) for t in self._state(request_id).tables)

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation may take now: free unhashed blocks, free cached
        sliding-window blocks and the full blocks of unlocked nodes."""
        return self.block_pool.num_free_unhashed + self._num_free_sw + self._num_unlocked_full

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree (block positions, tombstones included)."""
        return self._num_nodes

    def num_stranded_blocks(self) -> int:
        """Cached blocks no lookup can reach (O(tree)); always 0: only leaves lose their
        full blocks and a node is dropped only without blocks and children."""
        reachable = 0
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                reachable += sum(b is not None for b in child.blocks)
                stack.append(child)
        return sum(1 for b in self.blocks if b.block_hash is not None) - reachable

    def _forget_tree(self) -> None:
        """``reset_prefix_cache``'s part that is this tree's own (radix.py's method does
        the rest)."""
        self._owner = [None] * self.num_blocks
        self._num_nodes = self._num_free_sw = self._num_unlocked_full = 0
        if self._node_by_hash is not None:
            self._node_by_hash = {}

    # -------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        """Verify the tree, locks, pool and tables (module docstring); raise
        ``InvariantError`` naming the block or request if broken."""
        blocks = self.blocks
        n = self.num_blocks
        bs = self.block_size
        null = self.null_block
        if null.block_hash is not None or null.prev_free_block or null.next_free_block:
            raise InvariantError("the null block was cached or queued")
        for i, b in enumerate(blocks):
            if b.block_id != i:
                raise InvariantError(f"blocks[{i}] has block_id {b.block_id}")
        self.block_pool.check_invariants()  # (the queue, unhashed blocks first)
        # Tree.
        in_tree: dict[int, _HybridNode] = {}
        locks: dict[int, int] = {}  # id(node) -> paths counted below
        nodes_by_id: dict[int, _HybridNode] = {}
        num_nodes = num_free_sw = num_unlocked_full = 0
        candidates: list[int] = []
        for node, child in _tree_edges(self._roots, "blocks"):
            if child.blocks is None:
                raise InvariantError(f"{child!r} is linked wrongly (no blocks)")
            if id(child) in nodes_by_id:
                raise InvariantError(f"{child!r} is in the tree twice")
            nodes_by_id[id(child)] = child
            locks[id(child)] = 0
            num_nodes += 1
            if len(child.blocks) != self.num_groups:
                raise InvariantError(f"{child!r} has no slot per group")
            if not child.lock and not child.children and all(
                    b is None for b in child.blocks):
                raise InvariantError(f"{child!r} is an unlocked leaf without blocks")
            if node.blocks is not None and not node.lock and child.lock:
                raise InvariantError(f"{child!r} is locked under the unlocked {node!r}")
            for g, b in enumerate(child.blocks):
                if b is None:
                    if self._is_full[g]:
                        raise InvariantError(
                            f"{child!r} has no block of full-attention group {g}")
                    continue
                if not self._cacheable[g]:
                    raise InvariantError(f"{child!r} caches group {g} (window 1)")
                bid = b.block_id
                if (not 0 <= bid < n or blocks[bid] is not b or self._owner[bid]
                        is not child or self._owner_group[bid] != g or bid in in_tree):
                    raise InvariantError(
                        f"block {bid} of {child!r} (group {g}) is not filed as its")
                if b.block_hash is None:
                    raise InvariantError(f"block {bid} is in the tree without a hash")
                in_tree[bid] = child
                if self._is_full[g]:
                    if not child.lock:
                        num_unlocked_full += 1
                        if not child.children:
                            candidates.append(bid)
                elif b.ref_cnt == 0:
                    num_free_sw += 1
                    candidates.append(bid)
                if b.ref_cnt and not child.lock:
                    raise InvariantError(f"block {bid} is held but its node is unlocked")
        for b in blocks:
            if (b.block_hash is not None) != (b.block_id in in_tree):
                raise InvariantError(
                    f"block {b.block_id} has hash {b.block_hash!r} but is "
                    f"{'' if b.block_id in in_tree else 'not '}in the tree")
            if self._owner[b.block_id] is not None and b.block_id not in in_tree:
                raise InvariantError(f"block {b.block_id} maps to a detached node")
        for name, got, want in (("nodes", num_nodes, self._num_nodes),
                                ("cached blocks", len(in_tree), self.num_cached_blocks),
                                ("free cached sliding blocks", num_free_sw, self._num_free_sw),
                                ("unlocked full blocks", num_unlocked_full,
                                 self._num_unlocked_full)):
            if got != want:
                raise InvariantError(f"tree holds {got} {name}, counted {want}")
        # Requests.
        refs = [0] * n
        for rid, st, req in _held_states(self):
            tables = st.tables
            if len(tables) != self.num_groups or st.blocks is not tables[0]:
                raise InvariantError(f"request {rid!r}: {len(tables)} tables")
            if len({len(t) for t in tables}) != 1:
                raise InvariantError(f"request {rid!r}: tables of different lengths")
            total, nc = self._idle_bounds(st)
            # NOTE: after a None return the window bound may lag (conservative).
            if st.idle_until != total or st.idle_nc > nc:
                raise InvariantError(
                    f"request {rid!r}: fast-path bounds ({st.idle_until}, {st.idle_nc}) vs "
                    f"({total}, {nc})")
            if -(-req.num_computed_tokens // bs) > len(tables[0]):
                raise InvariantError(
                    f"request {rid!r} has {req.num_computed_tokens} computed tokens but "
                    f"{len(tables[0])} slots")
            path = st.path
            if len(path) > len(tables[0]):
                raise InvariantError(f"request {rid!r}: path of {len(path)} > its slots")
            if st.ns != _namespace(req):
                raise InvariantError(f"request {rid!r}: namespace {st.ns!r} is not its own")
            hashes = req.block_hashes if self.enable_caching else ()
            keys = block_keys(req, 0, len(path), bs) if path else []
            parent = self._roots.get(st.ns)
            for k, node in enumerate(path):
                if id(node) not in nodes_by_id or node.parent is not parent:
                    raise InvariantError(
                        f"request {rid!r}: path node #{k} is not attached in order")
                if node.key != keys[k]:
                    raise InvariantError(f"request {rid!r}: path node #{k} has another key")
                for b in node.blocks:
                    if b is not None and (k >= len(hashes) or b.block_hash != hashes[k]):
                        raise InvariantError(
                            f"request {rid!r}: path node #{k} (block {b.block_id}) is not "
                            "cached under the request's block hash")
                locks[id(node)] += 1
                parent = node
            for g, table in enumerate(tables):
                num_null = check_leading_nulls(table, null, st.num_null[g], rid, g)
                if num_null and self._is_full[g]:
                    raise InvariantError(
                        f"request {rid!r}: full-attention group {g} has null slots")
                for i, b in enumerate(table):
                    if b is null:
                        if i >= num_null:
                            raise InvariantError(
                                f"request {rid!r} group {g}: a null slot after a real block")
                        continue
                    if blocks[b.block_id] is not b:
                        raise InvariantError(f"request {rid!r} holds a foreign block {b.block_id}")
                    refs[b.block_id] += 1
                    if b.block_hash is None:
                        continue
                    if i >= len(path) or path[i].blocks[g] is not b:
                        raise InvariantError(
                            f"request {rid!r} group {g} slot {i} (block {b.block_id}) has a "
                            "hash but is not its path node's block")
        for b in blocks:
            if b.ref_cnt != refs[b.block_id]:
                raise InvariantError(
                    f"block {b.block_id} has ref_cnt {b.ref_cnt} but {refs[b.block_id]} slots "
                    "hold it")
        for key, node in nodes_by_id.items():
            if node.lock != locks[key]:
                raise InvariantError(
                    f"{node!r} has lock {node.lock} but {locks[key]} running paths hold it")
        if not self.enable_caching and self._num_nodes:
            raise InvariantError("caching is off but the tree holds blocks")
        self.policy.check_invariants(candidates)
        by_hash = self._node_by_hash
        if by_hash is not None:  # the hash index: exactly the tree's nodes
            if len(by_hash) != num_nodes:
                raise InvariantError(
                    f"the hash index holds {len(by_hash)} nodes, the tree {num_nodes}")
            for node in nodes_by_id.values():
                h = node.block_hash
                if by_hash.get(h) is not node or any(
                        b is not None and b.block_hash != h for b in node.blocks):
                    raise InvariantError(f"{node!r} is not indexed under its block hash")
        if self._waiting_policy is not None:  # admission drops a request's interest
            held = [r for r in self._waiting_policy.waiting_ids() if r in self._states]
            if held:
                raise InvariantError(f"requests {held[:5]} hold blocks but are still "
                                     "waiting for the queue-aware policy (a leak)")


__all__ = ["RadixHybridKVCacheManager"]
