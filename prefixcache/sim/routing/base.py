"""The routing seam: which replica serves an arriving request.

A router sees, per decision, the arriving ``Request`` (prompt, salt, adapter, block
hashes on demand) and one ``ReplicaLoad`` per replica; routers that need the replicas'
cache contents learn them only from the KV cache events the replicas publish
(``on_events``), as a production router does. A router keeps its own state; it never
reaches into a replica's manager.

A new router is one file in this package plus one line in ``ROUTERS``
(``prefixcache/sim/routing/__init__.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence


class ReplicaLoad(NamedTuple):
    """What a router may know about one replica's load at decision time.

    Attributes:
      index: the replica's index, ``0 .. num_replicas - 1``.
      outstanding: requests queued or running there.
      waiting: requests queued (not admitted yet).
      active_blocks: KV blocks held by its running requests.
      queued_blocks: blocks its queued requests' prompts will need.
      num_blocks: its KV cache capacity in blocks.

    NOTE: a NamedTuple (built once per replica per decision: a frozen dataclass's
    ``__init__`` cost ~3x more on the routing clock).
    """

    index: int
    outstanding: int
    waiting: int
    active_blocks: int
    queued_blocks: int
    num_blocks: int


class Router:
    """Base class of routing policies.

    Args:
      num_replicas: replicas behind the router (>= 1).
      block_size: tokens per KV block (for routers that key on blocks).
      seed: seed of any randomness.

    Attributes:
      name: the registry name.
      needs_events: the router must be fed every replica's KV cache events.
    """

    name = "base"
    needs_events = False

    def __init__(self, num_replicas: int, *, block_size: int, seed: int = 0):
        # The one int rule (prefixcache._validate): numpy ints are ints, bools are not;
        # a seed is an int (a str or float seed was taken, and seeds Random differently).
        from prefixcache._validate import check_int, check_positive_int  # noqa: PLC0415

        self.num_replicas = check_positive_int("num_replicas", num_replicas)
        self.block_size = check_positive_int("block_size", block_size)
        self.seed = check_int("seed", seed)

    def route(self, request, loads: Sequence[ReplicaLoad], now: float) -> int:
        """The index of the replica that serves ``request`` (arriving at ``now`` s)."""
        raise NotImplementedError

    def on_events(self, replica: int, events: Sequence[Any]) -> None:
        """KV cache events a replica published (only called when ``needs_events``)."""

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the router's own state is inconsistent."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas={self.num_replicas})"


def least_loaded(loads: Sequence[ReplicaLoad]) -> int:
    """The replica with the fewest outstanding requests (lowest index among equals)."""
    best = loads[0]
    for ld in loads:
        if ld.outstanding < best.outstanding:
            best = ld
    return best.index
