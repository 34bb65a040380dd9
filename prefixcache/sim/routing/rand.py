"""``random``: a uniformly random replica (seeded)."""

from __future__ import annotations

import random

from prefixcache.sim.routing.base import Router


class RandomRouter(Router):
    name = "random"

    def __init__(self, num_replicas: int, *, block_size: int, seed: int = 0):
        super().__init__(num_replicas, block_size=block_size, seed=seed)
        self._rng = random.Random(seed)

    def route(self, request, loads, now):
        return self._rng.randrange(self.num_replicas)
