"""prefixcache: automatic prefix caching of LLM KV caches (vLLM-compatible).

Public API::

    from prefixcache import CacheConfig, KVCacheManager, Request, MultiModalFeature, LoRARequest, BlockHasher

The packages, top to bottom (no layer imports one above it; ``docs/ARCHITECTURE.md``
has the contracts between them)::

    prefixcache.serve        OpenAI-compatible server, metrics, KV events (extra `serve`)
    prefixcache.engine       requests in, tokens out: scheduler, model runner, host pages
    prefixcache.sim          trace replay, discrete-event simulation, routing (host only)
    prefixcache.core         the host-side prefix cache and its CacheConfig (host only)
    prefixcache.scheduling   waiting-queue policies, shared by engine and simulator
    prefixcache.metadata     the step's index arrays for the kernels (numpy)
    prefixcache.model        flax nnx model, checkpoint loading (HF directory, GGUF)
    prefixcache.text         tokenizer, chat template, detokenizer (extra `text`)
    prefixcache.cost_model   roofline step times, model shapes (host only)
    prefixcache.kv_dtypes    KV page dtypes and byte budgets
    prefixcache._validate    argument checks at public boundaries
    prefixcache_kernels      JAX / Pallas paged attention (its own top-level package;
                             never imports prefixcache)

Rules: ``core``, ``sim``, ``metadata``, ``cost_model`` and ``text`` never import jax;
no module-level mutable state (registries are read-only ``MappingProxyType``s, seeds are
passed in); a plug-in is one file plus one registration (docs/extending.md).
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
