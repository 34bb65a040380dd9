"""Latency by cached-prefix length at scale: the Mooncake conversation trace through the DES.

Runs experiments.latency_by_prefix on the first 3,000 requests (~36M prompt tokens,
the first ~15 minutes) of the real Mooncake FAST'25 conversation trace (dataset
`mooncake_conversation`, downloaded once and checksum verified; 12,031
requests, ~12k input tokens, real arrival times over one hour; hash_ids expanded
into token blocks) with Llama-3.1-8B (bf16) on an 8-chip TPU v6e, H100 and
H200 instance (peak FLOP/s, bandwidth and HBM x 8, communication not modelled: the
trace was served by a cluster, one chip would be overloaded): the KV cache gets all
HBM left after the weights (90% utilisation), 16-token blocks, an 8192-token step
budget. Simulated only (no engine run). The trace is streamed once per accelerator.

Command:
  python -m experiments.latency_by_prefix --config=configs/latency_by_prefix_mooncake.py \
      --workdir=/tmp/latency_mooncake
  # the whole trace:
  python -m experiments.latency_by_prefix --config=configs/latency_by_prefix_mooncake.py \
      --workdir=/tmp/lm --config.max_requests=0

Expected: the hit rate is capacity bound: 0.070 on v6e (110k blocks = 1.8M
tokens of KV), 0.183 on H100 (267k blocks), 0.251 on H200 (476k blocks), against
0.320 for these 3,000 requests with an infinite cache at 512-token blocks
(experiments.replay --config=configs/replay_mooncake_conversation.py
--max_requests=3000). TTFT p50 / p99: v6e 153 / 1169 ms, H100 122 / 1004 ms, H200
109 / 976 ms; requests whose cached prefix exceeds 4k tokens see p50 ~90-100 ms on
H100/H200 against ~112-124 ms for < 2k (queueing behind 12k-token prefills
dominates both). No preemptions, no failures. Quick variant (`:quick`: the first 200 requests, H100
only): 3.0 s wall on the shared 2-core dev machine (load average ~6).
"""

from configs import _base
from configs import latency_by_prefix


def get_config(arg=None):
    quick = _base.variant(arg)
    c = latency_by_prefix.get_config()
    src = _base.requests_config("shared_system_prompt", dataset="mooncake_conversation")
    for key in ("trace", "dataset", "workload"):
        c[key] = src[key]
    c.max_requests = 3000
    c.accelerators = ("tpu_v6e", "h100", "h200")
    c.num_chips = 8
    c.num_blocks = 0  # all HBM left after the weights
    c.arrival_rate = 0.0  # the trace's real timestamps
    c.prefix_edges = (0, 1, 2048, 4096, 8192, 16384, 32768, 131072)
    c.curve_prompt_len = 16384
    c.measured.enable = False
    if quick:  # the first 200 requests, one accelerator
        c.max_requests = 200
        c.accelerators = ("h100",)
    return c
