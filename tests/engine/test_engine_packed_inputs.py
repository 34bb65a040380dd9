"""The model runner's packed transfer (one int32 buffer per step) against the plain path
(the `DeviceInputs` pytree moved as is): same arrays, same tokens, same logits."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from prefixcache.core import MultiModalFeature, Request
from prefixcache.engine import Engine, SamplingParams
from prefixcache.engine.model_runner import pack_inputs, unpack_inputs
from prefixcache.engine.sampler import SamplingArrays
from prefixcache.metadata import MetadataBuilder, ScheduledSeq
from prefixcache.model import ModelConfig

BS = 16
COMMON = dict(num_blocks=64, block_size=BS, seed=0, max_num_seqs=4,
              max_num_batched_tokens=128, max_model_len=256, token_buckets=(128,),
              seq_buckets=(4,), page_buckets=(16,))


def test_pack_round_trip_is_bit_exact():
    b = MetadataBuilder(block_size=BS, num_blocks=32, max_num_seqs=4, max_num_tokens=32,
                        max_pages_per_seq=8)
    step = b.build([ScheduledSeq([3, 4], 17, [5, 6, 7]), ScheduledSeq([9], 0, [1])])
    # Float fields with -0.0, a subnormal and a NaN; seeds above 2**31 (uint32).
    sampling = SamplingArrays.build(
        [(-0.0, 5, np.float32(1e-45), 2**32 - 1, 3), (float("nan"), 0, 0.5, 2**31, 0)], 4)
    packed, layout = pack_inputs(step, sampling)
    assert packed.dtype == np.int32 and packed.ndim == 1
    got = jax.jit(unpack_inputs, static_argnums=1)(packed, layout)
    want = jax.tree.leaves((step, sampling))
    got_leaves = jax.tree.leaves(got)
    assert jax.tree.structure(got) == jax.tree.structure((step, sampling))
    for a, g in zip(want, got_leaves):
        g = np.asarray(g)
        assert g.dtype == a.dtype and g.shape == a.shape
        assert g.tobytes() == a.tobytes()
    # An all-greedy step ships no sampling arrays.
    packed, layout = pack_inputs(step, None)
    assert packed.size == sum(a.size for a in jax.tree.leaves(step))
    got_step, none = jax.jit(unpack_inputs, static_argnums=1)(packed, layout)
    assert none is None
    for a, g in zip(jax.tree.leaves(step), jax.tree.leaves(got_step)):
        assert np.asarray(g).tobytes() == a.tobytes()


def test_pack_rejects_other_dtypes():
    b = MetadataBuilder(block_size=BS, num_blocks=32, max_num_seqs=4, max_num_tokens=32,
                        max_pages_per_seq=8)
    step = b.build([ScheduledSeq([3], 0, [5])])
    sampling = SamplingArrays.build([], 4)._replace(top_k=np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="4-byte"):
        pack_inputs(step, sampling)
    swapped = SamplingArrays.build([], 4)._replace(top_k=np.zeros(4, ">i4"))
    with pytest.raises(ValueError, match="native 4-byte"):
        pack_inputs(step, swapped)


def test_packed_and_plain_transfers_give_identical_steps():
    config = ModelConfig.tiny()
    packed = Engine(config, **COMMON)
    plain = Engine(config, share_programs_with=packed, **COMMON)
    plain.runner.pack_transfers = False
    packed.record_logits = plain.record_logits = True
    rng = np.random.default_rng(0)
    v = config.vocab_size
    shared = rng.integers(1, v, 40).tolist()
    emb = rng.normal(size=(6, config.d_model)).astype(np.float32)
    prompts, params, mms = [], [], []
    for i in range(4):
        prompts.append(shared + rng.integers(1, v, 5 + 7 * i).tolist())
        params.append(SamplingParams(max_tokens=6, temperature=0.8 if i % 2 else 0.0,
                                     top_k=20, top_p=0.9, seed=i))
        mms.append(None)
    # One multimodal request: its rows travel beside the packed buffer.
    prompts.append(Request("mm", rng.integers(1, v, 30).tolist(),
                           mm_features=(MultiModalFeature("img", 4, 6),)))
    params.append(SamplingParams(max_tokens=4))
    mms.append({"img": emb})
    outs = {}
    for name, eng in (("packed", packed), ("plain", plain)):
        ps = [Request(p.request_id, list(p.prompt_token_ids), mm_features=p.mm_features)
              if isinstance(p, Request) else p for p in prompts]
        # Twice: the second round hits the cached prefixes (mixed prefill rows).
        outs[name] = [eng.generate(ps[:4], params[:4]),
                      eng.generate([shared + [1, 2, 3]] + [ps[4]], [params[0], params[4]],
                                   mm_embeddings=[None, mms[4]])]
    for a, b in zip(outs["packed"], outs["plain"]):
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert [o.metrics.num_cached_tokens for o in a] == [
            o.metrics.num_cached_tokens for o in b]
    assert any(o.metrics.num_cached_tokens for o in outs["packed"][1])
    assert len(packed.step_logits) == len(plain.step_logits)
    for sa, sb in zip(packed.step_logits, plain.step_logits):
        assert sa.keys() == sb.keys()
        for rid in sa:
            assert sa[rid].tobytes() == sb[rid].tobytes(), rid
    assert packed.runner.compiled_shapes == plain.runner.compiled_shapes
