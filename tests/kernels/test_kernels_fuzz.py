"""Fuzzing MetadataBuilder + write_kv + every attention backend (issue 13, item 5).

Hypothesis draws ragged batches: the number of sequences, each one's cached prefix and
scheduled length (decode, fresh prefill, chunk over a prefix, in any caller order),
a random permutation of the pool's pages, extra trailing block ids, and the shape
buckets' padding. The host builds the index arrays, `write_kv` stores the step's new
K/V through `slot_mapping`, and each backend (reference; Pallas TPU and GPU in
interpret mode) must match the float64 oracle -- with NaN in every page, slot and
padding token that no live query may read.

Shapes are fixed by one bucket each, so each backend compiles once per page size.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

import prefixcache_kernels as kernels
from kernel_cases import Case, oracle, tolerance
from prefixcache.metadata import MetadataBuilder, ScheduledSeq

HEAD_DIM = 64
NUM_KV_HEADS, GROUP = 2, 2
NUM_BLOCKS = 24
T, S, P = 64, 4, 8  # the one token / sequence / page bucket
SCALE = 1.0 / math.sqrt(HEAD_DIM)
TPU_TILES = kernels.TPUBlockSizes(num_q_per_block=8, num_kv_pages_per_block=2,
                                  num_kv_heads_per_block=1)
GPU_TILES = kernels.GPUBlockSizes(num_q_per_block=4, num_kv_pages_per_block=1, k_splits=2)


def run_reference(q, kv, md):
    return kernels.paged_attention(q, kv, md.kv_lens, md.page_indices, md.cu_q_lens,
                                   md.num_seqs, sm_scale=SCALE, backend="reference")


def run_tpu(q, kv, md):
    with pltpu.force_tpu_interpret_mode():
        return kernels.ragged_paged_attention_tpu(
            q, kv, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            sm_scale=SCALE, block_sizes=TPU_TILES)


def run_gpu(q, kv, md):
    return kernels.ragged_paged_attention_gpu(
        q, kv, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs, sm_scale=SCALE,
        block_sizes=GPU_TILES, interpret=True)


@st.composite
def batches(draw, page_size):
    """(seqs as (num_computed, q_len, extra_blocks), page permutation)."""
    max_kv = P * page_size
    n = draw(st.integers(1, S))
    seqs, pages, tokens = [], 0, 0
    for _ in range(n):
        kind = draw(st.sampled_from(["decode", "prefill", "mixed"]))
        budget = T - tokens - (n - len(seqs) - 1)  # leave one token per later seq
        if kind == "decode" or budget < 2:
            q = 1
            c = draw(st.integers(0, max_kv - 1))
        elif kind == "prefill":
            q, c = draw(st.integers(2, min(budget, max_kv))), 0
        else:  # a chunk over KV already cached
            q = draw(st.integers(2, min(budget, max_kv - 1)))
            c = draw(st.integers(1, max_kv - q))
        need = -(-(c + q) // page_size)
        extra = draw(st.integers(0, 1))
        if pages + need + extra > NUM_BLOCKS:
            c, q, need, extra = 0, 1, 1, 0
            if pages + 1 > NUM_BLOCKS:
                break
        seqs.append((c, q, extra))
        pages += need + extra
        tokens += q
    perm = draw(st.permutations(range(NUM_BLOCKS)))
    return seqs, perm


def check(backend, page_size, dtype, seqs, perm, seed):
    rng = np.random.default_rng(seed)
    builder = MetadataBuilder(block_size=page_size, num_blocks=NUM_BLOCKS, max_num_seqs=S,
                              max_num_tokens=T, max_pages_per_seq=P, token_buckets=(T,),
                              seq_buckets=(S,), page_buckets=(P,))
    nq = NUM_KV_HEADS * GROUP
    kv = np.full((NUM_BLOCKS + 1, page_size, 2 * NUM_KV_HEADS, HEAD_DIM), np.nan, np.float32)
    sched, ks, vs, qs = [], [], [], []
    nxt = 0
    for c, q, extra in seqs:
        need = -(-(c + q) // page_size)
        blocks = list(perm[nxt:nxt + need + extra])
        nxt += need + extra
        k = rng.standard_normal((c + q, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((c + q, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
        k = np.asarray(jnp.asarray(k, dtype).astype(jnp.float32))  # as stored
        v = np.asarray(jnp.asarray(v, dtype).astype(jnp.float32))
        for t in range(c):  # the cached prefix is already in the pages
            kv[blocks[t // page_size], t % page_size, 0::2] = k[t]
            kv[blocks[t // page_size], t % page_size, 1::2] = v[t]
        sched.append(ScheduledSeq(blocks, c, rng.integers(0, 1000, q).tolist()))
        ks.append(k)
        vs.append(v)
        qs.append(rng.standard_normal((q, nq, HEAD_DIM)).astype(np.float32))
    step = builder.build(sched)
    md = step.metadata
    n = len(sched)
    # Host-side contract: caller seq i's tokens end at row logits_indices[i], in order.
    q_rows = np.full((T, nq, HEAD_DIM), np.nan, np.float32)
    k_new = np.full((T, NUM_KV_HEADS, HEAD_DIM), np.nan, np.float32)
    v_new = np.full_like(k_new, np.nan)
    row_of_seq = {}
    for i, ((c, q, _), s) in enumerate(zip(seqs, sched)):
        last = int(step.logits_indices[i])
        rows = np.arange(last - q + 1, last + 1)
        np.testing.assert_array_equal(step.input_ids[rows], s.token_ids)
        np.testing.assert_array_equal(md.positions[rows], np.arange(c, c + q))
        pos = np.arange(c, c + q)
        want_slots = np.asarray(s.block_ids)[pos // page_size] * page_size + pos % page_size
        np.testing.assert_array_equal(md.slot_mapping[rows], want_slots)
        q_rows[rows] = qs[i]
        k_new[rows] = ks[i][c:]
        v_new[rows] = vs[i][c:]
        row_of_seq[int(np.searchsorted(md.cu_q_lens[1:n + 1], last, side="right"))] = i
    live = int(md.cu_q_lens[n])
    assert np.all(md.slot_mapping[live:] == NUM_BLOCKS * page_size)  # padding page
    assert np.all(md.page_indices[n:] == NUM_BLOCKS)
    kv_dev = kernels.write_kv(jnp.asarray(kv, dtype), jnp.asarray(k_new, dtype),
                              jnp.asarray(v_new, dtype), jnp.asarray(md.slot_mapping))
    q_dev = jnp.asarray(q_rows, dtype)
    out = {"reference": run_reference, "pallas_tpu": run_tpu, "pallas_gpu": run_gpu}[
        backend](q_dev, kv_dev, md)
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(out[:live])), "NaN from a padding slot or unused page"
    order = [row_of_seq[r] for r in range(n)]
    case = Case(q=np.asarray(q_dev), kv_pages=None, kv_lens=md.kv_lens,
                page_indices=md.page_indices, cu_q_lens=md.cu_q_lens, num_seqs=md.num_seqs,
                seqs=[(seqs[i][1], seqs[i][0] + seqs[i][1]) for i in order],
                k_seq=[ks[i].astype(np.float64) for i in order],
                v_seq=[vs[i].astype(np.float64) for i in order])
    ref = oracle(case, sm_scale=SCALE)
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(out[:live], ref[:live], rtol=rtol, atol=atol)


FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                  HealthCheck.data_too_large])


@pytest.mark.parametrize("page_size", [8, 16])
@settings(max_examples=12, **FUZZ)
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_reference_f32(page_size, data, seed):
    seqs, perm = data.draw(batches(page_size))
    check("reference", page_size, np.float32, seqs, perm, seed)


@settings(max_examples=6, **FUZZ)
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_reference_bf16(data, seed):
    seqs, perm = data.draw(batches(8))
    check("reference", 8, jnp.bfloat16, seqs, perm, seed)


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
@settings(max_examples=4, **FUZZ)
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_pallas_interpret(backend, data, seed):
    seqs, perm = data.draw(batches(8))
    check(backend, 8, np.float32, seqs, perm, seed)
