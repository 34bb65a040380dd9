"""Routing (default config): a small many-tenant workload on 1 and 4 simulated replicas.

Runs experiments.route on the generated `tenant_prefixes` workload, shrunk to run in
about a minute: 600 requests from 24 tenants, each with a private 2,048-token prefix
and a unique 128-512-token question, Poisson arrivals at 6 req/s; Llama-3.1-8B on one
H100 per replica, 2,048 blocks of 16 tokens (32k tokens) per replica -- a third of the
tenants' prefixes. All six routing policies.

Command:
  python -m experiments.route --config=configs/route.py --workdir=/tmp/route

Expected: with 1 replica every policy gives the same hits and TTFTs (hit rate ~0.29:
the one cache thrashes over 24 prefixes); at 4 replicas the prefix-aware policies
(kv_events, cache_aware, session) keep each tenant on one replica, reach a hit rate of
~0.77 and the lowest P90 TTFT, while random / round_robin / least_loaded stay at ~0.3.
"""

from configs import _base


def get_config(arg=None):
    quick = _base.variant(arg)
    c = _base.route_config("tenant_prefixes", num_requests=600, num_tenants=24,
                           prefix_len=2048, question_len=(128, 512), output_len=(32, 128),
                           arrival_rate=6.0)
    c.replicas = "1,4"
    c.num_blocks = 2048
    if quick:  # 200 requests of 8 tenants, 1 and 4 replicas, 683 blocks (a third again)
        c.workload.kwargs.num_requests = 200
        c.workload.kwargs.num_tenants = 8
        c.num_blocks = 683
    return c
