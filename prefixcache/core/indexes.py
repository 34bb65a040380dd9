"""Prefix indexes, selected by name: ``KVCacheManager(..., index=name)``.

An index maps a request's prefix to cached blocks: ``"hash"`` is vLLM's hash chain
(``KVCacheManager`` itself), ``"radix"`` SGLang's radix tree. Each is a manager class
with the same public API and constructor keywords; the registry names it as
``"module:Class"`` and imports it only when selected.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

# NOTE: read-only (no module-level mutable state): add an index here.
INDEXES = MappingProxyType({
    "hash": "prefixcache.core.kv_cache_manager:KVCacheManager",
    "radix": "prefixcache.core.radix:RadixKVCacheManager",
})

DEFAULT_INDEX = "hash"


def index_names() -> tuple[str, ...]:
    """The registered index names."""
    return tuple(INDEXES)


def get_index_class(name: str) -> type:
    """The manager class registered as ``name``; ``ValueError`` naming the choices."""
    if not isinstance(name, str) or name not in INDEXES:
        raise ValueError(f"unknown index {name!r}; expected one of {index_names()}")
    module, _, attr = INDEXES[name].partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"index {name!r} is registered but cannot be imported: {e}") from None
    return getattr(mod, attr)


__all__ = ["DEFAULT_INDEX", "INDEXES", "get_index_class", "index_names"]
