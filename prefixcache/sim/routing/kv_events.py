"""``kv_events``: precise prefix-aware routing from the replicas' KV cache events.

A global index (block hash -> the replicas that hold it) is built ONLY from the
events the replicas publish -- ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``
(vLLM's KV events, as NVIDIA Dynamo's KV router and llm-d's precise prefix-cache
scorer consume them). Per request, each replica's *overlap* is the number of leading
prompt blocks it holds; the router picks the replica with the smallest cost, a
weighted sum of normalised scores in the manner of llm-d's scorers::

    cost = overlap_weight * (1 - overlap / prompt blocks)      # prefill still to do
         + (active blocks + queued blocks) / blocks per replica  # memory / queue load

(active = held by running requests, queued = needed by queued prompts). Among equal
costs, the least-loaded replica, then the lowest index. NOTE: Dynamo's raw logit
(``weight * prefill blocks + active blocks``) in block units let a replica's running
decode blocks outweigh a whole cached prefix on the tenant workload (hit rate 0.64 vs
0.83 with the normalised cost at 4 replicas, ``configs/route.py``); normalising both
terms to [0, 1] keeps the weight meaningful across block sizes and pool sizes.

Host tier (``medium``): a replica with a host memory tier (``KVCacheManager(
num_host_blocks=N)``) publishes its tier moves as events of ``medium="CPU"`` -- a
demotion is ``BlockRemoved(GPU)`` + ``BlockStored(CPU)``, a promotion ``BlockStored(GPU)``
+ ``BlockRemoved(CPU)``, a host eviction or a host copy dropped because the device
recomputed the hash ``BlockRemoved(CPU)`` (``prefixcache/core/host_tier.py``). The index
keeps the two media apart per replica and hash (as llm-d's KV-cache-aware scorer tracks
the medium of each block), and a replica's overlap walks the prompt's blocks as the
manager's lookup does: a device hit, else a host hit, else stop. The router counts a
host block at ``host_weight`` of a device block::

    overlap = device blocks + host_weight * host blocks      (of the leading match)

Default ``host_weight`` (``DEFAULT_HOST_WEIGHT = 0.8``), from the cost model: a device
hit saves the block's prefill compute; a host hit saves it too but the step then waits
for the block's copy over the host link, so its worth relative to a device hit is
``1 - load_time(block) / prefill_time(block)`` (``host_hit_weight``). For Llama-3.1-8B on
H100/H200 over PCIe Gen5 (``h200_pcie5``, 53.6 GB/s) that is 0.83 at the start of a
prompt, 0.84 at 2k tokens of context and 0.89 at 15k, for any block size or chip count
(both sides scale alike): copying a block's KV (128 KiB per token) takes ~17% of the
time its prefill does. 0.8 rounds it down (the copy's fixed latency and a promotion's device
blocks are not counted). ``host_hit_weight(cost_model, block_size)`` gives the figure
for another model or link.

The index keys on whatever the events carry: raw digests (the simulator's replicas
publish them, so a request's own block hashes are the keys) or vLLM's default ints (the
digest's low 64 bits: pass ``int_event_hashes=True`` to the router). A replica may hold
one hash in several blocks (append-only block tables), so the index
counts blocks per (hash, replica) and a replica leaves a hash's set only when its last
such block is removed.
"""

from __future__ import annotations

from typing import Sequence

import math
from typing import Any

from prefixcache.core.events import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, \
    BlockStored
from prefixcache.sim.routing.base import Router

_MASK64 = (1 << 64) - 1
DEFAULT_HOST_WEIGHT = 0.8  # a host hit's worth in device hits (module docstring)


def check_host_weight(host_weight: Any) -> float:
    """``host_weight`` as a float if it is a real number in [0, 1], else ``ValueError``."""
    if (isinstance(host_weight, bool) or not isinstance(host_weight, (int, float))
            or not 0.0 <= host_weight <= 1.0):
        raise ValueError(f"kv_events: host_weight must be a number in [0, 1] (a host hit's "
                         f"worth in device hits), got {host_weight!r}")
    return float(host_weight)


