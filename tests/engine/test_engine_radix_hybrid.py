"""The radix index under a sliding-window model in the engine (``index="radix"`` with
``ModelConfig.tiny_hybrid()``: 4 layers S,S,F,S, window 16, block 8): tokens equal the
cache-off run, the later requests hit the shared prefix, and the scheduler's per-group
rows equal the manager's tables after every step; and eviction policies other than LRU
under a tight pool, on both indexes.
"""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache.engine import Engine, SamplingParams
from prefixcache.model import ModelConfig

BUCKETS = dict(token_buckets=(64,), seq_buckets=(4,), page_buckets=(16,))
COMMON = dict(num_blocks=96, block_size=8, seed=0, max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=128, index="radix", **BUCKETS)


def _run(engine, prompts, max_tokens):
    outs = []
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=max_tokens))
        while engine.has_unfinished_requests():
            outs += engine.step()
            sched, mgr = engine.scheduler, engine.kv_cache_manager
            for state in sched.running:
                assert sched.block_ids(state.request_id) == mgr.get_block_ids(state.request_id)
            mgr.check_invariants()
    return outs


def test_radix_index_tokens_identical_with_cache_on_and_off():
    config = ModelConfig.tiny_hybrid()
    cached = Engine(config, enable_caching=True, **COMMON)
    uncached = Engine(config, enable_caching=False, share_programs_with=cached, **COMMON)
    assert type(cached.kv_cache_manager.implementation).__name__ == "RadixHybridKVCacheManager"
    rng = np.random.default_rng(0)
    system = rng.integers(1, config.vocab_size, 40).tolist()
    prompts = [system + rng.integers(1, config.vocab_size, n).tolist() for n in (5, 9)]
    prompts.append(list(prompts[0]))  # an exact repeat: a hit up to the last token
    outs_c = _run(cached, prompts, 10)
    outs_u = _run(uncached, prompts, 10)
    assert all(o.error is None for o in outs_c + outs_u)
    assert [o.token_ids for o in outs_c] == [o.token_ids for o in outs_u]
    # The shared 40-token prefix hits (whole blocks; the sliding groups' last window
    # before the hit point cached), as with the hash index (test_engine_hybrid.py).
    assert [o.metrics.num_cached_tokens for o in outs_c] == [0, 40, 40]


MINMAX = {"normalization": "minmax", "alpha": 0.2}


@pytest.mark.parametrize("eviction,options,index", [
    ("marconi", MINMAX, "radix"),  # told each block's group
    ("queue_aware", None, "radix"),  # the tree's per-group waiting hooks
    ("marconi", MINMAX, "hash"),
    ("s3fifo", None, "hash"),
])
def test_policies_under_pressure_keep_tokens_identical(eviction, options, index):
    # Any online policy serves a sliding-window model in the engine, on both indexes.
    config = ModelConfig.tiny_hybrid()
    kw = {**COMMON, "num_blocks": 40, "index": index}
    cached = Engine(config, enable_caching=True, eviction=eviction,
                    manager_kwargs={"eviction_options": options} if options else None, **kw)
    uncached = Engine(config, enable_caching=False, share_programs_with=cached, **kw)
    impl = cached.kv_cache_manager.implementation
    assert impl.policy.name == eviction
    rng = np.random.default_rng(1)
    systems = [rng.integers(1, config.vocab_size, 32).tolist() for _ in range(3)]
    prompts = [systems[(i // 2) % 3] + rng.integers(1, config.vocab_size, 6 + i).tolist()
               for i in range(8)]
    outs_c = _run(cached, prompts, 6)
    outs_u = _run(uncached, prompts, 6)
    assert all(o.error is None for o in outs_c + outs_u)
    assert [o.token_ids for o in outs_c] == [o.token_ids for o in outs_u]
    assert cached.kv_cache_manager.num_evictions > 0  # (the pool was under pressure)
    assert sum(o.metrics.num_cached_tokens for o in outs_c) > 0
    if eviction == "marconi" and index == "radix":  # each block scored as its group's
        cached_ids = [b for b in range(40) if impl._owner[b] is not None]
        assert {impl._owner_group[b] for b in cached_ids} == {0, 1, 2, 3}  # (S, S, S, F)
        assert all(impl.policy.group[b] == impl._owner_group[b] for b in cached_ids)
        assert [m[0] for m in impl.policy._models] == ["attention"] * 4
        assert [m[1] for m in impl.policy._models] == [16, 16, 16, None]
