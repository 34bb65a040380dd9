"""prefixcache: automatic prefix caching of LLM KV caches (vLLM-compatible).

Public API::

    from prefixcache import CacheConfig, KVCacheManager, Request, MultiModalFeature, LoRARequest, BlockHasher

``prefixcache.core`` holds the host-side cache (plus ``KVCacheBlock``, the events and
``PrefixCacheStats``) and its one typed configuration ``CacheConfig``; ``prefixcache.sim``
replays request traces through it; ``prefixcache.engine`` serves a model over it;
``prefixcache.cost_model`` prices steps (below ``core``: no layer imports upward).
``docs/ARCHITECTURE.md`` is the module map and the layering rules.
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
