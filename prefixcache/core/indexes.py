"""Prefix indexes by name, and the one rule that picks (or refuses) an implementation.

``KVCacheManager(..., index=name, kv_cache_groups=..., eviction=..., num_host_blocks=...)``
is the one manager class; below it, the implementation registered for the index and
the group layout does the work:

    * ``"hash"``: vLLM's block-hash chain (``kv_cache_manager.HashKVCacheManager`` for
      one full-attention group; ``hybrid.HybridKVCacheManager`` for any other layout,
      ``kv_groups.HYBRID_MANAGER``);
    * ``"radix"``: SGLang's radix tree (``radix.RadixKVCacheManager`` for one
      full-attention group; ``radix_hybrid.RadixHybridKVCacheManager``, SGLang's SWA
      radix cache, for any other layout: ``LAYOUT_INDEXES``).

The registry names each as ``"module:Class"`` and imports it only when selected.
``resolve_manager_class`` is the ONE place a combination of index x group layout x
eviction policy x tier is refused, with its reason (``COMBINATION_RULES``).
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

# NOTE: read-only (no module-level mutable state): add an index here.
INDEXES = MappingProxyType({
    "hash": "prefixcache.core.kv_cache_manager:HashKVCacheManager",
    "radix": "prefixcache.core.radix:RadixKVCacheManager",
})

DEFAULT_INDEX = "hash"

# The implementation of an index for a layout other than one full-attention group
# (sliding-window / hybrid), by index name; the hash index's is vLLM's hybrid manager,
# ``kv_groups.HYBRID_MANAGER`` (resolved there). Every index has one (a test pins it).
LAYOUT_INDEXES = MappingProxyType({
    "radix": "prefixcache.core.radix_hybrid:RadixHybridKVCacheManager",
})

# Tiers below the device pool, by name (``KVCacheManager(num_host_blocks=N)`` selects
# "host"); each entry is the tier's class.
TIERS = MappingProxyType({
    "host": "prefixcache.core.host_tier:HostTier",
})

# The combinations no implementation serves yet, each with its reason. Keys:
# (what the layout is, what else is asked). Everything not listed runs.
COMBINATION_RULES = MappingProxyType({
    ("hybrid", "tier"): (
        "the host tier demotes one full-attention group's blocks; per-group host pages "
        "for sliding-window layouts are not built"),
    ("layout_index", "waiting"): (
        "a waiting-queue policy protects the blocks a waiting request will hit, which "
        "with sliding-window groups depend on where each group's hit ends; the per-group "
        "waiting hooks are built in the hash index's coordinator (core/hybrid.py "
        "waiting_keys), not in the radix tree's multi-group manager"),
    ("state", "index"): (
        "a state-space (Mamba) group keeps one state snapshot per cached block boundary; "
        "only the hash index (vLLM's MambaManager rules) keeps them -- state checkpoints "
        "on radix tree nodes (Marconi's design) are not built"),
})

# The group kinds each index's layout implementation serves (the hash index serves
# every registered kind, ``kv_groups.GROUP_KINDS``).
LAYOUT_INDEX_KINDS = MappingProxyType({
    "radix": ("full_attention", "sliding_window"),
})


def index_names() -> tuple[str, ...]:
    """The registered index names."""
    return tuple(INDEXES)


def _load(registry, kind: str, name: str) -> type:
    module, _, attr = registry[name].partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{kind} {name!r} is registered but cannot be imported: {e}") from None
    return getattr(mod, attr)


def get_index_class(name: str) -> type:
    """The implementation class registered as ``name`` (for one full-attention group);
    ``ValueError`` naming the choices."""
    if not isinstance(name, str) or name not in INDEXES:
        raise ValueError(f"unknown index {name!r}; expected one of {index_names()}")
    return _load(INDEXES, "index", name)


def refusal(index: str, kv_cache_groups, eviction: str, num_host_blocks) -> str | None:
    """Why the combination is not served (``None``: it runs). Raises ``ValueError`` for
    an unknown index and for a bad layout (``kv_groups.check_kv_cache_groups``)."""
    from prefixcache.core.kv_groups import check_kv_cache_groups, is_hybrid

    get_index_class(index)  # unknown -> ValueError naming the choices
    if kv_cache_groups is None:
        return None
    groups = check_kv_cache_groups(kv_cache_groups)
    if not is_hybrid(groups):
        return None
    if index != DEFAULT_INDEX:
        served = LAYOUT_INDEX_KINDS.get(index, ())
        for g in groups:
            if g.spec.kind not in served:
                return (f"index={index!r} is not supported with a {g.spec.kind!r} KV cache "
                        f"group: {COMBINATION_RULES[('state', 'index')]}")
    asked = []
    # (a bad num_host_blocks value is the tier's own check, in the implementation)
    if type(num_host_blocks) is int and num_host_blocks > 0:
        asked.append(("tier", f"num_host_blocks={num_host_blocks}"))
    from prefixcache.core.eviction import get_policy_class, policy_name

    try:
        waiting = get_policy_class(eviction).needs_waiting
    except ValueError:  # an unknown policy: the implementation's own check names it
        waiting = False
    for what, text in asked:
        return (f"{text} is not supported with KV cache groups other than one "
                f"full-attention group: "
                f"{COMBINATION_RULES[('hybrid', what)]}")
    if waiting and index != DEFAULT_INDEX:
        return (f"eviction={policy_name(eviction)!r} is not supported by index={index!r} "
                f"with KV cache groups other than one full-attention group: "
                f"{COMBINATION_RULES[('layout_index', 'waiting')]}")
    return None


def resolve_manager_class(index: str, kv_cache_groups, eviction: str = "lru",
                          num_host_blocks=0) -> type:
    """The implementation ``KVCacheManager`` builds for this combination, or
    ``ValueError`` naming why it is refused (``refusal``)."""
    why = refusal(index, kv_cache_groups, eviction, num_host_blocks)
    if why is not None:
        raise ValueError(why)
    if kv_cache_groups is not None:
        from prefixcache.core.kv_groups import is_hybrid, layout_manager_class

        if is_hybrid(tuple(kv_cache_groups)):
            if index == DEFAULT_INDEX:
                return layout_manager_class(kv_cache_groups)
            return _load(LAYOUT_INDEXES, "index", index)
    return get_index_class(index)


__all__ = [
    "COMBINATION_RULES",
    "DEFAULT_INDEX",
    "INDEXES",
    "LAYOUT_INDEXES",
    "TIERS",
    "get_index_class",
    "index_names",
    "refusal",
    "resolve_manager_class",
]
