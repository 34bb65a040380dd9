"""Latency by cached-prefix length: DES of Llama-3.1-8B on TPU v5e/v6e, H100, H200 + tiny model.

Runs experiments.latency_by_prefix. Simulated part: the generated `rag` workload
(1000 prompts of ~1-2k tokens: a 256-token system prompt + 2 of 200 documents drawn
by Zipf(1.1) popularity + a question; Poisson arrivals at 4 requests/s) through the
discrete-event simulation: 8192 blocks of 16 tokens, a token budget of 8192 per
step, roofline step times of Llama-3.1-8B (bf16) on one chip of each accelerator
(TPU v5e, with 16 GiB of HBM, cannot hold the 16 GB of weights: the cache size is
fixed here, not derived from HBM, so all four chips see the same hits). TTFT
percentiles per cached-prefix bin, plus the queue-free roofline curve for a
2048-token prompt. Measured part: the tiny model through the engine on this
machine, cold vs warm, for shared prefixes of 0..1024 tokens.

Command:
  python -m experiments.latency_by_prefix --config=configs/latency_by_prefix.py \
      --workdir=/tmp/latency

Expected: simulated token hit rate ~0.666 on every chip; TTFT p50 falls with the
cached prefix (H100: 24.8 ms with no hit, 20.7 ms for < 512 cached tokens, ~10 ms
for 512-1536, ~6.3 ms for >= 1536; TPU v5e: 125 -> 111 -> ~56 -> ~31 ms), tracking
the roofline curve; H200 ~ H100 (same FLOP/s) but lower for decode-heavy steps,
v6e ~1.6x H100, v5e ~5x. Measured (tiny model, dev CPU): cold TTFT grows with the
prompt (3 ms at 32 tokens, ~157 ms at 1056), warm stays ~3-11 ms (the cached
prefix is skipped); warm / cold ~0.07 at a 1024-token prefix.
"""

import ml_collections

from configs import _base


def get_config():
    c = _base.requests_config("rag")
    c.warmup_requests = 0  # 0: cold runs only; N: warm runs prefill the first N prompts
    c.model = "llama_3_1_8b"  # a prefixcache.sim.cost_model.ModelShape preset
    c.accelerators = ("tpu_v5e", "tpu_v6e", "h100", "h200")
    c.num_chips = 1
    c.flops_efficiency = 1.0  # 1.0 = the roofline bound
    c.bandwidth_efficiency = 1.0
    c.step_overhead_s = 0.0
    c.num_blocks = 8192  # 0: as many as fit in the HBM left after the weights
    c.block_size = 16
    c.hash_algo = "sha256"
    c.eviction = "lru"  # the simulated server's eviction policy (not belady: no future)
    c.max_num_batched_tokens = 8192
    c.max_num_seqs = 256
    c.arrival_rate = 4.0  # 0: the trace's timestamps; > 0: Poisson arrivals (req/s)
    c.prefix_edges = (0, 1, 512, 1024, 1536, 2048, 3072, 4096)
    c.curve_prompt_len = 2048

    c.measured = ml_collections.ConfigDict()
    c.measured.enable = True
    c.measured.prefix_lengths = (0, 128, 256, 512, 1024)
    c.measured.suffix_len = 32
    c.measured.repeats = 3
    c.measured.num_blocks = 256
    c.measured.block_size = 16
    c.measured.max_num_batched_tokens = 2048
    c.measured.max_tokens = 1
    return c
