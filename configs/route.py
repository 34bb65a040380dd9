"""Routing (default config): a small many-tenant workload on 1 and 4 simulated replicas.

Runs experiments.route on the generated `tenant_prefixes` workload, shrunk: 600
requests from 24 tenants, each with a private 2,048-token prefix
and a unique 128-512-token question, Poisson arrivals at 6 req/s; Llama-3.1-8B on one
H100 per replica, 2,048 blocks of 16 tokens (32k tokens) per replica -- a third of the
tenants' prefixes. All six routing policies.

Command:
  python -m experiments.route --config=configs/route.py --workdir=/tmp/route
  python -m experiments.route --config=configs/route.py:quick --workdir=/tmp/route_q

Expected (measured with this config): with 1 replica every policy
gives the same hits and TTFTs (token hit rate 0.476, P90 TTFT 0.040 s); at 4 replicas
the prefix-aware policies keep each tenant on one replica: cache_aware and kv_events
0.831 (P90 0.009-0.010 s), session 0.831, while random / round_robin / least_loaded
stay at 0.43-0.46 (P90 0.037-0.038 s).

Quick variant (`:quick`: 200 requests of 8 tenants, 683 blocks per replica): 1 replica
0.434 for every policy; 4 replicas cache_aware and kv_events 0.831, session 0.811,
random / round_robin / least_loaded 0.38-0.46. 34 s wall on the same machine under a
load average of ~13 (tests/experiments/test_exp_quick_configs.py checks these numbers).
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
