"""Compare eviction policies on the Mooncake FAST'25 synthetic trace (Mooncake's Table 1 grid).

Runs experiments.compare_policies on `synthetic_trace.jsonl` (3,993 requests, ~15k input tokens each, built from public datasets; hash_ids expanded into
512-token blocks) with 512-token blocks, one request at a time (concurrency 1), vLLM's free
order, at Mooncake's Table 1 capacities -- 1k, 3k, 10k, 30k, 50k, 100k and 200k blocks (200k
holds the whole trace) -- with every registered eviction policy on the hash index, plus the
infinite-cache ideal. Cells run in parallel worker processes (one per CPU); each streams the
trace itself. Bytes: Llama-3.1-70B's KV (320 KiB per token, 160 MiB per block).
xxhash with a fixed root: hit rates do not depend on the hash algorithm, and it is the
fastest one.

Command:
  python -m experiments.compare_policies --config=configs/compare_policies_mooncake_synthetic.py \
      --workdir=/tmp/cp_mooncake_synthetic
  # on a Ray cluster (the trace at the same path on every node):
  python -m experiments.compare_policies --config=configs/compare_policies_mooncake_synthetic.py \
      --workdir=/tmp/cp_mooncake_synthetic --executor=ray --ray_address=HOST:6379

Expected: the infinite-cache ideal 0.6504 (39,802,880 of 61,194,628 prompt tokens), as
configs/replay_mooncake_synthetic.py; every policy reaches it at 200k blocks. Per-policy
figures: see WORKSPACE_NOTES.md ("Eviction policies on the Mooncake traces").
"""

from configs import _base, compare_policies


def get_config():
    c = compare_policies.get_config()
    src = _base.requests_config("shared_system_prompt",
                                trace=f"{_base.MOONCAKE_DIR}/synthetic_trace.jsonl")
    for key in ("trace", "workload"):
        c[key] = src[key]
    c.trace_format = "mooncake"
    c.block_size = 512
    c.capacities = "1000,3000,10000,30000,50000,100000,200000"
    c.policies = "all"
    c.indexes = "hash"
    c.concurrency = 1
    c.hash_algo = "xxhash"
    c.hash_seed = "0"
    c.model = "llama_3_1_70b"
    return c
