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

An index of a user's own package needs no line here: pass its class where a name goes
(``KVCacheManager(index=MyIndex)``, ``CacheConfig(index=MyIndex)``, every driver's
``index=``). The class declares ``INDEX_NAME`` (what records show; not a registered
name) and the manager protocol (``INDEX_PROTOCOL``: subclass ``HashKVCacheManager`` or
``RadixKVCacheManager``, or write the methods); it serves one full-attention group unless
it declares ``LAYOUT_CLASS`` (its implementation for other layouts: a class or
``"module:Class"``) and ``LAYOUT_KINDS`` (the group kinds that one serves).
"""

from __future__ import annotations

import importlib
import numbers
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
# "host", ``disk_bytes`` "disk", ``remote_bytes`` / ``remote`` "remote"; a tier of one's
# own: one entry here, or its class passed in ``tiers``); each entry is the tier's class.
TIERS = MappingProxyType({
    "host": "prefixcache.core.tiers.host:HostTier",
    "disk": "prefixcache.core.tiers.disk:DiskTier",
    "remote": "prefixcache.core.tiers.remote:RemoteStore",
})

# The combinations no implementation serves yet, each with its reason. Keys:
# (what the layout is, what else is asked). Everything not listed runs.
COMBINATION_RULES = MappingProxyType({
    ("layout index", "tier"): (
        "the radix layout index (SGLang's SWA radix cache) keeps per-group values on "
        "tree nodes and tombstones a node's sliding-window value while its "
        "full-attention value stays; demoting per-group node values to host slots and "
        "continuing a tree walk through them is not built (the hash index serves a "
        "host tier with full-attention and sliding-window groups)"),
    ("state", "tier"): (
        "a state-space (Mamba) group's snapshots are demoted and promoted per (block "
        "hash, group) key by the hash index's pool only; an index other than the hash "
        "index that serves state groups (the radix index does not: state checkpoints on "
        "tree nodes, Marconi's design, are not built) would have to demote its own "
        "per-node states and continue its walk through host entries, which no such "
        "index declares"),
    ("kind", "tier"): (
        "the host tier serves the group kinds listed in indexes.TIER_GROUP_KINDS, whose "
        "hits are read through the per-group key lookup (SingleTypeManager.get_cached) "
        "that a host entry can answer; a kind registered without being listed there may "
        "hold blocks a host copy cannot stand in for"),
    ("layout", "index"): (
        "the index's class matches one chain of full-attention blocks; another layout "
        "needs per-group hit rules (where each group's hit ends) that the class does not "
        "declare (LAYOUT_CLASS, with the group kinds it serves in LAYOUT_KINDS)"),
    ("layout index", "waiting"): (
        "a waiting-queue policy protects the blocks a waiting request will hit, which "
        "with sliding-window groups depend on where each group's hit ends; an index's "
        "layout implementation serves it only with the per-group waiting hooks "
        "(indexes.WAITING_HOOKS: on_waiting, drop_waiting, waiting_keys, as the hash "
        "index's coordinator core/hybrid.py and the radix index's core/radix_hybrid.py "
        "provide them), which this one does not declare"),
    ("state", "index"): (
        "a state-space (Mamba) group keeps one state snapshot per cached block boundary; "
        "only the hash index (vLLM's MambaManager rules) keeps them -- state checkpoints "
        "on radix tree nodes (Marconi's design) are not built"),
})

# An index class of a user's own package: what it must provide (``check_index_class``).
INDEX_PROTOCOL = ("find_longest_cache_hit", "allocate_slots", "free", "check_invariants")

# What a layout implementation (``LAYOUT_CLASS``, ``LAYOUT_INDEXES``) provides to serve
# a policy that reads the waiting queue (``needs_waiting``: queue_aware): the per-group
# keys of a waiting request's hit (``waiting_keys``) and the queue's two hooks.
WAITING_HOOKS = ("on_waiting", "drop_waiting", "waiting_keys")

# The group kinds each index's layout implementation serves (the hash index serves
# every registered kind, ``kv_groups.GROUP_KINDS``).
LAYOUT_INDEX_KINDS = MappingProxyType({
    "radix": ("full_attention", "sliding_window"),
})


# The group kinds the host tier serves in a multi-group layout (the hash index's
# ``GroupHostTier``: one host slot per block of one group; a state-space group's block
# is one state snapshot, one page of the state arrays, demoted and promoted whole), and
# the tiers below it (disk, remote, a user's: the same per-group keys).
TIER_GROUP_KINDS = ("full_attention", "sliding_window", "mamba")


def index_names() -> tuple[str, ...]:
    """The registered index names."""
    return tuple(INDEXES)


def is_index_class(value) -> bool:
    """``value`` is a class given in place of an index name (checked by
    `check_index_class`)."""
    return isinstance(value, type)


def check_index_class(cls: type) -> type:
    """``cls`` itself when it can serve as an index (``INDEX_NAME``, ``INDEX_PROTOCOL``,
    a well-formed ``LAYOUT_CLASS`` / ``LAYOUT_KINDS``); ``ValueError`` naming what is
    missing."""
    name = getattr(cls, "INDEX_NAME", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"index class {cls.__name__} needs an INDEX_NAME (a non-empty str: "
                         "the name records show)")
    if name in INDEXES and _load(INDEXES, "index", name) is not cls:
        raise ValueError(f"index class {cls.__name__}: INDEX_NAME={name!r} is the registered "
                         f"index's name; give it a name of its own (not one of "
                         f"{index_names()})")
    missing = [m for m in INDEX_PROTOCOL if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(
            f"index class {cls.__name__} lacks the manager protocol: no {', '.join(missing)} "
            "(an index answers its hit from find_longest_cache_hit and KVCacheBlocks from "
            "allocate_slots, and provides free and check_invariants; subclass "
            "HashKVCacheManager or "
            "RadixKVCacheManager)")
    layout = getattr(cls, "LAYOUT_CLASS", None)
    kinds = getattr(cls, "LAYOUT_KINDS", ())
    if layout is not None and not isinstance(layout, (type, str)):
        raise ValueError(f"index class {cls.__name__}: LAYOUT_CLASS must be a class or "
                         f"'module:Class', got {layout!r}")
    if (not isinstance(kinds, tuple) or not all(isinstance(k, str) for k in kinds)
            or (layout is None) != (not kinds)):
        raise ValueError(f"index class {cls.__name__}: LAYOUT_KINDS must be a tuple of group "
                         f"kind names, given exactly when LAYOUT_CLASS is, got {kinds!r}")
    return cls


def _load(registry, kind: str, name: str) -> type:
    module, _, attr = registry[name].partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{kind} {name!r} is registered but cannot be imported: {e}") from None
    return getattr(mod, attr)


def get_index_class(name: str | type) -> type:
    """The implementation class registered as ``name`` (for one full-attention group),
    or ``name`` itself when it is an index class (`check_index_class`); ``ValueError``
    naming the choices."""
    if is_index_class(name):
        return check_index_class(name)
    if not isinstance(name, str) or name not in INDEXES:
        raise ValueError(f"unknown index {name!r}; expected one of {index_names()} or an "
                         "index class (INDEX_NAME and the manager protocol)")
    return _load(INDEXES, "index", name)


def index_name(index: str | type) -> str:
    """The name a record shows for ``index`` (a registered name, or a class's
    ``INDEX_NAME``)."""
    return get_index_class(index).INDEX_NAME if is_index_class(index) else index


def _canonical(index):
    """A registered index's class given as a class -> its name (the same index)."""
    if is_index_class(index) and check_index_class(index).INDEX_NAME in INDEXES:
        return index.INDEX_NAME
    return index


