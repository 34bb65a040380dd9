"""The storage tier chain on the Mooncake FAST'25 synthetic trace, 8 replicas.

Runs experiments.tiers on `synthetic_trace.jsonl` (hash_ids expanded into 512-token
blocks): 8 replicas of 1,000 device blocks behind a round-robin router, per replica a
host tier of 1x and a disk of 4x, one remote store of 16x shared by all replicas, lru
everywhere; TTFT from the DES of Llama-3.1-8B (bf16) on one H200 per replica. See
configs/tiers.py (mooncake_config).

Command:
  python -m experiments.tiers --config=configs/tiers_mooncake_synthetic.py --workdir=/tmp/tiers_synthetic

Expected: the full run is not measured yet (long on a 2-core machine). Quick variant
(`:quick`: the first 600 requests, 200-block pools), measured: token hit rate 0.0015
device only -> 0.0048 +host -> 0.0104 +host+disk -> 0.0260 +host+disk+remote (0.0155
remote hits); never evicts 0.1132 (Belady's bound: see the rows). TTFT mean 275.8 / 275.1 / 275.2 / 272.9 ms.
~3 min wall on the shared machine.
"""

from configs import tiers


def get_config(arg=None):
    return tiers.mooncake_config("mooncake_synthetic", arg)
