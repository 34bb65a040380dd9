"""Sweep: token hit rate and evictions vs cache capacity, cold vs warm (RAG workload).

Runs experiments.sweep_capacity on the generated `rag` workload (1000 requests: a
256-token system prompt + 2 of 200 documents drawn by Zipf(1.1) popularity + a
question). The first 500 requests warm the cache for the warm runs; the last 500 are
measured, cold (empty cache) and warm, at 9 capacities from 128 to 32,768 blocks of
16 tokens.

Command:
  python -m experiments.sweep_capacity --config=configs/sweep_capacity.py --workdir=/tmp/sweep

Expected: hit rate rising with capacity, cold from 0.25 (128 blocks;
61 of 500 measured prompts do not fit and fail) to 0.676 (>= 16,384 blocks), warm
from 0.25 to 0.778 (the warm-up's documents are still cached); evictions fall to 0
at 32,768 blocks. results.jsonl: 18 lines (9 capacities x cold/warm).
"""

from configs import _base


def get_config(arg=None):
    quick = _base.variant(arg)
    c = _base.requests_config("rag")
    c.capacities = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
    c.warmup_requests = 500
    c.block_size = 16
    c.hash_algo = "sha256"
    c.hash_seed = ""
    c.free_order = "append"
    c.eviction = "lru"  # prefixcache.core.eviction.POLICIES
    c.concurrency = 8
    c.kv_bytes = ""  # KV byte budgets instead of capacities ("2GiB,4GiB"; capacities=())
    c.kv_dtype = "bfloat16"  # KV dtype(s) for bytes per block (prefixcache.kv_dtypes)
    c.model = "llama_3_2_1b"  # prefixcache.sim.cost_model preset for bytes per block
    if quick:  # 200 requests (100 warm-up), 4 capacities
        c.workload.kwargs.num_requests = 200
        c.warmup_requests = 100
        c.capacities = (128, 512, 2048, 8192)
    return c
