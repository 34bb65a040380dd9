"""Replay: 500 token-identical multimodal prompts isolated by image, cache salt and LoRA.

Runs experiments.replay on the generated `mm_salt` workload (seed 0): every request is
admitted through the real KVCacheManager (prefix lookup + allocation of the whole
prompt, decode one slot per output token), at most `concurrency` requests holding
blocks.

Command:
  python -m experiments.replay --config=configs/replay_mm_salt.py --workdir=/tmp/replay_mm_salt

Expected: token hit rate 0.721: a request hits 576 tokens (36 blocks:
the 10-token prefix + the 576 placeholders, all keyed by image, salt and adapter)
when an earlier request had the same (image, salt, LoRA) and its blocks were not
evicted since: 458 requests hit 576, 42 miss (the first of each of the 40
combinations + 2 after eviction); 3,459 evictions, 0 failed.
"""

from configs import _base


def get_config():
    return _base.replay_config("mm_salt")
