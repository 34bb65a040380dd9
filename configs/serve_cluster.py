"""Replicas of `prefixcache serve` behind sglang-router, beside the simulated cluster.

Runs experiments.serve_cluster: 2 local replicas of the tiny model (256 blocks of 16
tokens each), sglang-router in front (its default backend: the openai one applies no
policy), policies cache_aware, round_robin and power_of_two; 64 text requests from 8 tenants (a private 120-word
prefix each, a 12-word question), Poisson arrivals at 4 req/s, 8 tokens out. The same
requests through prefixcache.sim.cluster with the same router names.

Command:
  python -m experiments.serve_cluster --config=configs/serve_cluster.py --workdir=/tmp/sc
  python -m experiments.serve_cluster --config=configs/serve_cluster.py:quick --workdir=/tmp/scq

Expected: cache_aware keeps each tenant on one replica (the highest hit rate, served
and simulated); round_robin and power_of_two spread a tenant over both replicas and hit
less; served and simulated hit rates agree to within the requests that arrive before
their tenant's first request has been cached (the simulation's clock is a roofline, the
served one is this machine's). Quick variant (`:quick`: 24 requests of 4 tenants,
cache_aware and round_robin) is what the tests run.
"""

from configs import _base


def get_config(arg=None):
    quick = _base.variant(arg)
    c = _base.route_config("tenant_prefixes")  # the cost model's fields (simulation only)
    for key in ("trace", "dataset", "workload", "replicas", "policies", "arrival_rate",
                "time_scale", "num_host_blocks", "host_eviction", "host_link", "host_weight"):
        del c[key]
    c.serve_model = "tiny"  # the served model (MODEL_OR_PATH of `prefixcache serve`)
    c.served_model_name = "tiny"
    # c.model / c.accelerator: the simulation's roofline preset (another clock)
    c.replicas = 2  # local replicas to start (ignored when replica_urls is set)
    c.replica_urls = ""  # comma-separated URLs of running replicas (then none is started)
    c.policies = "cache_aware,round_robin,power_of_two"  # sglang-router's policy names
    c.num_requests = 64
    c.num_tenants = 8
    c.prefix_words = 120
    c.question_words = 12
    c.max_tokens = 8
    c.arrival_rate = 4.0  # req/s, Poisson
    c.num_blocks = 256  # per replica
    c.block_size = 16
    c.max_model_len = 1024
    # Further `prefixcache serve` flags of every replica (small shapes: few programs to
    # compile before a replica is ready).
    c.serve_flags = "--max-num-seqs 8 --max-num-batched-tokens 256"
    c.startup_timeout_s = 300.0
    c.request_timeout_s = 300.0
    if quick:
        c.num_requests = 24
        c.num_tenants = 4
        c.prefix_words = 20
        c.question_words = 6
        c.max_tokens = 4
        c.max_model_len = 256
        c.num_blocks = 64
        c.serve_flags = "--max-num-seqs 4 --max-num-batched-tokens 64"
        c.policies = "cache_aware,round_robin"
    return c
