"""Errors a user meets first name the argument as the user spelled it.

One row per mistake: the call, the exception type and the words the message must hold.
Kernel limits belong to the Pallas backends only (the reference takes any head_dim and
page size); a KV array without its padding page, a Python int for an array, a dict for a
ScheduledSeq, "no" for a bool and a list for a dataset name are refused up front.
"""
import jax.numpy as jnp
import numpy as np
import pytest

import prefixcache_kernels as kernels
from prefixcache import KVCacheManager
from prefixcache.core import CacheConfig
from prefixcache.metadata import MetadataBuilder, ScheduledSeq
from prefixcache.sim import datasets
from prefixcache.sim.replay import replay

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 6, 4, 1, 16


def _step():
    """A one-sequence step of 3 tokens: (q, k, v, kv_pages, metadata, builder)."""
    builder = MetadataBuilder(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_seqs=4,
                              max_num_tokens=16, max_pages_per_seq=4)
    md = builder.build([ScheduledSeq([2], 0, [7, 8, 9])]).metadata
    T = md.positions.shape[0]
    q = jnp.ones((T, 2 * HEADS, HEAD_DIM), jnp.float32)
    k = jnp.ones((T, HEADS, HEAD_DIM), jnp.float32)
    kv_pages = jnp.zeros(builder.kv_pages_shape(HEADS, HEAD_DIM), jnp.float32)
    return q, k, kv_pages, md, builder


def _fused(**changes):
    q, k, kv_pages, md, _ = _step()
    args = dict(q=q, k=k, v=k, kv_pages=kv_pages, slot_mapping=md.slot_mapping,
                kv_lens=md.kv_lens, page_indices=md.page_indices, cu_q_lens=md.cu_q_lens,
                num_seqs=md.num_seqs)
    args.update(changes)
    return lambda: kernels.write_kv_and_attend(**args, sm_scale=0.25, num_blocks=NUM_BLOCKS,
                                               backend="reference")


def _no_padding_page():
    return jnp.zeros((NUM_BLOCKS, BLOCK_SIZE, 2 * HEADS, HEAD_DIM), jnp.float32)


def _config(**kw):
    return dict(page_size=16, head_dim=64, num_q_heads=4, num_kv_heads=2,
                q_dtype=jnp.float32, kv_dtype=jnp.float32, platform="cpu", **kw)


