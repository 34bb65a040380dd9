"""Replay: a Mooncake-scale generated hash_ids trace (20,000 requests, ~12,000 input tokens).

Streaming/memory benchmark. The trace (Mooncake JSONL, ~240M prompt tokens) is
generated deterministically by `prefixcache.sim.workloads.mooncake_scale` (seed 0)
into the workdir (reused on later runs) and streamed through the replay: memory is
bounded by the running window and the cache, not by the trace. 16-token blocks, a
cache of 65,536 blocks (~1M tokens), 8 requests holding blocks at once.

Command:
  python -m experiments.replay --config=configs/replay_mooncake_scale.py \
      --workdir=/tmp/mc_scale

Expected: EXPECT
"""

from configs import _base


def get_config():
    return _base.replay_config("mooncake_scale", num_blocks=65_536, block_size=16,
                               concurrency=8)
