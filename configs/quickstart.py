"""Quickstart: prefix caching end to end on the tiny model (CPU; 29 s wall measured on the
shared 2-core dev machine).

Runs a synthetic chat workload -- a shared system prompt, multi-turn follow-ups of several
users, and a few unrelated cold requests -- one request at a time, once with the prefix
cache reset before every request (cold) and once with the cache kept (warm), and prints
cold vs warm TTFT by cached-prefix length, reused tokens, hit rates, evictions and cache
usage. Writes `results.jsonl` (one line per request and mode, plus a summary line, each
with provenance) and `ttft_vs_cached_prefix.png` into --workdir.

Command:
  python -m experiments.quickstart --config=configs/quickstart.py --workdir=/tmp/quickstart
  (the config is the default; override fields as --config.num_users=8 or
  --config.block_size=32; --noprogress hides the progress bar)

Expected: greedy outputs identical cold and warm (the run fails otherwise); warm TTFT well
below cold TTFT for long cached prefixes (the warm/cold ratio shrinks as the cached prefix
grows); a warm-pass token hit rate around 0.6 with some evictions (the pool holds 1536
tokens, the workload ~2000 distinct ones).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = ""  # set with --workdir (required)
    # Engine.
    c.num_blocks = 96  # 1536 tokens: the cold requests force evictions
    c.block_size = 16
    c.max_num_seqs = 8
    c.max_num_batched_tokens = 1024
    c.max_model_len = 1024
    # () -> one page bucket of ceil(max_model_len / block_size) pages (64 here): fewer
    # compiled programs, a faster run; follows --config.block_size.
    c.page_buckets = ()
    c.hash_algo = "sha256"
    c.eviction = "lru"  # prefixcache.core.eviction.POLICIES (not belady: online)
    c.attention_backend = "auto"
    # Workload.
    c.system_prompt_lens = (128, 512)  # user u starts from system prompt u % 2
    c.num_users = 4
    c.num_turns = 3
    c.user_msg_len = 48
    c.num_cold = 3
    c.cold_prompt_len = 384
    c.max_tokens = 8
    return c
