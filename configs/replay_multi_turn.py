"""Replay: 300 six-turn conversations; each turn extends the previous prompt and output.

Runs experiments.replay on the generated `multi_turn` workload (seed 0): every request is
admitted through the real KVCacheManager (prefix lookup + allocation of the whole
prompt, decode one slot per output token), at most `concurrency` requests holding
blocks.

Command:
  python -m experiments.replay --config=configs/replay_multi_turn.py --workdir=/tmp/replay_multi_turn

Expected: token hit rate 0.769 (853k of 1.11M prompt tokens: later turns
reuse their conversation's earlier prompt and output blocks), 19,242 evictions, 0
failed.
"""

from configs import _base


def get_config():
    return _base.replay_config("multi_turn")
