"""What the engine hands back: per-request outputs and per-run metrics."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """Per-request metrics.

    Attributes:
      num_prompt_tokens: prompt length.
      num_cached_tokens: prompt tokens served from the prefix cache at the first admission.
      ttft_s: arrival (add_request) to first output token, seconds (None if none came).
      e2e_s: arrival to finish, seconds.
      queue_s: arrival to first scheduled, seconds (None if never scheduled).
      num_preemptions: how often it was preempted (by recompute).
      num_output_tokens: tokens generated.
      miss_reasons: why its prompt blocks missed (``prefixcache.core.misses``: reason ->
        blocks, evicted sub-counts ``evicted_device`` / ``evicted_host`` beside), summed
        over its admissions (a re-admission after a preemption looks up its prompt and
        output so far again); None unless the engine was built with
        ``miss_reasons=True``.
    """

    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float | None
    e2e_s: float | None
    queue_s: float | None
    num_preemptions: int
    num_output_tokens: int
    miss_reasons: dict | None = None


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A finished request.

    Attributes:
      request_id: its id.
      prompt_token_ids: the prompt.
      token_ids: generated tokens (empty for a rejected request).
      finish_reason: "length", "stop", "abort" or "error".
      error: why the request was rejected (finish_reason "error"), else None.
      metrics: RequestMetrics.
      text: the output decoded by the engine's tokenizer (special tokens skipped unless
        the SamplingParams say otherwise; cut before a matched stop string); None when the
        engine has no tokenizer.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    error: str | None
    metrics: RequestMetrics
    text: str | None = None

    @property
    def finished(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class EngineMetrics:
    """Per-run metrics (since the engine was built or `reset_metrics()`).

    Attributes:
      num_requests: requests finished (errors included).
      num_rejected: requests finished with an error.
      num_prompt_tokens: prompt tokens of admitted requests.
      num_cached_tokens: of those, tokens served from the cache at first admission.
      token_hit_rate: num_cached_tokens / num_prompt_tokens (reused tokens).
      request_hit_rate: share of admitted requests with any cached token.
      num_computed_tokens: tokens the model actually computed (prefill incl. recompute
        after preemption, and decode).
      num_preemptions: preemptions by recompute.
      num_evictions: cached blocks evicted (their hash dropped) by the manager.
      peak_usage, mean_usage: KV pool usage (fraction of blocks held), sampled after
        each step's scheduling.
      num_steps: engine steps that ran the model.
      num_compiled_programs: distinct bucketed step shapes run (over the engine's life).
      num_programs_built: programs the engine's jitted step and host-copy functions
        hold, read from jax's executable caches (compiled or loaded from the persistent
        compilation cache; over the engine's life; a shared step program counts the
        programs of every engine sharing it).
      num_compiles_after_warmup: of those, built after `Engine.warmup()` finished (0
        when no request waited for a compile); None when the engine never warmed up.
      host_schedule_s, host_prepare_s, device_s, host_update_s: summed wall time of
        scheduling, metadata/input building, device step (transfer + run + fetch of
        the sampled ids), and output processing.
      device_hit_tokens, host_hit_tokens: prompt tokens the manager's lookups found
        cached on the device / in the host tier (every lookup, re-admissions after a
        preemption included); None when the engine has no host tier.
      host_blocks_loaded, host_blocks_stored: blocks promoted (host -> device) and
        demoted (device -> host); host_bytes_loaded, host_bytes_stored: their KV bytes
        (all layers); host_pool_bytes: the host tier's pages; host_copy_programs:
        distinct compiled copy programs (over the engine's life; bucketed sizes). None
        without a host tier.
      hit_tokens_by_tier: prompt tokens adopted from the cache at admission by the
        tier that held them (``{"device", "host", "disk", "remote", ...}``: the
        manager's `hit_tokens_by_tier` over the window); None without a host tier.
      disk_blocks_loaded, disk_blocks_stored: page files read into device pages and
        written (host -> disk demotions); disk_bytes_loaded, disk_bytes_stored: their
        KV bytes; disk_corrupt: page files that failed their checks (each a miss, never
        served); disk_write_errors: pages that could not be written (a full disk: those
        blocks are misses); disk_used_bytes: the page files' bytes now (headers included). None
        without a disk tier (`Engine(disk_dir=..., disk_bytes=...)`).
      num_blocks, kv_dtype, kv_bytes_per_block: the engine's KV pool (allocatable
        blocks, page dtype, device bytes of one block over all layers, scales
        included); kv_pool_bytes: its KV arrays' bytes, `(num_blocks + 1) *
        kv_bytes_per_block` (the padding page counted); kv_cache_bytes: the byte budget
        the pool was sized by (`Engine(kv_cache_bytes=...)`), None when sized by
        num_blocks. Properties of the engine, not of the metrics window.
      per_tenant, per_adapter: reuse of admitted requests by cache salt and by LoRA
        adapter name (``""``: requests without one): ``{name: {"requests",
        "prompt_tokens", "cached_tokens", "token_hit_rate"}}``; each sums to
        num_prompt_tokens / num_cached_tokens.
      miss_reasons: the finished requests' miss reasons summed (``Engine(miss_reasons=
        True)``; None otherwise): ``{"missed_blocks", "reasons", "per_tenant",
        "per_adapter"}`` as the replay summary's ``miss_reasons``.
      residency: block residency histograms (``Engine(residency=RATE)``; None
        otherwise): per tier, ``lifetime``, ``idle_before_evict``, ``reuse_gap`` (wall
        seconds since the scheduler started) and ``hits_per_residency``, as the replay
        summary's ``residency`` (``prefixcache.core.residency``; over the engine's life,
        not the metrics window).
    """

    num_requests: int
    num_rejected: int
    num_prompt_tokens: int
    num_cached_tokens: int
    token_hit_rate: float
    request_hit_rate: float
    num_computed_tokens: int
    num_preemptions: int
    num_evictions: int
    peak_usage: float
    mean_usage: float
    num_steps: int
    num_compiled_programs: int
    host_schedule_s: float
    host_prepare_s: float
    device_s: float
    host_update_s: float
    device_hit_tokens: int | None = None
    host_hit_tokens: int | None = None
    host_blocks_loaded: int | None = None
    host_blocks_stored: int | None = None
    host_bytes_loaded: int | None = None
    host_bytes_stored: int | None = None
    host_pool_bytes: int | None = None
    host_copy_programs: int | None = None
    num_blocks: int | None = None
    kv_dtype: str | None = None
    kv_bytes_per_block: int | None = None
    kv_pool_bytes: int | None = None
    kv_cache_bytes: int | None = None
    per_tenant: dict | None = None
    per_adapter: dict | None = None
    miss_reasons: dict | None = None
    residency: dict | None = None
    num_programs_built: int | None = None
    num_compiles_after_warmup: int | None = None
    hit_tokens_by_tier: dict | None = None
    disk_blocks_loaded: int | None = None
    disk_blocks_stored: int | None = None
    disk_bytes_loaded: int | None = None
    disk_bytes_stored: int | None = None
    disk_corrupt: int | None = None
    disk_write_errors: int | None = None
    disk_used_bytes: int | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