def _layout_of(index) -> tuple[tuple[str, ...], object]:
    """(the group kinds ``index``'s layout implementation serves, that implementation:
    a class, a ``"module:Class"`` or None); the hash index's is ``kv_groups``'."""
    if is_index_class(index):
        cls = get_index_class(index)
        return tuple(getattr(cls, "LAYOUT_KINDS", ())), getattr(cls, "LAYOUT_CLASS", None)
    return LAYOUT_INDEX_KINDS.get(index, ()), LAYOUT_INDEXES.get(index)


def check_implementation(manager, index, kv_cache_groups, eviction, num_host_blocks) -> str:
    """The one rule, applied by an implementation's constructor: ``ValueError`` with the
    reason when the combination is refused, or naming the class that serves it when
    that is not ``type(manager)``; else the index's name (``index_name``)."""
    cls = resolve_manager_class(index, kv_cache_groups, eviction, num_host_blocks)
    if type(manager) is not cls:
        own = getattr(type(manager), "INDEX_NAME", None)
        raise ValueError(
            f"{type(manager).__name__}{f' (the {own!r} index)' if own else ''} does not "
            f"serve index={index_name(index)!r} with "
            f"kv_cache_groups={kv_cache_groups!r}: {cls.__name__} does (KVCacheManager builds "
            "the implementation of each layout: one full-attention group or others)")
    return index_name(index)


