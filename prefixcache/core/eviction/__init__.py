"""Eviction policies for the prefix cache, selected by name.

A policy is one file in this package plus one line in ``POLICIES`` below (the
registration). ``make_policy(name, num_blocks=..., **options)`` builds one;
``KVCacheManager(..., eviction=name)`` selects it. A policy defined in a user's own
package needs no registration here: its class goes where a name goes
(``CacheConfig(eviction=MyPolicy)``, ``KVCacheManager(..., eviction=MyPolicy)``); every
lookup (`get_policy_class`) takes either. The protocol between an index and a policy is
in ``base.py``.
"""

from __future__ import annotations

from types import MappingProxyType

from prefixcache.core.eviction.arc import ARCPolicy
from prefixcache.core.eviction.base import (
    EvictionPolicy,
    HitCounts,
    KeyedPolicy,
    PolicyError,
    TimedPolicy,
    WaitingFanout,
    policy_clock,
    reads_waiting_queue,
)
from prefixcache.core.eviction.belady import BeladyPolicy, TraceFuture
from prefixcache.core.eviction.cost import CostPolicy
from prefixcache.core.eviction.fifo import FIFOPolicy
from prefixcache.core.eviction.hinted import HintedPolicy
from prefixcache.core.eviction.length import LengthPolicy
from prefixcache.core.eviction.lfu import LFUPolicy
from prefixcache.core.eviction.lru import LRUPolicy
from prefixcache.core.eviction.marconi import MarconiPolicy
from prefixcache.core.eviction.pgdsf import PGDSFPolicy
from prefixcache.core.eviction.priority import PriorityPolicy
from prefixcache.core.eviction.queue_aware import QueueAwarePolicy
from prefixcache.core.eviction.random_choice import RandomPolicy
from prefixcache.core.eviction.s3fifo import S3FIFOPolicy
from prefixcache.core.eviction.slru import SLRUPolicy
from prefixcache.core.eviction.tlru import TLRUPolicy
from prefixcache.core.eviction.ttl_lru import TTLLRUPolicy

# NOTE: the registry is read-only (no module-level mutable state): add a policy here.
POLICIES = MappingProxyType({
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
    "lfu": LFUPolicy,
    "slru": SLRUPolicy,
    "priority": PriorityPolicy,
    "length": LengthPolicy,
    "cost": CostPolicy,
    "belady": BeladyPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "pgdsf": PGDSFPolicy,
    "queue_aware": QueueAwarePolicy,
    "marconi": MarconiPolicy,
    "ttl_lru": TTLLRUPolicy,
    "tlru": TLRUPolicy,
    "random": RandomPolicy,
    "hinted": HintedPolicy,
})

DEFAULT_POLICY = "lru"


def policy_names() -> tuple[str, ...]:
    """The registered policy names."""
    return tuple(POLICIES)


def online_policy_names() -> tuple[str, ...]:
    """The registered policies that run without the trace's future (``needs_future``
    False): the ones a server, the engine and the host tier offer."""
    return tuple(name for name, cls in POLICIES.items() if not cls.needs_future)


def is_policy_class(value) -> bool:
    """``value`` is an `EvictionPolicy` subclass (a plug-in given in place of a name)."""
    return isinstance(value, type) and issubclass(value, EvictionPolicy)


def get_policy_class(name: str | type[EvictionPolicy]) -> type[EvictionPolicy]:
    """The policy class registered as ``name``, or ``name`` itself when it is an
    `EvictionPolicy` subclass (a user's own policy, unregistered); ``ValueError`` naming
    the choices."""
    if is_policy_class(name):
        if not isinstance(getattr(name, "name", None), str) or not name.name:
            raise ValueError(f"eviction policy class {name.__name__} needs a name (str)")
        return name
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; expected one of "
                         f"{policy_names()} or an EvictionPolicy subclass")
    return POLICIES[name]


def policy_name(name: str | type[EvictionPolicy]) -> str:
    """The name a record shows for ``name`` (a registered name, or a class's ``name``)."""
    return get_policy_class(name).name if is_policy_class(name) else name


def make_policy(name: str | type[EvictionPolicy], *, num_blocks: int,
                block_size: int | None = None, **options) -> EvictionPolicy:
    """Build the policy ``name`` for a pool of ``num_blocks`` blocks.

    Args:
        name: a registered name (``policy_names()``) or an `EvictionPolicy` subclass.
        num_blocks: blocks in the pool.
        block_size: tokens per block; passed on to policies with
            ``needs_block_size`` (``cost``), ignored by the others.
        **options: the policy's own options (e.g. ``belady``'s ``future``); an option
            the policy does not take is a ``TypeError`` naming it.
    """
    cls = get_policy_class(name)
    name = policy_name(name)
    if cls.needs_block_size:
        if block_size is None:
            raise ValueError(f"eviction policy {name!r} needs block_size")
        options = {**options, "block_size": block_size}
    try:
        return cls(num_blocks, **options)
    except TypeError as e:
        raise TypeError(f"eviction policy {name!r}: {e}") from None


__all__ = [
    "DEFAULT_POLICY",
    "TraceFuture",
    "EvictionPolicy",
    "HitCounts",
    "KeyedPolicy",
    "POLICIES",
    "PolicyError",
    "get_policy_class",
    "is_policy_class",
    "make_policy",
    "policy_name",
    "online_policy_names",
    "policy_clock",
    "policy_names",
    "reads_waiting_queue",
    "TimedPolicy",
    "WaitingFanout",
]
