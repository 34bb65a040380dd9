"""Benchmark: block hashing throughput per algorithm (sha256, sha256_cbor, xxhash, xxhash_cbor).

Runs experiments.bench_hashing on the generated `shared_system_prompt` workload (500
requests, ~650k prompt tokens, 16-token blocks): the pure chain function
(`BlockHasher.hash_token_blocks`) and the per-request path (`Request.block_hashes`),
rounds interleaved over algorithms, medians of 5 rounds after 1 warm-up round. With
`compare_vllm` (default on) and the vLLM peer venv installed, vLLM 0.33's own
`--hash-only` benchmark runs on the same trace in the same invocation.

Command:
  python -m experiments.bench_hashing --config=configs/bench_hashing.py --workdir=/tmp/hash

Expected (dev machine, 2 shared cores): pure function sha256 ~14M, sha256_cbor ~9M,
xxhash ~16M, xxhash_cbor ~11M prompt tokens/s; the per-request path 5-15% lower;
vLLM 0.33's hash-only on the same trace 1.8-4.5M tokens/s, i.e. 3.1-4.8x (request
path) and 3.6-5.7x (pure). Timings swing 20-40% on a shared machine: compare the
per-round ratios (median_round_ratio_vs_sha256).
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
    # The peer harness inside this checkout (installer: experiments/peers/setup_vllm_env.sh).
    c.vllm_replay_script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))), "experiments", "peers", "vllm_replay.py")
    return c
