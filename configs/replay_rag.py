"""Replay: 1000 RAG prompts, 2 of 200 documents each drawn by Zipf(1.1) popularity.

Runs experiments.replay on the generated `rag` workload (seed 0): every request is
admitted through the real KVCacheManager (prefix lookup + allocation of the whole
prompt, decode one slot per output token), at most `concurrency` requests holding
blocks.

Command:
  python -m experiments.replay --config=configs/replay_rag.py --workdir=/tmp/replay_rag

Expected: token hit rate 0.621 (the system prompt always, plus the leading
popular documents), 37,519 evictions, 0 failed.
"""

from configs import _base


def get_config():
    return _base.replay_config("rag")
