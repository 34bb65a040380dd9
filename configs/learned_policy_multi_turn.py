"""The learned eviction policy study of ``configs/learned_policy.py`` on the generated
`multi_turn` workload (300 six-turn conversations, seed 0): a trace where what Belady
knows -- which conversation has ended -- is in no feature a cache keeps.

Command:
  OPENBLAS_NUM_THREADS=1 python -m experiments.learned_policy \
      --config=configs/learned_policy_multi_turn.py --workdir=/tmp/lp_mt

Expected: EXPECTED below (held-out token hit rates, CPU).
"""

from configs import _base
from configs import learned_policy

EXPECTED = "measured below"


def get_config(arg=None):
    c = learned_policy.get_config(arg)
    c.workload = _base.requests_config("multi_turn").workload
    if _base.variant(arg):
        c.workload.kwargs.num_conversations = 80
    return c
