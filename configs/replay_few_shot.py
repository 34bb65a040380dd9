"""Replay: 10 few-shot headers of 3000 tokens x 200 short questions, shuffled.

Runs experiments.replay on the generated `few_shot` workload (seed 0): every request is
admitted through the real KVCacheManager (prefix lookup + allocation of the whole
prompt, decode one slot per output token), at most `concurrency` requests holding
blocks.

Command:
  python -m experiments.replay --config=configs/replay_few_shot.py --workdir=/tmp/replay_few_shot

Expected: token hit rate 0.975 (each header misses once, then 2992 of its
3000 tokens hit), 9,841 evictions, 0 failed.
"""

from configs import _base


def get_config():
    return _base.replay_config("few_shot")
