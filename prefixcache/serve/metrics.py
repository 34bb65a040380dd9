"""Prometheus metrics of the server: vLLM's `vllm:` metric names with prefix `prefixcache:`.

One `ServerMetrics` per app, on its own `CollectorRegistry` (nothing global). The
front end updates them from each step's outputs; `GET /metrics` renders the registry.

| name | kind | what |
|---|---|---|
| `prefixcache:prefix_cache_queries_total` | counter | prompt tokens looked up at admission (vLLM's) |
| `prefixcache:prefix_cache_hits_total` | counter | of those, tokens found cached (vLLM's series, labelled `model_name` only); with a host tier, also one series per tier labelled `tier` (`device`, `host`, `disk`): the prefix-hit tokens adopted at admission by the tier that held them (`KVCacheManager.hit_tokens_by_tier`). Select `{tier=""}` for vLLM's total, `{tier!=""}` to sum or split the tiers |
| `prefixcache:external_prefix_cache_hits_total` | counter | prefix-hit tokens served from the host tier (vLLM's name for the offload tier's hits) |
| `prefixcache:num_requests_running` | gauge | requests in the running batch |
| `prefixcache:num_requests_waiting` | gauge | requests queued (in the engine or not yet added) |
| `prefixcache:kv_cache_usage_perc` | gauge | fraction of KV blocks held (0..1, as vLLM) |
| `prefixcache:time_to_first_token_seconds` | histogram | HTTP arrival to first token |
| `prefixcache:inter_token_latency_seconds` | histogram | between consecutive tokens of a request |
| `prefixcache:e2e_request_latency_seconds` | histogram | HTTP arrival to finish |
| `prefixcache:prompt_tokens_total`, `prefixcache:generation_tokens_total` | counter | tokens of finished requests |
| `prefixcache:request_success_total` | counter | finished requests by `finished_reason` |
| `prefixcache:num_preemptions_total` | counter | preemptions by recompute |
| `prefixcache:prompt_block_misses_total` | counter | missed prompt blocks of finished requests by `reason` (`prefixcache.core.misses.REASONS` but `isolated`, counted as `cold` so that no tenant learns of another's cache; only with `serve --miss-reasons`) |
| `prefixcache:compiled_programs` | gauge | programs the engine's jitted step functions hold (compiled, or loaded from the persistent compilation cache; `Engine.num_programs_built`) |
| `prefixcache:compiles_after_warmup` | gauge | of those, built after the warm-up (0: no request waited for a compile; absent with `--no-warmup`) |
| `prefixcache:kv_block_lifetime_seconds`, `prefixcache:kv_block_idle_before_evict_seconds`, `prefixcache:kv_block_reuse_gap_seconds` | histogram | block residency by `tier` (`GPU`, `CPU`): stored to removed, last release to removal, between hits (`Engine(residency=RATE)`, sampled blocks; either engine mode) |
| `prefixcache:kv_block_hits_per_residency` | histogram | hits one stay of a block earned, by `tier` (same) |
"""

from __future__ import annotations

import threading

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 10.0)

PREFIX = "prefixcache:"


class ServerMetrics:
    """The server's Prometheus collectors, labelled with the served model's name."""

    def __init__(self, model_name: str, registry=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry() if registry is None else registry
        r, lab = self.registry, ["model_name"]

        def counter(name, doc, labels=lab):
            return Counter(PREFIX + name, doc, labels, registry=r)

        self._queries = counter("prefix_cache_queries",
                                "Prompt tokens looked up in the prefix cache at admission.")
        self._hits = _HitsByTier(model_name)
        r.register(self._hits)
        self._host_hits = counter(
            "external_prefix_cache_hits",
            "Prefix-hit tokens served from the host-memory tier (vLLM's external cache).")
        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self._gen_tokens = counter("generation_tokens",
                                   "Generated tokens of finished requests.")
        self._success = counter("request_success", "Finished requests by reason.",
                                lab + ["finished_reason"])
        self._preemptions = counter("num_preemptions", "Preemptions by recompute.")
        self._misses = counter("prompt_block_misses",
                               "Missed prompt blocks of finished requests, by reason "
                               "(serve --miss-reasons).", lab + ["reason"])
        self._running = Gauge(PREFIX + "num_requests_running", "Requests running.", lab,
                              registry=r)
        self._waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting.", lab,
                              registry=r)
        self._usage = Gauge(PREFIX + "kv_cache_usage_perc",
                            "Fraction of KV cache blocks held (0..1).", lab, registry=r)
        self._ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                               "Time to first token (HTTP arrival to first token).", lab,
                               buckets=_LATENCY_BUCKETS, registry=r)
        self._itl = Histogram(PREFIX + "inter_token_latency_seconds",
                              "Time between consecutive tokens of a request.", lab,
                              buckets=_ITL_BUCKETS, registry=r)
        self._programs = Gauge(PREFIX + "compiled_programs",
                               "Programs the engine's jitted step functions hold.", lab,
                               registry=r)
        self._after_warmup = Gauge(PREFIX + "compiles_after_warmup",
                                   "Programs built after the warm-up finished.", lab,
                                   registry=r)
        self._e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                              "End-to-end request latency (HTTP arrival to finish).", lab,
                              buckets=_LATENCY_BUCKETS, registry=r)
        # Children bound once: the engine thread calls these every step.
        m = model_name
        self.queries, self.host_hits = (
            c.labels(m) for c in (self._queries, self._host_hits))
        self.hits = self._hits
        self.prompt_tokens, self.generation_tokens = (
            self._prompt_tokens.labels(m), self._gen_tokens.labels(m))
        self.preemptions = self._preemptions.labels(m)
        self.running, self.waiting, self.usage = (
            g.labels(m) for g in (self._running, self._waiting, self._usage))
        self.ttft, self.itl, self.e2e = (
            h.labels(m) for h in (self._ttft, self._itl, self._e2e))
        self._model_name = m

    def set_programs(self, num_built: int, after_warmup: int | None) -> None:
        """The compile gauges (`Engine.num_programs_built`, `num_compiles_after_warmup`;
        the latter left out while None: the engine never warmed up)."""
        self._programs.labels(self._model_name).set(num_built)
        if after_warmup is not None:
            self._after_warmup.labels(self._model_name).set(after_warmup)

    def add_tier_hits(self, hits_by_tier) -> None:
        """Count prefix-hit tokens by the tier that held them (``{tier: tokens}``)."""
        for tier, n in hits_by_tier.items():
            if n:
                self._hits.inc_tier(tier, n)

    def success(self, reason: str):
        return self._success.labels(self._model_name, reason)

    def add_misses(self, miss_reasons) -> None:
        """Count a finished request's miss reasons (``RequestMetrics.miss_reasons``;
        the evicted sub-counts are not reasons of their own and are left out;
        ``isolated`` is counted as ``cold``: see `protocol.client_miss_reasons`)."""
        from prefixcache.serve.protocol import client_miss_reasons  # noqa: PLC0415
        from prefixcache.core.misses import REASONS  # noqa: PLC0415

        for r, v in client_miss_reasons(miss_reasons).items():
            if v and r in REASONS:
                self._misses.labels(self._model_name, r).inc(v)

    def watch_residency(self, snapshot) -> None:
        """Exposes block residency histograms (``prefixcache.core.residency``) read at
        each scrape from ``snapshot()`` (a ``ResidencyTracker.summary()``-shaped dict or
        None) as Prometheus histograms labelled by model and tier."""
        self.registry.register(_ResidencyCollector(snapshot, self._model_name))

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


