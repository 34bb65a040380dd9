"""Replay: 500 token-identical multimodal prompts isolated by image, cache salt and LoRA.

Runs experiments.replay on the generated `mm_salt` workload (seed 0): every request is
admitted through the real KVCacheManager (prefix lookup + allocation of the whole
prompt, decode one slot per output token), at most `concurrency` requests holding
blocks.

Command:
  python -m experiments.replay --config=configs/replay_mm_salt.py --workdir=/tmp/replay_mm_salt

Expected: EXPECT
"""

from configs import _base


def get_config():
    return _base.replay_config("mm_salt")
