"""The serving engine: scheduler, model runner, engine loop.

Public API: `from prefixcache.engine import Engine, SamplingParams`.
"""
from prefixcache.engine.engine import Engine
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
]
