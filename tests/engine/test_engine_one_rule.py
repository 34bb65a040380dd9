"""The one int rule (``prefixcache._validate``: numpy integer scalars are ints, stored
as ``int``; bools and floats are not) in the model and engine constructors, as in the
managers and ``CacheConfig`` (tests/core/test_core_one_rule.py). On main
``ModelConfig`` and ``SamplingParams`` refused numpy ints that ``CacheConfig`` and
``Engine`` took, and ``make_kv_caches(num_blocks=True)`` built a 2-page cache.
"""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache._validate import ArgumentTypeError
from prefixcache.engine import Engine
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.model.config import ModelConfig
from prefixcache.model.step import make_kv_caches

DIMS = dict(vocab_size=32, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
            head_dim=8, mlp_dim=32)


def test_model_config_and_sampling_params():
    i64 = np.int64
    mc = ModelConfig(**{k: i64(v) for k, v in DIMS.items()}, sliding_window=i64(4))
    assert mc == ModelConfig(**DIMS, sliding_window=4) and type(mc.d_model) is int
    assert hash(mc) == hash(ModelConfig(**DIMS, sliding_window=4))
    for name in DIMS:
        with pytest.raises(ArgumentTypeError, match=f"{name} must be a positive int"):
            ModelConfig(**{**DIMS, name: True})
    sp = SamplingParams(max_tokens=i64(3), top_k=i64(2), seed=i64(5), stop_token_ids=(i64(1),))
    assert sp == SamplingParams(max_tokens=3, top_k=2, seed=5, stop_token_ids=(1,))
    assert type(sp.max_tokens) is int and type(sp.stop_token_ids[0]) is int
    for bad in (dict(max_tokens=True), dict(top_k=np.bool_(True)), dict(seed=1.0),
                dict(stop_token_ids=(True,)), dict(max_tokens=np.float64(3))):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_make_kv_caches_and_engine_sizes():
    mc = ModelConfig(**DIMS)
    a = make_kv_caches(mc, num_blocks=np.int64(3), block_size=np.int32(4))
    b = make_kv_caches(mc, num_pages=4, page_size=4)
    assert [x.shape for x in a] == [x.shape for x in b]
    for kw, name in ((dict(num_blocks=True, block_size=4), "num_blocks"),
                     (dict(num_blocks="3", block_size=4), "num_blocks"),
                     (dict(num_pages=4, page_size=True), "page_size"),
                     (dict(num_pages=4.0, page_size=4), "num_pages")):
        with pytest.raises(ValueError, match=name):
            make_kv_caches(mc, **kw)
    for kw, name in ((dict(num_blocks=True), "num_blocks"), (dict(block_size=4.0), "block_size"),
                     (dict(max_num_seqs=np.bool_(True)), "max_num_seqs")):
        with pytest.raises(ArgumentTypeError, match=f"{name} must be a positive int"):
            Engine(mc, **{"num_blocks": 8, "block_size": 4, **kw})
