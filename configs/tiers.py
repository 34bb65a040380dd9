"""The storage tier chain on 8 replicas: device / +host / +host+disk / +shared remote.

Runs experiments.tiers on the generated `multi_turn` workload (120 conversations x 4
turns, each turn re-sending the conversation so far), 16-token blocks, 8 replicas of 64
device blocks behind a round-robin router (a conversation's turns land on different
replicas: the case a shared store serves), Llama-3.1-8B (bf16) on one H200 per
replica; host tiers of 2x the device pool (PCIe Gen5 host link), disks of 8x (NVMe
link), one remote store of 32x shared by all replicas (RDMA link), lru everywhere.

Command:
  python -m experiments.tiers --config=configs/tiers.py --workdir=/tmp/tiers

Expected: token hit rate grows with each tier (device < +host < +host+disk <
+host+disk+remote, the ideal above all), the remote's hits coming from blocks other
replicas demoted; TTFT falls as hits grow. Quick variant (`:quick`: 24 conversations,
a few seconds) is what CI runs.
"""

from configs import _base


def get_config(arg=None):
    quick = _base.variant(arg)
    c = _base.requests_config("multi_turn", num_conversations=120, num_turns=4,
                              new_tokens=(40, 160), output_len=(4, 24), start_window_s=20.0,
                              turn_gap_s=(1.0, 20.0))
    c.num_blocks = 32  # the device pool of each replica (blocks)
    c.block_size = 16
    c.replicas = 8
    c.router = "round_robin"
    c.host_multiple = 1.0  # host tier per replica, x num_blocks
    c.disk_multiple = 2.0  # disk tier per replica, x num_blocks (pages)
    c.remote_multiple = 32.0  # one remote store shared by the replicas, x num_blocks
    # The tiers' policies (prefixcache.core.eviction, not belady): CacheConfig's defaults.
    _base.cache_defaults(c, "hash_algo", "hash_seed", "free_order", "eviction",
                         "host_eviction", "disk_eviction", "remote_eviction")
    c.model = "llama_3_1_8b"
    c.accelerator = "h200"
    c.num_chips = 1
    c.host_link = "h200_pcie5"
    c.max_num_batched_tokens = 8192
    c.max_num_seqs = 256
    if quick:
        c.workload.kwargs.num_conversations = 24
    return c
