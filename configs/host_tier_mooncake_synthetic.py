"""A host-memory tier on the Mooncake FAST'25 synthetic trace: hit rate and TTFT.

The setting of configs/host_tier_mooncake_conversation.py (512-token blocks, a device
pool of 10k blocks, host tiers of 2x, 4x, 10x, Llama-3.1-8B on 8 x H200, `h200_pcie5`)
on `synthetic_trace.jsonl` (3,993 requests, ~15k input tokens each, built from public
datasets, multi-turn order kept).

Command:
  PREFIXCACHE_DATA=/tmp/lead/data python -m experiments.host_tier \
      --config=configs/host_tier_mooncake_synthetic.py --workdir=/tmp/host_tier_syn

Expected: see WORKSPACE_NOTES.md / experiments/results/host_tier_mooncake_synthetic.jsonl
(the replay's device-only hit rate at 10k blocks is 0.441, the ideal 0.6504, as
configs/compare_policies_mooncake_synthetic.py).
"""

from configs import host_tier


def get_config():
    return host_tier.mooncake_config("mooncake_synthetic")
