"""Hybrid state-space layout (full attention + Mamba) vs full attention only, per policy.

Runs experiments.hybrid_state on the generated `multi_turn` workload (120 six-turn
conversations, seed 0) and `shared_system_prompt` (300 requests), 16-token blocks, 8 requests
at once, vLLM's free order: every (layout, eviction policy, capacity) cell replays the
trace through a fresh KVCacheManager. Layouts: "full,full" (a model of two
full-attention layer groups), "full,mamba" (one of them a state-space group, vLLM
0.33's Mamba "align" rules: a state kept per block boundary a step ends on, at most two
state blocks held per running request, prompts split where a state must be kept) and
"full,mamba_r0" (the same with vLLM's prefix_cache_retention_interval=0: only the states
at the prompt's replay boundary and at the lookup's junction are kept).

Command:
  python -m experiments.hybrid_state --config=configs/hybrid_state.py --workdir=/tmp/hybrid_state

Outputs: <workdir>/hybrid_state.jsonl (one row per cell with provenance: hit tokens and
rate, prefill chunks, evictions, peak and mean cached blocks); the last stdout line the
rows' summary.

Expected (measured, session 9; LRU token hit rate; the quick variant's cells are pinned by
tests/experiments/test_exp_quick_configs.py):
  multi_turn 2048 blocks: full,full 0.547  full,mamba 0.774  full,mamba_r0 0.684
  multi_turn 8192 blocks: 0.788 / 0.788 / 0.691
  shared_system_prompt 8192 blocks: 0.778 / 0.775 / 0.775
A state group holds at most two blocks per running request, so at a tight pool more
attention history fits. Every page counts one block (real Mamba states are larger).

marconi (Marconi's FLOP-aware eviction, alpha 1, llama_3_1_8b per-layer FLOPs, Mamba2
state bytes; session 10; quick cells pinned as above):
  multi_turn 2048 blocks: full,full 0.540  full,mamba 0.778  full,mamba_r0 0.681
  (LRU 0.547 / 0.774 / 0.684); 8192 blocks and shared_system_prompt: LRU's figures.
marconi_minmax (the same score min-max normalised over the candidates at each eviction,
Marconi's rule; session 12): multi_turn 2048 blocks: full,full 0.267  full,mamba 0.751
  full,mamba_r0 0.653; 8192 blocks and shared_system_prompt: LRU's figures. Min-max
  stretches the small FLOP differences between attention blocks (deeper = a little more
  attention saved) to the whole [0, 1], as wide as recency: at alpha 1 shallow blocks
  go first and break the chains behind them (the hash pool may evict any released block;
  on the radix index, which evicts leaves only, one group: 0.739 vs LRU 0.788). Small
  alphas recover (Marconi tunes alpha per workload): full,mamba at alpha 0.01 / 0.05 /
  0.2: 0.774 / 0.774 / 0.776 (LRU 0.774); full,full: 0.547 / 0.540 / 0.531.
marconi_tuned (min-max, alpha picked per cell on the first quarter of the trace from
  0 / 0.05 / 0.2 / 0.5 / 1; session 12): alpha 0 (= LRU) in every multi_turn 2048 cell --
  on full,full the prefix's hit tokens fall with alpha (66,576 at 0 ... 43,120 at 1), on
  full,mamba and full,mamba_r0 every value ties there -- so it equals LRU. Held-out token
  hit rate (the requests after that quarter), multi_turn 2048 blocks, full,full /
  full,mamba / full,mamba_r0: lru 0.509 / 0.777 / 0.690; marconi 0.503 / 0.782 / 0.687;
  marconi_minmax 0.217 / 0.747 / 0.651; queue_aware 0.615 / 0.791 / 0.693.
queue_aware (the replay's look-ahead of 8 waiting requests; per group, the blocks each
one's hit would use: every prompt block in full attention, the state at the hit):
  multi_turn 2048 blocks: full,full 0.641  full,mamba 0.785  full,mamba_r0 0.686;
  8192 blocks and shared_system_prompt: LRU's figures.
Memory (peak / mean cached blocks) equals LRU's in every cell: the pool is full either
way; the policy only changes which blocks it holds.
"""

import ml_collections

from configs import _base


def get_config(arg=None):
    quick = _base.variant(arg)
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = ""
    c.workloads = "multi_turn,shared_system_prompt"  # prefixcache.sim.workloads names
    # Each workload's generator arguments (configs/_base.py's, smaller).
    c.workload_kwargs = ml_collections.ConfigDict({
        "multi_turn": {**_base.WORKLOAD_KWARGS["multi_turn"], "num_conversations": 120},
        "shared_system_prompt": {**_base.WORKLOAD_KWARGS["shared_system_prompt"],
                                 "num_requests": 300},
    })
    # '|' between layouts, ';' between groups (kv_groups.parse_kv_groups entries);
    # mamba_r0: the state group with vLLM's retention_interval=0 (Marconi-style
    # admission: only the replay boundary's and the junction's states are cached).
    c.layouts = "full;full|full;mamba|full;mamba_r0"
    # prefixcache.core.eviction names (no future-readers); marconi: Marconi's FLOP-aware
    # eviction score (recency + alpha x FLOPs saved per byte, per group kind);
    # queue_aware: the replay's look-ahead of `concurrency` waiting requests, per group.
    # marconi_minmax: marconi with Marconi's own min-max normalisation over the
    # candidates at each eviction (policy_variants: label -> eviction + options).
    # marconi_tuned: the same with alpha picked per cell on the first tune_fraction of the
    # trace (Marconi's retrospective grid search, offline; rows: "tuned", and every row's
    # heldout_hit_rate_tokens over the requests after that prefix).
    c.policies = "lru,lfu,s3fifo,marconi,marconi_minmax,marconi_tuned,queue_aware"
    c.policy_variants = ml_collections.ConfigDict({
        "marconi_minmax": {"eviction": "marconi", "options": {"normalization": "minmax"}},
        "marconi_tuned": {"eviction": "marconi", "options": {"normalization": "minmax"},
                          "tune": {"option": "alpha", "grid": [0.0, 0.05, 0.2, 0.5, 1.0]}},
    })
    c.tune_fraction = 0.25
    c.capacities = "2048,8192"  # blocks
    c.block_size = 16
    c.concurrency = 8
    c.free_order = "unhashed_first"
    c.hash_algo = "sha256"
    if quick:
        c.workloads = "multi_turn"
        c.policies = "lru,marconi"
        c.capacities = "2048"
    return c
