"""KV cache groups: which layers share one block table, and their attention type.

vLLM 0.33's ``kv_cache_interface`` shape, reduced to what the host manager needs (the
page shape lives in the model config, not here):

    groups = [
        KVCacheGroup(FullAttentionSpec(), ["layers.5", "layers.11"]),
        KVCacheGroup(SlidingWindowSpec(sliding_window=512), ["layers.0", "layers.1"]),
    ]
    manager = KVCacheManager(num_blocks, block_size, kv_cache_groups=groups)

Rules (vLLM's, checked by ``check_kv_cache_groups`` before anything is built):
    * at least one group; every group has at least one layer; a layer name appears
      once across all groups (one attention type per layer, one block table per
      group);
    * all groups share the manager's ``block_size`` (vLLM allows per-group block sizes
      with a common scheduler block; our KV array has one page size);
    * ``sliding_window`` is a positive int (bool rejected). The kernels mask any
      window (``prefixcache_kernels/reference.py``: a query at position p sees keys in
      ``(p - W, p]``), so it need not be a multiple of ``block_size``.
    * No full-attention group is required. NOTE: vLLM 0.33 serves sliding-window-only
      models (one ``SlidingWindowManager``, or the hybrid coordinator with
      ``full_attention_group_id = None``), so the manager does too; the hybrid
      coordinator only *orders* full attention first (its left-to-right scan bounds
      the right-to-left sliding-window searches), which ``lookup_groups`` mirrors.
      A layout is rejected only for what vLLM rejects: empty groups, duplicate layers.

Groups with equal specs are looked up together (vLLM's ``SpecGroup``): a block hit
counts only if every group of the spec has the block cached.

Group kinds. A kind is a spec class and a single-type manager class in one file of
``prefixcache.core.groups`` (``full_attention``, ``sliding_window``, ``mamba``: a
state-space group whose per-request state is a fixed-size snapshot, vLLM's
``MambaSpec`` in "align" mode), registered once in ``GROUP_KINDS`` by the spec's
``kind`` name as a lazy ``"module:ManagerClass"`` string. A kind of a user's own
package needs no registration: its spec class names its manager (``manager_class``).
The hybrid manager (``core.hybrid``) is a coordinator over one such manager per group.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import MappingProxyType
from typing import Sequence, Union

from prefixcache._validate import ArgumentTypeError
from prefixcache.core.groups.full_attention import FullAttentionSpec
from prefixcache.core.groups.sliding_window import SlidingWindowSpec

# NOTE: the hybrid manager's class, imported only when a layout needs it (the
# registry form of core/indexes.py: one entry, no import cost on the default path).
HYBRID_MANAGER = "prefixcache.core.hybrid:HybridKVCacheManager"


KVCacheSpec = Union[FullAttentionSpec, SlidingWindowSpec]

# NOTE: the group kinds, by their spec's ``kind`` name (read-only): a new kind is one
# file of ``prefixcache.core.groups`` (its spec class and its ``SingleTypeManager``
# subclass, whose ``spec_class`` is the spec) plus one entry here, a lazy
# "module:ManagerClass" string (the file is imported when a layout uses the kind).
GROUP_KINDS = MappingProxyType({
    "full_attention": "prefixcache.core.groups.full_attention:FullAttentionManager",
    "sliding_window": "prefixcache.core.groups.sliding_window:SlidingWindowManager",
    "mamba": "prefixcache.core.groups.mamba:MambaManager",
})


def group_manager_class(kind: str) -> type:
    """The single-type manager class of group kind ``kind`` (``GROUP_KINDS``),
    imported on first use; ``ValueError`` naming the kinds for an unknown one."""
    try:
        target = GROUP_KINDS[kind]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown KV cache group kind {kind!r}: registered kinds are "
            f"{sorted(GROUP_KINDS)} (kv_groups.GROUP_KINDS)") from None
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def spec_manager_class(spec) -> type:
    """The single-type manager class of ``spec``'s group kind: the one its class
    names (``manager_class``: a kind of the user's own package, no registry edit), else
    the registered one (``GROUP_KINDS``, by ``spec.kind``)."""
    own = getattr(type(spec), "manager_class", None)
    if own is not None:
        return own
    return group_manager_class(spec.kind)


def _check_own_kind(spec_cls: type, manager) -> None:
    """A spec class that names its manager: a ``SingleTypeManager`` subclass whose
    ``spec_class`` the spec is, under a kind name of its own."""
    from prefixcache.core.groups.base import SingleTypeManager  # noqa: PLC0415

    name = spec_cls.__name__
    if not (isinstance(manager, type) and issubclass(manager, SingleTypeManager)):
        raise ArgumentTypeError(
            f"{name}.manager_class must be a SingleTypeManager subclass, got {manager!r}")
    if not issubclass(spec_cls, manager.spec_class):
        raise ArgumentTypeError(
            f"{name}.manager_class={manager.__name__} serves "
            f"{manager.spec_class.__name__} specs (its spec_class), not {name}")
    kind = getattr(spec_cls, "kind", None)
    if type(kind) is not str or not kind:
        raise ArgumentTypeError(f"{name} needs a kind (a non-empty str class attribute)")
    if kind in GROUP_KINDS and group_manager_class(kind) is not manager:
        raise ValueError(
            f"{name}.kind={kind!r} is a registered group kind's name; give the kind a name "
            f"of its own (not one of {sorted(GROUP_KINDS)})")


def _spec_names() -> str:
    return " or ".join(group_manager_class(k).spec_class.__name__ for k in GROUP_KINDS)


def _is_spec(spec) -> bool:
    own = getattr(type(spec), "manager_class", None)
    if own is not None:
        _check_own_kind(type(spec), own)
        return True
    kind = getattr(type(spec), "kind", None)
    if type(kind) is not str or kind not in GROUP_KINDS:
        return False
    return isinstance(spec, group_manager_class(kind).spec_class)


@dataclasses.dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table (vLLM's ``KVCacheGroupSpec``).

    Args:
        spec: ``FullAttentionSpec()`` or ``SlidingWindowSpec(W)``.
        layer_names: the layers' names (a non-empty sequence of distinct non-empty
            strings; stored as a tuple).
    """

    spec: KVCacheSpec
    layer_names: tuple[str, ...]

    def __post_init__(self):
        if not _is_spec(self.spec):
            raise ArgumentTypeError(
                f"KVCacheGroup spec must be a {_spec_names()} "
                f"(kv_groups.GROUP_KINDS), or a spec class naming its manager_class, "
                f"got {self.spec!r}")
        names = self.layer_names
        if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
            raise ArgumentTypeError(
                f"layer_names must be a list or tuple of str, got {names!r}")
        names = tuple(names)
        if not names:
            raise ValueError(f"a KV cache group needs at least one layer ({self.spec})")
        for n in names:
            if not isinstance(n, str) or not n:
                raise ArgumentTypeError(f"layer names must be non-empty str, got {n!r}")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"layer names {dup} appear twice in one KV cache group")
        object.__setattr__(self, "layer_names", names)


