"""Compare eviction policies x indexes x capacities on the generated RAG workload.

Runs experiments.compare_policies on the `rag` workload (1000 requests: a 256-token
system prompt + 2 of 200 documents drawn by Zipf(1.1) popularity + a question; see
configs/_base.py), 16-token blocks, 8 requests at once, vLLM's free order, at 8
capacities from 256 to 32,768 blocks, with every registered eviction policy on the hash
index, in parallel worker processes (one per CPU). Bytes are Llama-3.1-8B's KV
(128 KiB per token).

Command:
  python -m experiments.compare_policies --config=configs/compare_policies.py \
      --workdir=/tmp/compare_policies
  # the radix index too, on a Ray cluster:
  python -m experiments.compare_policies --config=configs/compare_policies.py \
      --workdir=/tmp/cp --indexes=hash,radix --executor=ray --ray_address=HOST:6379

Expected (lru, hash): token hit rate 0.380, 0.443, 0.503, 0.558, 0.622, 0.666, 0.710,
0.728 from 256 to 32,768 blocks; the infinite-cache ideal 0.7278 (1,154,640 of
1,586,539 prompt tokens; 104,067 blocks, 0 evictions), reached at 32,768 blocks.
compare_policies.jsonl: 8 rows per policy and index + the ideal row, and
compare_policies.cells.jsonl (each cell as it finishes: a rerun resumes from it).

Quick variant (`--config=configs/compare_policies.py:quick`: 150 requests, lru, lfu,
length + belady, 256/1024/4096 blocks, hash and radix; 25 rows): 21 s wall on the shared
2-core dev machine under a load average of ~10 (8.8 s at ~8 with fewer jobs).
"""

import ml_collections

from configs import _base


def get_config(arg=None):
    quick = _base.variant(arg)
    c = _base.requests_config("rag")
    c.block_size = 16
    c.capacities = "256,512,1024,2048,4096,8192,16384,32768"  # blocks, comma-separated
    c.policies = "all"  # comma-separated names of prefixcache.core.eviction, or all
    c.belady_bound = True  # add belady (the offline bound) when it is registered
    # Policies with options, by label (name the label in `policies`), e.g.
    # {"ttl60s": {"eviction": "ttl_lru", "options": {"ttl": 60, "unit": "s"}}}.
    c.policy_variants = ml_collections.ConfigDict({})
    c.indexes = "hash"  # comma-separated: hash, radix (or all)
    c.concurrency = 8
    c.free_order = "unhashed_first"  # vLLM's
    c.hash_algo = "sha256"
    c.hash_seed = ""  # "" -> the algorithm's default root
    c.model = "llama_3_1_8b"  # a prefixcache.sim.cost_model preset, for bytes ("": none)
    c.kv_bytes = ""  # KV byte budgets instead of capacities ("1GiB,4GiB"; capacities "")
    c.kv_dtype = ""  # KV dtype of those bytes (prefixcache.kv_dtypes); "": the preset's
    c.miss_reasons = True  # per-row miss reasons and evicted_blocks (prefixcache.core.misses)
    c.queue_depth = 0  # queue_aware's waiting queue in the replay (0: concurrency)
    c.nonprefix_bound = True  # the ideal row carries the non-prefix reuse bound
    c.nonprefix_recompute_fraction = 0.15  # CacheBlend's share of a reused chunk recomputed
    c.nonprefix_alignment = "block"  # where earlier chunks may start: block | token
    c.trace_tokens = "expand"  # "lazy": hash-id traces keep hash ids (same results, faster)
    c.executor = "local"  # local | ray
    c.workers = 0  # 0: one per CPU
    c.ray_address = ""  # "": a local Ray instance
    if quick:  # 150 requests, 3 policies (+ belady), 3 capacities, hash and radix
        c.workload.kwargs.num_requests = 150
        c.capacities = "256,1024,4096"
        c.policies = "lru,lfu,length"
        c.indexes = "hash,radix"
    return c


def mooncake_config(dataset: str, arg=None):
    """Mooncake's Table 1 capacities on one Mooncake trace (``configs/compare_policies_mooncake_*``).

    512-token blocks, one request at a time, 1k-200k blocks (Table 1's 1k, 10k, 30k,
    50k, 100k plus 3k and 200k; Table 1 itself is measured on another trace, see
    configs/compare_policies_mooncake_conversation.py), every registered policy on
    the hash index; xxhash with a fixed root (hit rates do not depend on the algorithm,
    and it is the fastest); Llama-3.1-70B's KV for bytes (160 MiB per block).
    """
    quick = _base.variant(arg)
    c = get_config()
    src = _base.requests_config("shared_system_prompt", dataset=dataset)
    for key in ("trace", "dataset", "workload"):
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
    if quick:  # the first 200 requests, 3 policies (+ belady), 3 capacities
        c.max_requests = 200
        c.capacities = "300,1000,3000"
        c.policies = "lru,lfu,length"
    return c


# Capacities (blocks) per block size for the hash-id datasets without a study of their
# own yet: about 64k to 16M tokens of KV.
_DATASET_CAPACITIES = {16: "4096,16384,65536,262144,1048576",
                       64: "1024,4096,16384,65536,262144",
                       512: "1000,3000,10000,30000,50000,100000,200000"}


def dataset_config(dataset: str, arg=None):
    """Every registered policy on a registered hash-id dataset at its own block size
    (``configs/compare_policies_<dataset>.py``): 8 requests at once, hash ids kept lazy,
    xxhash with a fixed root, Llama-3.1-8B's KV for bytes; ``:quick``: the first 300
    requests, lru / queue_aware / pgdsf (+ belady) at the two smallest capacities."""
    from prefixcache.sim import datasets  # noqa: PLC0415

    quick = _base.variant(arg)
    d = datasets.get(dataset)
    c = get_config()
    src = _base.requests_config("shared_system_prompt", dataset=dataset)
    for key in ("trace", "dataset", "workload"):
        c[key] = src[key]
    c.trace_format = d.trace_format
    c.block_size = d.block_size
    c.capacities = _DATASET_CAPACITIES[d.block_size]
    c.policies = "all"
    c.indexes = "hash"
    c.concurrency = 8
    c.hash_algo = "xxhash"
    c.hash_seed = "0"
    c.trace_tokens = "lazy"
    if quick:
        c.max_requests = 300
        c.capacities = ",".join(c.capacities.split(",")[:2])
        c.policies = "lru,queue_aware,pgdsf"
    return c


def agentic_config(trace_format: str, arg=None):
    """The generated agentic workload written in ``trace_format`` (``agentx`` /
    ``tracelab``) and read back by its reader: 2 small sessions, lru / ttl_lru / tlru
    (+ belady) at 64-token blocks and 2 capacities (the quick variant of the AgentX and
    TraceLab configs, whose data cannot be fetched offline)."""
    c = get_config()
    src = _base.requests_config("agentic", format=trace_format, num_sessions=2,
                                mean_steps=12.0, system_tokens=1000, tool_tokens=3000,
                                compact_at=24000, summary_tokens=2000, subagent_prob=0.2,
                                subagent_mean_steps=4.0)
    for key in ("trace", "dataset", "workload"):
        c[key] = src[key]
    c.block_size = 64
    c.capacities = "256,1024"
    c.policies = "lru,ttl_lru,tlru"
    c.indexes = "hash"
    c.concurrency = 8
    c.hash_algo = "xxhash"
    c.hash_seed = "0"
    c.trace_tokens = "lazy"
    c.model = "llama_3_1_8b"
    return c
