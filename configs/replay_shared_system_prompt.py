"""Replay: 2000 requests sharing one 1024-token system prompt (+64..512 unique tokens).

Runs experiments.replay on the generated `shared_system_prompt` workload (seed 0): every request is
admitted through the real KVCacheManager (prefix lookup + allocation of the whole
prompt, decode one slot per output token), at most `concurrency` requests holding
blocks.

Command:
  python -m experiments.replay --config=configs/replay_shared_system_prompt.py --workdir=/tmp/replay_shared_system_prompt

Expected: token hit rate 0.781 (every request after the first reuses
exactly the 1024 system-prompt tokens: 2,046,976 of 2,620,378 prompt tokens), 35,909
evictions (unique suffixes cycle through the 4096-block pool), 0 failed.
"""

from configs import _base


def get_config():
    return _base.replay_config("shared_system_prompt")
