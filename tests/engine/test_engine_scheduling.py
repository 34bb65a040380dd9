"""The engine under every waiting-queue policy: greedy tokens never change.

Scheduling policies only reorder admissions, so every request's greedy tokens must be
the same under fcfs / lpm / dfs_weight, with the cache on and off.
"""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache.engine import Engine, SamplingParams
from prefixcache.model import ModelConfig
from prefixcache.scheduling import scheduling_policy_names

BUCKETS = dict(token_buckets=(128,), seq_buckets=(4,), page_buckets=(32,))
COMMON = dict(num_blocks=40, block_size=16, seed=0, max_num_seqs=4,
              max_num_batched_tokens=128, max_model_len=512, **BUCKETS)


def _prompts(vocab):
    rng = np.random.default_rng(5)
    tenants = [rng.integers(1, vocab, 96).tolist() for _ in range(3)]
    # Tenants interleave in arrival order; the pool (40 blocks) holds about two
    # tenants' prefixes plus the running requests.
    return [tenants[i % 3] + rng.integers(1, vocab, 8 + i).tolist() for i in range(12)]


def test_greedy_tokens_identical_under_every_policy_cache_on_and_off():
    config = ModelConfig.tiny()
    base = Engine(config, enable_caching=False, **COMMON)
    prompts = _prompts(config.vocab_size)
    params = SamplingParams(max_tokens=6)
    want = [o.token_ids for o in base.generate(prompts, params)]
    cached = {}
    for policy in scheduling_policy_names():
        for caching in (True, False):
            e = Engine(config, enable_caching=caching, scheduling_policy=policy,
                       share_programs_with=base, **COMMON)
            outs = e.generate(prompts, params)
            assert [o.error for o in outs] == [None] * len(prompts)
            assert [o.token_ids for o in outs] == want, (policy, caching)
            e.kv_cache_manager.check_invariants()
            assert e.kv_cache_manager.num_free_blocks == COMMON["num_blocks"]
            if caching:
                cached[policy] = sum(o.metrics.num_cached_tokens for o in outs)
    # Every policy reuses prefixes here (the figures are reported in WORKSPACE_NOTES).
    assert all(v > 0 for v in cached.values()), cached


def test_unknown_policy_is_rejected_before_anything_is_built():
    with pytest.raises(ValueError, match="unknown scheduling policy 'sjf'"):
        Engine(ModelConfig.tiny(), num_blocks=8, scheduling_policy="sjf")
