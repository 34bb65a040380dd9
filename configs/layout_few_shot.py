"""Prompt layout on few-shot prompts: the header before vs after the question.

Runs experiments.layout on the `few_shot` workload (10 few-shot headers of 3000
tokens x 200 questions of 30-80 tokens, shuffled; see configs/_base.py), generated
twice with the same tokens -- header first (`stable_first`) and question first
(`stable_last`) -- through 4096 blocks of 16 tokens (65,536 tokens: room for all 10
headers), 8 requests at once. Simulated TTFT: Llama-3.1-8B's roofline prefill of the
uncached tokens on one H100 (no queueing).

Command:
  python -m experiments.layout --config=configs/layout_few_shot.py --workdir=/tmp/layout_fs

Expected: header first reuses 5,954,080 of 6,109,119 prompt tokens (hit rate 0.975:
all but the first request of each header hit its 2,992 full-block tokens), question
first none (0.000). Simulated TTFT mean / p50 / p90: 4.81 / 4.60 / 4.60 ms against
45.57 / 45.56 / 45.89 ms (9.5x the mean). ~5 s.
"""

from configs import _base, layout


def get_config():
    c = layout.get_config()
    src = _base.requests_config("few_shot")
    c.workload = src.workload
    return c
