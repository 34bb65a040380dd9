"""Prompt layout: a shared system prompt before vs after each request's own text.

Runs experiments.layout on the `shared_system_prompt` workload (2000 requests: one
1024-token system prompt + a unique 64-512-token part each; see configs/_base.py),
generated twice with the same tokens -- system prompt first (`stable_first`) and
last (`stable_last`) -- and replays both through 4096 blocks of 16 tokens, 8
requests at once. Simulated TTFT: Llama-3.1-8B's roofline prefill of each request's
uncached tokens on one H100 (no queueing).

Command:
  python -m experiments.layout --config=configs/layout.py --workdir=/tmp/layout
  # the few-shot variant: configs/layout_few_shot.py

Expected: stable_first reuses 2,046,976 of 2,620,378 prompt tokens (hit rate 0.781:
every request after the first hits the whole 1024-token system prompt), stable_last
none (0.000: the shared tokens never start a prompt). Simulated TTFT mean / p50 / p90:
5.21 / 4.54 / 6.86 ms (stable first) against 18.94 / 18.89 / 21.58 ms (stable last),
3.6x the mean. 0 failed; evictions 35,729 (stable first: the unique parts cycle through
the 4096 blocks) and 163,665 (stable last: nothing is ever reused). Short enough to be
its own quick config (tests/experiments/test_exp_quick_configs.py checks these numbers).
"""

from configs import _base


def get_config():
    c = _base.requests_config("shared_system_prompt")
    c.num_blocks = 4096
    c.block_size = 16
    c.concurrency = 8
    c.hash_algo = "sha256"
    c.hash_seed = ""  # "" -> the algorithm's default root
    c.free_order = "unhashed_first"  # vLLM's
    c.model = "llama_3_1_8b"  # a prefixcache.sim.cost_model preset
    c.accelerator = "h100"
    c.num_chips = 1
    return c