def refusal(index: str | type, kv_cache_groups, eviction: str, num_host_blocks) -> str | None:
    """Why the combination is not served (``None``: it runs). Raises ``ValueError`` for
    an unknown index and for a bad layout (``kv_groups.check_kv_cache_groups``)."""
    from prefixcache.core.kv_groups import check_kv_cache_groups, is_hybrid

    get_index_class(index)  # unknown -> ValueError naming the choices
    index = _canonical(index)
    if kv_cache_groups is None:
        return None
    groups = check_kv_cache_groups(kv_cache_groups)
    if not is_hybrid(groups):
        return None
    if index != DEFAULT_INDEX:
        served, layout = _layout_of(index)
        if layout is None and is_index_class(index):
            return (f"index={index_name(index)!r} is not supported with KV cache groups other "
                    f"than one full-attention group: {COMBINATION_RULES[('layout', 'index')]}")
        for g in groups:
            if g.spec.kind not in served:
                rule = "layout" if is_index_class(index) else "state"
                return (f"index={index_name(index)!r} is not supported with a "
                        f"{g.spec.kind!r} KV cache group: "
                        f"{COMBINATION_RULES[(rule, 'index')]}")
    # (a bad num_host_blocks value is the tier's own check, in the implementation;
    # numpy ints are ints, bools are not: the one int rule)
    if (isinstance(num_host_blocks, numbers.Integral) and not isinstance(num_host_blocks, bool)
            and num_host_blocks > 0):
        why = _tier_refusal(index, groups, int(num_host_blocks))
        if why is not None:
            return why
    from prefixcache.core.eviction import get_policy_class, policy_name

    try:
        waiting = get_policy_class(eviction).needs_waiting
    except ValueError:  # an unknown policy: the implementation's own check names it
        waiting = False
    if waiting and index != DEFAULT_INDEX and not _serves_waiting(index):
        return (f"eviction={policy_name(eviction)!r} is not supported by index={index_name(index)!r} "
                f"with KV cache groups other than one full-attention group: "
                f"{COMBINATION_RULES[('layout index', 'waiting')]}")
    return None


def _serves_waiting(index) -> bool:
    """``index``'s layout implementation has the per-group waiting hooks
    (``WAITING_HOOKS``; the radix index's does). NOTE: imports it (a registered
    ``"module:Class"`` or an index class's ``LAYOUT_CLASS``), as building it would."""
    layout = _layout_of(index)[1]
    if layout is None:
        return False
    cls = layout if isinstance(layout, type) else _load({index_name(index): layout}, "index",
                                                        index_name(index))
    return all(callable(getattr(cls, m, None)) for m in WAITING_HOOKS)


def _tier_refusal(index: str | type, groups, num_host_blocks: int) -> str | None:
    """Why a host tier is not served with this multi-group layout (``None``: it is)."""
    if index != DEFAULT_INDEX:
        # (the radix index refuses state groups already, by ("state", "index"); an
        # index class may declare them in LAYOUT_KINDS)
        state = any(g.spec.kind == "mamba" for g in groups)
        rule = ("state", "tier") if state else ("layout index", "tier")
        return (f"num_host_blocks={num_host_blocks} with index={index_name(index)!r} is not supported "
                "with KV cache groups other than one full-attention group: "
                f"{COMBINATION_RULES[rule]}")
    for g in groups:
        if g.spec.kind not in TIER_GROUP_KINDS:
            return (f"num_host_blocks={num_host_blocks} is not supported with a "
                    f"{g.spec.kind!r} KV cache group: "
                    f"{COMBINATION_RULES[('kind', 'tier')]}")
    return None


def resolve_manager_class(index: str | type, kv_cache_groups, eviction: str = "lru",
                          num_host_blocks=0) -> type:
    """The implementation ``KVCacheManager`` builds for this combination, or
    ``ValueError`` naming why it is refused (``refusal``)."""
    why = refusal(index, kv_cache_groups, eviction, num_host_blocks)
    if why is not None:
        raise ValueError(why)
    if kv_cache_groups is not None:
        from prefixcache.core.kv_groups import is_hybrid, layout_manager_class

        if is_hybrid(tuple(kv_cache_groups)):
            index = _canonical(index)
            if index == DEFAULT_INDEX:
                return layout_manager_class(kv_cache_groups)
            layout = _layout_of(index)[1]
            if isinstance(layout, type):
                return layout
            return _load({index_name(index): layout}, "index", index_name(index))
    return get_index_class(index)


__all__ = [
    "COMBINATION_RULES",
    "DEFAULT_INDEX",
    "INDEXES",
    "INDEX_PROTOCOL",
    "LAYOUT_INDEXES",
    "TIERS",
    "TIER_GROUP_KINDS",
    "WAITING_HOOKS",
    "check_implementation",
    "check_index_class",
    "get_index_class",
    "index_name",
    "index_names",
    "is_index_class",
    "refusal",
    "resolve_manager_class",
]
