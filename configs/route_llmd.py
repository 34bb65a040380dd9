"""Routing on an llm-d-like workload: 150 tenants with 6k-token prefixes, 8 replicas.

The shape of llm-d's precise-prefix-cache benchmark (8 pods, Qwen-32B on 16 H100,
150 tenants with 6k-token prefixes; published P90 TTFT 0.542 s precise KV-event
routing vs 31.1 s approximate vs 92.6 s random): generated `tenant_prefixes`
workload, 3,000 requests (a tenant's 6,000-token prefix + a 128-1,024-token question,
64-256 output tokens), Poisson arrivals at 20 req/s; Llama-3.1-8B on one H100 per
replica with 8,192 blocks of 16 tokens (131k tokens: 21 of the 150 prefixes) per
replica. Replicas 8; all six policies.

Command:
  python -m experiments.route --config=configs/route_llmd.py --workdir=/tmp/route_llmd

Expected: see WORKSPACE_NOTES.md ("Routing"): kv_events / cache_aware keep tenants on
the replica that caches their prefix (hit rate ~0.8, P90 TTFT well under a second),
random / round_robin thrash every cache (hit rate < 0.2) and queue behind 6k-token
prefills.
"""

from configs import _base


def get_config():
    c = _base.route_config("tenant_prefixes")
    c.replicas = "8"
    c.num_blocks = 8192
    return c
