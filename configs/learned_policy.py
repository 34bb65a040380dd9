"""A learned eviction policy (an MLP imitating Belady, trained with optax) on the
generated `rag` workload: trained on the first half of the trace, evaluated on the
held-out second half beside lru, belady and the best registered policy.

Runs experiments.learned_policy: 1000 RAG requests (a 256-token system prompt + 2 of 200
documents drawn by Zipf(1.1) popularity + a question; seed 0), 16-token blocks, a pool
of 10% of the blocks the training half would need never to evict, 8 requests running
at once. The training half replayed under belady records 3000 eviction decisions (64
candidates each at most); a 32-32 MLP reads recency, frequency, time since the last
hit and age (depth and tokens saved are left out: with them the model learns the
training half's depth distribution and loses held-out hits -- 0.623 against 0.636 on
this trace, and 0.46 against 0.66 on multi_turn) and is fit for 1500 adam steps.

Command:
  OPENBLAS_NUM_THREADS=1 python -m experiments.learned_policy \
      --config=configs/learned_policy.py --workdir=/tmp/lp
  OPENBLAS_NUM_THREADS=1 python -m experiments.learned_policy \
      --config=configs/learned_policy.py:quick --workdir=/tmp/lp_quick

Expected: EXPECTED below (held-out token hit rates, CPU).
"""

from configs import _base

EXPECTED = "measured below"

# The features the model reads by default (a subset of learned.FEATURES; see above).
DEFAULT_FEATURES = ("recency", "frequency", "since_hit", "age")


def get_config(arg=None):
    quick = _base.variant(arg)
    c = _base.requests_config("rag")
    c.block_size = 16
    c.hash_algo = "sha256"
    c.concurrency = 8
    c.train_fraction = 0.5
    c.capacity_fraction = 0.1
    c.max_decisions = 3000
    c.max_candidates = 64
    c.record_under = "belady"  # the recorded cache evolves as belady's ("lru": as lru's)
    c.hidden = (32, 32)
    c.features = DEFAULT_FEATURES
    c.steps = 1500
    c.batch_size = 256
    c.learning_rate = 3e-3
    # the tuned policy: the best of these on the training half
    c.tuned_policies = ("lru", "fifo", "lfu", "slru", "arc", "s3fifo", "tlru")
    if quick:  # 400 requests, 800 decisions, 300 steps
        c.workload.kwargs.num_requests = 400
        c.max_decisions = 800
        c.steps = 300
    return c
