"""The radix index under a sliding-window model in the engine (``index="radix"`` with
``ModelConfig.tiny_hybrid()``: 4 layers S,S,F,S, window 16, block 8): tokens equal the
cache-off run, the later requests hit the shared prefix, and the scheduler's per-group
rows equal the manager's tables after every step.
"""

from __future__ import annotations

import numpy as np

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
