"""Replay: a Mooncake-scale generated hash_ids trace (20,000 requests, ~12,000 input tokens).

Streaming/memory benchmark. The trace (Mooncake JSONL, ~240M prompt tokens) is
generated deterministically by `prefixcache.sim.workloads.mooncake_scale` (seed 0)
into the workdir (reused on later runs) and streamed through the replay: memory is
bounded by the running window and the cache, not by the trace. 16-token blocks, a
cache of 65,536 blocks (~1M tokens), 8 requests holding blocks at once.

Command:
  python -m experiments.replay --config=configs/replay_mooncake_scale.py \
      --workdir=/tmp/mc_scale

Expected: 20,000 requests, 240,715,824 prompt tokens (12,036 on average), replayed
in one process with peak RSS ~100 MiB (limit: 2 GiB); token hit rate 0.153 with
this 1M-token cache (the trace's ideal reuse with an infinite cache at 512-token
blocks is 44.4%), 13.3M evictions, 0 failed. Dev machine (2 cores shared with
other jobs, 74% of one core): loop 146 s, 137 requests/s, 1.65M prompt tokens/s,
3m10s wall including reading and expanding the trace.
"""

from configs import _base


def get_config():
    return _base.replay_config("mooncake_scale", num_blocks=65_536, block_size=16,
                               concurrency=8)
