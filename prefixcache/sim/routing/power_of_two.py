"""``power_of_two``: two replicas drawn at random, the less loaded one serves (seeded).

The "power of two choices" rule of sglang-router's ``power_of_two`` policy: draw two
distinct replicas uniformly, send the request to the one with fewer outstanding requests
(the first drawn among equals). With one replica, that replica.
"""

from __future__ import annotations

import random

from prefixcache.sim.routing.base import Router


class PowerOfTwoRouter(Router):
    name = "power_of_two"

    def __init__(self, num_replicas: int, *, block_size: int, seed: int = 0):
        super().__init__(num_replicas, block_size=block_size, seed=seed)
        self._rng = random.Random(seed)

    def route(self, request, loads, now):
        if self.num_replicas == 1:
            return 0
        a, b = self._rng.sample(range(self.num_replicas), 2)
        return b if loads[b].outstanding < loads[a].outstanding else a
