"""A host-memory tier on the Mooncake FAST'25 synthetic trace: hit rate and TTFT.

The setting of configs/host_tier_mooncake_conversation.py (512-token blocks, a device
pool of 10k blocks, host tiers of 2x, 4x, 10x, Llama-3.1-8B on 8 x H200, `h200_pcie5`)
on `synthetic_trace.jsonl` (3,993 requests, ~15k input tokens each, built from public
datasets, multi-turn order kept).

Command:
  python -m experiments.host_tier \
      --config=configs/host_tier_mooncake_synthetic.py --workdir=/tmp/host_tier_syn

Expected (experiments/results/host_tier_mooncake_synthetic_76f4695.jsonl): token hit rate
0.4408 with no tier (as configs/compare_policies_mooncake_synthetic.py at 10k blocks) ->
0.6371 with 2x, 0.6504 (= the ideal; the host holds at most 30,966 blocks) with 4x and 10x.
DES TTFT mean 32.9 -> 22.0 / 21.4 / 21.4 ms (-33% / -35% / -35%), p50 1.9 -> 1.6 ms, p90
101.6 -> 57.9 / 56.3 / 56.3 ms; 3.7-3.9 s of load time charged (1.6-1.7 TB loaded).
Quick variant (`:quick`: the first 300 requests, a 1k-block pool, tiers 2x and 10x): 28 s
wall on the shared 2-core dev machine under a load average of ~14.
With loads hidden behind compute (--config.host_load_overlap=True, the optimistic bound;
..._overlap_ac32ce1.jsonl): mean 21.7 / 21.0 / 21.0 ms (-34% / -36% / -36%).
"""

from configs import host_tier


def get_config(arg=None):
    return host_tier.mooncake_config("mooncake_synthetic", arg)
