"""Multi-process JAX: the tiny model on one mesh spanning 2 CPU processes on localhost.

Runs experiments.launch_multiprocess: starts `num_processes` worker processes on
127.0.0.1 (each with `devices_per_process` simulated CPU devices; process 0 is the
JAX coordinator), builds one mesh over all their devices (tensor parallel over kv
heads, `ModelConfig.tiny(num_heads=16, num_kv_heads=8)` so 8 devices each hold one kv
head), serves `num_requests` prompts sharing a prefix, checks at every step that all
processes built identical inputs, then runs the same requests in ONE process on one
device and compares the greedy tokens.

Command:
  python -m experiments.launch_multiprocess --config=configs/launch_multiprocess.py \
      --workdir=/tmp/mp

Expected: `"tokens_identical": true`, `"inputs_identical": true`, 8 devices in the
mesh, 4 addressable per process; ~30-60 s on 2 cores (mostly compilation).
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.num_processes = 2
    c.devices_per_process = 4
    c.port = 0  # 0 -> a free port
    c.timeout_s = 150.0
    c.num_requests = 6
    c.prefix_len = 40
    c.max_tokens = 8
    c.num_blocks = 48
    c.block_size = 16
    c.seed = 0
    c.hash_seed = 0
    c.workdir = ""
    return c
