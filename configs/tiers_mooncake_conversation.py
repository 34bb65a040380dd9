"""The storage tier chain on the Mooncake FAST'25 conversation trace, 8 replicas.

Runs experiments.tiers on `conversation_trace.jsonl` (hash_ids expanded into 512-token
blocks): 8 replicas of 1,000 device blocks behind a round-robin router, per replica a
host tier of 1x and a disk of 4x, one remote store of 16x shared by all replicas, lru
everywhere; TTFT from the DES of Llama-3.1-8B (bf16) on one H200 per replica. See
configs/tiers.py (mooncake_config).

Command:
  python -m experiments.tiers --config=configs/tiers_mooncake_conversation.py --workdir=/tmp/tiers_conversation

Expected: the full run is not measured yet (long on a 2-core machine). Quick variant
(`:quick`: the first 600 requests, 200-block pools), measured: token hit rate 0.0362
device only -> 0.0373 +host -> 0.0489 +host+disk -> 0.0546 +host+disk+remote (0.0057
remote hits); never evicts 0.1713 (Belady's bound: see the rows). TTFT mean 397.0 / 396.8 / 398.1 / 397.9 ms (the
loads cost about what they save at this load). ~3 min wall on the shared machine.
"""

from configs import tiers


def get_config(arg=None):
    return tiers.mooncake_config("mooncake_conversation", arg)
