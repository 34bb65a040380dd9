"""Block pool: preallocated KV cache blocks, the LRU free queue and the hash map.

The design of vLLM's ``vllm/v1/core/block_pool.py`` and
``kv_cache_utils.py``: every ``KVCacheBlock`` is created once, up front; free blocks
sit in an intrusive doubly linked list threaded through the blocks themselves (O(1)
removal from the middle when a cached block is hit); full blocks are findable by their
chained hash; a block table is append-only, so two blocks may hold the same content
under the same hash.

Unlike vLLM there is no reserved null block: ids ``0 .. num_blocks - 1`` are all
allocatable (the device keeps a separate padding page, see docs/DESIGN.md); a pool of
several KV cache groups has a ``null_block`` outside the pool (id ``num_blocks``).

There is one pool class. What varies is given to it as components:

* the **eviction policy** (``prefixcache.core.eviction``): ``None`` runs vLLM's LRU on
  the intrusive free queue itself -- the one specialised path, with no Python call per
  block -- and any ``EvictionPolicy`` decides which free cached block is reused
  (``policy="lru"`` gives exactly the queue's order: a test pins it);
* the **group layout**: ``groups=None`` keys the hash map by digest (one
  full-attention group); with KV cache groups each key is ``digest + group id``
  (``cache_group_blocks``), events carry ``group_idx``, and a null block pads skipped
  slots;
* the **tier** under the pool (``attach_tier``, ``prefixcache.core.tiers``): an evicted
  block's key is demoted to it, and caching a key the tier holds drops it there (the
  tiers stay exclusive);
* the **index** that finds cached blocks: by default the pool's own hash map (vLLM's);
  an index that keeps its own keys (the radix tree, ``prefixcache.core.radix``) and
  decides which free cached blocks the policy may evict (SGLang's unlocked leaves)
  gives the pool two hooks (``on_evict``, ``on_reset``): the pool still owns the ids,
  reference counts, the free queue, the touch, the release and the eviction (event,
  demotion, miss accounting, counters), and tells the index each block it evicts.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from prefixcache._validate import check_host_memory
from prefixcache.core.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    KVCacheEvent,
    device_block_stored,
    event_extra_keys,
)

FREE_ORDERS = ("append", "unhashed_first")
# Host memory per block (the KVCacheBlock object, its id and list slot: ~112 bytes
# measured with tracemalloc for 1M blocks), for the up-front memory check.
HOST_BYTES_PER_BLOCK = 128
KV_CACHE_SPEC_KIND = "full_attention"  # the one KV cache group's kind, as vLLM names it
_MASK64 = (1 << 64) - 1
_KEY_BYTES = 4  # the group id's bytes at the end of a cache key (vLLM's layout)


def group_suffix(group_id: int) -> bytes:
    """The 4 big-endian bytes that follow a block hash in group ``group_id``'s keys."""
    return group_id.to_bytes(_KEY_BYTES, "big", signed=False)


