"""Accuracy (vs a float64 oracle) and KV bytes per token of each KV dtype, on CPU.

Command:
  python -m experiments.kv_quant --config=configs/kv_quant.py --workdir=/tmp/kv_quant

Expected (reference backend, CPU; rel_error = max |out - ref| / max |ref| per case):
float32 1.6e-7..2.7e-7, bfloat16 2.6e-3..2.8e-3, int8 0.9e-2..1.3e-2 written at once
and up to 2.2e-2 written token by token (each scale rise rounds once more),
float8_e4m3fn 4.0e-2..4.9e-2 both ways (power-of-two scales: token-by-token pages are
the same bytes). Bytes per cached token, 16-token blocks: tiny 2048 (f32) / 1024
(bf16) / 514 (fp8, int8); Llama-3.2-1B 65536 / 32768 / 16448 / 16448.
results.jsonl: 24 accuracy rows + 8 bytes rows.
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.workdir = ""
    c.seed = 0
    c.kv_dtypes = "float32,bfloat16,int8,float8_e4m3fn"
    c.cases = "decode,prefill,chunk_over_prefix"
    c.backend = "reference"  # or pallas_tpu / pallas_gpu with interpret=True on CPU
    c.interpret = False
    c.block_size = 16
    c.models = "tiny,llama_3_2_1b"
    return c
