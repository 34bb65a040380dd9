"""``least_loaded``: the replica with the fewest outstanding requests (SGLang router's
``shortest_queue``; lowest index among equals)."""

from __future__ import annotations

from prefixcache.sim.routing.base import Router, least_loaded


class LeastLoadedRouter(Router):
    name = "least_loaded"

    def route(self, request, loads, now):
        return least_loaded(loads)
