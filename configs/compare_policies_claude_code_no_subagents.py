"""Compare eviction policies on SemiAnalysis' Claude Code agent sessions without sub-agents
(`traces.jsonl`; 64-token hash ids).

Runs experiments.compare_policies with every registered policy (+ belady) on the hash
index at the dataset's own block size (refused otherwise), 8 requests at once, hash ids
kept lazy (no token expansion), with miss reasons per row; capacities and the rest in
configs/compare_policies.py (dataset_config). The trace is the registered dataset
`claude_code_no_subagents` (prefixcache.sim.datasets): downloaded once into $PREFIXCACHE_DATA; its
checksum is registered or recorded on first download and verified on every later use.

Command:
  python -m experiments.compare_policies \
      --config=configs/compare_policies_claude_code_no_subagents.py \
      --workdir=/tmp/cp_claude_code_no_subagents
  # quick (the first 300 requests, lru / queue_aware / pgdsf + belady, 2 capacities):
  python -m experiments.compare_policies \
      --config=configs/compare_policies_claude_code_no_subagents.py:quick \
      --workdir=/tmp/cp_claude_code_no_subagents_quick

Expected: not measured yet -- no copy of this trace was reachable where this config was
written (offline); the first run records the figures.
"""

from configs import compare_policies


def get_config(arg=None):
    return compare_policies.dataset_config("claude_code_no_subagents", arg)
