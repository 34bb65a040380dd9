"""Replay: the Mooncake FAST'25 conversation trace (12,031 requests, ~12k input tokens each).

Runs experiments.replay on the dataset `mooncake_conversation`
(`conversation_trace.jsonl`, downloaded once into $PREFIXCACHE_DATA -- default
~/.cache/prefixcache -- and checksum verified; hash_ids expanded into 512-token blocks
of deterministic token ids) with 512-token blocks and a cache of 200,000 blocks (~102M
tokens: effectively infinite for this trace), one request at a time.

Command:
  python -m experiments.replay --config=configs/replay_mooncake_conversation.py \
      --workdir=/tmp/mc_conv
  # a local copy of the trace (no download), a quick run on the first 500 requests:
  python -m experiments.replay --config=configs/replay_mooncake_conversation.py \
      --config.dataset= --config.trace=/path/conversation_trace.jsonl --config.max_requests=500

Expected: token hit rate 0.3734 (54,063,104 of 144,793,823 prompt
tokens; 12,030 of 12,031 requests hit), equal to the trace README's ideal reuse of
37.34% with an infinite cache at 512-token blocks; 0 evictions, 0 failed; peak RSS
~140 MiB (the trace is streamed).
"""

from configs import _base


def get_config():
    c = _base.replay_config(
        "shared_system_prompt", dataset="mooncake_conversation",
        num_blocks=200_000, block_size=512, concurrency=1)
    return c
