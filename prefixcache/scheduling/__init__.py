"""Waiting-queue (admission order) policies shared by the engine and the simulator.

A policy is one file in this package plus one line in ``SCHEDULING_POLICIES``;
``make_scheduling_policy(name, **options)`` builds one. A policy of a user's own package
needs no registration: its class (or an instance) goes where a name goes
(``Engine(scheduling_policy=MyPolicy)``, ``des.simulate(scheduling=MyPolicy())``). Host
code only (no jax).
"""

from __future__ import annotations

from types import MappingProxyType

from prefixcache.scheduling.base import WaitingPolicy
from prefixcache.scheduling.dfs_weight import DFSWeightPolicy
from prefixcache.scheduling.fcfs import FCFSPolicy
from prefixcache.scheduling.lpm import LPMPolicy

# NOTE: read-only (no module-level mutable state): register a policy here.
SCHEDULING_POLICIES = MappingProxyType({
    "fcfs": FCFSPolicy,
    "lpm": LPMPolicy,
    "dfs_weight": DFSWeightPolicy,
})


def scheduling_policy_names() -> tuple[str, ...]:
    return tuple(SCHEDULING_POLICIES)


def make_scheduling_policy(name="fcfs", **options) -> WaitingPolicy:
    """Build the waiting-queue policy ``name`` (a registered name or a `WaitingPolicy`
    subclass, built with ``options``; an instance is returned as it is, and takes no
    options); ``ValueError`` for an unknown name."""
    if isinstance(name, WaitingPolicy):
        if options:
            raise ValueError(f"scheduling policy {name.name!r} is already built: options "
                             f"{sorted(options)} go to its class")
        return name
    if isinstance(name, type) and issubclass(name, WaitingPolicy):
        try:
            return name(**options)
        except TypeError as e:
            raise TypeError(f"scheduling policy {name.__name__}: {e}") from None
    if not isinstance(name, str) or name not in SCHEDULING_POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; expected one of "
                         f"{scheduling_policy_names()}")
    try:
        return SCHEDULING_POLICIES[name](**options)
    except TypeError as e:
        raise TypeError(f"scheduling policy {name!r}: {e}") from None


__all__ = ["SCHEDULING_POLICIES", "WaitingPolicy", "make_scheduling_policy",
           "scheduling_policy_names"]
