"""Why bf16 is slower than f32 on CPU: one LM-head-sized matrix-vector product in each.

Command:
  python -m experiments.bench_bf16_matvec --config=configs/bench_bf16_matvec.py \
      --workdir=/tmp/bench_bf16_matvec

Times `x @ W.T` (W [rows, cols], x [1, cols], f32 accumulation as the model's LM head)
jitted in float32 and in bfloat16, side by side in one run, as wall and CPU milliseconds
and weight bytes read per second, and reports whether XLA's compiled program converts the
whole bf16 matrix to a float32 temporary before the dot.

Expected on a CPU without native bf16 dot instructions (AVX2; no AVX512_BF16 / AMX):
bf16 several times slower than f32, and `converts_weights_to_f32` true (every step
reads the bf16 weights, writes them out as f32, then reads that copy: more traffic than
the f32 model, plus an elementwise conversion pass).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = ""  # set with --workdir (required)
    c.rows = 49152  # SmolLM2's vocabulary
    c.cols = 576  # SmolLM2's d_model
    c.calls = 10  # calls per timed run
    c.repeats = 5  # timed runs (the fastest is reported)
    return c
