"""Host-side prefix-caching core: hashing, requests, block pool, KV cache manager.

Plain Python (no jax): fast enough to replay millions of requests without a device.
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
from prefixcache.core.host_tier import HostHit, HostTransfer
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
]
