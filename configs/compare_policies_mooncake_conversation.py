"""Compare eviction policies on the Mooncake FAST'25 conversation trace (Table 1's capacities).

Runs experiments.compare_policies on `conversation_trace.jsonl` (12,031 requests, ~12k input
tokens each, one hour of real traffic; hash_ids expanded into 512-token blocks) with
512-token blocks, one request at a time (concurrency 1), vLLM's free order, at 1k, 3k,
10k, 30k, 50k, 100k and 200k blocks (200k holds the whole trace) with every registered
eviction policy on the hash index, plus the infinite-cache ideal. Mooncake's Table 1
(arXiv 2407.00079 v3, section 4.2) uses 1k, 10k, 30k, 50k and 100k blocks, measured on
its own 23,608-request one-hour trace (the request count of the FAST'25 release's
tool-and-agent trace), not on the traces replayed here: its figures cannot be compared
with ours cell by cell. Cells run in parallel worker processes (one per CPU); each
streams the trace itself.
Bytes: Llama-3.1-70B's KV (160 MiB per block). xxhash with a fixed root (hit rates do not
depend on the hash algorithm; it is the fastest). See configs/compare_policies.py
(mooncake_config).

Command:
  python -m experiments.compare_policies --config=configs/compare_policies_mooncake_conversation.py \
      --workdir=/tmp/cp_mooncake_conversation
  # on a Ray cluster (the trace at the same path on every node):
  python -m experiments.compare_policies --config=configs/compare_policies_mooncake_conversation.py \
      --workdir=/tmp/cp_mooncake_conversation --executor=ray --ray_address=HOST:6379

Expected: the infinite-cache ideal 0.3734 (54,063,104 of 144,793,823 prompt tokens, at
296,813 blocks), as configs/replay_mooncake_conversation.py; every policy reaches it at 200k
blocks (0 evictions). lru: 0.046, 0.067, 0.217, 0.333, 0.362, 0.371, 0.373 from 1k to 200k
blocks (at 1k-3k little more than the trace's shared first block hits). On this trace
LRU is last of lru / lfu / length at 1k and 3k blocks (0.046 vs 0.049 / 0.057, 0.067 vs
0.077 / 0.068); lru >= lfu >= length holds from 10k blocks. The other policies:
WORKSPACE_NOTES.md ("Eviction policies on the Mooncake traces"). The whole grid was cut
off after 10 min on the shared 2-core dev machine: run it where it can finish, or rerun
with the same --workdir to resume (finished cells are kept in
compare_policies.cells.jsonl).

Quick variant (`:quick`: the first 200 requests, lru, lfu, length + belady, 300/1k/3k
blocks; 13 rows): 33 s wall on the shared 2-core dev machine under a load average of ~11
(9.9 s at ~8).
"""

from configs import compare_policies


def get_config(arg=None):
    return compare_policies.mooncake_config("mooncake_conversation", arg)
