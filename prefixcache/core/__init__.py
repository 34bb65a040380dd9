"""Host-side prefix-caching core: hashing, requests, block pool, KV cache manager.

Plain Python (no jax): fast enough to replay millions of requests without a device.

Modules:

* ``cache_config``: ``CacheConfig``, the one typed cache configuration every driver takes.
* ``kv_cache_manager``: ``KVCacheManager``, the one manager class (vLLM's scheduler-facing
  API: ``get_computed_blocks``, ``allocate_slots``, ``free``, ``take_events``,
  ``make_prefix_cache_stats``, ``check_invariants``), over the implementation
  ``indexes.resolve_manager_class`` picks: ``HashKVCacheManager`` (vLLM's block-hash
  chain, here), ``radix.RadixKVCacheManager`` (SGLang's radix tree),
  ``hybrid.HybridKVCacheManager`` (sliding-window / hybrid layouts, ``kv_groups``).
* ``kv_cache_blocks``: ``KVCacheBlocks``, the one result type (blocks per KV cache group).
* ``indexes``: the index and tier registries and the one rule that refuses a combination.
* ``block_pool``: ``KVCacheBlock``, ``BlockPool`` (vLLM's free queue and hash map; the
  eviction policy, the group layout and the tier under it are its components);
  ``eviction/``: the policies (``POLICIES``; one file each).
* ``tiers``: the storage tiers under the device pool, one chain: ``tiers.host`` (the
  host-memory tier: ``HostTier``, ``HostHit``, ``HostTransfer``; ``host_tier`` keeps the
  old import path), ``tiers.disk`` (``DiskTier``), ``tiers.remote`` (``RemoteStore``,
  shared by replicas), ``tiers.base`` (``KeyTier``, ``TierChain``, ``TierTransfer``,
  ``TierHit``, ``TierLink``).
* ``hashing``: the block-hash spec (serializers, digests, extra keys, ``BlockHasher``);
  ``hash_writers``: its fast writers' tables and helpers.
* ``request``: ``Request``, ``MultiModalFeature``, ``LoRARequest``.
* ``events``: KV cache events (vLLM's fields); ``stats``: ``PrefixCacheStats``.
* ``misses``: miss accounting, why each missed prompt block missed (``MissAccountant``,
  ``REASONS``), read by the replay, the simulators, the engine and the server.
"""

from prefixcache.core.block_pool import (
    BlockPool,
    FreeKVCacheBlockQueue,
    InvariantError,
    KVCacheBlock,
)
from prefixcache.core.cache_config import CacheConfig
from prefixcache.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from prefixcache.core.hashing import BlockHasher
from prefixcache.core.tiers import TierHit, TierLink, TierTransfer
from prefixcache.core.tiers.host import HostHit, HostTransfer
from prefixcache.core.kv_cache_manager import KVCacheManager
from prefixcache.core.kv_groups import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from prefixcache.core.request import LoRARequest, MultiModalFeature, Request
from prefixcache.core.stats import PrefixCacheStats

__all__ = [
    "AllBlocksCleared",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "FreeKVCacheBlockQueue",
    "FullAttentionSpec",
    "HostHit",
    "HostTransfer",
    "InvariantError",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheGroup",
    "KVCacheManager",
    "LoRARequest",
    "MultiModalFeature",
    "PrefixCacheStats",
    "Request",
    "SlidingWindowSpec",
    "TierHit",
    "TierLink",
    "TierTransfer",
]
