"""Compare eviction policies on the Mooncake FAST'25 conversation trace (Mooncake's Table 1 grid).

Runs experiments.compare_policies on `conversation_trace.jsonl` (12,031 requests, ~12k input
tokens each, one hour of real traffic; hash_ids expanded into 512-token blocks) with
512-token blocks, one request at a time (concurrency 1), vLLM's free order, at Mooncake's
Table 1 capacities -- 1k, 3k, 10k, 30k, 50k, 100k and 200k blocks (200k holds the whole
trace) -- with every registered eviction policy on the hash index, plus the infinite-cache
ideal. Cells run in parallel worker processes (one per CPU); each streams the trace itself.
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
blocks (at 1k-3k little more than the trace's shared first block hits). ~15 s CPU per lru
cell; the other policies: WORKSPACE_NOTES.md ("Eviction policies on the Mooncake traces").
"""

from configs import compare_policies


def get_config(arg=None):
    return compare_policies.mooncake_config("mooncake_conversation", arg)
