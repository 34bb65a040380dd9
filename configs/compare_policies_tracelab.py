"""Compare eviction policies on TraceLab's coding-agent trace (UW SyFI, arXiv 2606.30560:
357,161 Claude Code / Codex rounds; 64-token hash ids rebuilt from each round's
cached-prefix split, see prefixcache.sim.trace_formats.read_tracelab).

Runs experiments.compare_policies with every registered policy (+ belady) on the hash
index at 64-token blocks, 8 requests at once, hash ids kept lazy; the trace is the
registered dataset `tracelab` (prefixcache.sim.datasets: the release asset
`syfi_coding_trace.jsonl.gz`, verified against the SHA-256 TraceLab publishes).

Command:
  python -m experiments.compare_policies --config=configs/compare_policies_tracelab.py \
      --workdir=/tmp/cp_tracelab
  # quick: the generated agentic workload written as TraceLab rounds and read back by
  # its reader (2 sessions; lru / ttl_lru / tlru + belady at 2 capacities):
  python -m experiments.compare_policies --config=configs/compare_policies_tracelab.py:quick \
      --workdir=/tmp/cp_tracelab_quick

Expected: the release was not reachable where this config was written (no network): the
first run records the figures. TraceLab reports 52.6B cache-read of 54.9B input tokens
(95.8%, the providers' own caches); the rebuilt trace's ideal row is at most that (the
reader reuses only what the providers reported). Quick: runs in seconds.
"""

from configs import _base, compare_policies


def get_config(arg=None):
    if not _base.variant(arg):
        return compare_policies.dataset_config("tracelab")
    return compare_policies.agentic_config("tracelab")
