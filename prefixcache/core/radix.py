"""A radix-tree prefix index (SGLang's RadixAttention) behind ``KVCacheManager``'s API.

``RadixKVCacheManager`` is a sibling of the hash-chain ``KVCacheManager``: the same
constructor keywords and scheduler-facing calls, so the replay and the engine drive
either unchanged. Only the index differs:

* **Hash chain** (vLLM): a block is found by its chained digest; any cached block can
  be evicted, so evicting an interior block leaves the blocks after it cached but
  unreachable ("stranded": no lookup can get past the hole).
* **Radix tree** (SGLang, ``page_size = block_size``): one node per cached block,
  children keyed by the block's token ids plus its extra keys; only unlocked leaves
  are evicted, so every cached block stays reachable (``num_stranded_blocks() == 0``).

Keys. The tree stands in for the hash chain exactly: a node's child key is the
block's token ids as bytes (``Request.token_bytes``: 8 native bytes per id, an exact
encoding of ``tuple(token_ids)``), or ``(token_bytes, extras)`` when the block has
extra keys -- one ``(mm_identifier, item_offset - block_start)`` per multimodal item
overlapping the block (the chain's ``("mm", ...)`` keys) and the cache salt on the
block the chain salts (block 0). The LoRA adapter, which the chain puts on every block,
selects the root: one subtree per ``(lora name, lora path)`` (SGLang's ``extra_key``
namespace). The salt sits in block 0's key rather than in the root: the same thing, as
a salted request's every later block hangs below its salted first block. Two requests
therefore reach the same node iff their chains give the same digest (barring digest
collisions).

NOTE: bytes keys, not tuples of ints: a tuple boxes every id and hashes it item by item
(a key + lookup cost ~2x the bytes one per block in a micro-benchmark; the tree's lookups
were its largest cost over the chain's). The hashes are still kept: ``block.block_hash``
of a node's block is ``request.block_hashes[depth]`` of the request that cached it, for
events, ``cached_block_ids`` and adoption checks; the tree, not the hash, decides hits.

Locks (SGLang's ``lock_ref``). A running request locks every node on its path from the
root: the nodes of its hit blocks and of the blocks it cached. Block tables are
append-only, so a request that fills a block whose key the tree already holds (a
block-aligned prompt's last block, which lookups never hit, or identical outputs) keeps
its own block *uncached* (a duplicate: no hash, reused first once freed) and locks the
existing node instead, continuing its path below it. So a node may be locked while its
block is free (``ref_cnt == 0``): such a block is not available for allocation.

Invariants (``check_invariants`` verifies all of them):
    * Every node holds exactly one block, whose ``block_hash`` is set; a block has a
      hash iff it is a node's; every node is reachable from a root (nothing strands);
      ``num_cached_blocks`` counts the nodes.
    * ``node.lock`` == the number of running requests whose path holds the node; a
      request's path is a chain from its namespace's root and its ``k``-th node has the
      key of the request's block ``k``. Hence a locked node's ancestors are locked and
      an unlocked node's whole subtree is unlocked.
    * A block held by a request (``ref_cnt > 0``) that is a node's is locked (the
      holder's path contains it); each ``ref_cnt`` equals the number of block tables
      holding the block.
    * The pool's free queue holds exactly the blocks with ``ref_cnt == 0``: first the
      ``num_free_unhashed`` blocks without a hash, then the free node blocks.
    * The policy's candidates are exactly the unlocked leaf nodes' blocks.
    * Available blocks (what ``allocate_slots`` may take) = free unhashed blocks +
      unlocked nodes (evictable leaf by leaf); free but locked node blocks are not.
    * A call that raises or returns ``None`` changes no state.

One pool. The tree is an index over a ``BlockPool`` (its ``on_evict`` / ``on_reset``
hooks): the pool owns the ids, reference counts, the free queue, allocation, touch,
release and eviction (events, demotion, miss accounting, counters); the tree keeps the
keys and the locks, hands the policy its candidates (unlocked leaves: ``add`` when a
node becomes one, ``discard`` when it stops being one) and hears each leaf the pool
evicts (``_unlink_leaf``: it unlinks the node and names its parent if that became a
candidate), as SGLang's tree picks leaves and hands their pages back to the allocator.

Host tier (``num_host_blocks > 0``; SGLang's HiCache: device L1, host L2).
The shared ``HostTier`` (``prefixcache/core/host_tier.py``: slots, host policy,
transfers, CPU events, its invariants) sits under the tree exactly as under the hash
chain:

* **Demotion** -- when the pool evicts an unlocked leaf, its block's hash goes
  to a host slot (``HostTransfer("store", block_id, slot)``; a full host first evicts
  one entry by the host policy). The node leaves the tree: the host tier is keyed by
  the block hash (the request's chained digest, equal iff the tree keys are equal: see
  Keys), not by a host-resident node.
* **Lookup** -- the tree walk (device nodes), then block by block in the host by the
  request's block hashes: ``HostHit`` placeholders (``block_id == -1``) after the device
  blocks. A device hit never follows a host hit: the tree holds no node below a block
  it does not hold.
* **Promotion** -- ``allocate_slots`` locks the device hits, pins the host entries,
  takes a fresh device block per host hit (``HostTransfer("load", block_id, slot)``,
  the placeholder's ``block_id`` set), and enters those blocks into the tree below the
  device hits (``BlockStored(medium="GPU")``), locked by the request. ``None`` (does
  not fit) changes nothing, host entries included.
* **Exclusive tiers** -- a hash the tree caches by computing it (a prompt that cannot
  hit its own last block, a chain whose parent the host evicted) leaves the host.

NOTE: the host-resident node alternative (HiCache keeps an evicted node in the tree,
``value`` on host) was not taken: the host policy would then be restricted to host
leaves (evicting an interior host node would strand its host subtree) and the tree
would gain a second node state; moving the hash into the shared ``HostTier`` keeps the
host policy, transfers, events and invariants exactly the hash index's, so radix+host
and hash+host differ only in what the device evicts. The cost: a host entry whose
host parent the host policy evicted is unreachable (as in the hash index's tier)
until the device caches that parent again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

from prefixcache._validate import ArgumentTypeError, check_arrival
from prefixcache.core.block_pool import (
    KV_CACHE_SPEC_KIND,
    BlockPool,
    InvariantError,
    KVCacheBlock,
)
from prefixcache.core.events import device_block_stored
from prefixcache.core.eviction import KeyedPolicy, make_policy
from prefixcache.core.eviction.base import WaitingFanout
from prefixcache.core.hashing import BlockHasher
from prefixcache.core.tiers.host import (HostHit, check_tier_args,
                                        make_host_tier)
from prefixcache.core.kv_cache_manager import (
    BlockPoolViews,
    manager_options,
    _OneGroupManager,
    _build_lower_tiers,
    _check_computed_fit,
    _check_host_hit,
    _check_request,
    _check_tier_hit,
    _check_sizes,
    _held_states,
    _init_lookup_counters,
    _make_prefix_cache_stats,
    _pop_held_state,
    _store_settings,
)
from prefixcache.core.kv_cache_blocks import KVCacheBlocks, empty_blocks
from prefixcache.core.kv_groups import FULL_ATTENTION_LAYOUT
from prefixcache.core.request import Request
from prefixcache.core.tiers import TierHit

_new = object.__new__

INDEX_NAME = "radix"


def _radix_hasher_and_policy(hash_algo, hash_seed, eviction: str, eviction_options,
                             num_blocks: int, block_size: int):
    """The radix index's managers' ``(BlockHasher, EvictionPolicy)``, in this order:
    ``eviction_options`` a mapping or ``None`` (else ``ValueError``), the hash algorithm
    (unknown: ``ValueError``), the policy and its options."""
    if eviction_options is not None and not isinstance(eviction_options, Mapping):
        raise ValueError(
            f"eviction_options must be a mapping or None, got {eviction_options!r}"
        )
    hasher = BlockHasher(hash_algo, hash_seed)  # unknown algo -> ValueError
    policy = make_policy(eviction, num_blocks=num_blocks, block_size=block_size,
                         **dict(eviction_options or {}))
    return hasher, policy


def _check_root(ns, root, payload) -> None:
    """``InvariantError`` unless ``root`` (its ``payload``: ``block`` / ``blocks``) is
    a well-formed root of namespace ``ns`` with children (both trees' rule)."""
    if root.key != ns or payload is not None or root.parent is not None:
        raise InvariantError(f"root of namespace {ns!r} is malformed")
    if not root.children:
        raise InvariantError(f"root of namespace {ns!r} has no children")


def _tree_edges(roots: dict, payload: str):
    """Every ``(parent, child)`` edge of the trees ``roots`` (namespace -> root), depth
    first, each root checked (`_check_root` on its ``payload`` attribute) and each
    child's key and parent link (both trees' ``check_invariants`` rule)."""
    for ns, root in roots.items():
        _check_root(ns, root, getattr(root, payload))
        stack = [root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                if child.key != key or child.parent is not node:
                    raise InvariantError(f"{child!r} is linked wrongly")
                yield node, child
                stack.append(child)


class _Node:
    """One cached block in the tree (a root: ``block is None``, ``key`` = namespace).

    Attributes:
        key: the block's child key under ``parent`` (see the module docstring).
        parent: the parent node (a root for a request's block 0).
        children: child key -> node.
        block: the cached ``KVCacheBlock``.
        lock: running requests whose path holds this node.
    """

    __slots__ = ("key", "parent", "children", "block", "lock")

    def __init__(self, key, parent: "_Node | None", block: KVCacheBlock | None):
        self.key = key
        self.parent = parent
        self.children: dict[Any, _Node] = {}
        self.block = block
        self.lock = 0

    def __repr__(self) -> str:
        bid = self.block.block_id if self.block is not None else None
        return f"_Node(block={bid}, lock={self.lock}, children={len(self.children)})"


class _RadixState:
    """What the manager holds for a running request.

    Attributes:
        request: the request object.
        blocks: its block table (append-only while it runs).
        path: the nodes of its first ``len(path)`` blocks (a chain from its root; node
            ``k`` holds ``blocks[k]`` or, for a duplicate, an equal block).
        ns: the request's namespace (its root's key).
        plain_from: its blocks from this one on have keys without extras.
        idle_until: the decode fast path's bound (as ``KVCacheManager``'s).
    """

    __slots__ = ("request", "blocks", "path", "ns", "plain_from", "idle_until")

    def __init__(self, request, blocks: list[KVCacheBlock], path: list[_Node], ns, bs: int):
        self.request = request
        self.blocks = blocks
        self.path = path
        self.ns = ns
        feats = request.mm_features  # sorted by offset, disjoint: the last ends last
        mm_end = feats[-1].offset + feats[-1].length if feats else 0
        salted = _SALT_BLOCK + 1 if request.cache_salt else 0
        mm_blocks = -(-mm_end // bs)
        self.plain_from = mm_blocks if mm_blocks > salted else salted
        self.idle_until = -1

    @property
    def num_cached_blocks(self) -> int:
        """Leading blocks of ``blocks`` on the tree (the path's length)."""
        return len(self.path)


def _namespace(request) -> tuple[str, str] | None:
    """The root a request's blocks hang under: its LoRA adapter (name, path) or None."""
    lora = request.lora
    return (lora.name, lora.path) if lora is not None else None


# NOTE: the block whose key carries the cache salt: block 0, as in vLLM's chain (the
# salt reaches later blocks through the parent). Should the salt ever enter a later
# block of the chain, this is the one place to change.
_SALT_BLOCK = 0


def extras_by_block(mm_features, cache_salt, block_size: int) -> dict[int, tuple]:
    """The extra part of the keys of a request's blocks that have one, by block index:
    ``(mm_identifier, offset - block_start)`` per overlapping item (offset order), then
    the salt on the salted block. A pure function of (items, salt, block size): the
    manager memoizes it per request shape."""
    bs = block_size
    out: dict[int, list] = {}
    for f in mm_features:  # sorted by offset
        # NOTE: the chain's overlap rule: offset < block end and offset + length >
        # block start.
        for i in range(f.offset // bs, -(-(f.offset + f.length) // bs)):
            out.setdefault(i, []).append((f.identifier, f.offset - i * bs))
    if cache_salt:
        out.setdefault(_SALT_BLOCK, []).append(cache_salt)
    return {i: tuple(v) for i, v in out.items()}


def block_keys(request, first: int, last: int, block_size: int, extras=None) -> list:
    """The tree keys of the request's blocks ``first .. last - 1`` (all full).

    Args:
        request: a ``Request`` with at least ``last * block_size`` tokens.
        first, last: block range.
        block_size: tokens per block.
        extras: ``extras_by_block`` of the request (computed when None).

    Returns:
        One key per block: its token ids as bytes (``Request.token_bytes``), or
        ``(token_bytes, extras)`` for a block with extra keys.
    """
    kb = request.token_bytes(first * block_size, last * block_size)
    w = 8 * block_size
    keys: list = [kb[j : j + w] for j in range(0, len(kb), w)]
    if extras is None:
        extras = extras_by_block(request.mm_features, request.cache_salt, block_size)
    for i, e in extras.items():
        if first <= i < last:
            keys[i - first] = (keys[i - first], e)
    return keys


def _num_unlocked_suffix(nodes) -> int:
    """How many of a path's hit ``nodes`` (root side first) are unlocked. Along a path
    locks never grow with depth (a path holding a node holds its parent), so the
    unlocked ones are a suffix: find where it starts by bisection."""
    lo, hi = 0, len(nodes)
    while lo < hi:
        mid = (lo + hi) // 2
        if nodes[mid].lock:
            lo = mid + 1
        else:
            hi = mid
    return len(nodes) - lo


class RadixKVCacheManager(_OneGroupManager, BlockPoolViews):
    """Allocates KV cache blocks and reuses cached prefixes found in a radix tree.

    Same constructor keywords, calls, return values and errors as ``KVCacheManager``
    (see its docstring); the differences are the index (module docstring) and:

    * Eviction: only unlocked leaf nodes are candidates; the policy
      (``prefixcache.core.eviction``, any registered name) picks among them. Free blocks
      without a hash (never cached, or duplicates) are always reused first.
    * ``free_order`` is accepted and validated for the shared constructor, but the tree
      always reuses unhashed free blocks first (the order of vLLM 0.33's
      ``"unhashed_first"``): the policy, not the queue, orders cached blocks.
    * A duplicate block (its key already cached) is not cached a second time, so
      ``counters()["blocks_cached"]`` counts nodes created and events are emitted only
      for them.

    Args:
        num_blocks, block_size, enable_caching, hash_algo, hash_seed, free_order,
        log_stats, enable_events, max_model_len, int_event_hashes: as ``KVCacheManager``.
        eviction: the eviction policy's registered name.
        eviction_options: keyword options for the policy (e.g. belady's ``future``).
        index: must be ``"radix"``.
        num_host_blocks, host_eviction, host_eviction_options: the host tier (module
            docstring, "Host tier"); as ``KVCacheManager``'s. 0: none, nothing changes.

    Attributes:
        policy: the ``EvictionPolicy`` object.
        blocks: all ``KVCacheBlock`` objects (``blocks[i].block_id == i``).
    """

    # The tree's children are keyed by token bytes: adopted hashes alone do not work.
    KEYS_BY_BLOCK_HASH = False
    INDEX_NAME = INDEX_NAME
    _NODE = _Node  # the tree's node class (_cache_start makes roots of it)

    def __init__(self, num_blocks: int, block_size: int, **options):
        (enable_caching, hash_algo, hash_seed, free_order, log_stats, enable_events,
         max_model_len, int_event_hashes, eviction, eviction_options, index,
         kv_cache_groups, num_host_blocks, host_eviction, host_eviction_options,
         lower_tiers) = manager_options(self, options, lower_tiers=True, checked=True)
        # (a refused layout or tier raised with its reason; a sliding-window layout is
        # another class's: radix_hybrid)
        num_host_blocks, host_options = check_tier_args(
            num_host_blocks, host_eviction, host_eviction_options, enable_caching)
        num_blocks, block_size, max_model_len = _check_sizes(
            num_blocks, block_size, max_model_len, free_order)
        self.hasher, self.policy = _radix_hasher_and_policy(
            hash_algo, hash_seed, eviction, eviction_options, num_blocks, block_size)
        host_tier = make_host_tier(num_host_blocks, host_eviction, host_options,
                                   block_size=block_size, num_device_blocks=num_blocks,
                                   enable_events=enable_events)
        lower = _build_lower_tiers(self, lower_tiers, num_host_blocks, block_size)
        # NOTE: keyed policies that keep KeyedPolicy's on_release / on_cached (a clock
        # tick and one stamp) get them inlined: a Python call per released node was the
        # tree's largest cost over the chain's free (whose LRU is the queue itself).
        cls = type(self.policy)
        keyed = isinstance(self.policy, KeyedPolicy)
        # queue_aware reads the waiting queue: admission drops the request from it.
        self._waiting_policy = self.policy if cls.needs_waiting else None
        self._stamp_release = keyed and cls.on_release is KeyedPolicy.on_release
        self._stamp_cached = keyed and cls.on_cached is KeyedPolicy.on_cached
        self.eviction = eviction
        self.index = index
        self.kv_cache_groups = FULL_ATTENTION_LAYOUT
        self.num_groups = 1
        self._empty = empty_blocks(1)  # the decode fast path's shared empty result
        self._empty_hit = self._empty  # what a lookup answers with caching off
        self._hit_blocks_class = KVCacheBlocks  # what get_computed_blocks wraps hits in
        _store_settings(self, num_blocks, block_size, enable_caching, free_order, log_stats,
                        enable_events, max_model_len)
        self._max_len = max_model_len if max_model_len is not None else 1 << 62
        # The one pool (module docstring, "One pool"): this tree is its index.
        self.block_pool = BlockPool(
            num_blocks, enable_caching=self.enable_caching, enable_events=self.enable_events,
            free_order=free_order, int_event_hashes=int_event_hashes, policy=self.policy,
            on_evict=self._unlink_leaf, on_reset=self._forget_all)
        self.blocks: list[KVCacheBlock] = self.block_pool.blocks
        self._take_blocks = self.block_pool.get_new_blocks  # (no frame of ours)
        self._nodes: list[_Node | None] = [None] * num_blocks  # block id -> its node
        self._roots: dict[Any, _Node] = {}  # namespace -> root (dropped when empty)
        self._num_unlocked_nodes = 0
        self._epoch = 0  # node removals (evictions, resets): invalidates _lookup
        # (request, hit nodes, their blocks, epoch) of the last lookup
        self._lookup: tuple | None = None
        self._extras_memo: dict[tuple, dict[int, tuple]] = {}  # see _extras
        self._states: dict[Any, _RadixState] = {}
        self._states_by_request: dict[Any, _RadixState] = {}
        _init_lookup_counters(self)
        self.device_hit_tokens = 0  # hit tokens adopted at admission (all on the device)
        # The host tier (module docstring, "Host tier"); None without one.
        self.host_tier = host_tier
        self.num_host_blocks = num_host_blocks
        self.host_eviction = host_eviction
        host_policy = host_tier.policy if host_tier is not None else None
        if host_policy is not None and host_policy.needs_waiting:
            # The host tier's policy reads the queue too (queue_aware; as the hash index).
            self._waiting_policy = WaitingFanout(self._waiting_policy, host_policy)
        self.host_hit_tokens = 0  # hit tokens adopted at admission from the host
        if host_tier is not None:
            pool = self.block_pool
            pool.attach_tier(host_tier)  # (the tier queues its CPU events on the pool's)
            # NOTE: instance attributes shadow the methods that learn about host hits
            # (lookup, admission) and the tree's caching (exclusive tiers); with no
            # tier the class methods run, unchanged.
            self._allocate_checked = self._allocate_checked_tiered
            self._cache = self._cache_tiered
            if lower:  # the tiers below the host (prefixcache.core.tiers)
                host_tier.attach_lower(lower, events_owner=pool if self.enable_events else None,
                                       event_hash=pool._event_hash, block_size=block_size)
        # Hit tokens adopted at admission from each tier below the host, by name.
        self._lower_hit_tokens = {t.name: 0 for t in lower}

    @property
    def hash_algo(self) -> str:
        return self.hasher.algo

    def _extras(self, request) -> dict[int, tuple]:
        """``extras_by_block`` of the request, memoized per (items, salt): requests of
        one shape share it (bounded: cleared past 4096 shapes)."""
        feats = request.mm_features
        salt = request.cache_salt
        if not feats and not salt:
            return {}
        k = (feats, salt)
        memo = self._extras_memo
        e = memo.get(k)
        if e is None:
            if len(memo) >= 4096:
                memo.clear()
            e = memo[k] = extras_by_block(feats, salt, self.block_size)
        return e

    def on_arrival(self, request, index: int) -> None:
        """Trace request number ``index`` arrives (forwarded to the policy)."""
        if type(index) is not int or index < 0 or not isinstance(request, Request):
            index = check_arrival(request, index)  # the one rule (every manager)
        if self.policy.needs_future:  # belady reads the request's block hashes
            request.bind_hasher(self.hasher, self.block_size)
        self.policy.on_arrival(request, index)

    def on_waiting(self, request_id, block_hashes) -> None:
        """As ``HashKVCacheManager.on_waiting`` (``queue_aware`` only)."""
        if self._waiting_policy is not None:
            self._waiting_policy.on_waiting(request_id, block_hashes)

    def drop_waiting(self, request_id) -> None:
        """As ``HashKVCacheManager.drop_waiting``."""
        if self._waiting_policy is not None:
            self._waiting_policy.drop_waiting(request_id)

    # -------------------------------------------------------------- scheduling
    def _lookup_nodes(self, request) -> list[_Node]:
        """The nodes of the longest cached path that starts the request (at most
        ``(num_tokens - 1) // block_size``); reads the tree only."""
        _check_request(request)  # (every lookup entry point comes here)
        request.bind_hasher(self.hasher, self.block_size)
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        nodes: list[_Node] = []
        root = self._roots.get(_namespace(request))
        if root is not None and max_blocks:
            append = nodes.append
            children = root.children
            extras = self._extras(request)
            # Tokens are keyed in chunks of 4, 8, 16, ... blocks: a lookup that stops
            # early copies little, a long hit one chunk per doubling.
            start, chunk = 0, 4
            while start < max_blocks:
                end = start + chunk if start + chunk < max_blocks else max_blocks
                for key in block_keys(request, start, end, bs, extras):
                    node = children.get(key)
                    if node is None:
                        break
                    append(node)
                    children = node.children
                else:
                    start, chunk = end, 2 * chunk
                    continue
                break
        return nodes

    def find_longest_cache_hit(self, request: Request) -> tuple[tuple[list, ...], int]:
        """The blocks of the longest cached path that starts the request, as
        ``((blocks,), num_hit_tokens)``: at most ``(num_tokens - 1) // block_size``
        blocks, as in the hash chain. Changes no block state (no locks, ref counts or
        queue order) and counts nothing (``KVCacheManager.get_computed_blocks`` does)."""
        nodes = self._lookup_nodes(request)
        computed = [node.block for node in nodes]
        # NOTE: allocate_slots adopts these nodes without walking them again while the
        # tree has lost no node since (the epoch counts removals); a copy of the list,
        # so that a caller changing the returned one in place is still checked.
        self._lookup = (request, nodes, computed[:], self._epoch)
        tier = self.host_tier
        if tier is not None and (tier.hash_to_slot or tier.lower is not None):
            # The host's run (``HostHit`` placeholders, ``block_id == -1``), then the
            # tiers' below it: the tokens count them all.
            computed += self._host_hits(request, len(nodes))
        return (computed,), len(computed) * self.block_size

    def _num_available(self) -> int:
        return self.block_pool.num_free_unhashed + self._num_unlocked_nodes

    def _allocate_checked(self, request, st, computed, total: int, need: int,
                          num_new_computed_tokens: int):
        """``_allocate_slow`` past the shared admission checks (the hash chain's, with
        its errors): the hit blocks' nodes found, locked and admitted."""
        bs = self.block_size
        ns = _namespace(request)
        nodes = self._adopted_nodes(request, computed, ns) if computed else []
        # Hit nodes not locked yet leave the available blocks when locked.
        num_unlocked_hits = _num_unlocked_suffix(nodes)
        num_held = len(st.blocks) if st is not None else 0
        num_new_blocks = max(-(-need // bs) - num_held - len(computed), 0)
        if num_new_blocks + num_unlocked_hits > self._num_available():
            self.num_failed_allocations += 1
            return None
        # --- state changes from here on -------------------------------------
        if st is None:
            st = self._admit(request, computed, nodes, num_unlocked_hits, ns)
            self._register(request, st, num_new_computed_tokens)
            self.device_hit_tokens += num_new_computed_tokens
        return self._grow_and_cache(request, st, num_new_blocks, total)

    def _admit(self, request, device: list[KVCacheBlock], nodes: list[_Node],
               num_unlocked_hits: int, ns) -> _RadixState:
        """Admit a new request with the device hits ``device`` (the blocks of
        ``nodes``, whose last ``num_unlocked_hits`` are unlocked): lock its path, touch
        the hits through the pool and register its state (a table of its own)."""
        if self._waiting_policy is not None:
            self._waiting_policy.drop_waiting(request.request_id)
        if num_unlocked_hits and not nodes[-1].children:
            # NOTE: only the path's last node can be a leaf (each other has the next
            # as a child), so only it can be a candidate.
            self.policy.discard(nodes[-1].block)
        for node in nodes:
            node.lock += 1
        self.block_pool.touch(device, request)
        self._num_unlocked_nodes -= num_unlocked_hits
        self._lookup = None  # NOTE: holds no request past its admission
        return _RadixState(request, list(device), nodes, ns, self.block_size)

    def _adopted_nodes(self, request, computed: list[KVCacheBlock], ns) -> list[_Node]:
        """The nodes of the hit blocks ``computed``: from the request's last lookup when
        they are its blocks and no node was removed since, else ``_hit_nodes``."""
        lk = self._lookup
        if lk is not None and lk[0] is request and lk[3] == self._epoch:
            n = len(computed)
            # NOTE: list == compares item by item at C speed, identity first (blocks
            # define no __eq__).
            if n <= len(lk[2]) and computed == lk[2][:n]:
                return lk[1][:n]
        return self._hit_nodes(request, computed, ns)

    def _hit_nodes(self, request, computed: list[KVCacheBlock], ns) -> list[_Node]:
        """The nodes of ``computed``; ``ValueError`` unless they are, in order, the
        cached nodes of the request's own first blocks (changes nothing but binding
        the request to this manager's hasher, as a lookup does)."""
        request.bind_hasher(self.hasher, self.block_size)
        hashes = request.block_hashes
        if len(computed) > len(hashes):
            raise ValueError(
                f"request {request.request_id!r} has {len(hashes)} full blocks but "
                f"adopts {len(computed)}"
            )
        parent = self._roots.get(ns)
        nodes_of = self._nodes
        nodes: list[_Node] = []
        append = nodes.append
        for b, h in zip(computed, hashes[: len(computed)]):
            try:
                node = nodes_of[b.block_id]
            except (AttributeError, IndexError, TypeError):
                node = None
            # NOTE: node.block is b rules out foreign blocks (and negative ids).
            if node is None or node.block is not b or node.parent is not parent or (
                parent is None or b.block_hash != h
            ):
                raise ValueError(
                    f"block {getattr(b, 'block_id', b)!r} is not the cached block "
                    f"#{len(nodes)} of request {request.request_id!r}'s prefix in this manager"
                )
            append(node)
            parent = node
        return nodes

    def _unlink_leaf(self, block: KVCacheBlock) -> KVCacheBlock | None:
        """The pool reuses ``block``, an unlocked leaf's (the policy's victim): unlink
        its node (the pool's ``on_evict`` hook). Returns the parent's block when the parent
        became an unlocked leaf (a new candidate), else ``None``."""
        bid = block.block_id
        node = self._nodes[bid]
        if node is None or node.lock or node.children or block.ref_cnt:
            raise InvariantError(
                f"evicting block {bid}: node {node!r}, ref_cnt {block.ref_cnt} (only an "
                "unlocked leaf's free block can be evicted)")
        parent = node.parent
        del parent.children[node.key]
        node.parent = None
        self._nodes[bid] = None
        self._num_unlocked_nodes -= 1
        self._epoch += 1
        if parent.block is None:
            if not parent.children:
                del self._roots[parent.key]
            return None
        if not parent.lock and not parent.children:
            return parent.block  # an unlocked interior node became a leaf
        return None

    def _cache_start(self, st: _RadixState, first: int, num_full: int) -> tuple:
        """``(parent, keys)`` for entering the request's blocks ``first .. num_full - 1``
        (``first == len(st.path)``): the node they go below (the path's last, or the
        namespace's root, made here) and their child keys. Both trees' rule."""
        if first:
            parent = st.path[-1]
        else:
            parent = self._roots.get(st.ns)
            if parent is None:
                parent = self._roots[st.ns] = self._NODE(st.ns, None, None)
        bs = self.block_size
        request = st.request
        if first >= st.plain_from:  # decode blocks: token bytes only
            kb = request.token_bytes(first * bs, num_full * bs)
            w = 8 * bs
            return parent, [kb[j : j + w] for j in range(0, len(kb), w)]
        return parent, block_keys(request, first, num_full, bs, self._extras(request))

    def _cache(self, st: _RadixState, num_full: int, hashes: Sequence[bytes]) -> None:
        """Enter the request's blocks ``len(st.path) .. num_full - 1`` into the tree."""
        policy = self.policy
        nodes = self._nodes
        events = self.enable_events
        run_start = -1  # first block of the current run of new nodes (events)
        num_new = 0
        path, blocks, request = st.path, st.blocks, st.request
        first = len(path)
        parent, keys = self._cache_start(st, first, num_full)
        for i, key in enumerate(keys, first):
            children = parent.children
            child = children.get(key)
            if child is None:
                b = blocks[i]
                if b.block_hash is not None:
                    raise InvariantError(
                        f"block {b.block_id} is being cached but already has hash "
                        f"{b.block_hash.hex()}"
                    )
                h = hashes[i]
                child = _Node(key, parent, b)
                child.lock = 1
                children[key] = child
                b.block_hash = h
                # (the key before it: what the pool demotes the block's key under)
                b.parent_hash = hashes[i - 1] if i else None
                nodes[b.block_id] = child
                num_new += 1
                if self._stamp_cached:  # KeyedPolicy.on_cached, inlined
                    policy.clock += 1
                    policy.cached_at[b.block_id] = policy.clock
                else:
                    policy.on_cached(b, h, request, i)
                if run_start < 0:
                    run_start = i
            else:
                # NOTE: a duplicate: this request's own block stays uncached (block
                # tables are append-only) and its path goes on through the node.
                if not child.lock:
                    self._num_unlocked_nodes -= 1
                    if not child.children:
                        policy.discard(child.block)
                child.lock += 1
                if events and run_start >= 0:
                    self._stored_event(request, hashes, run_start, i)
                run_start = -1
            path.append(child)
            parent = child
        self.block_pool.num_blocks_cached += num_new
        if events and run_start >= 0:
            self._stored_event(request, hashes, run_start, num_full)

    def _stored_event(self, request, hashes, start_block: int, end_block: int) -> None:
        """Queue ``BlockStored`` for the request's new nodes ``start .. end - 1``."""
        bs = self.block_size
        pool = self.block_pool
        eh = pool._event_hash
        pool.events.append(device_block_stored(
            request, list(map(eh, hashes[start_block:end_block])),
            eh(hashes[start_block - 1]) if start_block else None, start_block * bs,
            end_block * bs, bs, spec_kind=KV_CACHE_SPEC_KIND))

    # ------------------------------------------------------------- host tier
    def _host_hits(self, request, start: int) -> list[HostHit]:
        """The host tier's run of the request's blocks from ``start`` (the first block
        the tree does not hold): block by block while the host holds its hash."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        if start >= max_blocks:
            return []
        return self.host_tier.hit_run(request.block_hashes, start, max_blocks)

    def _allocate_checked_tiered(self, request, st, computed, total: int, need: int,
                                 num_new_computed_tokens: int):
        """``_allocate_checked`` with a host tier: the hit list is the tree's nodes then
        host hits; each host hit gets a fresh device block (a load recorded) and becomes
        a node, locked by the request, before its new blocks are taken."""
        bs = self.block_size
        ns = _namespace(request)
        tier = self.host_tier
        num_dev = len(computed)
        for i, b in enumerate(computed):
            if type(b) is HostHit or type(b) is TierHit:
                num_dev = i
                break
        device = computed[:num_dev]
        host = computed[num_dev:]
        if host:
            # NOTE: device hits first, then host hits: the tree holds no node below a
            # block it does not hold, so a lookup never finds a device hit behind a
            # host hit (unlike the hash chain's).
            request.bind_hasher(self.hasher, bs)
            hashes = request.block_hashes
            seen: set[int] = set()
            for i, b in enumerate(host, num_dev):
                if type(b) is TierHit and tier.lower is not None:
                    _check_tier_hit(tier.lower, b, i, hashes, request)
                    continue
                if type(b) is not HostHit:
                    raise (ValueError if type(b) is KVCacheBlock else ArgumentTypeError)(
                        f"new_computed_blocks #{i} ({b!r}) follows a host-tier hit: the radix "
                        "index's hit list is its device blocks, then HostHit objects")
                _check_host_hit(tier, b, i, hashes, seen, request)
        nodes = self._adopted_nodes(request, device, ns) if device else []
        num_unlocked_hits = _num_unlocked_suffix(nodes)
        num_held = len(st.blocks) if st is not None else 0
        num_new_blocks = max(-(-need // bs) - num_held - len(computed), 0)
        if num_new_blocks + len(host) + num_unlocked_hits > self._num_available():
            self.num_failed_allocations += 1
            return None
        # --- state changes from here on -------------------------------------
        if st is None:
            st = self._admit(request, device, nodes, num_unlocked_hits, ns)
            if host:
                # NOTE: pin the entries to load first: the device blocks taken for them
                # may evict leaves, whose demotions then never pick these slots.
                num_lower = 0
                for b in host:
                    if type(b) is HostHit:
                        tier.pin(b.host_slot)
                    else:
                        b.tier.pin(b.block_hash)
                        num_lower += 1
                fresh = self._take_blocks(len(host))
                for b, blk in zip(host, fresh):
                    if type(b) is HostHit:
                        tier.load(b.host_slot, blk.block_id)
                    else:
                        tier.lower.load(b, blk.block_id)
                        self._lower_hit_tokens[b.tier.name] += bs
                    b.block_id = blk.block_id
                st.blocks.extend(fresh)
                # The loaded blocks become nodes below the device hits (GPU BlockStored).
                self._cache(st, len(st.blocks), hashes)
            self._register(request, st, num_new_computed_tokens)
            self.device_hit_tokens += len(device) * bs
            self.host_hit_tokens += (len(host) - num_lower if host else 0) * bs
        return self._grow_and_cache(request, st, num_new_blocks, total)

    def _cache_tiered(self, st: _RadixState, num_full: int, hashes: Sequence[bytes]) -> None:
        """``_cache`` with a host tier: a hash the tree now holds leaves the host
        (exclusive tiers: the device computed it again, ``num_discarded``); the host
        policy's chain position and priority are recorded per new node's block."""
        first = len(st.path)
        RadixKVCacheManager._cache(self, st, num_full, hashes)
        tier = self.host_tier
        if tier.track_origin:
            pos_of = tier.device_position
            prio_of = tier.device_priority
            hint_of = tier.device_retention
            prio = st.request.priority
            hint = getattr(st.request, "retention", None)
            blocks = st.blocks
            path = st.path
            for pos in range(first, num_full):
                b = blocks[pos]
                if path[pos].block is b:  # a new node (not a duplicate's)
                    pos_of[b.block_id] = pos
                    prio_of[b.block_id] = prio
                    hint_of[b.block_id] = hint
        on_host = tier.hash_to_slot
        # NOTE: one C-level disjointness test; the per-hash loop only on an overlap. (A
        # duplicate's hash is a device node's: never on the host.)
        if on_host and not on_host.keys().isdisjoint(hashes[first:num_full]):
            for h in hashes[first:num_full]:
                if h in on_host:
                    tier.discard(h)
        if tier.lower is not None:
            tier.lower.discard_cached(hashes[first:num_full])

    def free(self, request) -> None:
        """Release a request's blocks and unlock its path (deepest node first, so with
        LRU its last block is evicted first, as in the hash chain).

        Raises:
            ValueError: the request holds no blocks here (nothing changed).
        """
        # The one rule (_validate.held_state): the admitted Request or its id; and what
        # the release reads is checked first, so it cannot fail half way.
        st = _pop_held_state(self, request)
        req = st.request
        # Blocks: cached ones to the queue's tail, unhashed ones to its head.
        self.block_pool.free_blocks(reversed(st.blocks))
        # Path: deepest first. Only its last node can be a leaf (each other node has
        # the next as a child), so only it can become a candidate.
        policy = self.policy
        path = st.path
        for node in path:
            node.lock -= 1
        # (locks never grow with depth: the nodes this release unlocks are a suffix)
        num_unlocked = _num_unlocked_suffix(path)
        positions = range(len(path) - 1, len(path) - 1 - num_unlocked, -1)
        if self._stamp_release:  # KeyedPolicy.on_release, inlined
            clock = policy.clock
            released_at = policy.released_at
            for i in positions:
                clock += 1
                released_at[path[i].block.block_id] = clock
            policy.clock = clock
        else:
            on_release = policy.on_release
            for i in positions:
                on_release(path[i].block, req, i)
        if num_unlocked:
            self._num_unlocked_nodes += num_unlocked
            if not path[-1].children:
                self.policy.add(path[-1].block)

    # ------------------------------------------------------------- inspection
    def get_block_ids(self, request_id) -> list[int]:
        """The request's block table as block ids. Unknown id -> ``ValueError``."""
        st = self._states.get(request_id)
        if st is None:
            raise ValueError(f"unknown request id {request_id!r}: it holds no blocks")
        return [b.block_id for b in st.blocks]

    def get_blocks(self, request_id) -> list[KVCacheBlock]:
        """The request's block objects (a copy of the list)."""
        st = self._states.get(request_id)
        if st is None:
            raise ValueError(f"unknown request id {request_id!r}: it holds no blocks")
        return list(st.blocks)

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation may take now: free unhashed blocks + unlocked nodes."""
        return self.block_pool.num_free_unhashed + self._num_unlocked_nodes

    def num_stranded_blocks(self) -> int:
        """Cached blocks no lookup can reach: those not reachable from a root (O(tree)).

        Always 0 for the tree (only leaves are evicted); computed, not assumed, so a
        broken tree shows here and in ``check_invariants``.
        """
        reachable = 0
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            children = node.children.values()
            reachable += len(children)
            stack.extend(children)
        return sum(1 for b in self.blocks if b.block_hash is not None) - reachable

    def _forget_all(self) -> None:
        """The pool dropped every key (``reset_prefix_cache``; its ``on_reset`` hook):
        the tree forgets every node."""
        self._forget_tree()
        self._roots = {}
        self._epoch += 1
        self._lookup = None

    def _forget_tree(self) -> None:
        """``_forget_all``'s part that is this tree's own (its node maps)."""
        self._nodes = [None] * self.num_blocks
        self._num_unlocked_nodes = 0

    make_prefix_cache_stats = _make_prefix_cache_stats

    # -------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        """Verify the tree, locks, pool and request bookkeeping (module docstring);
        raise ``InvariantError`` naming the block or request if broken."""
        blocks = self.blocks
        n = self.num_blocks
        bs = self.block_size
        for i, b in enumerate(blocks):
            if b.block_id != i:
                raise InvariantError(f"blocks[{i}] has block_id {b.block_id}")
        self.block_pool.check_invariants()  # (the queue, unhashed blocks first)
        # Tree: every node reachable, one block each, keys consistent.
        locks: dict[int, int] = {}
        num_nodes = num_unlocked = 0
        candidates = []
        for node, child in _tree_edges(self._roots, "block"):
            b = child.block
            if (
                b is None or blocks[b.block_id] is not b
                or self._nodes[b.block_id] is not child
            ):
                raise InvariantError(f"a node has no block of this manager: {child!r}")
            if b.block_hash is None:
                raise InvariantError(f"block {b.block_id} is a node but has no hash")
            if b.block_id in locks:
                raise InvariantError(f"block {b.block_id} is in the tree twice")
            locks[b.block_id] = 0
            num_nodes += 1
            if not child.lock:
                num_unlocked += 1
                if not child.children:
                    candidates.append(b.block_id)
            if node.block is not None and node.lock == 0 and child.lock:
                raise InvariantError(
                    f"block {b.block_id} is locked under the unlocked block "
                    f"{node.block.block_id}"
                )
        for b in blocks:
            if (b.block_hash is not None) != (b.block_id in locks):
                raise InvariantError(
                    f"block {b.block_id} has hash {b.block_hash!r} but is "
                    f"{'' if b.block_id in locks else 'not '}a reachable node"
                )
            node = self._nodes[b.block_id]
            if node is not None and b.block_id not in locks:
                raise InvariantError(f"block {b.block_id} maps to a detached node")
        if num_nodes != self.num_cached_blocks:
            raise InvariantError(
                f"tree holds {num_nodes} nodes, num_cached_blocks {self.num_cached_blocks}"
            )
        if num_unlocked != self._num_unlocked_nodes:
            raise InvariantError(
                f"{num_unlocked} unlocked nodes, counted {self._num_unlocked_nodes}"
            )
        # Requests: tables, paths, locks and ref counts.
        refs = [0] * n
        for rid, st, req in _held_states(self):
            tbl = st.blocks
            path = st.path
            if len(path) > len(tbl):
                raise InvariantError(f"request {rid!r}: path of {len(path)} > {len(tbl)} blocks")
            if len(set(map(id, tbl))) != len(tbl):
                raise InvariantError(
                    f"request {rid!r} holds a block twice: {[b.block_id for b in tbl]}"
                )
            if st.idle_until != self._idle_bound(st):
                raise InvariantError(
                    f"request {rid!r}: decode fast-path bound {st.idle_until} != "
                    f"{self._idle_bound(st)}"
                )
            if st.ns != _namespace(req):
                raise InvariantError(f"request {rid!r}: namespace {st.ns!r} is not its own")
            hashes = req.block_hashes if self.enable_caching else ()
            keys = block_keys(req, 0, len(path), bs) if path else []  # not the memo
            parent = self._roots.get(st.ns)
            for k, node in enumerate(path):
                b = node.block
                if b is None or self._nodes[b.block_id] is not node or node.parent is not parent:
                    raise InvariantError(
                        f"request {rid!r}: path node #{k} is not attached in order"
                    )
                if node.key != keys[k]:
                    raise InvariantError(
                        f"request {rid!r}: path node #{k} (block {b.block_id}) has another key"
                    )
                if k >= len(hashes) or b.block_hash != hashes[k]:
                    raise InvariantError(
                        f"request {rid!r}: path node #{k} (block {b.block_id}) is not cached "
                        "under the request's block hash"
                    )
                if tbl[k] is not b and tbl[k].block_hash is not None:
                    raise InvariantError(
                        f"request {rid!r} block #{k} (id {tbl[k].block_id}) is neither the "
                        f"node's block {b.block_id} nor an uncached duplicate"
                    )
                locks[b.block_id] += 1
                parent = node
            for k, b in enumerate(tbl):
                if blocks[b.block_id] is not b:
                    raise InvariantError(f"request {rid!r} holds a foreign block {b.block_id}")
                refs[b.block_id] += 1
                if k >= len(path) and b.block_hash is not None:
                    raise InvariantError(
                        f"request {rid!r} block #{k} (id {b.block_id}) is past its path of "
                        f"{len(path)} but has a hash"
                    )
            _check_computed_fit(rid, req, len(tbl), bs)
        for b in blocks:
            if b.ref_cnt != refs[b.block_id]:
                raise InvariantError(
                    f"block {b.block_id} has ref_cnt {b.ref_cnt} but {refs[b.block_id]} "
                    "requests hold it"
                )
            node = self._nodes[b.block_id]
            if node is not None:
                if node.lock != locks[b.block_id]:
                    raise InvariantError(
                        f"node of block {b.block_id} has lock {node.lock} but "
                        f"{locks[b.block_id]} running paths hold it"
                    )
                if b.ref_cnt and not node.lock:
                    raise InvariantError(f"block {b.block_id} is held but its node is unlocked")
        if not self.enable_caching and num_nodes:
            raise InvariantError("caching is off but the tree holds blocks")
        self.policy.check_invariants(candidates)
        if self._waiting_policy is not None:  # admission drops a request's interest
            held = [r for r in self._waiting_policy.waiting_ids() if r in self._states]
            if held:
                raise InvariantError(f"requests {held[:5]} hold blocks but are still "
                                     "waiting for the queue-aware policy (a leak)")
        if self.host_tier is not None:
            # Exclusive tiers, the host map <-> slots, the host policy's candidates.
            self.host_tier.check_invariants(
                {b.block_hash for b in blocks if b.block_hash is not None})
