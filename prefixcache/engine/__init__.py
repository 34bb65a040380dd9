"""The serving engine: requests in, tokens out, over the real ``KVCacheManager``.

Public API: `from prefixcache.engine import Engine, SamplingParams`.

Modules: `engine` (`Engine(model_config, *, cache_config=..., ...)`: `generate`,
`chat`, `step`, `metrics()`), `scheduler` (`Scheduler`: admission through a
`prefixcache.scheduling` policy, chunked prefill, preemption, LoRA slots),
`block_table` (one int32 row per running request), `model_runner` (`ModelRunner`: one
jitted device step from `prefixcache.metadata`'s arrays), `host_pages` (the host tier's
pages and the batched copies of every tier), `page_files` (the disk tier's KV page
files), `sampler` / `sampling_params`, `outputs` (`RequestOutput`,
metrics), `distributed` (one process per host), `faults` (fault injection points),
`warmup` (`Engine.warmup`: every step program compiled before any request; JAX's
persistent compilation cache, `enable_compilation_cache`).
"""
from prefixcache.engine.engine import Engine, model_kv_cache_groups
from prefixcache.engine.model_runner import ModelRunner
from prefixcache.engine.outputs import EngineMetrics, RequestMetrics, RequestOutput
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.scheduler import (EngineRequest, ScheduledRequest, Scheduler,
                                          SchedulerOutput)

__all__ = [
    "Engine",
    "EngineMetrics",
    "EngineRequest",
    "ModelRunner",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "model_kv_cache_groups",
]
