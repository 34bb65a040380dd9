"""Routing the Mooncake synthetic trace across 4 replicas, each with a host-memory tier.

configs/route_mooncake_synthetic.py (3,993 requests at their own timestamps, 512-token
blocks, Llama-3.1-8B on one H100 per replica: 833 device blocks each) at 4 replicas, plus
a host tier of 4x the device pool per replica (3,332 blocks, lru), loads over PCIe Gen5
(`h200_pcie5`); kv_events scores a host block at host_weight="auto" (1 - load/prefill of
a block = 0.83 here), against cache_aware and round_robin.

Command:
  python -m experiments.route \
      --config=configs/route_mooncake_synthetic_host.py --workdir=/tmp/route_ms_host

Expected: token hit rate / P90 TTFT -- kv_events 0.547 (0.214 device
+ 0.333 host) / 0.60 s, cache_aware 0.547 / 0.62 s, round_robin 0.207 / 1.13 s; without
the tier (--num_host_blocks=0) 0.209 / 0.96 s, 0.205 / 1.32 s, 0.065 / 1.43 s. kv_events
with --host_weight=1 routes alike; with --host_weight=0 (host blocks worth nothing) 0.321
/ 0.87 s. Quick variant (`:quick`: the first 300 requests, 2 replicas): 7.4 s wall on
the shared 2-core dev machine (load average ~7).
"""

from configs import route_mooncake_synthetic


def get_config(arg=None):
    c = route_mooncake_synthetic.get_config(arg)
    c.replicas = "4" if not c.max_requests else "2"
    c.policies = "kv_events,cache_aware,round_robin"
    c.num_host_blocks = 3332  # 4 x the 833 device blocks left on an H100 after the weights
    c.host_eviction = "lru"
    c.host_link = "h200_pcie5"
    c.host_weight = "auto"
    return c
