"""The learned eviction policy study of ``configs/learned_policy.py`` on the generated
`multi_turn` workload (300 six-turn conversations, seed 0): a trace where what Belady
knows -- which conversation has ended -- is in no feature a cache keeps.

Command:
  OPENBLAS_NUM_THREADS=1 python -m experiments.learned_policy \
      --config=configs/learned_policy_multi_turn.py --workdir=/tmp/lp_mt

Expected (held-out half, token hit rate; measured on a shared 2-core CPU): lru 0.661,
belady 0.738, tuned (tlru at its defaults, which order as lru) 0.661, learned 0.638
(training half: lru 0.768, learned 0.743): the model does not find what belady knows,
and loses to recency. Inference: 1519 us per eviction against lru's 15.8 us (0.31
rankings of ~3,310 candidates per eviction).
"""

from configs import _base
from configs import learned_policy


def get_config(arg=None):
    c = learned_policy.get_config(arg)
    c.workload = _base.requests_config("multi_turn").workload
    if _base.variant(arg):
        c.workload.kwargs.num_conversations = 80
    return c
