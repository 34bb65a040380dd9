"""Trace-replay simulator: no model, no device, the real ``KVCacheManager``.

* ``trace``: the JSONL trace format (ours and Mooncake's), ``output_token``;
  ``trace_formats``: the Qwen-Bailian, Claude Code, AgentX and TraceLab readers;
  ``agentic``: generated coding-agent sessions (tool-call loops with sub-agents).
* ``replay``: the exact replay semantics of vLLM's manager under the peer harness
  (``experiments/peers/vllm_replay.py``); ``misses``: the old name of
  ``prefixcache.core.misses`` (why each prompt block missed), the same module.
* ``workloads``: deterministic synthetic workloads (shared system prompt,
  multi-turn chat, few-shot, RAG with Zipf popularity, multimodal + salts +
  adapters) and a Mooncake-scale ``hash_ids`` trace generator.
* ``cost_model``: re-exports ``prefixcache.cost_model`` (roofline step times of a
  model shape on TPU v5e/v6e, H100, H200; host -> device links for a host tier).
* ``des``: a discrete-event simulation (arrivals, batching, the cache, the cost
  model) that yields simulated TTFT per request; ``cluster``: ``simulate_cluster``
  over replicas and a router from ``routing/`` (one file per router, ``ROUTERS``).
* ``compare``: one cell of a policy comparison (``experiments.compare_policies``).
* ``datasets``: public traces by name (pinned URL + SHA-256), downloaded once into
  ``$PREFIXCACHE_DATA`` and verified, or a local copy. Imported as
  ``prefixcache.sim.datasets`` (not re-exported: it is also a ``python -m`` command).

Host only: nothing here imports jax.

NOTE: the replay function is imported from its module
(``from prefixcache.sim.replay import replay``), not re-exported here: a package
attribute ``replay`` would shadow the submodule of the same name.
"""

from prefixcache.sim.cost_model import ACCELERATORS, HOST_LINKS, Accelerator, CostModel, HostLink, \
    ModelShape
from prefixcache.sim.des import SchedulerConfig, simulate
from prefixcache.sim.trace import TraceError, TraceRequest, output_token, read_trace, write_trace
from prefixcache.sim.workloads import WORKLOADS, generate, mooncake_scale

__all__ = [
    "ACCELERATORS",
    "Accelerator",
    "CostModel",
    "HOST_LINKS",
    "HostLink",
    "ModelShape",
    "SchedulerConfig",
    "TraceError",
    "TraceRequest",
    "WORKLOADS",
    "generate",
    "mooncake_scale",
    "output_token",
    "read_trace",
    "simulate",
    "write_trace",
]
