"""Tensor parallelism over kv heads on 8 simulated CPU devices == one device: the default
scanned step (stacked KV) on a mesh against the unrolled step on one device; the unrolled
step on a mesh too."""
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from prefixcache.metadata import MetadataBuilder, ScheduledSeq
from prefixcache.model import ModelConfig, Transformer, make_kv_caches, make_step_fn, shard_model

BS = 8
NUM_BLOCKS = 16


def run_steps(config, mesh, *, scan=True):
    model = Transformer(config, rngs=nnx.Rngs(0))  # same seed: same weights
    b = MetadataBuilder(block_size=BS, num_blocks=NUM_BLOCKS, max_num_seqs=4,
                        max_num_tokens=32, max_pages_per_seq=4, token_buckets=[32],
                        seq_buckets=[4], page_buckets=[4])
    rng = np.random.default_rng(0)
    a = rng.integers(0, config.vocab_size, 20).tolist()
    c = a[:8] + rng.integers(0, config.vocab_size, 6).tolist()
    kv = make_kv_caches(config, num_blocks=NUM_BLOCKS, block_size=BS, mesh=mesh, stacked=scan)
    step = make_step_fn(model, mesh=mesh, scan_layers=scan)
    out = []
    for batch in (
        [ScheduledSeq([0, 1, 2], 0, a[:17])],
        [ScheduledSeq([0, 1, 2], 17, a[17:18]), ScheduledSeq([0, 3], 8, c[8:14])],
    ):
        si = b.build(batch)
        md = si.metadata
        if len(config.kv_groups) > 1:  # the groups share KV arrays: disjoint block ids
            md = tuple(b.build([s._replace(block_ids=[x + 4 * g for x in s.block_ids])
                                for s in batch]).metadata
                       for g in range(len(config.kv_groups)))
        logits, kv = step(kv, si.input_ids, md, si.logits_indices)
        out.append(np.asarray(logits)[: len(batch)])
    return out, [np.asarray(k) for k in kv], kv  # (stacked: one row per array)


_KV8 = ModelConfig.tiny(num_heads=8, num_kv_heads=8, d_model=64, mlp_dim=128, num_layers=1,
                        vocab_size=256)
# a local (window 8 < the 17-token prompt) + a global layer: the window reaches the
# kernels under shard_map.
_HYBRID = ModelConfig.tiny(num_layers=2, sliding_window=8,
                           layer_types=("sliding_attention", "full_attention"))


@pytest.mark.parametrize(
    "config, mesh_shape, axes, scan",
    [
        # 8 kv heads over an 8-way "model" axis: one kv head (one K/V pair) per device.
        (_KV8, (8,), ("model",), True),
        # tiny (2 kv heads, GQA 2) on a 4 x 2 mesh: replicated over "data".
        (ModelConfig.tiny(num_layers=1), (4, 2), ("data", "model"), True),
        (_HYBRID, (4, 2), ("data", "model"), True),
        (_HYBRID, (4, 2), ("data", "model"), False),  # the unrolled step on a mesh
    ],
    ids=["kv8-model8", "tiny-data4xmodel2", "hybrid-data4xmodel2", "hybrid-unrolled"],
)
def test_sharded_step_equals_single_device(config, mesh_shape, axes, scan):
    devices = np.array(jax.devices()[:8]).reshape(mesh_shape)
    mesh = Mesh(devices, axes)
    want_logits, want_kv, _ = run_steps(config, None, scan=False)
    got_logits, got_kv, kv_arrays = run_steps(config, mesh, scan=scan)
    assert len(got_kv) == len(want_kv) == config.kv_group_size
    for w, g in zip(want_logits, got_logits):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    for w, g in zip(want_kv, got_kv):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    m = mesh.shape["model"]
    # The cache really is split over kv heads (K/V pairs together), not replicated.
    shard = (kv_arrays if scan else kv_arrays[0]).addressable_shards[0].data
    assert shard.shape[-2] == 2 * config.num_kv_heads // m


def test_mesh_errors():
    devices = np.array(jax.devices()[:8])
    config = ModelConfig.tiny()  # 2 kv heads
    model = Transformer(config, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"num_kv_heads \(2\) is not divisible .* 4"):
        shard_model(model, Mesh(devices[:4], ("model",)))
    with pytest.raises(ValueError, match="lack the 'model' axis"):
        make_step_fn(model, mesh=Mesh(devices[:2], ("tp",)))
    with pytest.raises(ValueError, match="num_kv_heads"):
        make_kv_caches(config, num_blocks=4, block_size=8, mesh=Mesh(devices, ("model",)))
