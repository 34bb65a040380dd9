"""Sweep: token hit rate per GiB of KV, bf16 vs fp8 vs int8 pages (RAG workload).

experiments.sweep_capacity on the same `rag` workload as configs/sweep_capacity.py
(1000 requests, the first 500 warm the cache), with the cache sized in bytes of
Llama-3.2-1B KV instead of blocks: 8 budgets from 64 MiB to 8 GiB, each converted
per KV dtype (16-token blocks: bfloat16 512 KiB; float8_e4m3fn and int8 257 KiB,
their per-(page, kv head) f32 scales included; `prefixcache.kv_dtypes`).

Command:
  python -m experiments.sweep_capacity --config=configs/sweep_capacity_kv_dtypes.py \
      --workdir=/tmp/sweep_kv

Expected: at every budget fp8 and int8 hold 1.99x the blocks of bf16 (255 vs 128 at
64 MiB), so their hit rate at a budget is about bf16's at twice that budget. Cold:
bf16 0.246 (64 MiB; 61 prompts do not fit), 0.377, 0.437, 0.495, 0.551, 0.616,
0.650, 0.676 (8 GiB); fp8 = int8 0.376 (64 MiB), 0.436, 0.495, 0.551, 0.616, 0.650,
0.676 (4 GiB and 8 GiB).
results.jsonl: 48 lines (8 budgets x 3 dtypes x cold/warm); sweep_capacity_kv.png.
"""

from configs import sweep_capacity


def get_config():
    c = sweep_capacity.get_config()
    c.capacities = ()
    c.kv_bytes = "64MiB,128MiB,256MiB,512MiB,1GiB,2GiB,4GiB,8GiB"
    c.kv_dtype = "bfloat16,float8_e4m3fn,int8"
    c.model = "llama_3_2_1b"
    return c
