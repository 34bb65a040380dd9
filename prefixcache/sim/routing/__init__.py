"""Request routers for the multi-replica simulator, selected by name.

A router is one file in this package plus one line in ``ROUTERS`` (the registration);
``make_router(name, num_replicas=..., block_size=..., seed=..., **options)`` builds one.
A router of a user's own package needs no registration: its class goes where a name
goes (``make_router(MyRouter, ...)``), or an instance to
``simulate_cluster(router=MyRouter(num_replicas, block_size=...))``.
The protocol is in ``base.py``; ``prefixcache.sim.cluster`` drives them.
"""

from __future__ import annotations

from types import MappingProxyType

from prefixcache.sim.routing.base import ReplicaLoad, Router
from prefixcache.sim.routing.cache_aware import CacheAwareRouter
from prefixcache.sim.routing.kv_events import KVEventsRouter
from prefixcache.sim.routing.least_loaded import LeastLoadedRouter
from prefixcache.sim.routing.power_of_two import PowerOfTwoRouter
from prefixcache.sim.routing.rand import RandomRouter
from prefixcache.sim.routing.round_robin import RoundRobinRouter
from prefixcache.sim.routing.session import SessionRouter

# NOTE: read-only (no module-level mutable state): register a router here.
ROUTERS = MappingProxyType({
    "random": RandomRouter,
    "round_robin": RoundRobinRouter,
    "least_loaded": LeastLoadedRouter,
    "power_of_two": PowerOfTwoRouter,
    "session": SessionRouter,
    "cache_aware": CacheAwareRouter,
    "kv_events": KVEventsRouter,
})


def router_names() -> tuple[str, ...]:
    return tuple(ROUTERS)


def check_router_name(name: str) -> str:
    """``name`` if it is a registered router, else ``ValueError`` naming the choices."""
    if not isinstance(name, str) or name not in ROUTERS:
        raise ValueError(f"unknown routing policy {name!r}; expected one of {router_names()}")
    return name


def make_router(name: str, *, num_replicas: int, block_size: int, seed: int = 0,
                **options) -> Router:
    """Build the router ``name`` (a registered name or a `Router` subclass); an option it
    does not take is a ``TypeError`` naming it."""
    if isinstance(name, type) and issubclass(name, Router):
        cls, name = name, name.__name__
    else:
        cls = ROUTERS[check_router_name(name)]
    try:
        return cls(num_replicas, block_size=block_size, seed=seed, **options)
    except TypeError as e:
        # (an ArgumentTypeError, a TypeError and a ValueError, keeps both)
        raise type(e)(f"routing policy {name!r}: {e}") from None


__all__ = ["ROUTERS", "ReplicaLoad", "Router", "check_router_name", "make_router", "router_names"]
