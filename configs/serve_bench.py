"""Serving benchmark: engine + tiny model on a shared-system-prompt workload, caching off vs on.

Runs experiments.serve_bench: 48 requests (a 512-token system prompt shared by all +
16..64 unique tokens, vocabulary of the tiny model), served 8 at a time through
`prefixcache.engine.Engine` (512 blocks of 16 tokens, up to 8 running, 1024-token
step budget, at most 8 output tokens each), three passes: caching off, on with a
cold cache, on again with the warm cache. Every step shape is compiled in an untimed
pass first.

Command:
  python -m experiments.serve_bench --config=configs/serve_bench.py --workdir=/tmp/serve

Expected: greedy outputs identical in all three passes
(outputs_identical_to_off); token hit rate 0 (off), ~0.91 (on, cold: the system
prompt is computed once) and ~0.98 (on, warm); wall time and TTFT p50 fall with
caching (dev CPU: 6.3 s -> 2.6 s -> 1.35 s, TTFT p50 628 -> 213 -> 61 ms);
no new programs compiled in the timed passes after the compile pass.

Host tier: --config.num_host_blocks=N (e.g. with --config.num_blocks=64, far below the
working set) gives the caching engines N host pages; the summary rows then show the
hits by tier and the bytes moved (device_hit_tokens, host_hit_tokens,
host_blocks_loaded/stored, host_bytes_loaded/stored, host_pool_bytes); the caching-off
engine has no cache and no tier.

KV byte budget and dtype (issue 17): --config.kv_cache_bytes=BUDGET (e.g. "2MiB"; then
--config.num_blocks=0) sizes the pool in bytes for --config.kv_dtype ("" = the model's
float32; bfloat16, float8_e4m3fn, int8), the engine's padding page counted; the summary
rows carry kv_dtype, kv_bytes_per_block, num_blocks, kv_pool_bytes, kv_cache_bytes.
fp8 vs bf16 at one budget (the tiny model: 2 layers x 2 kv heads x 64; a bf16 block of
16 tokens is 16 KiB, an fp8 one 8 KiB + 32 B of scales):
  python -m experiments.serve_bench --workdir=/tmp/serve_bf16 --config.num_blocks=0 \
      --config.kv_cache_bytes=2MiB --config.kv_dtype=bfloat16
  python -m experiments.serve_bench --workdir=/tmp/serve_fp8 --config.num_blocks=0 \
      --config.kv_cache_bytes=2MiB --config.kv_dtype=float8_e4m3fn
Expected (dev CPU): 127 bf16 vs 254 fp8 blocks; token hit rate on_cold 0.906 both,
on_warm 0.925 (bf16) vs 0.983 (fp8: nearly all of it stays cached); outputs identical
to off at each dtype. At 1MiB (63 vs 126 blocks) both reach 0.925 warm, bf16 with a
preemption and twice the evictions.

Fault injection (reproducing a failed model step): --config.inject=step:N[:point][:kind]
fails the N-th model step of the timed on_cold pass (see prefixcache.engine.faults),
e.g. `--config.inject=step:5:before_device:kv_lost`. Expected then: the requests of
that step finish with an error (on_cold `errors` > 0, their rows carry it), every
other request's tokens equal the off pass (outputs_identical_to_off_where_ok), and
the on_warm pass, on the same engine, runs clean.
"""

from configs import _base


def get_config():
    c = _base.requests_config("shared_system_prompt", num_requests=48, system_len=512,
                              unique_len=(16, 64), output_len=(4, 16), vocab=512)
    c.num_blocks = 512  # 0 with kv_cache_bytes
    c.kv_cache_bytes = ""  # "" = sized by num_blocks; else a budget ("2MiB", bytes)
    c.kv_dtype = ""  # "" = the model's dtype; else one of prefixcache.kv_dtypes.KV_DTYPES
    c.block_size = 16
    c.hash_algo = "sha256"
    c.eviction = "lru"  # prefixcache.core.eviction.POLICIES (not belady: online)
    c.max_num_seqs = 8
    c.max_num_batched_tokens = 1024
    c.batch_size = 8
    c.max_tokens = 8
    # Host-memory tier (issue 16): blocks; 0 = off. On: the summary rows add the engine's
    # device_hit_tokens, host_hit_tokens, host_blocks_loaded, host_bytes_loaded, ...
    c.num_host_blocks = 0
    c.host_eviction = "lru"
    c.inject = ""  # "" = no fault; else a prefixcache.engine.faults.parse_fault spec
    return c
