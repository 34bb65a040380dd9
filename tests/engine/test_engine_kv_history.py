"""Prefix caching never changes the output, at every KV dtype, when chunk boundaries
fall inside pages (issue 25).

Block size 8 and a token budget of 12 end prefill chunks mid-page, so with the cache
off a page is written in two calls where with the cache on (the prefix hit moves the
chunk boundaries) it is written in one. Before issue 25 an int8 page's bytes depended
on that split (each requantization rounded again: amax/127 scales, round to nearest),
and greedy tokens differed cache on vs off on this workload; fp8 differed in its
subnormals. `kernels.quant` now makes a page's bytes a function of its final contents.
"""
from __future__ import annotations

import numpy as np
import pytest

from prefixcache.engine import Engine, SamplingParams
from prefixcache.kv_dtypes import KV_DTYPES
from prefixcache.model import ModelConfig

BS = 8
COMMON = dict(num_blocks=96, block_size=BS, seed=0, max_num_seqs=4,
              max_num_batched_tokens=12, max_model_len=160, token_buckets=(12,),
              seq_buckets=(4,), page_buckets=(20,))


def _workload(engine, vocab):
    """Shared-prefix multi-turn chat: 3 conversations of 2-3 turns over one system
    prompt (7 requests); returns every request's greedy tokens and cached counts."""
    rng = np.random.default_rng(5)
    system = rng.integers(1, vocab, 21).tolist()
    greedy = SamplingParams(max_tokens=9)
    tokens, cached = [], []
    for conv in range(3):
        history = system + rng.integers(1, vocab, 3 + 2 * conv).tolist()
        for _ in range(2 if conv else 3):
            out = engine.generate([history], [greedy])[0]
            tokens.append(out.token_ids)
            cached.append(out.metrics.num_cached_tokens)
            history = history + out.token_ids + rng.integers(1, vocab, 5).tolist()
    return tokens, cached


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_greedy_tokens_identical_cache_on_off_with_chunks_ending_inside_pages(kv_dtype):
    config = ModelConfig.tiny()
    on = Engine(config, enable_caching=True, kv_dtype=kv_dtype, **COMMON)
    off = Engine(config, enable_caching=False, kv_dtype=kv_dtype, share_programs_with=on,
                 **COMMON)
    on_tokens, on_cached = _workload(on, config.vocab_size)
    off_tokens, off_cached = _workload(off, config.vocab_size)
    assert sum(on_cached) > 0 and sum(off_cached) == 0
    # The hits move chunk boundaries relative to pages (hits are whole blocks; the
    # budget of 12 is not a multiple of 8): the pages really are written differently.
    assert any(c % 12 for c in on_cached if c)
    assert on_tokens == off_tokens
