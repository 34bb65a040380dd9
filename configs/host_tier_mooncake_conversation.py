"""A host-memory tier on the Mooncake FAST'25 conversation trace: hit rate and TTFT.

Runs experiments.host_tier on `conversation_trace.jsonl` (12,031 requests, ~12k input
tokens each, one hour of real traffic; hash_ids expanded into 512-token blocks) with
512-token blocks, a device pool of 10k blocks and host tiers of 2x, 4x, 10x (lru), plus
the never-evicting ideal. Hit rates: the replay, one request at a time. TTFT: the DES of
Llama-3.1-8B (bf16) on 8 x H200 at the trace's timestamps, host loads over PCIe Gen5 x16
per GPU (`h200_pcie5`). See configs/host_tier.py (mooncake_config).

Command:
  python -m experiments.host_tier \
      --config=configs/host_tier_mooncake_conversation.py --workdir=/tmp/host_tier_conv

Expected (experiments/results/host_tier_mooncake_conversation_76f4695.jsonl): token hit
rate 0.2165 with no tier (as configs/compare_policies_mooncake_conversation.py at 10k
blocks) -> 0.3332 / 0.3615 / 0.3714 with 2x / 4x / 10x (device hits stay 0.2165, the
rest loaded from the host; ideal 0.3734). DES TTFT mean 173.5 -> 152.7 / 147.2 / 145.1 ms
(-12% / -15% / -16%), p50 112.9 -> 94.8 / 93.3 / 91.5 ms, p90 402 -> 348 / 326 / 316 ms;
5.2-6.9 s of load time charged over the hour (2.2-2.9 TB loaded). Long on a 2-core
machine: rerun with the same --workdir to resume (finished cells are kept in
host_tier.cells.jsonl). Quick variant (`:quick`: the first 300 requests, a 1k-block pool,
tiers 2x and 10x): 32 s wall on the shared 2-core dev machine under a load average of ~13.
DES TTFT with loads hidden behind compute (--config.host_load_overlap=True, the optimistic
bound; ..._overlap_ac32ce1.jsonl): mean 149.3 / 143.0 / 140.7 ms (-14% / -18% / -19%).
"""

from configs import host_tier


def get_config(arg=None):
    return host_tier.mooncake_config("mooncake_conversation", arg)
