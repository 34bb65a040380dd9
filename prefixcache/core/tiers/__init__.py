"""Storage tiers under the device pool: ``host`` -> ``disk`` -> ``remote`` (and any
tier of one's own), as one chain (``base.py``: the ``KeyTier`` protocol, ``BudgetTier``
for tiers sized in bytes, ``TierChain``, ``TierTransfer``, ``TierLink``), served by the
hash index with every group layout and the radix index with one full-attention group.

``TIERS`` is the registry (name -> ``"module:Class"``); a tier of one's own is one file
(a ``KeyTier`` subclass) and one entry here, or its class passed where a name goes:
``KVCacheManager(..., num_host_blocks=N, tiers=({"tier": MyTier, "num_blocks": 64},))``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from prefixcache.core.tiers.base import (
    DISK_LINK,
    HOST_LINK,
    REMOTE_LINK,
    TIER_NAMES,
    BudgetTier,
    KeyTier,
    Tier,
    TierChain,
    TierHit,
    TierLink,
    TierTransfer,
    key_of,
)
from prefixcache.core.tiers.disk import DiskTier
from prefixcache.core.tiers.remote import RemoteStore

# The registry (name -> "module:Class") is ``indexes.TIERS``, beside the indexes.
from prefixcache.core.indexes import TIERS  # noqa: E402

# The manager's keywords (and CacheConfig's fields) of the tiers below the host, with
# their defaults: the one table.
LOWER_TIER_DEFAULTS = MappingProxyType({
    "disk_bytes": 0,
    "disk_eviction": "lru",
    "disk_eviction_options": None,
    "page_bytes": None,
    "remote_bytes": 0,
    "remote_eviction": "lru",
    "tiers": None,
})


def get_tier_class(tier: str | type) -> type:
    """The class of a registered tier name, or ``tier`` itself when it is a ``KeyTier``
    subclass; ``ValueError`` naming the choices otherwise."""
    if isinstance(tier, type):
        if not issubclass(tier, KeyTier):
            raise ValueError(f"tier class {tier.__name__} must subclass "
                             "prefixcache.core.tiers.KeyTier")
        return tier
    if not isinstance(tier, str) or tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; registered: {', '.join(TIERS)} (or pass a "
                         "KeyTier subclass)")
    module, name = TIERS[tier].split(":")
    return getattr(importlib.import_module(module), name)


def lower_tiers_requested(kwargs: Mapping[str, Any]) -> bool:
    """Whether manager keywords ask for any tier below the host."""
    return bool(kwargs.get("disk_bytes") or kwargs.get("remote_bytes")
                or kwargs.get("remote") is not None or kwargs.get("tiers"))


def build_lower_tiers(*, block_size: int, key_bytes: int, disk_bytes: int = 0,
                      disk_eviction="lru", disk_eviction_options=None, page_bytes=None,
                      remote_bytes: int = 0, remote_eviction="lru", remote=None,
                      tiers: Sequence[Mapping[str, Any]] | None = None) -> list[KeyTier]:
    """The tiers below the host, top first: ``disk`` (``disk_bytes > 0``), each of
    ``tiers`` (mappings: ``"tier"`` a registered name or a ``KeyTier`` subclass, the
    other items its keyword arguments), then ``remote`` (the shared ``RemoteStore``
    given, else one of ``remote_bytes``). Bad arguments raise ``ValueError`` naming
    them, before anything is built."""
    out: list[KeyTier] = []
    if disk_bytes:
        out.append(DiskTier(disk_bytes, page_bytes=page_bytes, block_size=block_size,
                            eviction=disk_eviction, eviction_options=disk_eviction_options,
                            key_bytes=key_bytes))
    if tiers is not None:
        if isinstance(tiers, (str, bytes, Mapping)) or not isinstance(tiers, Sequence):
            raise ValueError(f"tiers must be a sequence of mappings, got {tiers!r}")
        for spec in tiers:
            if not isinstance(spec, Mapping) or "tier" not in spec:
                raise ValueError(f"tiers: each entry must be a mapping with a 'tier' item "
                                 f"(a name or KeyTier subclass), got {spec!r}")
            opts = dict(spec)
            cls = get_tier_class(opts.pop("tier"))
            opts.setdefault("block_size", block_size)
            if cls is DiskTier or cls is RemoteStore:
                opts.setdefault("page_bytes", page_bytes)
            try:
                out.append(cls(**opts))
            except TypeError as e:
                raise ValueError(f"tiers: {cls.__name__}({opts}): {e}") from None
    if remote is not None:
        if not isinstance(remote, KeyTier) or not remote.inclusive:
            raise ValueError(f"remote must be a shared RemoteStore (an inclusive KeyTier), "
                             f"got {remote!r}")
        if remote_bytes:
            raise ValueError("give the remote tier as remote (a shared store) or remote_bytes "
                             f"(a store of this manager's own), not both; got remote_bytes="
                             f"{remote_bytes!r}")
        out.append(remote)
    elif remote_bytes:
        out.append(RemoteStore(remote_bytes, page_bytes=page_bytes, block_size=block_size,
                               eviction=remote_eviction))
    return out


__all__ = [
    "BudgetTier",
    "DISK_LINK",
    "HOST_LINK",
    "LOWER_TIER_DEFAULTS",
    "REMOTE_LINK",
    "TIERS",
    "TIER_NAMES",
    "DiskTier",
    "KeyTier",
    "RemoteStore",
    "Tier",
    "TierChain",
    "TierHit",
    "TierLink",
    "TierTransfer",
    "build_lower_tiers",
    "get_tier_class",
    "key_of",
    "lower_tiers_requested",
]
