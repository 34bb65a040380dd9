"""Compare eviction policies on the Qwen-Bailian coder-model trace
(`qwen_coder_blksz_16.jsonl`; 16-token hash ids).

Runs experiments.compare_policies with every registered policy (+ belady) on the hash
index at the dataset's own block size (refused otherwise), 8 requests at once, hash ids
kept lazy (no token expansion), with miss reasons per row; capacities and the rest in
configs/compare_policies.py (dataset_config). The trace is the registered dataset
`bailian_coder` (prefixcache.sim.datasets): downloaded once into $PREFIXCACHE_DATA; its
checksum is registered or recorded on first download and verified on every later use.

Command:
  python -m experiments.compare_policies --config=configs/compare_policies_bailian_coder.py \
      --workdir=/tmp/cp_bailian_coder
  # quick (the first 300 requests, lru / queue_aware / pgdsf + belady, 2 capacities):
  python -m experiments.compare_policies --config=configs/compare_policies_bailian_coder.py:quick \
      --workdir=/tmp/cp_bailian_coder_quick

Expected: not measured yet -- no copy of this trace was reachable where this config was
written (offline); the first run records the figures.
"""

from configs import compare_policies


def get_config(arg=None):
    return compare_policies.dataset_config("bailian_coder", arg)
