"""Benchmark: block hashing throughput per algorithm (sha256, sha256_cbor, xxhash, xxhash_cbor).

Runs experiments.bench_hashing on the generated `shared_system_prompt` workload (500
requests, ~650k prompt tokens, 16-token blocks): the pure chain function
(`BlockHasher.hash_token_blocks`) and the per-request path (`Request.block_hashes`),
rounds interleaved over algorithms, medians of 5 rounds after 1 warm-up round. With
`compare_vllm` (default on) and the vLLM peer venv installed, vLLM 0.33's own
`--hash-only` benchmark runs on the same trace in the same invocation.

Command:
  python -m experiments.bench_hashing --config=configs/bench_hashing.py --workdir=/tmp/hash

Expected: ~1-3M prompt tokens/s per algorithm on one CPU core of the dev
machine (pure function: sha256 ~2.5M, sha256_cbor ~2.4M, xxhash ~3.0M, xxhash_cbor
~3.2M; the per-request path somewhat lower), xxhash_cbor the fastest; against
vLLM's hash-only benchmark on the same trace, 1.5x (pickle variants) to 2.4x (CBOR
variants) for the pure function. Timings swing 20-40% on a shared machine: compare
the per-round ratios.
"""

import os

from configs import _base


def get_config():
    c = _base.requests_config("shared_system_prompt", num_requests=500)
    c.algos = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
    c.modes = ("pure", "request")
    c.block_size = 16
    c.hash_seed = "0"  # a fixed root for every algorithm (xxhash's default is random)
    c.repeats = 5
    c.warmup = 1
    c.compare_vllm = True
    c.vllm_python = os.path.expanduser("~/.cache/prefixcache-peers/vllm-venv/bin/python")
    c.vllm_replay_script = "/work/shared/peers/vllm_replay.py"
    return c
