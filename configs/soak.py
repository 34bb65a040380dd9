"""Soak and memory pressure of the KV cache manager and the engine (short by default).

Runs experiments.soak. Manager: random operations on one KVCacheManager (256 blocks of
16 tokens, max_model_len 1024, events on) over every public call -- admissions with
prefix hits, prefill chunks, decode steps, lookahead slots, preemption and re-admission,
frees, reset_prefix_cache (refused while blocks are held, done after a drain),
inspection and stats calls, rejected bad calls -- with salts (also cache_salt_offset),
LoRA adapters and multimodal items; check_invariants every 10^4 operations, where the
RSS is sampled; after the warm-up (the first 30% of the run) its peak may exceed the
warm-up's peak by < 5% (checked for runs of >= 200,000 operations). Engine:
the tiny model, 128 requests in flight on a pool of 10% of their demand, random aborts
(5% of steps), rejections (3%: too long / token id outside the vocabulary), salts,
LoRA (cache key only), multimodal prompts, stop tokens; every request must come back
once with a valid outcome and every block must be free at the end.

Command (short, what CI runs; ~20-40 s on the dev CPU):
  python -m experiments.soak --config=configs/soak.py --workdir=/tmp/soak
Long (10^6 manager operations, 5,000 engine requests):
  python -m experiments.soak --config=configs/soak.py --workdir=/tmp/soak --config.long=True

Expected: both parts pass (a failed check raises). Short: 30,000 manager operations
(5 invariant checks, thousands of refused allocations, preemptions and evictions, hits
on the shared prefixes, RSS reported but not checked: the hasher's bounded caches fill
during the first ~150k operations) and 150 engine requests (~13 preemptions, a few
aborts and rejections, pool 65 blocks = 10% of 648, no leak), ~1 s + ~20 s. Long (2-core
dev CPU under a load average of ~15, 3-5 min in all): 10^6 manager operations in
70-130 s, 102 invariant checks, RSS 53 -> ~80 MiB during the warm-up and then flat (the
peak after it 0.03% over the warm-up's peak); 5,000 engine requests in 100-150 s, at
seed 0 exactly 4534 "length", 15 "stop", 300 aborted, 151 rejected with a reason, 497
preemptions (host decisions are deterministic), every block free at the end.
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = ""
    c.long = False  # True: manager.long_num_ops and engine.long_num_requests

    c.manager = ml_collections.ConfigDict()
    c.manager.enable = True
    c.manager.num_ops = 30_000
    c.manager.long_num_ops = 1_000_000
    c.manager.check_every = 10_000
    c.manager.num_blocks = 256  # ~1/4 of what 48 running requests can ask for
    c.manager.block_size = 16
    c.manager.max_model_len = 1024
    c.manager.max_running = 48
    c.manager.hash_algo = "sha256"
    c.manager.warmup_fraction = 0.3
    c.manager.rss_growth_limit = 0.05
    c.manager.rss_min_ops = 200_000  # shorter runs report the RSS growth, unchecked

    c.engine = ml_collections.ConfigDict()
    c.engine.enable = True
    c.engine.num_requests = 150
    c.engine.long_num_requests = 5000
    c.engine.inflight = 128
    c.engine.pool_fraction = 0.1
    c.engine.block_size = 16
    c.engine.max_model_len = 256
    c.engine.max_prompt_len = 128
    c.engine.max_tokens = 32
    c.engine.max_num_seqs = 16
    c.engine.max_num_batched_tokens = 256
    c.engine.token_buckets = (32, 256)  # few shapes: few compiles on CPU
    c.engine.abort_prob = 0.05  # per step: abort one random unfinished request
    c.engine.reject_prob = 0.03
    c.engine.salt_prob = 0.3
    c.engine.mm_prob = 0.2
    c.engine.lora_prob = 0.1
    c.engine.check_every = 50  # steps between check_invariants
    return c