CASES = {
    # --- the kernels' arrays
    "fused: kv_pages without the padding page": (
        _fused(kv_pages=_no_padding_page()), ValueError,
        r"kv_pages has 6 pages .*num_blocks \+ 1 = 7"),
    "write_kv: kv_pages without the padding page": (
        lambda: kernels.write_kv(_no_padding_page(), jnp.ones((1, HEADS, HEAD_DIM)),
                                 jnp.ones((1, HEADS, HEAD_DIM)), jnp.zeros(1, jnp.int32),
                                 num_blocks=NUM_BLOCKS),
        ValueError, r"num_blocks \+ 1 = 7"),
    "fused: num_seqs as a Python int": (
        _fused(num_seqs=1), TypeError, r"num_seqs must be an array \(i32\[1\]"),
    "paged_attention: num_seqs as a Python int": (
        lambda: kernels.paged_attention(*(lambda q, k, kv, md, b: (
            q, kv, md.kv_lens, md.page_indices, md.cu_q_lens, 1))(*_step()), sm_scale=0.25),
        TypeError, "num_seqs must be an array"),
    "write_kv: slot_mapping as a list": (
        lambda: kernels.write_kv(_no_padding_page(), jnp.ones((1, HEADS, HEAD_DIM)),
                                 jnp.ones((1, HEADS, HEAD_DIM)), [0]),
        TypeError, "slot_mapping must be an array, got list"),
    "fused: kv_lens of floats": (
        _fused(kv_lens=np.zeros(4, np.float32)), ValueError, "kv_lens dtype must be int32"),
    "fused: q of rank 2": (
        _fused(q=jnp.ones((16, HEAD_DIM))), ValueError, r"q must be \[num_tokens"),
    "fused: integer k": (
        _fused(k=jnp.ones((16, HEADS, HEAD_DIM), jnp.int32)), ValueError,
        "k dtype must be floating"),
    # --- kernel limits belong to the Pallas backends
    "pallas_tpu: head_dim 16": (
        lambda: kernels.check_backend_config("pallas_tpu", interpret=True,
                                             **_config() | dict(head_dim=16)),
        ValueError, r"the Pallas tpu backend needs head_dim in \(64, 128, 256\), got 16"),
    "pallas_gpu: page_size 4": (
        lambda: kernels.check_backend_config("pallas_gpu", interpret=True,
                                             **_config() | dict(page_size=4)),
        ValueError, r"the Pallas gpu backend needs page_size in \[8, 128\], got 4"),
    "pallas_tpu kernel itself: head_dim 16": (
        lambda: kernels.ragged_paged_attention_tpu(
            *(lambda q, k, kv, md, b: (q, kv, md.kv_lens, md.page_indices, md.cu_q_lens,
                                       md.num_seqs))(*_step()), sm_scale=0.25, interpret=True),
        ValueError, "the Pallas tpu backend needs head_dim"),
    # --- the host-side builder
    "build: a dict for a ScheduledSeq": (
        lambda: _step()[4].build([dict(block_ids=[0], num_computed_tokens=0, token_ids=[1])]),
        TypeError, r"seqs\[0\] must be a ScheduledSeq.*got dict"),
    "check_kv_pages: no padding page": (
        lambda: _step()[4].check_kv_pages(np.zeros((NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_DIM))),
        ValueError, r"kv_pages has 6 pages but needs num_blocks \+ 1 = 7"),
    "from_manager: not a manager": (
        lambda: MetadataBuilder.from_manager("m", max_num_seqs=4, max_num_tokens=16),
        TypeError, "manager must be a KV cache manager"),
    "from_cache_config: pool in bytes only": (
        lambda: MetadataBuilder.from_cache_config(CacheConfig(kv_cache_bytes="1MiB"),
                                                  max_num_seqs=4, max_num_tokens=16),
        ValueError, r"cache_config.num_blocks is not set .*with_pool_blocks"),
    # --- bool options
    "KVCacheManager(enable_caching='no')": (
        lambda: KVCacheManager(8, 4, enable_caching="no"), TypeError,
        "enable_caching must be a bool"),
    "KVCacheManager(log_stats=1)": (
        lambda: KVCacheManager(8, 4, log_stats=1), TypeError, "log_stats must be a bool"),
    "KVCacheManager(enable_events='yes')": (
        lambda: KVCacheManager(8, 4, enable_events="yes"), TypeError,
        "enable_events must be a bool"),
    "CacheConfig(enable_caching='no')": (
        lambda: CacheConfig(num_blocks=8, enable_caching="no"), TypeError,
        "enable_caching must be a bool"),
    "replay(progress='no')": (
        lambda: replay([], num_blocks=8, block_size=4, progress="no"), TypeError,
        "progress must be a bool"),
    "replay(miss_reasons='no')": (
        lambda: replay([], num_blocks=8, block_size=4, miss_reasons="no"), TypeError,
        "miss_reasons must be a bool"),
    "replay(record_evictions=None)": (
        lambda: replay([], num_blocks=8, block_size=4, record_evictions=None), TypeError,
        "record_evictions must be a bool"),
    "replay(enable_caching='no')": (
        lambda: replay([], num_blocks=8, block_size=4, enable_caching="no"), TypeError,
        "enable_caching must be a bool"),
    # --- dataset names
    "datasets.get(a list)": (
        lambda: datasets.get(["mooncake_synthetic"]), TypeError,
        "dataset name must be a str .*got list"),
    "datasets.path_of(a list)": (
        lambda: datasets.path_of(["mooncake_synthetic"], download=False), TypeError,
        "dataset name must be a str"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_user_error(name):
    call, exc, match = CASES[name]
    with pytest.raises(exc, match=match):
        call()


def test_type_errors_are_value_errors_too():
    """Callers written against ValueError (run_cli, older code) still catch them."""
    for name, (call, exc, _) in CASES.items():
        if exc is TypeError:
            with pytest.raises(ValueError):
                call()


def test_builder_sizes_come_from_the_manager_or_the_config():
    m = KVCacheManager(num_blocks=10, block_size=4, max_model_len=30)
    b = MetadataBuilder.from_manager(m, max_num_seqs=2, max_num_tokens=16)
    assert (b.num_blocks, b.block_size, b.max_pages_per_seq, b.num_pages) == (10, 4, 8, 11)
    assert b.kv_pages_shape(2, 16) == (11, 4, 4, 16)
    b.check_kv_pages(np.zeros((11, 4, 4, 16)))  # the right shape passes
    c = MetadataBuilder.from_cache_config(CacheConfig(num_blocks=5, block_size=8),
                                          max_num_seqs=2, max_num_tokens=16)
    assert (c.num_blocks, c.block_size, c.max_pages_per_seq) == (5, 8, 5)
    assert kernels.check_backend_config("reference", **_config() | dict(
        head_dim=16, page_size=1)) == "reference"