def host_hit_weight(cost_model, block_size: int, context_tokens: int = 0,
                    chunk_tokens: int = 8192) -> float:
    """A host hit's worth in device hits under ``cost_model``: ``1 - load / prefill``.

    ``prefill`` is what one block of ``block_size`` tokens adds to a prefill step of
    ``chunk_tokens`` tokens after ``context_tokens`` cached ones (the compute a hit
    saves); ``load`` is the block's copy over ``cost_model.host_link`` (bandwidth only:
    the per-transfer latency is shared by a step's loads). Clipped to [0, 1].

    Raises:
      ValueError: the cost model has no ``host_link``; bad counts.
    """
    for name, v in (("block_size", block_size), ("chunk_tokens", chunk_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) \
            or context_tokens < 0:
        raise ValueError(f"context_tokens must be an int >= 0, got {context_tokens!r}")
    chunk = max(chunk_tokens, block_size)
    saved = (cost_model.prefill_time(chunk, context_tokens)
             - cost_model.prefill_time(chunk - block_size, context_tokens + block_size))
    load = cost_model.block_bytes(block_size) / cost_model.host_bytes_per_s
    if not saved > 0:
        return 0.0
    w = 1.0 - load / saved
    return min(1.0, max(0.0, w)) if math.isfinite(w) else 0.0


def event_hash(digest: bytes) -> int:
    """A block digest as vLLM's events carry it by default (low 64 bits, big-endian)."""
    return int.from_bytes(digest, "big") & _MASK64


def _drop(tiers: dict, counts: dict, bit: int, h) -> None:
    """Replica ``bit`` no longer holds ``h`` in this medium (its last block went)."""
    del counts[h]
    m = tiers[h] & ~bit
    if m:
        tiers[h] = m
    else:
        del tiers[h]


class GlobalBlockIndex:
    """Which replicas hold which block hashes, and on which medium, from KV cache events.

    ``holders`` / ``counts`` are the device (``medium="GPU"``, or ``None`` as older
    publishers send) and ``host_holders`` / ``host_counts`` the host tier
    (``medium="CPU"``); any other medium is a ``ValueError``.

    Invariants (``check``), per medium: ``holders[h]`` has bit r set iff
    ``counts[r][h] > 0``; no entry with a zero count or an empty mask.
    """

    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas
        self.holders: dict = {}  # hash (digest or int) -> bitmask of replicas (device)
        self.counts: list[dict] = [{} for _ in range(num_replicas)]
        self.host_holders: dict = {}  # the same for the host tier
        self.host_counts: list[dict] = [{} for _ in range(num_replicas)]

    @staticmethod
    def _bad_medium(replica: int, ev):
        raise ValueError(f"replica {replica}: KV cache event on unknown medium {ev.medium!r} "
                         f"(expected {MEDIUM_GPU!r} or {MEDIUM_CPU!r}): {ev!r}")

    def apply(self, replica: int, events: Sequence) -> None:
        """Apply ``replica``'s events in order (its device and host maps)."""
        bit = 1 << replica
        device = (self.holders, self.counts[replica])
        host = (self.host_holders, self.host_counts[replica])
        # NOTE: one dict lookup per event picks the medium's maps.
        tier = {MEDIUM_GPU: device, None: device, MEDIUM_CPU: host}.get
        for ev in events:
            if isinstance(ev, BlockStored):
                holders, cnt = tier(ev.medium) or self._bad_medium(replica, ev)
                for h in ev.block_hashes:
                    c = cnt.get(h, 0)
                    cnt[h] = c + 1
                    if not c:
                        holders[h] = holders.get(h, 0) | bit
            elif isinstance(ev, BlockRemoved):
                holders, cnt = tier(ev.medium) or self._bad_medium(replica, ev)
                for h in ev.block_hashes:
                    c = cnt.get(h, 0)
                    if c <= 0:
                        raise ValueError(
                            f"replica {replica}: BlockRemoved for hash {h!r} it never stored "
                            f"(medium {ev.medium!r})")
                    if c == 1:
                        _drop(holders, cnt, bit, h)
                    else:
                        cnt[h] = c - 1
            elif isinstance(ev, AllBlocksCleared):
                # NOTE: the manager's reset empties both tiers with this one event.
                for holders, cnt in (device, host):
                    for h in list(cnt):
                        _drop(holders, cnt, bit, h)
            else:
                raise ValueError(f"replica {replica}: unknown KV cache event {ev!r}")

    def overlaps(self, hashes: Sequence[int]) -> list[int]:
        """Per replica, the number of leading ``hashes`` it holds on the device."""
        n = self.num_replicas
        out = [0] * n
        alive = (1 << n) - 1
        get = self.holders.get
        depth = 0
        for h in hashes:
            m = alive & get(h, 0)
            gone = alive & ~m
            while gone:
                low = gone & -gone
                out[low.bit_length() - 1] = depth
                gone ^= low
            alive = m
            if not alive:
                break
            depth += 1
        while alive:
            low = alive & -alive
            out[low.bit_length() - 1] = depth
            alive ^= low
        return out

    def tier_overlaps(self, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Per replica, ``(device blocks, host blocks)`` of its leading match: the walk
        of the manager's lookup -- each block on the device, else on the host, else
        the match ends."""
        n = self.num_replicas
        depth_of = [0] * n
        host = [0] * n
        alive = (1 << n) - 1
        get = self.holders.get
        hget = self.host_holders.get
        depth = 0
        for h in hashes:
            d = alive & get(h, 0)
            c = alive & hget(h, 0) & ~d
            m = d | c
            gone = alive & ~m
            while gone:
                low = gone & -gone
                depth_of[low.bit_length() - 1] = depth
                gone ^= low
            while c:
                low = c & -c
                host[low.bit_length() - 1] += 1
                c ^= low
            alive = m
            if not alive:
                break
            depth += 1
        while alive:
            low = alive & -alive
            depth_of[low.bit_length() - 1] = depth
            alive ^= low
        return [k - j for k, j in zip(depth_of, host)], host

    def union(self) -> set[int]:
        """The hashes some replica holds on the device."""
        return set(self.holders)

    def host_union(self) -> set[int]:
        """The hashes some replica holds in its host tier."""
        return set(self.host_holders)

    def check(self) -> None:
        for medium, holders, counts in (("device", self.holders, self.counts),
                                        ("host", self.host_holders, self.host_counts)):
            for h, m in holders.items():
                assert m, f"{medium}: hash {h!r} with an empty replica set"
                for r in range(self.num_replicas):
                    assert bool(m >> r & 1) == (counts[r].get(h, 0) > 0), (
                        f"{medium}: hash {h!r}: replica {r} bit and count disagree")
            for r, cnt in enumerate(counts):
                for h, c in cnt.items():
                    assert c > 0 and holders.get(h, 0) >> r & 1, f"{medium}: replica {r} {h!r}"


class KVEventsRouter(Router):
    name = "kv_events"
    needs_events = True

    def __init__(self, num_replicas: int, *, block_size: int, seed: int = 0,
                 overlap_weight: float = 1.0, int_event_hashes: bool = False,
                 host_weight: float = DEFAULT_HOST_WEIGHT):
        super().__init__(num_replicas, block_size=block_size, seed=seed)
        if not float(overlap_weight) >= 0.0:
            raise ValueError(f"kv_events: overlap_weight must be >= 0, got {overlap_weight!r}")
        self.overlap_weight = float(overlap_weight)
        # A host block counts host_weight of a device block (module docstring).
        self.host_weight = check_host_weight(host_weight)
        self.int_event_hashes = bool(int_event_hashes)
        self.index = GlobalBlockIndex(num_replicas)

    def on_events(self, replica, events):
        self.index.apply(replica, events)

    def route(self, request, loads, now):
        hashes = request.block_hashes
        if self.int_event_hashes:
            hashes = [event_hash(h) for h in hashes]
        index = self.index
        if index.host_holders:
            device, host = index.tier_overlaps(hashes)
            hw = self.host_weight
            overlaps = [d + hw * c for d, c in zip(device, host)]
        else:  # no host tier (or nothing on it): the device walk alone
            overlaps = index.overlaps(hashes)
        w = self.overlap_weight / max(len(hashes), 1)
        n = len(hashes)
        best = None
        for ld, o in zip(loads, overlaps):
            load = (ld.active_blocks + ld.queued_blocks) / ld.num_blocks
            key = (w * (n - o) + load, ld.outstanding, ld.index)
            if best is None or key < best:
                best = key
        return best[2]

    def check_invariants(self) -> None:
        self.index.check()
