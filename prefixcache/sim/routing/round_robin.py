"""``round_robin``: replicas in turn."""

from __future__ import annotations

from prefixcache.sim.routing.base import Router


class RoundRobinRouter(Router):
    name = "round_robin"

    def __init__(self, num_replicas: int, *, block_size: int, seed: int = 0):
        super().__init__(num_replicas, block_size=block_size, seed=seed)
        self._next = 0

    def route(self, request, loads, now):
        i = self._next
        self._next = (i + 1) % self.num_replicas
        return i