def _int_block_hash(h: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash`` with int hashes on (its default)."""
    return int.from_bytes(h, "big") & _MASK64


def _bytes_block_hash(h: bytes) -> bytes:
    return h


class InvariantError(AssertionError):
    """The pool's bookkeeping is inconsistent (a bug, never a caller error)."""


class KVCacheBlock:
    """Metadata of one KV cache block (the KV data lives on the device).

    Attributes:
        block_id: index of the block's page in the KV array, ``0 .. num_blocks-1``.
        ref_cnt: number of running requests whose block table holds this block.
        block_hash: the chained digest of the block's tokens while the block is full
            and cached; ``None`` otherwise (reset when the block is evicted).
        prev_free_block / next_free_block: links of the free queue; both ``None``
            exactly when the block is not in the queue. Only ``FreeKVCacheBlockQueue``
            touches them.
        parent_hash: while the block is cached, the digest of the block before it in
            its chain (``None`` for a first block); stale otherwise. Read only by
            ``stranded_block_ids``.
    """

    __slots__ = (
        "block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block",
        "parent_hash",
    )

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.parent_hash: bytes | None = None

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        h = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={h}, prev_free_block={prev_id}, next_free_block={next_id})"
        )


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, threaded through the blocks themselves.

    Invariants:
        * The order is the eviction order: the head is evicted (reused) first.
          With ``free_order="append"`` the head is the least recently freed block,
          and within one freed request the block holding more tokens comes first.
        * A block is in the queue iff its ``ref_cnt`` is 0; its links are ``None``
          iff it is not in the queue.
        * ``num_free_blocks`` equals the number of blocks between the two sentinels.

    No Python objects are allocated while the list is manipulated (two sentinel
    blocks with ids -1 and -2 bound the list).
    """

    __slots__ = ("num_free_blocks", "head", "tail")

    def __init__(self, blocks: Sequence[KVCacheBlock]):
        self.num_free_blocks = len(blocks)
        self.head = KVCacheBlock(-1)  # sentinel before the first free block
        self.tail = KVCacheBlock(-2)  # sentinel after the last free block
        prev = self.head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.tail
        self.tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block. Raises ``ValueError`` when empty."""
        if self.num_free_blocks == 0:
            raise ValueError("no free blocks")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks (caller checked ``n <= free``)."""
        head = self.head
        cur = head.next_free_block
        out = []
        append = out.append
        for _ in range(n):
            append(cur)
            nxt = cur.next_free_block
            cur.prev_free_block = cur.next_free_block = None
            cur = nxt
        head.next_free_block = cur
        cur.prev_free_block = head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue in O(1)."""
        prev = block.prev_free_block
        nxt = block.next_free_block
        if prev is None or nxt is None:
            raise InvariantError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the tail, in the given order (last one becomes the tail)."""
        tail = self.tail
        self._link(tail.prev_free_block, tail, blocks)

    def _link(self, prev: KVCacheBlock, nxt: KVCacheBlock,
              blocks: Sequence[KVCacheBlock]) -> None:
        """Link ``blocks``, in order, between the adjacent ``prev`` and ``nxt``."""
        if not blocks:
            return
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def release(self, ordered_blocks: Iterable[KVCacheBlock], unhashed_first: bool) -> int:
        """Drop one reference from each block; blocks reaching 0 join the queue.

        Blocks go to the tail in the given order, except -- with ``unhashed_first`` --
        never-cached ones (``block_hash is None``), which go to the head afterwards
        (LIFO). Returns how many went to the head.

        NOTE: one pass, the tail linked in as blocks come (``append_n`` inlined: this
        runs once per freed block).
        """
        tail = self.tail
        last = tail.prev_free_block
        first: list[KVCacheBlock] = []
        n = 0
        for block in ordered_blocks:
            rc = block.ref_cnt - 1
            block.ref_cnt = rc
            if rc == 0:
                if unhashed_first and block.block_hash is None:
                    # Never-cached blocks can never be hit: reuse them first (LIFO);
                    # cached ones go to the tail for LRU eviction (vLLM's order).
                    first.append(block)
                else:
                    block.prev_free_block = last
                    last.next_free_block = block
                    last = block
                    n += 1
            elif rc < 0:
                raise InvariantError(f"block {block.block_id} freed below ref_cnt 0")
        last.next_free_block = tail
        tail.prev_free_block = last
        self.num_free_blocks += n
        if first:
            self.prepend_n(first)
        return len(first)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the head, in the given order (first one becomes the head)."""
        head = self.head
        self._link(head, head.next_free_block, blocks)

    def block_ids(self) -> list[int]:
        """The free block ids, head (next to be reused) first."""
        out = []
        cur = self.head.next_free_block
        tail = self.tail
        while cur is not tail:
            out.append(cur.block_id)
            cur = cur.next_free_block
        return out


