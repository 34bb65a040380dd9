"""``PolicyBlockPool``: the hash-chain block pool with a pluggable eviction policy.

``BlockPool`` runs vLLM's LRU on its intrusive free queue (the fast path, used for
``eviction="lru"``, untouched). This subclass asks an ``EvictionPolicy``
(``prefixcache/core/eviction/``) which free cached block to reuse:

* the free queue still holds every free block (``num_free_blocks``,
  ``free_block_ids`` and the queue invariants keep working); freed blocks that hold
  no hash go to its head, cached ones to its tail -- so the unhashed free blocks are
  always a prefix of the queue (whatever ``free_order``: they can never be hit, so
  they are always reused first);
* the free cached blocks are exactly the policy's candidates;
* ``get_new_blocks`` takes unhashed blocks from the queue head first, then the
  policy's victims (unlinked from the queue in O(1)); in-use blocks are never
  candidates, so never evicted.

With the keyed ``lru`` policy this gives exactly ``BlockPool``'s hits and block ids
with ``free_order="unhashed_first"`` (a test pins it).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from prefixcache.core.block_pool import BlockPool, InvariantError, KVCacheBlock
from prefixcache.core.eviction import EvictionPolicy


class PolicyBlockPool(BlockPool):
    """A ``BlockPool`` whose cached free blocks are evicted in ``policy``'s order.

    Args:
        num_blocks, enable_caching, enable_events, free_order, int_event_hashes: as
            ``BlockPool`` (``free_order`` has no effect on eviction order here).
        policy: the eviction policy (fresh, built for ``num_blocks``).
    """

    def __init__(self, num_blocks: int, *, policy: EvictionPolicy, **kwargs):
        if not isinstance(policy, EvictionPolicy):
            raise TypeError(f"policy must be an EvictionPolicy, got {type(policy).__name__}")
        if policy.num_blocks != num_blocks:
            raise ValueError(
                f"policy was built for {policy.num_blocks} blocks, the pool has {num_blocks}"
            )
        super().__init__(num_blocks, **kwargs)
        self.policy = policy

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Unhashed free blocks from the queue head first, then the policy's victims."""
        q = self.free_block_queue
        if num_blocks > q.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: only {q.num_free_blocks} free")
        policy = self.policy
        num_unhashed = q.num_free_blocks - len(policy)
        k = num_blocks if num_blocks < num_unhashed else num_unhashed
        ret = q.popleft_n(k) if k > 0 else []
        for _ in range(num_blocks - k):
            victim = policy.pop()
            q.remove(victim)
            self._evict(victim)
            policy.on_evicted(victim)
            ret.append(victim)
        self.num_blocks_allocated += num_blocks
        for block in ret:
            block.ref_cnt = 1
        return ret

    def touch(self, blocks: Iterable[KVCacheBlock], request=None) -> None:
        discard = self.policy.discard
        on_hit = self.policy.on_hit
        n = 0
        for block in blocks:
            if block.ref_cnt == 0:
                # (FreeKVCacheBlockQueue.remove, inlined as BlockPool.touch does: this
                # runs once per hit block)
                prev = block.prev_free_block
                nxt = block.next_free_block
                prev.next_free_block = nxt
                nxt.prev_free_block = prev
                block.prev_free_block = block.next_free_block = None
                n += 1
                discard(block)
            block.ref_cnt += 1
            on_hit(block, request)
        self.free_block_queue.num_free_blocks -= n

    def cache_full_blocks(self, request, blocks: Sequence[KVCacheBlock],
                          block_hashes: Sequence[bytes], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int) -> None:
        super().cache_full_blocks(
            request, blocks, block_hashes, num_cached_blocks, num_full_blocks, block_size
        )
        on_cached = self.policy.on_cached
        for pos in range(num_cached_blocks, num_full_blocks):
            blk = blocks[pos]
            on_cached(blk, blk.block_hash, request, pos)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], request=None,
                    first_position: int = 0) -> None:
        """As ``BlockPool.free_blocks``; blocks whose ``ref_cnt`` reaches 0 with a hash
        are released to the policy (``on_release`` + ``add``) and queued at the tail,
        unhashed ones go to the head. ``ordered_blocks`` is ``request``'s block table
        reversed (position ``first_position + len - 1 - i``) when ``request`` is given
        (``first_position``: where the freed run starts in the table; the hybrid
        manager frees a sliding-window table's tail)."""
        ordered = list(ordered_blocks)
        n = len(ordered)
        q = self.free_block_queue
        on_release = self.policy.on_release
        add = self.policy.add
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
        if not super().reset_prefix_cache():
            return False
        self.policy.clear()
        return True

    def check_invariants(self) -> None:
        super().check_invariants()
        ids = self.free_block_queue.block_ids()
        blocks = self.blocks
        seen_hashed = False
        for bid in ids:
            if blocks[bid].block_hash is not None:
                seen_hashed = True
            elif seen_hashed:
                raise InvariantError(
                    f"free block {bid} holds no hash but sits behind a cached free block "
                    "(unhashed free blocks must be the queue's head)"
                )
        self.policy.check_invariants([bid for bid in ids if blocks[bid].block_hash is not None])
