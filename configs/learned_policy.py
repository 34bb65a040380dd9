"""A learned eviction policy (an MLP imitating Belady, trained with optax) on the
generated `multi_turn` workload: trained on the first half, evaluated on the other.

Runs experiments.learned_policy: 300 six-turn conversations (seed 0), 16-token blocks,
a pool of 10% of the blocks the training half would need never to evict, 8 requests
running at once; the training half replayed under belady records 3000 eviction
decisions (64 candidates each at most); a 6-32-32-1 MLP is fit for 1500 adam steps.

Command:
  python -m experiments.learned_policy --config=configs/learned_policy.py --workdir=/tmp/lp
  python -m experiments.learned_policy --config=configs/learned_policy.py:quick --workdir=/tmp/lp_quick

Expected: see EXPECTED below (held-out token hit rates; the learned policy between lru
and belady).
"""

from configs import _base

# Measured with the commands above (CPU):
EXPECTED = "filled in below"


def get_config(arg=None):
    quick = _base.variant(arg)
    c = _base.requests_config("multi_turn")
    c.block_size = 16
    c.hash_algo = "sha256"
    c.concurrency = 8
    c.train_fraction = 0.5
    c.capacity_fraction = 0.1
    c.max_decisions = 3000
    c.max_candidates = 64
    c.record_under = "lru"  # the recorded cache evolves as lru's ("belady": as belady's)
    c.hidden = (32, 32)
    c.steps = 1500
    c.batch_size = 256
    c.learning_rate = 3e-3
    # the tuned policy: the best of these on the training half
    c.tuned_policies = ("lru", "fifo", "lfu", "slru", "arc", "s3fifo", "tlru")
    if quick:
        c.workload.kwargs.num_conversations = 80
        c.max_decisions = 800
        c.steps = 300
    return c
