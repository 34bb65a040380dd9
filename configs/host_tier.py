"""A host-memory tier behind a small device pool: hit rate and simulated TTFT (tiny, fast).

Runs experiments.host_tier on the generated `multi_turn` workload, small (40
conversations x 4 turns = 160 requests of ~60-700 tokens; each turn re-sends the whole
conversation so far, turns 1-20 s apart), 16-token blocks, a device pool of 64 blocks
(1,024 tokens: a few conversations) and host tiers of 2x, 4x and 10x it (lru). Hit
rates from the replay (4 requests at once); TTFT from the DES of Llama-3.1-8B (bf16)
on one H200, host loads over PCIe Gen5 x16 (`h200_pcie5`: 53.6 GB/s effective, 10 us
per transfer). Seconds on a laptop; the Mooncake versions are
configs/host_tier_mooncake_{conversation,synthetic}.py.

Command:
  python -m experiments.host_tier --config=configs/host_tier.py --workdir=/tmp/host_tier

Expected: token hit rate 0.0106 with no tier (the pool holds about one conversation)
-> 0.0825 / 0.1609 / 0.4422 with 2x / 4x / 10x, all of the growth host hits (device hits
stay 0.0106); the never-evicting ideal 0.6038. DES TTFT mean 4.8 -> 4.7 / 4.6 / 4.2 ms
(-2% / -4% / -12%; short prompts on one H200 are mostly bound by reading the weights),
p90 6.8 -> 5.5 ms at 10x. Quick variant (`:quick`: 20 conversations, tiers 2x and 10x):
13 s wall on the shared 2-core dev machine under a load average of ~12.
"""

from configs import _base


def get_config(arg=None):
    quick = _base.variant(arg)
    c = _base.requests_config("multi_turn", num_conversations=40, num_turns=4,
                              new_tokens=(40, 160), output_len=(4, 24), start_window_s=20.0,
                              turn_gap_s=(1.0, 20.0))
    c.num_blocks = 64  # the device pool (blocks)
    c.block_size = 16
    c.host_multiples = "2,4,10"  # host tier sizes as multiples of num_blocks (0: always run)
    c.host_eviction = "lru"  # the host tier's policy (prefixcache.core.eviction, not belady)
    c.hash_algo = "sha256"
    c.hash_seed = ""  # "" -> the algorithm's default root
    c.free_order = "unhashed_first"  # vLLM's
    c.concurrency = 4  # the replay's requests at once
    # DES: the model, its chips and the host link (prefixcache.sim.cost_model presets).
    c.model = "llama_3_1_8b"
    c.accelerator = "h200"
    c.num_chips = 1
    c.host_link = "h200_pcie5"
    c.host_load_overlap = False  # True: loads hidden behind compute (max, not sum)
    c.max_num_batched_tokens = 8192
    c.max_num_seqs = 256
    c.arrival_rate = 0.0  # 0: the trace's timestamps; > 0: Poisson arrivals (req/s)
    c.des_max_requests = 0  # 0: all
    c.executor = "local"  # local | ray
    c.workers = 0  # 0: one per CPU
    c.ray_address = ""
    if quick:  # 20 conversations, tiers of 2x and 10x
        c.workload.kwargs.num_conversations = 20
        c.host_multiples = "2,10"
    return c


def mooncake_config(dataset: str, arg=None):
    """A Mooncake trace (``configs/host_tier_mooncake_*``): 512-token blocks (the
    trace's own hash-id granularity, as configs/compare_policies_mooncake_*), a device
    pool of 10k blocks (5.1M tokens), host tiers of 2x, 4x, 10x; the replay one request
    at a time (as configs/compare_policies_mooncake_*); the DES at the trace's timestamps with
    Llama-3.1-8B on 8 x H200 (the 10k blocks are 687 GB of KV: they fit the ~1 TB the
    8 chips leave after the weights), host loads over each GPU's PCIe Gen5 x16 link."""
    quick = _base.variant(arg)
    c = get_config()
    src = _base.requests_config("shared_system_prompt", dataset=dataset)
    for key in ("trace", "dataset", "workload"):
        c[key] = src[key]
    c.trace_format = "mooncake"
    c.num_blocks = 10_000
    c.block_size = 512
    c.concurrency = 1
    c.hash_algo = "xxhash"
    c.hash_seed = "0"
    c.num_chips = 8
    if quick:  # the first 300 requests, a 1k-block pool, tiers of 2x and 10x
        c.max_requests = 300
        c.num_blocks = 1000
        c.host_multiples = "2,10"
    return c
