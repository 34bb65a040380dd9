"""Replay: the Mooncake FAST'25 synthetic trace (3,993 requests, ~15k input tokens each).

Runs experiments.replay on the dataset `mooncake_synthetic` (`synthetic_trace.jsonl`,
downloaded once into $PREFIXCACHE_DATA -- default ~/.cache/prefixcache -- and checksum
verified; hash_ids expanded into 512-token blocks of deterministic token ids) with
512-token blocks and a cache of 200,000 blocks (~102M tokens: effectively infinite for
this trace), one request at a time.

Command:
  python -m experiments.replay --config=configs/replay_mooncake_synthetic.py \
      --workdir=/tmp/mc_synth
  # a local copy of the trace (no download), a quick run on the first 500 requests:
  python -m experiments.replay --config=configs/replay_mooncake_synthetic.py \
      --config.dataset= --config.trace=/path/synthetic_trace.jsonl --config.max_requests=500

Expected: token hit rate 0.6504 (39,802,880 of 61,194,628 prompt
tokens), equal to the trace README's ideal reuse of 65.04% with an infinite cache at
512-token blocks; 0 evictions, 0 failed; peak RSS ~110 MiB.
"""

from configs import _base


def get_config():
    c = _base.replay_config(
        "shared_system_prompt", dataset="mooncake_synthetic",
        num_blocks=200_000, block_size=512, concurrency=1)
    return c
