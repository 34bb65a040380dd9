"""Compare eviction policies on SemiAnalysis' AgentX corpus (Weka-format Claude Code
sessions with nested sub-agents; 64-token hash ids).

Runs experiments.compare_policies with every registered policy (+ belady) on the hash
index at the corpus's block size (64), 8 requests at once, hash ids kept lazy; the
trace is the registered dataset `agentx` (prefixcache.sim.datasets, Hugging Face
`semianalysisai/cc-traces-weka-062126`, `traces.jsonl`): downloaded once into
$PREFIXCACHE_DATA, its checksum recorded on first download and verified afterwards.

Command:
  python -m experiments.compare_policies --config=configs/compare_policies_agentx.py \
      --workdir=/tmp/cp_agentx
  # quick: the generated agentic workload written in the AgentX format and read back by
  # its reader (2 sessions; lru / ttl_lru / tlru + belady at 2 capacities):
  python -m experiments.compare_policies --config=configs/compare_policies_agentx.py:quick \
      --workdir=/tmp/cp_agentx_quick

Expected: the corpus was not reachable where this config was written (no network): the
first run records the figures; SemiAnalysis reports (InferenceX #1632) a theoretical hit
rate of 85.8% for the v0.2 corpus at 64-token blocks, which the ideal row of the full run
is to be compared with. Quick: runs in seconds; figures in its rows.
"""

from configs import _base, compare_policies


def get_config(arg=None):
    if not _base.variant(arg):
        return compare_policies.dataset_config("agentx")
    return compare_policies.agentic_config("agentx")
