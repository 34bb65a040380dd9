"""``session``: consistent hashing of a prefix key (session affinity).

The key is the request's first ``key_blocks`` blocks of tokens with its cache salt and
adapter (the part of a prompt a conversation or tenant keeps across turns); a hash ring
with ``vnodes`` virtual nodes per replica maps it to a replica, so adding a replica moves
only ~1/N of the keys. With a system prompt longer than the key shared by everyone, every
request goes to one replica: the known weakness of prefix-key affinity.
"""

from __future__ import annotations

import bisect
import hashlib

from prefixcache.sim.routing.base import Router


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class SessionRouter(Router):
    name = "session"

    def __init__(self, num_replicas: int, *, block_size: int, seed: int = 0,
                 key_blocks: int = 2, vnodes: int = 64):
        super().__init__(num_replicas, block_size=block_size, seed=seed)
        if isinstance(key_blocks, bool) or not isinstance(key_blocks, int) or key_blocks < 1:
            raise ValueError(f"session router: key_blocks must be an int >= 1, got {key_blocks!r}")
        if isinstance(vnodes, bool) or not isinstance(vnodes, int) or vnodes < 1:
            raise ValueError(f"session router: vnodes must be an int >= 1, got {vnodes!r}")
        self.key_blocks = key_blocks
        ring = sorted((_h64(f"{seed}/{r}/{v}".encode()), r)
                      for r in range(num_replicas) for v in range(vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [r for _, r in ring]

    def key(self, request) -> bytes:
        n = min(self.key_blocks * self.block_size, request.num_prompt_tokens)
        lora = request.lora
        parts = [repr(request.cache_salt).encode(),
                 repr((lora.name, lora.path) if lora is not None else None).encode(),
                 request.token_bytes(0, n)]  # the ids' u64 bytes: exact, one copy
        return b"|".join(parts)

    def route(self, request, loads, now):
        i = bisect.bisect_left(self._points, _h64(self.key(request)))
        return self._owners[i % len(self._owners)]
