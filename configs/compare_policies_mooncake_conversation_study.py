"""The shipped study: eviction policies with miss reasons on the Mooncake conversation trace.

Runs experiments.compare_policies on the whole Mooncake FAST'25 `conversation_trace.jsonl`
(12,031 requests; 512-token blocks, one request at a time, vLLM's free order, xxhash
with a fixed root; see configs/compare_policies_mooncake_conversation.py) with lru, lfu,
length, arc, s3fifo, pgdsf, queue_aware (a waiting queue of the next 8 requests) and the
offline belady bound, at 1k, 3k, 10k, 30k and 100k blocks (5 of that config's 7
capacities: 50k and 200k left out for time), plus the infinite-cache ideal; every row
carries its miss reasons (`miss_reasons`, `evicted_blocks`: the eviction-induced
prefills) and its distance to belady (`belady_gap_*`). Hash ids stay hash ids
(`trace_tokens="lazy"`: the same hits, no token expansion).

Quick variant (`:quick`: the first 200 requests, lru / arc / queue_aware + belady at
300, 1k and 3k blocks): lru = arc = queue_aware 0.0366, 0.0366, 0.0442 (123, 123, 82
evicted-block prefills), belady 0.0482, 0.0593, 0.0593, the ideal 0.0593; 4.0 s of cells.

Command (the trace is the registered dataset `mooncake_conversation`, fetched into
$PREFIXCACHE_DATA; `--trace=PATH/conversation_trace.jsonl` reads a local copy instead):
  python -m experiments.compare_policies \
      --config=configs/compare_policies_mooncake_conversation_study.py \
      --workdir=/tmp/cp_mooncake_conversation_study

Expected (the committed results: experiments/results/compare_policies_mooncake_conversation_study.jsonl
and .png; the page experiments/results/compare_policies_mooncake_conversation.md): the
ideal 0.3734 (296,813 blocks); lru 0.0455,
0.0669, 0.2165, 0.3332, 0.3710 from 1k to 100k blocks; belady 0.1826, 0.2972, then the
ideal from 10k blocks with 0 evicted-block prefills; queue_aware 0.0468, 0.0705, 0.2174,
0.3335, 0.3710. Every row misses the same 170,899 cold and 12,009 partial blocks. 41
cells: 25.1 min of replay loops (loop_s), 35.4 min of cell wall time over two workers,
17 min 51 s wall on the shared 2-core dev machine (other jobs running).
"""

from configs import compare_policies


def get_config(arg=None):
    c = compare_policies.mooncake_config("mooncake_conversation", arg)
    if c.max_requests:  # :quick -- the first 200 requests, 300/1k/3k blocks
        c.policies = "lru,arc,queue_aware"  # + belady
    else:
        c.policies = "lru,lfu,length,arc,s3fifo,pgdsf,queue_aware"  # + belady (belady_bound)
        c.capacities = "1000,3000,10000,30000,100000"
    c.queue_depth = 8
    c.trace_tokens = "lazy"
    c.workers = 2
    c.miss_reasons = True
    return c
