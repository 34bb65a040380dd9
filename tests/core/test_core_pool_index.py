"""An index that keeps its own keys over the one BlockPool (the pool's on_evict /
on_reset hooks, as the radix trees use them): the pool allocates, touches, releases and
evicts; the index chooses the candidates and hears each eviction."""

import pytest

from prefixcache.core.block_pool import BlockPool, InvariantError
from prefixcache.core.eviction import make_policy
from prefixcache.core.events import AllBlocksCleared, BlockRemoved
from prefixcache.core.kv_cache_manager import KVCacheManager
from prefixcache.core.request import Request


class _ChainIndex:
    """A toy index: one chain of blocks, keys b"k0", b"k1", ...; only the last cached
    block is a candidate (a leaf), and evicting it makes the one before it the leaf."""

    def __init__(self):
        self.chain = []  # cached blocks, root first
        self.resets = 0

    def cache(self, pool, block):
        block.block_hash = b"k%d" % len(self.chain)
        block.parent_hash = self.chain[-1].block_hash if self.chain else None
        self.chain.append(block)
        pool.num_blocks_cached += 1

    def on_evict(self, block):
        assert self.chain and self.chain[-1] is block, "only the leaf is a candidate"
        self.chain.pop()
        return self.chain[-1] if self.chain else None  # the new leaf

    def on_reset(self):
        self.chain = []
        self.resets += 1


def _pool(index, num_blocks=4, **kw):
    policy = make_policy("lru", num_blocks=num_blocks, block_size=4)
    return BlockPool(num_blocks, policy=policy, on_evict=index.on_evict,
                     on_reset=index.on_reset, enable_events=True, int_event_hashes=False,
                     **kw)


def test_hooks_come_together_with_a_policy_and_no_groups():
    index = _ChainIndex()
    with pytest.raises(ValueError, match="on_evict= and on_reset= come together"):
        BlockPool(4, policy=make_policy("lru", num_blocks=4, block_size=4),
                  on_evict=index.on_evict)
    with pytest.raises(ValueError, match="with a policy"):
        BlockPool(4, on_evict=index.on_evict, on_reset=index.on_reset)


def test_the_pool_evicts_the_index_leaves_and_counts_unhashed_blocks():
    index = _ChainIndex()
    pool = _pool(index)
    a = pool.get_new_blocks(3)  # ids 0, 1, 2 from the head; one unhashed block left
    assert [b.block_id for b in a] == [0, 1, 2] and pool.num_free_unhashed == 1
    for b in a:
        index.cache(pool, b)
    pool.free_blocks(reversed(a))  # the queue: [3 | 2, 1, 0] (cached ones at the tail)
    assert pool.num_free_unhashed == 1 and pool.free_block_queue.block_ids() == [3, 2, 1, 0]
    pool.policy.add(a[2])  # the index's one candidate: its leaf
    pool.check_invariants()
    pool.evicted_by = {}
    # Two blocks: the unhashed 3, then the leaf 2 (the index names 1 as the new leaf).
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [3, 2]
    assert [b.block_id for b in index.chain] == [0, 1]
    assert pool.policy.candidate_ids() == [1]
    assert a[2].block_hash is None and pool.num_evictions == 1 and pool.num_cached_blocks == 2
    assert pool.evicted_by == {b"k2": "device"}
    assert pool.take_events() == [BlockRemoved(block_hashes=[b"k2"], medium="GPU",
                                               group_idx=0)]
    pool.check_invariants()
    # Touching a cached free block takes it out of the queue; the index keeps its
    # candidates (the pool discards none: the index does).
    pool.policy.discard(a[1])
    pool.touch([a[0], a[1]])
    assert pool.free_block_queue.block_ids() == [] and pool.policy.candidate_ids() == []
    # 2 and 3 hold no key: to the head, in the order given; 1, 0 to the tail.
    pool.free_blocks([got[1], got[0], a[1], a[0]])
    assert pool.num_free_unhashed == 2
    assert pool.free_block_queue.block_ids() == [2, 3, 1, 0]
    pool.policy.add(a[1])
    pool.check_invariants()


def test_the_pool_reset_tells_the_index():
    index = _ChainIndex()
    pool = _pool(index)
    blocks = pool.get_new_blocks(2)
    for b in blocks:
        index.cache(pool, b)
    assert not pool.reset_prefix_cache()  # held: nothing changes
    assert index.resets == 0
    pool.free_blocks(reversed(blocks))
    pool.policy.add(blocks[1])
    assert pool.reset_prefix_cache()
    assert index.resets == 1 and index.chain == [] and pool.num_free_unhashed == 4
    assert pool.num_cached_blocks == 0 and pool.take_events() == [AllBlocksCleared()]
    pool.check_invariants()


def test_a_broken_unhashed_count_is_an_invariant_error():
    index = _ChainIndex()
    pool = _pool(index)
    pool.num_free_unhashed = 3  # all four free blocks are unhashed
    with pytest.raises(InvariantError, match="outside its part"):
        pool.check_invariants()


@pytest.mark.parametrize("groups", [None, "sw"])
def test_the_radix_trees_keep_no_queue_of_their_own(groups):
    from prefixcache.core.kv_groups import parse_kv_groups

    kw = {} if groups is None else {"kv_cache_groups": parse_kv_groups("full,sw8")}
    m = KVCacheManager(6, 4, index="radix", enable_events=True, **kw)
    impl = m.implementation
    pool = impl.block_pool
    assert isinstance(pool, BlockPool) and impl.blocks is pool.blocks
    assert not hasattr(impl, "_free") and not hasattr(impl, "events")
    r = Request("a", list(range(9)))
    blocks, hit = m.get_computed_blocks(r)
    m.allocate_slots(r, r.num_tokens - hit, hit, blocks)
    m.free(r)
    assert m.free_block_ids() == pool.free_block_queue.block_ids()
    assert m.counters()["blocks_cached"] == pool.num_blocks_cached > 0
    assert m.take_events() and pool.take_events() == []
    m.check_invariants()