class BlockPool:
    """Owns all blocks, the free queue, the hash map, the null block and events.

    Invariants (checked by ``check_invariants``):
        * ``blocks[i].block_id == i``; every ``ref_cnt >= 0``.
        * A block is in the free queue iff ``ref_cnt == 0``.
        * ``cached_block_hash_to_block`` maps a key to one block, or to a
          ``{block_id: block}`` dict (>= 1 entries) when several blocks were cached
          under the same key; a block is in the map under ``h`` iff
          ``block.block_hash == h``.
        * Lookups return the block inserted first among those still cached (vLLM's
          ``get_one_block`` order), so hits and block ids match vLLM exactly.
        * With a policy: the free blocks that hold no key are the queue's head, and
          the free cached blocks are exactly the policy's candidates.

    Args:
        num_blocks: number of allocatable blocks (ids ``0 .. num_blocks - 1``).
        enable_caching: cache full blocks by hash (prefix caching).
        enable_events: queue ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``.
        free_order: ``"append"`` (the seed's: all freed blocks to the tail) or
            ``"unhashed_first"`` (vLLM >= 0.11: freed blocks without a hash to the
            head, hashed ones to the tail; each group in the given order). With a
            policy, freed blocks without a key always go to the head.
        int_event_hashes: events carry ``int.from_bytes(digest[-8:], "big")`` (vLLM's
            default) instead of the raw digest bytes.
        policy: ``None`` (the free queue's LRU) or an ``EvictionPolicy`` built for
            ``num_blocks`` blocks.
        groups: ``None`` (one full-attention group, keys are digests) or the checked
            KV cache groups (``kv_groups.check_kv_cache_groups``): keys carry the
            group id, events name each group's spec.
        on_evict, on_reset: ``None`` (the hash map is the index) or the hooks of an
            index that keeps its own keys. Such an index sets ``block.block_hash``
            (and ``block.parent_hash``, the key before it, for the tier's demotion) on
            the blocks it caches, and hands the policy its candidates itself (``add``
            / ``discard``; needs a policy); the pool evicts a candidate as a hash-map
            block and calls ``on_evict(block)`` first (the index drops it; it returns
            a block that became a candidate by this, added to the policy after
            ``on_evicted``, or ``None``); ``on_reset()`` after a reset dropped every
            key. Freed blocks without a key then always go to the queue's head and
            ``num_free_unhashed`` counts them (the index's free cached blocks need not
            all be candidates).
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        enable_caching: bool = True,
        enable_events: bool = False,
        free_order: str = "append",
        int_event_hashes: bool = True,
        policy=None,
        groups=None,
        on_evict=None,
        on_reset=None,
    ):
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if free_order not in FREE_ORDERS:
            raise ValueError(f"unknown free_order {free_order!r}; expected one of {FREE_ORDERS}")
        from prefixcache.core.eviction.base import EvictionPolicy
        if policy is not None:
            if not isinstance(policy, EvictionPolicy):
                raise TypeError(
                    f"policy must be an EvictionPolicy, got {type(policy).__name__}")
            if policy.num_blocks != num_blocks:
                raise ValueError(
                    f"policy was built for {policy.num_blocks} blocks, the pool has "
                    f"{num_blocks}")
        if (on_evict is None) != (on_reset is None) or on_evict is not None and (
                policy is None or groups is not None):
            raise ValueError(
                "a BlockPool's on_evict= and on_reset= come together, with a policy (the "
                "index hands it the candidates) and no groups= (the group-keyed hash map "
                "is the pool's own)")
        check_host_memory(f"a block pool of num_blocks={num_blocks}",
                          num_blocks * HOST_BYTES_PER_BLOCK)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.free_order = free_order
        self.policy = policy
        # NOTE: most policies keep the protocol's no-op on_hit / on_evicted: touch and
        # eviction skip the call per block then (None).
        cls = type(policy)
        self._on_hit = (None if policy is None or cls.on_hit is EvictionPolicy.on_hit
                        else policy.on_hit)
        self._on_evicted = (None if policy is None or cls.on_evicted is EvictionPolicy.on_evicted
                            else policy.on_evicted)
        self.groups = groups
        self.on_evict = on_evict  # (None: the hash map is the index)
        self.on_reset = on_reset
        # With an index of its own: the free blocks without a key (the queue's head).
        self.num_free_unhashed = num_blocks
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        # NOTE: the padding page of a multi-group layout; not in self.blocks (ids
        # 0..num_blocks-1 stay the pool).
        self.null_block = KVCacheBlock(num_blocks) if groups is not None else None
        self.events: list[KVCacheEvent] = []
        # NOTE: vLLM publishes the low 64 bits of each digest (big-endian) as an int
        # unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0; routers expect that default.
        self._event_hash = _int_block_hash if int_event_hashes else _bytes_block_hash
        # The tier under this pool (``attach_tier``); None: evicted keys are dropped.
        self.host_tier = None
        # Cumulative counters (never reset).
        self.num_evictions = 0  # cached blocks whose hash was dropped to reuse them
        self.num_blocks_cached = 0  # blocks that entered the hash map
        self.num_blocks_allocated = 0  # blocks popped from the free queue
        self.num_blocks_cleared = 0  # cached blocks dropped by reset_prefix_cache
        # Miss accounting's hook (``prefixcache.core.misses``): a dict that each eviction
        # sets ``evicted_by[block_hash] = "device"`` in (a reset replaces it with a new
        # empty dict); ``None`` (the default) costs one test per eviction.
        self.evicted_by: dict | None = None
        # With groups (``misses.GroupProbeAccountant``, no tier): the suffix of the one
        # group whose evictions ``evicted_by`` gets, as plain digests (the other groups'
        # cost one ``endswith``); ``None``: ``evicted_by`` takes every ``(hash, group)``
        # key (a filtering hook: ``misses.GroupEvictions``).
        self.evicted_suffix: bytes | None = None

    def attach_tier(self, tier) -> None:
        """Put ``tier`` (a host tier, ``prefixcache.core.tiers.host``) under this pool:
        evicted keys are demoted to it, cached keys leave it."""
        self.host_tier = tier
        tier.pool = self
        tier._event_hash = self._event_hash

    # ------------------------------------------------------------------ lookups
    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """A block cached under ``block_hash`` (the first inserted), or ``None``."""
        b = self.cached_block_hash_to_block.get(block_hash)
        if b is None or type(b) is KVCacheBlock:
            return b
        return next(iter(b.values()))

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the hash map now (O(1), from the counters)."""
        return self.num_blocks_cached - self.num_evictions - self.num_blocks_cleared

    def stranded_block_ids(self) -> list[int]:
        """Cached blocks no lookup can reach: some earlier block of their chain is not
        cached (evicted), so every lookup stops before them. O(cached blocks)."""
        cached = self.cached_block_hash_to_block
        # NOTE: first one cheap pass: a stranded block exists only if some cached block's
        # parent is not cached (with lru a freed request's deepest block goes first, so
        # usually none is, and this pass is all the work).
        parents = {b.parent_hash for b in self.blocks if b.block_hash is not None}
        parents.discard(None)
        if parents <= cached.keys():
            return []
        parent_of = {b.block_hash: b.parent_hash for b in self.blocks if b.block_hash is not None}
        reach: dict[bytes, bool] = {}  # cached hash -> a lookup can reach it
        out = []
        chain: list[bytes] = []  # NOTE: one list reused (few allocations: see replay)
        for b in self.blocks:
            h = b.block_hash
            if h is None:
                continue
            ok = reach.get(h)
            if ok is None:
                cur = h
                while True:
                    chain.append(cur)
                    p = parent_of[cur]
                    if p is None:  # the chain's first block
                        ok = True
                        break
                    ok = reach.get(p)
                    if ok is not None:
                        break
                    if p not in cached:  # an earlier block was evicted
                        ok = False
                        break
                    cur = p
                for x in chain:
                    reach[x] = ok
                chain.clear()
            if not ok:
                out.append(b.block_id)
        return out

    # ------------------------------------------------------------- allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks, evicting cached ones.

        Without a policy: from the queue head (vLLM's LRU). With one: the free blocks
        that hold no key first (the queue's head), then the policy's victims. Each
        block gets ``ref_cnt = 1``; a block that was cached loses its key (demoted to
        the tier when there is one; a ``BlockRemoved`` event when events are on).
        """
        q = self.free_block_queue
        if num_blocks > q.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: only {q.num_free_blocks} free")
        policy = self.policy
        if policy is None:
            ret = q.popleft_n(num_blocks)
            self.num_blocks_allocated += num_blocks
            for block in ret:
                if block.block_hash is not None:
                    self._evict(block)
                block.ref_cnt = 1
            return ret
        on_evict = self.on_evict
        if on_evict is None:
            num_unhashed = q.num_free_blocks - len(policy)
        else:
            num_unhashed = self.num_free_unhashed
        k = num_blocks if num_blocks < num_unhashed else num_unhashed
        ret = q.popleft_n(k) if k > 0 else []
        if on_evict is not None:
            self.num_free_unhashed = num_unhashed - k
        on_evicted = self._on_evicted
        for _ in range(num_blocks - k):
            victim = policy.pop()
            q.remove(victim)
            leaf = on_evict(victim) if on_evict is not None else None
            self._evict(victim)
            if on_evicted is not None:
                on_evicted(victim)
            if leaf is not None:
                policy.add(leaf)  # (the index's new candidate: an unlocked leaf)
            ret.append(victim)
        self.num_blocks_allocated += num_blocks
        for block in ret:
            block.ref_cnt = 1
        return ret

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop ``block``'s key from the hash map (it is being reused); demote the key
        to the tier below when no other block holds it."""
        key = block.block_hash
        cached = self.cached_block_hash_to_block
        cur = cached.pop(key, None)
        if cur is None:
            if self.on_evict is None:
                raise InvariantError(
                    f"block {block.block_id} has hash {key.hex()} that is not in the "
                    "hash map")
            # (an index of its own: the key was never the map's; the rest is shared)
        elif type(cur) is dict:
            if cur.pop(block.block_id, None) is None:
                raise InvariantError(f"block {block.block_id} missing under its hash {key.hex()}")
            if cur:
                cached[key] = cur
        elif cur is not block:
            cached[key] = cur
            raise InvariantError(
                f"hash {key.hex()} maps to block {cur.block_id}, not to block "
                f"{block.block_id} that carries it")
        block.block_hash = None
        self.num_evictions += 1
        ev = self.evicted_by
        if self.groups is None:
            if ev is not None:
                ev[key] = "device"
            if self.enable_events:
                self.events.append(BlockRemoved(
                    block_hashes=[self._event_hash(key)], medium=MEDIUM_GPU, group_idx=0))
        else:
            if ev is not None:
                sfx = self.evicted_suffix
                if sfx is None:
                    ev[key] = "device"  # (the (hash, group) key: misses.GroupEvictions)
                elif key.endswith(sfx):
                    ev[key[:-_KEY_BYTES]] = "device"  # (the tracked group's digest)
            if self.enable_events:
                self.events.append(BlockRemoved(
                    block_hashes=[self._event_hash(key[:-_KEY_BYTES])], medium=MEDIUM_GPU,
                    group_idx=int.from_bytes(key[-_KEY_BYTES:], "big")))
        tier = self.host_tier
        # NOTE: a duplicate device block may still hold the key: then it stays here.
        if tier is not None and key not in cached:
            tier.store(block.block_id, key, block.parent_hash)

    def touch(self, blocks: Iterable[KVCacheBlock], request=None) -> None:
        """Take a reference on prefix-hit blocks (out of the free queue if unused).

        ``request`` (the one adopting them) is for the eviction policy only."""
        n = 0
        policy = self.policy
        # NOTE: an index of its own takes its candidates out of the policy itself (a
        # free cached block need not be one); the policy hears every hit either way.
        discard = policy.discard if policy is not None and self.on_evict is None else None
        on_hit = self._on_hit
        for block in blocks:
            if block.ref_cnt == 0:
                # Unlink from the free queue in O(1) (FreeKVCacheBlockQueue.remove,
                # inlined: this runs once per hit block).
                prev = block.prev_free_block
                nxt = block.next_free_block
                prev.next_free_block = nxt
                nxt.prev_free_block = prev
                block.prev_free_block = block.next_free_block = None
                n += 1
                if discard is not None:
                    discard(block)
            block.ref_cnt += 1
            if on_hit is not None:
                on_hit(block, request)
        self.free_block_queue.num_free_blocks -= n

    def cache_full_blocks(
        self,
        request,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
    ) -> None:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` into the hash map (one
        full-attention group: keys are the digests).

        Args:
            request: the owning request (for event token ids and extra keys).
            blocks: the request's block table.
            block_hashes: the request's full-block digests (at least
                ``num_full_blocks`` of them).
            num_cached_blocks: blocks of the table already cached.
            num_full_blocks: blocks that are full after this step.
            block_size: tokens per block.
        """
        if len(block_hashes) < num_full_blocks:
            raise InvariantError(
                f"caching blocks up to {num_full_blocks} with only {len(block_hashes)} "
                "block hashes"
            )
        # NOTE: one slice of each (a Request's hashes are a read-only view whose
        # per-item indexing is a Python-level call); the hashes' slice starts at the
        # parent of the first new block (kept as each block's parent_hash).
        if num_cached_blocks:
            hashes = block_hashes[num_cached_blocks - 1:num_full_blocks]
            parents = hashes[:-1]
            hashes = hashes[1:]
        else:
            hashes = block_hashes[:num_full_blocks]
            parents = [None, *hashes[:-1]]
        self._insert(blocks[num_cached_blocks:num_full_blocks], hashes, parents)
        self.num_blocks_cached += num_full_blocks - num_cached_blocks
        if self.enable_events:
            eh = self._event_hash
            self.events.append(device_block_stored(
                request, list(map(eh, hashes)),
                eh(block_hashes[num_cached_blocks - 1]) if num_cached_blocks else None,
                num_cached_blocks * block_size, num_full_blocks * block_size, block_size,
                spec_kind=KV_CACHE_SPEC_KIND))
        policy = self.policy
        if policy is not None:
            on_cached = policy.on_cached
            for pos in range(num_cached_blocks, num_full_blocks):
                blk = blocks[pos]
                on_cached(blk, blk.block_hash, request, pos)
        tier = self.host_tier
        if tier is not None:  # (hashes: the new blocks' keys)
            self._cached_on_tier(tier, request, blocks, range(num_cached_blocks,
                                                             num_full_blocks), hashes)
            if tier.lower is not None:
                tier.lower.discard_cached(hashes)

    def cache_group_blocks(self, request, blocks: Sequence[KVCacheBlock],
                           block_hashes: Sequence[bytes], num_cached_blocks: int,
                           num_full_blocks: int, block_size: int, group_id: int) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]`` of group ``group_id``
        under ``(hash, group_id)`` keys, skipping null slots (vLLM's
        ``cache_full_blocks`` with a group id; a pool built with ``groups``)."""
        if len(block_hashes) < num_full_blocks:
            raise InvariantError(
                f"caching blocks up to {num_full_blocks} with only {len(block_hashes)} hashes")
        if num_full_blocks <= num_cached_blocks:
            return
        null = self.null_block
        suffix = group_suffix(group_id)
        hashes = block_hashes[:num_full_blocks]
        # (loops, not comprehensions: their free variables would be cells made on
        # every call)
        positions = []
        new = []
        keys = []
        parents = []
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            if blk is not null:
                positions.append(i)
                new.append(blk)
                keys.append(hashes[i] + suffix)
                parents.append(hashes[i - 1] + suffix if i else None)
        self._insert(new, keys, parents, group_id)
        self.num_blocks_cached += len(positions)
        if self.enable_events and positions:
            stored = []
            for i in positions:
                stored.append(hashes[i])
            extra = []
            for i in range(num_cached_blocks, num_full_blocks):
                if blocks[i] is not null:
                    extra.append(event_extra_keys(request, i * block_size,
                                                  (i + 1) * block_size))
            eh = self._event_hash
            spec = self.groups[group_id].spec
            self.events.append(device_block_stored(
                request, list(map(eh, stored)),
                eh(hashes[num_cached_blocks - 1]) if num_cached_blocks else None,
                num_cached_blocks * block_size, num_full_blocks * block_size, block_size,
                extra, group_idx=group_id, spec_kind=spec.kind,
                sliding_window=spec.sliding_window))
        policy = self.policy
        tier = self.host_tier
        if policy is None and tier is None:
            return
        if policy is not None:
            # The policy sees each cached block under its plain digest (the prefix it
            # holds, whatever group), so belady's next uses are the trace's; a policy
            # with ``needs_groups`` hears the block's group too.
            if policy.needs_groups:  # (set_groups was called by the manager)
                on_cached_group = policy.on_cached_group
                for pos in positions:
                    on_cached_group(blocks[pos], block_hashes[pos], request, pos, group_id)
            else:
                on_cached = policy.on_cached
                for pos in positions:
                    on_cached(blocks[pos], block_hashes[pos], request, pos)
        if tier is not None:
            self._cached_on_tier(tier, request, blocks, positions, keys)
            if tier.lower is not None:
                tier.lower.discard_cached(keys)

    def _insert(self, blocks, keys, parents, group_id: int | None = None) -> None:
        """Enter each of ``blocks`` into the hash map under its key in ``keys`` (its
        parent's key in ``parents``); ``group_id`` (for errors): their group."""
        cached = self.cached_block_hash_to_block
        for blk, key, parent in zip(blocks, keys, parents):
            if blk.block_hash is not None:
                where = "" if group_id is None else f"group {group_id} "
                raise InvariantError(
                    f"{where}block {blk.block_id} is being cached as {key.hex()} but "
                    f"already has key {blk.block_hash.hex()}")
            blk.block_hash = key
            blk.parent_hash = parent
            cur = cached.get(key)
            if cur is None:
                cached[key] = blk
            elif type(cur) is dict:
                cur[blk.block_id] = blk
            else:
                # NOTE: no de-duplication: block tables are append-only, so the
                # same content may be cached twice under one key (seed example).
                cached[key] = {cur.block_id: cur, blk.block_id: blk}

    @staticmethod
    def _cached_on_tier(tier, request, blocks, positions, keys) -> None:
        """Blocks at ``positions`` of ``blocks`` were cached under ``keys``: record
        their origin for the tier's policy, and drop the keys the tier holds (the
        device and the tier stay exclusive)."""
        if tier.track_origin:
            pos_of = tier.device_position
            prio_of = tier.device_priority
            hint_of = tier.device_retention
            prio = request.priority
            hint = getattr(request, "retention", None)
            for pos in positions:
                bid = blocks[pos].block_id
                pos_of[bid] = pos
                prio_of[bid] = prio
                hint_of[bid] = hint
        on_host = tier.hash_to_slot
        # NOTE: one C-level disjointness test; the per-key loop only on an overlap.
        if on_host and not on_host.keys().isdisjoint(keys):
            for h in keys:
                if h in on_host:
                    tier.discard(h)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], request=None,
                    first_position: int = 0) -> None:
        """Drop one reference from each block; blocks reaching 0 join the queue.

        ``ordered_blocks`` is in eviction priority order (first evicted first): a
        request's blocks reversed, so its last block is reused first. ``request``
        (the owner, whose table ``ordered_blocks`` is, reversed) and
        ``first_position`` (where the freed run starts in the table: a sliding-window
        table frees its tail) are for the policy: blocks that reach 0 with a key are
        released to it (``on_release`` + ``add``) and queued at the tail, unkeyed ones
        at the head. With an index of its own, the index releases its candidates to
        the policy itself: here the blocks only join the queue.
        """
        policy = self.policy
        if policy is None:
            self.free_block_queue.release(ordered_blocks, self.free_order == "unhashed_first")
            return
        if self.on_evict is not None:  # (the index releases candidates to the policy)
            self.num_free_unhashed += self.free_block_queue.release(ordered_blocks, True)
            return
        ordered = list(ordered_blocks)
        n = len(ordered)
        q = self.free_block_queue
        on_release = policy.on_release
        add = policy.add
        first: list[KVCacheBlock] = []
        last: list[KVCacheBlock] = []
        for i, block in enumerate(ordered):
            rc = block.ref_cnt - 1
            if rc < 0:
                raise InvariantError(f"block {block.block_id} freed below ref_cnt 0")
            block.ref_cnt = rc
            if rc == 0:
                if block.block_hash is None:
                    first.append(block)
                else:
                    on_release(block, request,
                               first_position + n - 1 - i if request is not None else None)
                    add(block)
                    last.append(block)
        q.append_n(last)
        q.prepend_n(first)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached key (and the tier's). ``False`` (nothing changed) if any
        block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks:
            return False
        self.num_blocks_cleared += self.num_cached_blocks
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.block_hash = None
        if self.evicted_by is not None:
            self.evicted_by = {}
        if self.enable_events:
            self.events.append(AllBlocksCleared())
        if self.policy is not None:
            self.policy.clear()
        if self.on_reset is not None:
            self.num_free_unhashed = self.num_blocks
            self.on_reset()
        tier = self.host_tier
        if tier is not None:
            tier.clear()
            tier.evicted_by = self.evicted_by  # (the reset's new dict, or None)
            if tier.lower is not None:
                tier.lower.evicted_by = self.evicted_by
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the queued events (``[]`` when events are off)."""
        events = self.events
        self.events = []
        return events

    # -------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the block / hash on any inconsistency."""
        blocks = self.blocks
        n = self.num_blocks
        for i, b in enumerate(blocks):
            if b.block_id != i:
                raise InvariantError(f"blocks[{i}] has block_id {b.block_id}")
            if b.ref_cnt < 0:
                raise InvariantError(f"block {i} has ref_cnt {b.ref_cnt} < 0")
        # Free queue: well linked, exactly the blocks with ref_cnt 0.
        q = self.free_block_queue
        seen: set[int] = set()
        prev = q.head
        cur = q.head.next_free_block
        while cur is not q.tail:
            if cur is None:
                raise InvariantError(f"free queue broken after block {prev.block_id}")
            if cur.prev_free_block is not prev:
                raise InvariantError(
                    f"free queue: block {cur.block_id}.prev_free_block is not block "
                    f"{prev.block_id}"
                )
            if cur.block_id in seen or not 0 <= cur.block_id < n:
                raise InvariantError(f"free queue holds block {cur.block_id} twice or foreign")
            if blocks[cur.block_id] is not cur:
                raise InvariantError(f"free queue holds a foreign block {cur.block_id}")
            if cur.ref_cnt != 0:
                raise InvariantError(
                    f"block {cur.block_id} is in the free queue with ref_cnt {cur.ref_cnt}"
                )
            seen.add(cur.block_id)
            prev = cur
            cur = cur.next_free_block
        if q.tail.prev_free_block is not prev:
            raise InvariantError(f"free queue tail does not point back to block {prev.block_id}")
        if len(seen) != q.num_free_blocks:
            raise InvariantError(
                f"free queue holds {len(seen)} blocks but num_free_blocks is {q.num_free_blocks}"
            )
        for b in blocks:
            if b.ref_cnt == 0 and b.block_id not in seen:
                raise InvariantError(f"block {b.block_id} has ref_cnt 0 but is not in the free queue")
            if b.block_id not in seen and (b.prev_free_block or b.next_free_block):
                raise InvariantError(f"block {b.block_id} is not free but has queue links")
        if self.on_evict is not None:
            self._check_index_mode(q)
            return
        # Hash map <-> block hashes.
        in_map: set[int] = set()
        for h, entry in self.cached_block_hash_to_block.items():
            if type(entry) is dict:
                if not entry:
                    raise InvariantError(f"hash {h.hex()} maps to an empty dict")
                members = entry.items()
            else:
                members = [(entry.block_id, entry)]
            for bid, b in members:
                if b.block_id != bid or blocks[bid] is not b:
                    raise InvariantError(f"hash {h.hex()} maps to a foreign block {bid}")
                if b.block_hash != h:
                    got = b.block_hash.hex() if b.block_hash is not None else None
                    raise InvariantError(
                        f"hash {h.hex()} maps to block {bid} whose block_hash is {got}"
                    )
                if bid in in_map:
                    raise InvariantError(f"block {bid} is in the hash map twice")
                in_map.add(bid)
        for b in blocks:
            if b.block_hash is not None and b.block_id not in in_map:
                raise InvariantError(
                    f"block {b.block_id} has hash {b.block_hash.hex()} but is not in the hash map"
                )
        if not self.enable_caching and in_map:
            raise InvariantError(f"caching is off but blocks {sorted(in_map)} are cached")
        if len(in_map) != self.num_cached_blocks:
            raise InvariantError(
                f"{len(in_map)} blocks are cached but the counters say {self.num_cached_blocks}"
            )
        if self.policy is not None:
            ids = q.block_ids()
            seen_hashed = False
            for bid in ids:
                if blocks[bid].block_hash is not None:
                    seen_hashed = True
                elif seen_hashed:
                    raise InvariantError(
                        f"free block {bid} holds no hash but sits behind a cached free "
                        "block (unhashed free blocks must be the queue's head)")
            self.policy.check_invariants(
                [bid for bid in ids if blocks[bid].block_hash is not None])

    def _check_index_mode(self, q: FreeKVCacheBlockQueue) -> None:
        """``check_invariants``' part for an index of its own (the index checks its
        keys and its candidates): the map stays empty, the counters count the blocks
        with a key, and the ``num_free_unhashed`` free blocks without one are the
        queue's head."""
        blocks = self.blocks
        if self.cached_block_hash_to_block:
            raise InvariantError("the hash map holds keys while an index keeps its own")
        num_keyed = sum(1 for b in blocks if b.block_hash is not None)
        if num_keyed != self.num_cached_blocks:
            raise InvariantError(
                f"{num_keyed} blocks hold a key but the counters say {self.num_cached_blocks}")
        if not self.enable_caching and num_keyed:
            raise InvariantError(f"caching is off but {num_keyed} blocks are cached")
        for pos, bid in enumerate(q.block_ids()):
            if (blocks[bid].block_hash is None) != (pos < self.num_free_unhashed):
                raise InvariantError(
                    f"free queue position {pos} (block {bid}) is outside its part: the "
                    f"first {self.num_free_unhashed} free blocks are the unhashed ones")
        if self.num_free_unhashed > q.num_free_blocks:
            raise InvariantError(
                f"{self.num_free_unhashed} free unhashed blocks counted, "
                f"{q.num_free_blocks} free blocks")
