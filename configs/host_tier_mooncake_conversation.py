"""A host-memory tier on the Mooncake FAST'25 conversation trace: hit rate and TTFT.

Runs experiments.host_tier on `conversation_trace.jsonl` (12,031 requests, ~12k input
tokens each, one hour of real traffic; hash_ids expanded into 512-token blocks) with
512-token blocks, a device pool of 10k blocks and host tiers of 2x, 4x, 10x (lru), plus
the never-evicting ideal. Hit rates: the replay, one request at a time. TTFT: the DES of
Llama-3.1-8B (bf16) on 8 x H200 at the trace's timestamps, host loads over PCIe Gen5 x16
per GPU (`h200_pcie5`). See configs/host_tier.py (mooncake_config).

Command:
  PREFIXCACHE_DATA=/tmp/lead/data python -m experiments.host_tier \
      --config=configs/host_tier_mooncake_conversation.py --workdir=/tmp/host_tier_conv

Expected: see WORKSPACE_NOTES.md / experiments/results/host_tier_mooncake_conversation.jsonl
(the replay's device-only hit rate at 10k blocks is 0.217, the ideal 0.3734, as
configs/compare_policies_mooncake_conversation.py).
"""

from configs import host_tier


def get_config():
    return host_tier.mooncake_config("mooncake_conversation")
