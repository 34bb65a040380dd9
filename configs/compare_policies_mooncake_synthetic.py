"""Compare eviction policies on the Mooncake FAST'25 synthetic trace (Table 1's capacities).

The grid of configs/compare_policies_mooncake_conversation.py (512-token blocks,
concurrency 1, 1k-200k blocks, every registered policy on the hash index, plus the ideal)
on `synthetic_trace.jsonl` (3,993 requests, ~15k input tokens each, built from public
datasets, Poisson arrivals, multi-turn order kept).

Command:
  python -m experiments.compare_policies --config=configs/compare_policies_mooncake_synthetic.py \
      --workdir=/tmp/cp_mooncake_synthetic

Expected: the infinite-cache ideal 0.6504 (39,802,880 of 61,194,628 prompt tokens, at
122,698 blocks), as configs/replay_mooncake_synthetic.py. lru: 0.087, 0.198, 0.441, 0.637,
then 0.6504 from 50k blocks (0 evictions). The other policies: WORKSPACE_NOTES.md
("Eviction policies on the Mooncake traces"). Like Mooncake's Table 1 (measured on
another trace: see configs/compare_policies_mooncake_conversation.py), not comparable
cell by cell.

Quick variant (`:quick`: the first 200 requests, lru, lfu, length + belady, 300/1k/3k
blocks; 13 rows): 30 s wall on the shared 2-core dev machine under a load average of ~12.
"""

from configs import compare_policies


def get_config(arg=None):
    return compare_policies.mooncake_config("mooncake_synthetic", arg)