# One full-attention group (the layout of a manager built without kv_cache_groups).
FULL_ATTENTION_LAYOUT = (KVCacheGroup(FullAttentionSpec(), ("layers",)),)


def check_kv_cache_groups(groups) -> tuple[KVCacheGroup, ...]:
    """``groups`` as a tuple, or ``ValueError`` / ``ArgumentTypeError`` naming the
    problem (see the module docstring's rules)."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, (list, tuple)):
        raise ArgumentTypeError(
            f"kv_cache_groups must be a list or tuple of KVCacheGroup, got {groups!r}")
    groups = tuple(groups)
    if not groups:
        raise ValueError("kv_cache_groups is empty: a model needs at least one KV cache group")
    seen: dict[str, int] = {}
    for i, g in enumerate(groups):
        if not isinstance(g, KVCacheGroup):
            raise ArgumentTypeError(f"kv_cache_groups[{i}] is not a KVCacheGroup: {g!r}")
        for n in g.layer_names:
            if n in seen:
                raise ValueError(
                    f"layer {n!r} is in KV cache groups {seen[n]} and {i}: a layer has one "
                    "attention type and one block table")
            seen[n] = i
    return groups


def is_hybrid(groups: Sequence[KVCacheGroup]) -> bool:
    """Whether a (checked) layout needs the hybrid manager: anything but one
    full-attention group (the default manager's case)."""
    return not (len(groups) == 1 and isinstance(groups[0].spec, FullAttentionSpec))


def needs_aligned_prefill(groups: Sequence[KVCacheGroup]) -> bool:
    """Whether a (checked) layout has a group kind whose prefills must stop where it
    keeps a state (``SingleTypeManager.aligned_prefill``: state-space groups), so a
    scheduler splits them (``HybridKVCacheManager.prefill_chunks``)."""
    return any(spec_manager_class(g.spec).aligned_prefill for g in groups)


def parse_kv_groups(text: str) -> tuple[KVCacheGroup, ...]:
    """Groups from the peer harness's ``--kv-groups`` form: comma-separated ``full``,
    ``sw<W>`` or ``mamba``, one group (of one layer, ``layers.<i>``) each; ``"full,sw32"``
    is a full-attention group and a sliding-window group of W = 32, ``"full,mamba"`` a
    full-attention group and a state-space group (``groups.mamba.MambaSpec()``;
    ``mamba_r0``: ``MambaSpec(retention_interval=0)``)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"kv groups must be a non-empty string such as 'full,sw32', got {text!r}")
    groups = []
    for i, part in enumerate(p.strip() for p in text.split(",")):
        if part == "full":
            spec = FullAttentionSpec()
        elif part.startswith("sw") and part[2:].isascii() and part[2:].isdigit():
            spec = SlidingWindowSpec(int(part[2:]))
        elif part in ("mamba", "mamba_r0"):
            spec = group_manager_class("mamba").spec_class(
                retention_interval=None if part == "mamba" else 0)
        else:
            raise ValueError(
                f"bad kv group {part!r} in {text!r}: expected 'full', 'sw<W>', 'mamba' "
                "or 'mamba_r0'")
        groups.append(KVCacheGroup(spec, (f"layers.{i}",)))
    return tuple(groups)


def manager_class_for_groups(groups) -> type | None:
    """The implementation class a layout needs: ``None`` for one full-attention group
    (the index's own class), else the hybrid one. Bad layouts raise here."""
    groups = check_kv_cache_groups(groups)
    if not is_hybrid(groups):
        return None
    return layout_manager_class(groups)


def layout_manager_class(groups) -> type:
    """The hybrid implementation class (``HYBRID_MANAGER``), imported on first use."""
    module, _, attr = HYBRID_MANAGER.partition(":")
    return getattr(importlib.import_module(module), attr)


def lookup_groups(groups: Sequence[KVCacheGroup]) -> list[tuple[KVCacheSpec, list[int]]]:
    """vLLM's ``verify_and_split_kv_cache_groups``: group ids merged by equal spec (in
    first-seen order), full attention moved first (a stable sort)."""
    out: list[tuple[KVCacheSpec, list[int]]] = []
    for i, g in enumerate(groups):
        for spec, ids in out:
            if spec == g.spec:
                ids.append(i)
                break
        else:
            out.append((g.spec, [i]))
    out.sort(key=lambda e: not isinstance(e[0], FullAttentionSpec))
    return out


__all__ = [
    "FULL_ATTENTION_LAYOUT",
    "FullAttentionSpec",
    "GROUP_KINDS",
    "HYBRID_MANAGER",
    "KVCacheGroup",
    "KVCacheSpec",
    "SlidingWindowSpec",
    "check_kv_cache_groups",
    "group_manager_class",
    "spec_manager_class",
    "is_hybrid",
    "layout_manager_class",
    "lookup_groups",
    "manager_class_for_groups",
    "needs_aligned_prefill",
    "parse_kv_groups",
]
