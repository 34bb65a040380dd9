"""Agent retention hints on the generated agentic workload: hit rate and cost-model TTFT
with vs without hints, beside lru, ttl_lru and belady.

Runs experiments.retention: 8 coding-agent sessions (prefixcache.sim.agentic's
defaults, calibrated to TraceLab's and AgentX's published statistics: ~84 steps per
session, ~2k tokens of context growth per step, sub-agents forked from the system prompt
+ tools, human-paced gaps) through the AgentX format, 64-token blocks, 16 requests at
once, vLLM's free order, at 3 capacities from 4,096 to 16,384 blocks (256k to 1M tokens
of KV); hints keep a live loop's context for 300 s (hosted prompt caches' five minutes)
and end a sub-agent's / session's private blocks with its last request. TTFT: the
roofline cost model's prefill of each request alone, Llama-3.1-8B on an H100.

Command:
  python -m experiments.retention --config=configs/retention.py --workdir=/tmp/retention
  # quick (3 small sessions, 146 requests, lru / hinted / belady at 2 capacities):
  python -m experiments.retention --config=configs/retention.py:quick \
      --workdir=/tmp/retention_quick

Expected (experiments/results/retention.md; 17 min on the shared 2-core machine): token
hit rate lru = ttl_lru 0.8300 / 0.9535 / 0.9674, hinted 0.8329 / 0.9583 / 0.9678, belady
0.8465 / 0.9627 / 0.9678 at 4,096 / 8,192 / 16,384 blocks (infinite cache 0.9678); mean
TTFT at 8,192 blocks 129.6 ms (lru) vs 118.4 ms (hinted) vs 106.9 ms (belady). Quick:
lru 0.2248 / 0.4784, hinted 0.2272 / 0.4815, belady 0.2285 / 0.4865 at 90 / 180 blocks
(pinned in tests/experiments/test_exp_retention.py).
"""

import ml_collections

from configs import _base


def get_config(arg=None):
    quick = _base.variant(arg)
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = ""
    c.workload = ml_collections.ConfigDict(dict(num_sessions=8, format="agentx"))
    # A session trace instead of the generated one (its reader derives the hints): a
    # registered dataset by name, or a local file and its format (agentx, claude_code,
    # tracelab).
    c.dataset = ""
    c.trace = ""
    c.trace_format = ""
    c.ttl_s = 300.0  # the hints' TTL (seconds) and ttl_lru's
    c.policies = "lru,ttl_lru,hinted,belady"
    c.capacities = "4096,8192,16384"  # blocks
    c.block_size = 64  # the AgentX format's
    c.concurrency = 16
    c.model = "llama_3_1_8b"  # a prefixcache.sim.cost_model preset (TTFT)
    c.accelerator = "h100"
    if quick:
        c.workload = ml_collections.ConfigDict(dict(
            num_sessions=3, format="agentx", mean_steps=10.0, system_tokens=300,
            tool_tokens=900, compact_at=8000, summary_tokens=600, subagent_prob=0.3,
            subagent_mean_steps=3.0))
        c.ttl_s = 60.0
        c.policies = "lru,hinted,belady"  # (ttl_lru is lru in the replay: in-order frees)
        c.capacities = "90,180"
        c.concurrency = 4
    return c