_RESIDENCY_METRICS = (
    ("lifetime", "kv_block_lifetime_seconds", "KV block residency: stored to removed (s)."),
    ("idle_before_evict", "kv_block_idle_before_evict_seconds",
     "KV block residency: last release to removal (s)."),
    ("reuse_gap", "kv_block_reuse_gap_seconds",
     "KV block residency: time between hits of one stay (s)."),
    ("hits_per_residency", "kv_block_hits_per_residency", "Hits one stay of a block earned."),
)


class _ResidencyCollector:
    """A Prometheus collector over a residency summary (the engine keeps the counts; a
    scrape reads them: nothing is counted twice and nothing runs between scrapes)."""

    def __init__(self, snapshot, model_name: str):
        self._snapshot = snapshot
        self._model_name = model_name

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import HistogramMetricFamily

        summary = None
        for _ in range(3):  # (the engine thread may add a tier while we read)
            try:
                summary = self._snapshot()
                break
            except RuntimeError:
                continue
        tiers = (summary or {}).get("tiers", {})
        for key, name, doc in _RESIDENCY_METRICS:
            fam = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name", "tier"])
            for tier, hists in sorted(tiers.items()):
                h = hists[key]
                cum, buckets = 0, []
                for bound, count in zip(list(h["bounds"]) + [float("inf")], h["counts"]):
                    cum += count
                    buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)),
                                    cum))
                fam.add_metric([self._model_name, tier], buckets, h["sum"])
            yield fam


class _HitsByTier:
    """``prefixcache:prefix_cache_hits_total``: vLLM's series (``model_name``) and, once
    a tier's hits are counted, one series per tier (``model_name``, ``tier``), in one
    counter family (a collector of its own: prometheus_client's ``Counter`` keeps one
    label set per family, and vLLM's series must stay as it is)."""

    _DOC = "Prompt tokens found in the prefix cache at admission."

    def __init__(self, model_name: str):
        self._model_name = model_name
        self._lock = threading.Lock()
        self._total = 0.0
        self._by_tier: dict[str, float] = {}

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError(f"counters only go up, got {amount!r}")
        with self._lock:
            self._total += amount

    def inc_tier(self, tier: str, amount: float) -> None:
        if amount < 0:
            raise ValueError(f"counters only go up, got {amount!r}")
        with self._lock:
            self._by_tier[tier] = self._by_tier.get(tier, 0.0) + amount

    def describe(self):
        from prometheus_client.core import CounterMetricFamily  # noqa: PLC0415

        return [CounterMetricFamily(PREFIX + "prefix_cache_hits", self._DOC,
                                    labels=["model_name"])]

    def collect(self):
        from prometheus_client.core import CounterMetricFamily  # noqa: PLC0415
        from prometheus_client.samples import Sample  # noqa: PLC0415

        with self._lock:
            total, by_tier = self._total, sorted(self._by_tier.items())
        fam = CounterMetricFamily(PREFIX + "prefix_cache_hits", self._DOC,
                                  labels=["model_name"])
        fam.add_metric([self._model_name], total)
        for tier, v in by_tier:
            fam.samples.append(Sample(fam.name + "_total",
                                      {"model_name": self._model_name, "tier": tier}, v))
        return [fam]
