"""The storage tier chain on 8 replicas: device / +host / +host+disk / +shared remote.

Runs experiments.tiers on the generated `multi_turn` workload (120 conversations x 4
turns, each turn re-sending the conversation so far), 16-token blocks, 8 replicas of 32
device blocks behind a round-robin router (a conversation's turns land on different
replicas: the case a shared store serves), Llama-3.1-8B (bf16) on one H200 per
replica; per replica a host tier of 1x the device pool (PCIe Gen5 host link) and a disk
of 2x (the NVMe `DISK_LINK`: 6 GB/s, 100 us), one remote store of 32x shared by all
replicas (`REMOTE_LINK`: 12.5 GB/s, 1 ms), lru everywhere. The Mooncake versions are
configs/tiers_mooncake_{conversation,synthetic}.py.

Command:
  python -m experiments.tiers --config=configs/tiers.py --workdir=/tmp/tiers

Expected: token hit rate 0.0015 device only -> 0.0047 +host -> 0.0129 +host+disk ->
0.2157 +host+disk+remote (0.2027 of it remote hits: blocks other replicas demoted);
Belady with the chain's whole capacity in one pool 0.6084 = never evicts 0.6084 (the
replica split and demote-on-evict placement, not capacity, cost the rest). TTFT mean 4.18 / 4.18 / 4.22 / 4.66 ms: on short prompts the
remote's 1 ms link and 2 MiB pages cost more than recomputing them (loads are not
overlapped with compute here). Quick variant (`:quick`: 24 conversations): hit rate
0.0298 / 0.0645 / 0.0742 / 0.1034 (bounds 0.6001), ~10 s.
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


def mooncake_config(dataset: str, arg=None):
    """A Mooncake trace (``configs/tiers_mooncake_*``): 512-token blocks (the trace's own
    hash-id granularity), 8 replicas of 1,000 device blocks (512k tokens, 64 GiB of
    Llama-3.1-8B KV each), host 1x, disk 4x, one remote store of 16x shared."""
    quick = _base.variant(arg)
    c = get_config()
    src = _base.requests_config("shared_system_prompt", dataset=dataset)
    for key in ("trace", "dataset", "workload"):
        c[key] = src[key]
    c.trace_format = "mooncake"
    c.num_blocks = 1000
    c.block_size = 512
    c.hash_algo = "xxhash"
    c.hash_seed = "0"
    c.host_multiple = 1.0
    c.disk_multiple = 4.0
    c.remote_multiple = 16.0
    c.max_requests = 0
    if quick:  # the first 600 requests, 200-block pools
        c.max_requests = 600
        c.num_blocks = 200
    return c
