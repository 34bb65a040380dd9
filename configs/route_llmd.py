"""Routing on an llm-d-like workload: 150 tenants with 6k-token prefixes, 8 replicas.

The shape of llm-d's precise-prefix-cache benchmark (8 pods, Qwen-32B on 16 H100,
150 tenants with 6k-token prefixes; published P90 TTFT 0.542 s precise KV-event
routing vs 31.1 s approximate vs 92.6 s random): generated `tenant_prefixes`
workload, 3,000 requests (a tenant's 6,000-token prefix + a 128-1,024-token question,
64-256 output tokens), Poisson arrivals at 80 req/s (the load where routing decides
whether the cluster keeps up); Llama-3.1-8B on one H100 per replica with 8,192 blocks
of 16 tokens (131k tokens: 21 of the 150 prefixes) per replica. Replicas 8; all six
policies.

Command:
  python -m experiments.route --config=configs/route_llmd.py --workdir=/tmp/route_llmd

Expected: kv_events and cache_aware keep each tenant on a replica
that caches its prefix: hit rate 0.79, P90 TTFT 0.11 s; random / round_robin /
least_loaded thrash every cache (hit rate 0.11-0.12) and fall behind: P90 TTFT 19-20 s
(still growing with the trace); session (consistent hashing of the first 2 blocks)
hits 0.71 but overloads the replicas that drew popular tenants (load imbalance 2.6,
P90 15 s). At 20 req/s (`--config.workload.kwargs.arrival_rate=20`) nothing queues:
P90 0.10-0.17 s for all, hit rates as above. Quick variant (`:quick`: 300 requests of 30
tenants; random, cache_aware, kv_events): 6.3 s wall on the shared 2-core dev machine
(load average ~7).
"""

from configs import _base


def get_config(arg=None):
    quick = _base.variant(arg)
    c = _base.route_config("tenant_prefixes", arrival_rate=80.0)
    c.replicas = "8"
    c.num_blocks = 8192
    if quick:  # 300 requests of 30 tenants (the same load per tenant), 3 policies
        c.workload.kwargs.num_requests = 300
        c.workload.kwargs.num_tenants = 30
        c.policies = "random,cache_aware,kv_events"
    return c
