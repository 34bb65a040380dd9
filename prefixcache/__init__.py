"""prefixcache: automatic prefix caching of LLM KV caches (vLLM-compatible).

Public API::

    from prefixcache import CacheConfig, KVCacheManager, Request, MultiModalFeature, LoRARequest, BlockHasher

``prefixcache.core`` holds the host-side cache (plus ``KVCacheBlock``, the events and
``PrefixCacheStats``); ``prefixcache.sim`` replays request traces through it.
"""

from prefixcache.core import (
    BlockHasher,
    CacheConfig,
    KVCacheManager,
    LoRARequest,
    MultiModalFeature,
    Request,
)

__version__ = "0.1.0"

__all__ = [
    "BlockHasher",
    "CacheConfig",
    "KVCacheManager",
    "LoRARequest",
    "MultiModalFeature",
    "Request",
    "__version__",
]
