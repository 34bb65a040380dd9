"""The on-device sampler and the host-side multimodal row mapping of the model runner."""

from __future__ import annotations

import jax
import numpy as np

from prefixcache.core import MultiModalFeature, Request
from prefixcache.engine.model_runner import mm_rows_for_step
from prefixcache.engine.sampler import SamplingArrays, sample
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.scheduler import EngineRequest, ScheduledRequest
from prefixcache.metadata import MetadataBuilder, ScheduledSeq

V = 32


def _run(logits, rows):
    arrays = SamplingArrays.build(rows, logits.shape[0])
    all_greedy = all(r[0] == 0.0 for r in rows)
    return np.asarray(jax.jit(sample, static_argnames="all_greedy")(
        logits, arrays, all_greedy=all_greedy))


def test_greedy_topk1_and_tiny_topp_are_argmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, V)).astype(np.float32)
    argmax = logits.argmax(-1)
    assert (_run(logits, [(0.0, 0, 1.0, 0, 0)] * 8) == argmax).all()
    mixed = [(0.0, 0, 1.0, 0, 0), (2.0, 1, 1.0, 3, 0), (2.0, 0, 1e-6, 4, 1),
             (0.0, 5, 0.5, 9, 2)]
    # Rows 4..7 are padding (greedy).
    assert (_run(logits, mixed) == argmax).all()


def test_top_k_and_top_p_restrict_support_and_seed_determinism():
    rng = np.random.default_rng(1)
    row = rng.normal(size=V).astype(np.float32) * 2
    n = 256
    logits = np.tile(row, (n, 1))
    order = np.argsort(-row)
    # Many (seed, position) pairs in one call: top_k=3 only ever draws the top 3 ...
    rows = [(1.0, 3, 1.0, s, s % 7) for s in range(n)]
    got = _run(logits, rows)
    assert set(got) == set(order[:3].tolist())
    # ... and top_p keeps the smallest prefix whose mass reaches p.
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    k = int(np.searchsorted(np.cumsum(probs[order]), 0.6) + 1)
    got_p = _run(logits, [(1.0, 0, 0.6, s, 0) for s in range(n)])
    assert set(got_p) <= set(order[:k].tolist()) and len(set(got_p)) > 1
    # Deterministic per (seed, position), independent of the row it sits in.
    again = _run(logits[:4], [rows[5], rows[2], rows[200], rows[9]])
    assert again.tolist() == [got[5], got[2], got[200], got[9]]


def test_untruncated_rows_draw_the_same_beside_truncating_ones():
    # rows with top_k 0 and top_p 1 skip the vocabulary sort; a batch where another row
    # truncates (the sorted branch runs) gives them the same draws, and they sample
    # the distribution's full support
    rng = np.random.default_rng(2)
    row = rng.normal(size=V).astype(np.float32)
    n = 64
    logits = np.tile(row, (n, 1))
    free = [(1.0, 0, 1.0, s, 3) for s in range(n)]
    alone = _run(logits, free)
    mixed = _run(logits, free[:-1] + [(1.0, 2, 1.0, 99, 0)])
    assert mixed[:-1].tolist() == alone[:-1].tolist()
    assert set(mixed[-1:]) <= set(np.argsort(-row)[:2].tolist())
    assert len(set(alone.tolist())) > 8


def _state(rid, tokens, feats, emb):
    return EngineRequest(Request(rid, tokens, mm_features=feats), SamplingParams(), 0, emb)


def test_mm_rows_follow_the_builders_row_order_and_chunks():
    d = 4
    img = np.arange(10 * d, dtype=np.float32).reshape(10, d) + 1
    # r0: a decode step (sorted first by the builder although it comes second here).
    # r1: a later prefill chunk covering positions [8, 14) of an image at [5, 15).
    r1 = _state("r1", list(range(1, 21)), (MultiModalFeature("img", 5, 10),), {"img": img})
    r0 = _state("r0", [7] * 9, (), {})
    sched = [ScheduledRequest(r1, 8, 6, []), ScheduledRequest(r0, 8, 1, [])]
    builder = MetadataBuilder(block_size=4, num_blocks=16, max_num_seqs=4, max_num_tokens=16,
                              max_pages_per_seq=8)
    step = builder.build([ScheduledSeq([0, 1, 2, 3], 8, list(range(9, 15))),
                          ScheduledSeq([4, 5, 6], 8, [7])])
    embeds, mask = mm_rows_for_step(sched, step.logits_indices, 16, d, np.float32)
    pos = step.metadata.positions
    # Rows are where the builder put r1's tokens: position p carries image row p - 5.
    r1_rows = np.flatnonzero(mask)
    assert len(r1_rows) == 6
    np.testing.assert_array_equal(pos[r1_rows], np.arange(8, 14))
    np.testing.assert_array_equal(embeds[r1_rows], img[3:9])
    np.testing.assert_array_equal(step.input_ids[r1_rows], np.arange(9, 15))
    assert mm_rows_for_step(sched[1:], step.logits_indices[1:], 16, d, np.float32) is None
