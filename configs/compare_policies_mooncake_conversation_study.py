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

Command (the trace is the registered dataset `mooncake_conversation`; here its copy in
/work/shared/traces/mooncake):
  python -m experiments.compare_policies \
      --config=configs/compare_policies_mooncake_conversation_study.py \
      --config.dataset= --config.trace=/work/shared/traces/mooncake/conversation_trace.jsonl \
      --workdir=experiments/results/compare_policies_mooncake_conversation

Expected (the committed results, experiments/results/compare_policies_mooncake_conversation/):
the ideal 0.3734; lru 0.0460, 0.0671, 0.2165, 0.3331, 0.3709 from 1k to 100k blocks; belady
reaches the ideal from 10k blocks with 0 evicted-block prefills; the README's study
table lists every policy. 41 cells, ~13 CPU-minutes (two workers on the shared 2-core
dev machine: ~9 min wall).
"""

from configs import compare_policies


def get_config(arg=None):
    c = compare_policies.mooncake_config("mooncake_conversation", arg)
    c.policies = "lru,lfu,length,arc,s3fifo,pgdsf,queue_aware"  # + belady (belady_bound)
    c.capacities = "1000,3000,10000,30000,100000"
    c.queue_depth = 8
    c.trace_tokens = "lazy"
    c.workers = 2
    c.miss_reasons = True
    return c
