"""``lpm``: longest cached prefix first (SGLang's ``lpm``), FCFS among equals.

Requests whose prefix is in the cache now run before it is evicted, and requests
that computed a prefix pull in the ones that share it. Queues longer than
``max_reorder`` (SGLang: 128) are served FCFS.
"""

from __future__ import annotations

from prefixcache.scheduling.base import WaitingPolicy


class LPMPolicy(WaitingPolicy):
    name = "lpm"

    def prioritize(self, items, request_of, manager):
        peek = manager.peek_computed_tokens
        keyed = [(-peek(request_of(x)), i, x) for i, x in enumerate(items)]
        keyed.sort(key=lambda t: (t[0], t[1]))
        return [x for _, _, x in keyed]
