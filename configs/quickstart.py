"""Quickstart: prefix caching end to end on the tiny model (CPU, ~30 s).

Runs a synthetic chat workload -- a shared system prompt, multi-turn follow-ups of several
users, and a few unrelated cold requests -- one request at a time, once with the prefix
cache reset before every request (cold) and once with the cache kept (warm), and prints
cold vs warm TTFT by cached-prefix length, reused tokens, hit rates, evictions and cache
usage. Writes `results.jsonl` (one line per request and mode, plus a summary line, each
with provenance) and `ttft_vs_cached_prefix.png` into --workdir.

Command:
  python -m experiments.quickstart --workdir=/tmp/quickstart
  python -m experiments.quickstart --workdir=/tmp/qs --config=configs/quickstart.py \
      --config.num_users=8

Expected: greedy outputs identical cold and warm; follow-ups reuse >= 80% of their prompt;
warm TTFT well below cold TTFT for long cached prefixes (the ratio shrinks as the cached
prefix grows); a token hit rate around 0.7 for the warm pass.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    # Engine.
    c.num_blocks = 160
    c.block_size = 16
    c.max_num_seqs = 8
    c.max_num_batched_tokens = 1024
    c.hash_algo = "sha256"
    c.attention_backend = "auto"
    # Workload.
    c.system_prompt_len = 512
    c.num_users = 4
    c.num_turns = 3
    c.user_msg_len = 48
    c.num_cold = 3
    c.cold_prompt_len = 384
    c.max_tokens = 8
    return c
