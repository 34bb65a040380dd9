"""Block residency: how long a cached block lives, how long it sits idle before eviction,
the gap between its reuses, and how many hits one stay in the cache earns.

A *residency* is one stay of a block hash in one tier (``medium``: ``"GPU"`` for the
device pool, ``"CPU"`` for the host tier, ``"DISK"`` / ``"REMOTE"`` (a tier's ``medium``)
for the tiers below it, as the KV events name them): it starts when
the hash is stored there and ends when it is removed (evicted, promoted, cleared). The
tracker is fed by what a driver already sees -- the KV cache events the manager
publishes (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``), the hits of each
admission and the blocks each finished request releases -- with the driver's clock
(``now``: trace seconds, simulated seconds or wall seconds; the unit is the driver's).
Per residency it records:

* ``lifetime``: removed - stored;
* ``idle_before_evict``: removed - the last time a request released the block there
  (or, never released, the time it was stored);
* ``reuse_gap``: each hit's time since the previous hit of the same residency (or since
  it was stored, for the first hit); a hit counts on the tier it was served from (a
  block loaded from the disk is a disk hit, ``hit_media``);
* ``hits_per_residency``: the hits one residency earned (counted when it ends).

Sampling (``sample_rate``, as vLLM samples 1% of blocks for its residency metrics): a
hash is tracked when its 64-bit fingerprint falls under ``sample_rate * 2**64``, so the
same blocks are sampled on every run and every tier; ``sample_rate=1.0`` tracks every
block (the exact mode tests use). Nothing is built when the driver does not ask for it:
zero cost when off.

Histograms use fixed log-spaced bucket bounds (``BUCKETS``, in the driver's time unit;
``HIT_BUCKETS`` for hit counts), the shape Prometheus histograms take, so the same
buckets serve the replay summary, ``EngineMetrics`` and the server's ``/metrics``.

Host only: never imports jax.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from prefixcache.core.events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["BUCKETS", "HIT_BUCKETS", "METRICS", "Histogram", "ManagerResidency",
           "ResidencyTracker", "hit_media"]

# Upper bounds (inclusive) of the time buckets: 1 ms .. ~10^5 (x ~3.16 per bucket), +inf.
BUCKETS: tuple[float, ...] = tuple(10.0 ** (e / 2) for e in range(-6, 11))
HIT_BUCKETS: tuple[float, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
METRICS = ("lifetime", "idle_before_evict", "reuse_gap", "hits_per_residency")


class Histogram:
    """Counts per bucket (``bounds`` inclusive upper bounds, then +inf), sum and count."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Iterable[float]):
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the ``q`` quantile (None: empty;
        ``inf``: past the last bound)."""
        if not self.count:
            return None
        rank, seen = q * self.count, 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return self.bounds[i] if i < len(self.bounds) else float("inf")
        return float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum,
                "count": self.count, "mean": self.sum / self.count if self.count else None,
                "p50": self.quantile(0.5), "p90": self.quantile(0.9)}


class _Stay:
    __slots__ = ("stored", "last_hit", "last_release", "hits", "copies")

    def __init__(self, now: float):
        self.stored = now
        self.last_hit = None
        self.last_release = None
        self.hits = 0
        self.copies = 1


def hit_media(computed) -> list[str]:
    """The tier each entry of a lookup's hit run is served from, as the events' ``medium``
    (``"GPU"``: a device block, ``"CPU"``: a host tier ``HostHit``, a lower tier's
    ``TierHit``: that tier's ``medium``). ``computed``: ``get_computed_blocks``'s blocks
    (a ``KVCacheBlocks`` of one group, or its list), before or after the allocation
    that adopts them (the placeholders keep their type)."""
    from prefixcache.core.tiers.base import TierHit  # noqa: PLC0415
    from prefixcache.core.tiers.host import HostHit  # noqa: PLC0415

    blocks = getattr(computed, "blocks", None)
    if blocks is not None:
        blocks = blocks[0]
    else:
        blocks = computed
    out = []
    for b in blocks:
        t = type(b)
        out.append("CPU" if t is HostHit else b.tier.medium if t is TierHit else "GPU")
    return out


def _fingerprint(key) -> int:
    if isinstance(key, int):
        return (key * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    return int.from_bytes(hashlib.blake2b(bytes(key), digest_size=8).digest(), "little")


class ResidencyTracker:
    """Residency histograms per tier, fed with events, hits and releases.

    Args:
        sample_rate: the share of block hashes tracked, in (0, 1]; 1.0: every block.
        log: keep every finished residency as a dict (tests compare histograms to it).

    The driver calls, with its clock ``now`` (non-decreasing):
      * ``on_events(events, now)``: the manager's KV events of the step;
      * ``on_hits(keys, now, medium="GPU")``: the block hashes (event form) an admission
        hit, per tier;
      * ``on_release(keys, now)``: the hashes of the blocks a finished request released;
      * ``finish(now)``: ends the run (still-resident blocks are not counted as evicted;
        ``resident_at_end`` counts them).
    """

    def __init__(self, sample_rate: float = 1.0, *, log: bool = False):
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not (
                0.0 < float(sample_rate) <= 1.0):
            raise ValueError(f"sample_rate must be a number in (0, 1], got {sample_rate!r}")
        self.sample_rate = float(sample_rate)
        self._cut = min(1 << 64, int(self.sample_rate * (1 << 64)))
        self._live: dict[str, dict[Any, _Stay]] = {}
        self._sampled: dict[Any, bool] = {}
        self.hist: dict[str, dict[str, Histogram]] = {}
        self.log: list[dict[str, Any]] | None = [] if log else None
        self.resident_at_end: dict[str, int] = {}
        self._taken: dict[tuple[str, str], int] = {}  # (tier, metric) -> count last taken

    def _tracked(self, key) -> bool:
        s = self._sampled.get(key)
        if s is None:
            s = self._sampled[key] = _fingerprint(key) < self._cut
        return s

    def _hists(self, medium: str) -> dict[str, Histogram]:
        h = self.hist.get(medium)
        if h is None:
            h = self.hist[medium] = {m: Histogram(HIT_BUCKETS if m == "hits_per_residency"
                                                  else BUCKETS) for m in METRICS}
        return h

    def _store(self, key, medium: str, now: float) -> None:
        if not self._tracked(key):
            return
        live = self._live.setdefault(medium, {})
        stay = live.get(key)
        if stay is None:
            live[key] = _Stay(now)
        else:  # a duplicate block of the same hash (append-only block tables)
            stay.copies += 1

    def _remove(self, key, medium: str, now: float) -> None:
        live = self._live.get(medium)
        stay = live.get(key) if live else None
        if stay is None:
            return
        stay.copies -= 1
        if stay.copies > 0:
            return
        del live[key]
        self._end(key, medium, stay, now)

    def _end(self, key, medium: str, stay: _Stay, now: float) -> None:
        h = self._hists(medium)
        idle_from = stay.last_release if stay.last_release is not None else stay.stored
        rec = {"key": key, "medium": medium, "lifetime": now - stay.stored,
               "idle_before_evict": now - idle_from, "hits_per_residency": stay.hits}
        h["lifetime"].observe(rec["lifetime"])
        h["idle_before_evict"].observe(rec["idle_before_evict"])
        h["hits_per_residency"].observe(stay.hits)
        if self.log is not None:
            self.log.append(rec)

    def on_events(self, events: Iterable, now: float) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                medium = ev.medium or "GPU"
                for key in ev.block_hashes:
                    self._store(key, medium, now)
            elif isinstance(ev, BlockRemoved):
                medium = ev.medium or "GPU"
                for key in ev.block_hashes:
                    self._remove(key, medium, now)
            elif isinstance(ev, AllBlocksCleared):
                for medium, live in self._live.items():
                    for key, stay in list(live.items()):
                        self._end(key, medium, stay, now)
                    live.clear()

    def on_hits(self, keys: Iterable, now: float, medium: str = "GPU") -> None:
        live = self._live.get(medium)
        if not live:
            return
        gaps = None
        for key in keys:
            stay = live.get(key)
            if stay is None:
                continue
            if gaps is None:
                gaps = self._hists(medium)["reuse_gap"]
            prev = stay.last_hit if stay.last_hit is not None else stay.stored
            gaps.observe(now - prev)
            if self.log is not None:
                self.log.append({"key": key, "medium": medium, "reuse_gap": now - prev})
            stay.last_hit = now
            stay.hits += 1

    def on_hit_run(self, keys: list, media: list[str], now: float) -> None:
        """``on_hits`` for an admission's hit run: ``keys[i]`` was served from the tier
        ``media[i]`` (``hit_media``); each tier hears its own keys, in order."""
        by: dict[str, list] = {}
        for key, medium in zip(keys, media):
            by.setdefault(medium, []).append(key)
        for medium, ks in by.items():
            self.on_hits(ks, now, medium)

    def on_release(self, keys: Iterable, now: float) -> None:
        for live in self._live.values():
            for key in keys:
                stay = live.get(key)
                if stay is not None:
                    stay.last_release = now

    def finish(self, now: float) -> None:
        self.resident_at_end = {m: len(live) for m, live in self._live.items()}

    def take_changed(self) -> dict[str, dict[str, list]] | None:
        """The histograms that observed something since the last call, as
        ``{tier: {metric: [counts, sum, count]}}`` (whole states, so a reader that
        applies them with ``apply_changed`` holds the same histograms exactly); None when
        nothing changed. For a tracker whose summary is read in another process."""
        out = None
        for medium, hs in self.hist.items():
            for name, h in hs.items():
                if self._taken.get((medium, name), 0) != h.count:
                    self._taken[medium, name] = h.count
                    if out is None:
                        out = {}
                    out.setdefault(medium, {})[name] = [list(h.counts), h.sum, h.count]
        return out

    def apply_changed(self, changed: Mapping[str, Mapping[str, list]]) -> None:
        """Sets the histograms named in another tracker's ``take_changed()`` (same
        buckets) to the states given."""
        for medium, hs in changed.items():
            mine = self._hists(medium)
            for name, (counts, total, count) in hs.items():
                h = mine[name]
                if len(counts) != len(h.counts):
                    raise ValueError(f"residency histogram {medium}/{name}: {len(counts)} "
                                     f"buckets, expected {len(h.counts)}")
                h.counts, h.sum, h.count = [int(c) for c in counts], float(total), int(count)

    def summary(self) -> dict[str, Any]:
        """Per tier, per metric: the histogram (bounds, counts, sum, count, mean, p50,
        p90); plus ``sample_rate`` and ``resident_at_end``."""
        return {"sample_rate": self.sample_rate, "resident_at_end": dict(self.resident_at_end),
                "tiers": {m: {k: h.to_dict() for k, h in hs.items()}
                          for m, hs in sorted(self.hist.items())}}


class ManagerResidency:
    """A ``ResidencyTracker`` fed from one ``KVCacheManager`` built with
    ``enable_events=True``, by a driver with a clock (the DES; the engine's design is the
    same): it drains the manager's events itself (``drain(now)``, whose list the driver
    may pass on to another reader of the events), and hears each admission's hits and
    each finished request's release.

    Args:
        manager: the manager (one full-attention group; its events on).
        sample_rate: the share of block hashes tracked, in (0, 1] (1.0: exact).
        log: keep every finished residency (tests).
    """

    def __init__(self, manager, sample_rate: float, *, log: bool = False):
        if not getattr(manager, "enable_events", False):
            raise ValueError("residency statistics read the manager's KV events: build it "
                             "with enable_events=True")
        self.tracker = ResidencyTracker(sample_rate, log=log)
        self.manager = manager
        self.block_size = manager.block_size
        self._key = manager.block_pool._event_hash  # the events' form of a block hash
        self._tiered = getattr(manager, "num_host_blocks", 0) > 0

    def drain(self, now: float) -> list:
        """The manager's queued events, fed to the tracker at ``now``; returned."""
        events = self.manager.take_events()
        self.tracker.on_events(events, now)
        return events

    def host_hit_tokens(self) -> int:
        """The manager's host-hit counter (read before an allocation: ``admitted``'s
        ``host_before``)."""
        return self.manager.host_hit_tokens if self._tiered else 0

    def admitted(self, req, num_hit: int, now: float, host_before: int = 0,
                 computed=None) -> None:
        """``req`` was admitted with ``num_hit`` cached tokens (after its allocation and
        before its events are drained). ``computed``: the blocks ``get_computed_blocks``
        returned (each hit counts on the tier it came from: ``hit_media``); without
        them, ``host_before`` (``host_hit_tokens()`` before the allocation) splits the
        run: its last blocks the host hits, the others device hits."""
        if num_hit:
            bs = self.block_size
            keys = [self._key(h) for h in req.block_hashes[:num_hit // bs]]
            if computed is not None:
                self.tracker.on_hit_run(keys, hit_media(computed), now)
            else:
                n_host = ((self.manager.host_hit_tokens - host_before) // bs
                          if self._tiered else 0)
                self.tracker.on_hits(keys[:len(keys) - n_host], now)
                if n_host:
                    self.tracker.on_hits(keys[len(keys) - n_host:], now, medium="CPU")
        self.drain(now)

    def released(self, keys: list, now: float) -> None:
        """A finished request released the blocks of ``keys`` (``release_keys(req)``,
        read before ``free``)."""
        self.drain(now)
        self.tracker.on_release(keys, now)

    def release_keys(self, req) -> list:
        return [self._key(h) for h in req.block_hashes]

    def summary(self, now: float) -> dict[str, Any]:
        self.drain(now)
        self.tracker.finish(now)
        return self.tracker.summary()


def merge_summaries(summaries: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The sum of several trackers' summaries (replicas of a cluster)."""
    out: dict[str, Any] = {"sample_rate": None, "resident_at_end": {}, "tiers": {}}
    for s in summaries:
        out["sample_rate"] = s["sample_rate"]
        for m, n in s["resident_at_end"].items():
            out["resident_at_end"][m] = out["resident_at_end"].get(m, 0) + n
        for medium, metrics in s["tiers"].items():
            dst = out["tiers"].setdefault(medium, {})
            for name, h in metrics.items():
                d = dst.get(name)
                if d is None:
                    dst[name] = {**h, "counts": list(h["counts"])}
                    continue
                d["counts"] = [a + b for a, b in zip(d["counts"], h["counts"])]
                d["sum"] += h["sum"]
                d["count"] += h["count"]
                d["mean"] = d["sum"] / d["count"] if d["count"] else None
                hist = Histogram(d["bounds"])
                hist.counts, hist.sum, hist.count = d["counts"], d["sum"], d["count"]
                d["p50"], d["p90"] = hist.quantile(0.5), hist.quantile(0.9)
    return out
