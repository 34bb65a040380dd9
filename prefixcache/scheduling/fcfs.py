"""``fcfs``: first come, first served (vLLM's order; the default, unchanged behaviour)."""

from __future__ import annotations

from prefixcache.scheduling.base import WaitingPolicy


class FCFSPolicy(WaitingPolicy):
    name = "fcfs"

    @property
    def is_fcfs(self) -> bool:
        return True

    def order(self, waiting, request_of, manager):
        return list(waiting)

    def after_admission(self, waiting_fcfs, admitted, request_of):
        return None  # FCFS never passes anyone over
