"""Replay (default config): a small shared-system-prompt workload, generated in-process.

Runs experiments.replay on the generated `shared_system_prompt` workload (seed 0): every request is
admitted through the real KVCacheManager (prefix lookup + allocation of the whole
prompt, decode one slot per output token), at most `concurrency` requests holding
blocks.

Command:
  python -m experiments.replay --config=configs/replay.py --workdir=/tmp/replay

Expected: token hit rate 0.778 (199 of 200 requests reuse the 1024-token system
prompt: 203,776 of 261,934 prompt tokens), 0 failed. Per-request records in
<workdir>/requests.jsonl, the summary as the last stdout line.
"""

from configs import _base


def get_config():
    return _base.replay_config("shared_system_prompt", num_requests=200)
