"""The engine runs the radix-tree index unchanged (``Engine(..., index="radix")``): same
greedy tokens and prefix hits as with the hash chain, with and without memory pressure
(preemption + eviction).
"""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache.core.radix import RadixKVCacheManager
from prefixcache.engine import Engine, SamplingParams
from prefixcache.model import ModelConfig

BS = 16
COMMON = dict(block_size=BS, seed=0, max_num_seqs=8, max_num_batched_tokens=256,
              max_model_len=1024, token_buckets=(256,), seq_buckets=(8,), page_buckets=(64,))


def radix_engine(config, **kw) -> Engine:
    return Engine(config, enable_caching=True, index="radix", **kw)


@pytest.fixture(scope="module")
def config():
    return ModelConfig.tiny()


@pytest.fixture(scope="module")
def chain(config):
    return Engine(config, enable_caching=True, num_blocks=128, **COMMON)


@pytest.mark.parametrize("num_blocks", [128, 14])
def test_radix_engine_matches_the_chain(config, chain, num_blocks):
    rng = np.random.default_rng(7)
    v = config.vocab_size
    system = rng.integers(1, v, 40).tolist()
    prompts = [system + rng.integers(1, v, int(n)).tolist() for n in rng.integers(5, 40, 8)]
    prompts.append(list(system[:32]))  # block-aligned: its last block is a duplicate
    params = SamplingParams(max_tokens=24)
    ref_engine = chain
    if num_blocks != 128:
        ref_engine = Engine(config, enable_caching=True, share_programs_with=chain,
                            num_blocks=num_blocks, **COMMON)
    tree_engine = radix_engine(config, share_programs_with=chain, num_blocks=num_blocks,
                               **COMMON)
    ref = ref_engine.generate(prompts, params)
    got = tree_engine.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.error for o in got] == [None] * len(prompts)
    assert [o.metrics.num_cached_tokens for o in got] == [
        o.metrics.num_cached_tokens for o in ref
    ]
    tree = tree_engine.kv_cache_manager
    assert isinstance(tree.implementation, RadixKVCacheManager)
    tree.check_invariants()
    assert tree.num_free_blocks == num_blocks and tree.num_stranded_blocks() == 0
    if num_blocks == 14:
        m = tree_engine.metrics()
        assert m.num_preemptions > 0 and m.num_evictions > 0, m
    else:
        assert sum(o.metrics.num_cached_tokens for o in got) > 0
