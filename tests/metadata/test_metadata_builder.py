"""MetadataBuilder: round trip, ordering, distribution, buckets, padding and errors."""
import numpy as np
import pytest

from prefixcache.metadata import (
    AttentionMetadata,
    MetadataBuilder,
    ScheduledSeq,
    StepInputs,
    pow2_buckets,
)

BS = 4
NUM_BLOCKS = 64
PAD = NUM_BLOCKS


def make_builder(**kw):
    args = dict(block_size=BS, num_blocks=NUM_BLOCKS, max_num_seqs=16, max_num_tokens=128,
                max_pages_per_seq=32)
    args.update(kw)
    return MetadataBuilder(**args)


def random_schedule(rng, builder, *, as_arrays=False, exact_sorted=False, kinds=3):
    """Random decode / fresh prefill / cached-prefix seqs with distinct random block ids."""
    n = int(rng.integers(1, builder.max_num_seqs + 1))
    budget = builder.max_num_tokens
    free = list(rng.permutation(builder.num_blocks))
    seqs = []
    for _ in range(n):
        kind = rng.integers(kinds)  # 0 decode, 1 fresh prefill, 2 prefill over a prefix
        q = 1 if kind == 0 else int(rng.integers(2, 12))
        q = min(q, budget - (n - len(seqs) - 1))
        if q < 1:
            break
        comp = 0 if kind == 1 else int(rng.integers(0, 40))
        need = -(-(comp + q) // BS)
        # Occasionally a lookahead block past the need.
        extra = 0 if exact_sorted else int(rng.integers(0, 2))
        if need + extra > len(free):
            break
        blocks = [int(free.pop()) for _ in range(need + extra)]
        toks = rng.integers(0, 1000, q).tolist()
        if as_arrays:
            blocks = np.asarray(blocks, np.int32)
        seqs.append(ScheduledSeq(blocks, comp, toks))
        budget -= q
    if exact_sorted:  # already in decode / prefill / mixed order: the builder's fast path
        seqs.sort(key=lambda s: (len(s.token_ids) > 1) * (1 + (s.num_computed_tokens > 0)))
    return seqs


def check_round_trip(builder, seqs, step):
    md = step.metadata
    n = len(seqs)
    assert int(md.num_seqs[0]) == n
    cu = md.cu_q_lens
    # Map each caller seq to its sorted row through logits_indices (last token row).
    rows_of = []
    for i, s in enumerate(seqs):
        last = int(step.logits_indices[i])
        r = int(np.searchsorted(cu[1 : n + 1], last, side="right"))
        assert cu[r] <= last < cu[r + 1], (i, last)
        rows_of.append(r)
    assert sorted(rows_of) == list(range(n))  # a permutation
    for i, (blocks, comp, toks) in enumerate(seqs):
        r = rows_of[i]
        q = len(toks)
        assert cu[r + 1] - cu[r] == q
        assert int(step.logits_indices[i]) == cu[r + 1] - 1
        assert md.kv_lens[r] == comp + q
        sl = slice(int(cu[r]), int(cu[r + 1]))
        np.testing.assert_array_equal(step.input_ids[sl], toks)
        # Positions: query row j sits at kv_len - q_len + j.
        pos = np.arange(comp, comp + q)
        np.testing.assert_array_equal(md.positions[sl], pos)
        blocks = list(np.asarray(blocks))
        np.testing.assert_array_equal(
            md.slot_mapping[sl], [blocks[p // BS] * BS + p % BS for p in pos]
        )
        # Gathering through page_indices reproduces the sequence's slot for every position
        # of its KV (cached prefix included).
        all_pos = np.arange(comp + q)
        gathered = md.page_indices[r, all_pos // BS] * BS + all_pos % BS
        np.testing.assert_array_equal(
            gathered, [blocks[p // BS] * BS + p % BS for p in all_pos]
        )
        need = -(-(comp + q) // BS)
        assert (md.page_indices[r, need:] == PAD).all()


def check_padding(builder, seqs, step):
    md = step.metadata
    n = len(seqs)
    total = sum(len(s.token_ids) for s in seqs)
    assert (md.page_indices[n:] == PAD).all()
    assert (md.kv_lens[n:] == 0).all()
    assert (md.cu_q_lens[n:] == total).all()
    assert (step.input_ids[total:] == 0).all()
    assert (md.positions[total:] == 0).all()
    assert (md.slot_mapping[total:] // BS == PAD).all()
    assert (step.logits_indices[n:] == 0).all()
    # Padding page only for padding: live tokens never write it.
    assert (md.slot_mapping[:total] // BS < NUM_BLOCKS).all()


def check_shapes(builder, step):
    md = step.metadata
    T, S, P = MetadataBuilder.shape_of(step)
    assert (T, S, P) in set(builder.shape_buckets)
    assert md.page_indices.shape == (S, P)
    assert md.kv_lens.shape == (S,)
    assert md.cu_q_lens.shape == (S + 1,)
    assert md.num_seqs.shape == (1,)
    assert md.positions.shape == md.slot_mapping.shape == step.input_ids.shape == (T,)
    assert md.distribution.shape == (3,)
    for a in (*md, step.input_ids, step.logits_indices):
        assert a.dtype == np.int32


@pytest.mark.parametrize("as_arrays, exact_sorted, kinds", [
    (False, False, 3), (True, False, 3), (False, True, 3), (True, True, 3),
    (False, False, 1), (True, True, 1),  # decode-only steps
])
def test_random_schedules_round_trip(as_arrays, exact_sorted, kinds):
    rng = np.random.default_rng(0)
    builder = make_builder()
    for _ in range(200):
        seqs = random_schedule(rng, builder, as_arrays=as_arrays, exact_sorted=exact_sorted,
                               kinds=kinds)
        step = builder.build(seqs)
        assert isinstance(step, StepInputs) and isinstance(step.metadata, AttentionMetadata)
        check_shapes(builder, step)
        check_round_trip(builder, seqs, step)
        check_padding(builder, seqs, step)


def test_configured_buckets_are_the_only_shapes():
    rng = np.random.default_rng(1)
    builder = make_builder(token_buckets=[24, 64, 128], seq_buckets=[3, 16],
                           page_buckets=[5, 32])
    assert builder.token_buckets == (24, 64, 128)
    seen = set()
    for _ in range(200):
        seqs = random_schedule(rng, builder)
        step = builder.build(seqs)
        check_shapes(builder, step)
        check_round_trip(builder, seqs, step)
        shape = MetadataBuilder.shape_of(step)
        assert shape[0] in (24, 64, 128) and shape[1] in (3, 16) and shape[2] in (5, 32)
        # Smallest bucket that fits.
        total = sum(len(s.token_ids) for s in seqs)
        need = max(-(-(s.num_computed_tokens + len(s.token_ids)) // BS) for s in seqs)
        assert shape == builder.bucket_shape(total, len(seqs), need)
        seen.add(shape)
    assert len(seen) > 3
    assert seen <= set(builder.shape_buckets)
    assert builder.num_buckets == len(builder.shape_buckets)


def test_default_buckets_are_powers_of_two():
    b = MetadataBuilder(block_size=16, num_blocks=100, max_num_seqs=48, max_num_tokens=512,
                        max_pages_per_seq=20)
    assert b.token_buckets == (16, 32, 64, 128, 256, 512)
    assert b.seq_buckets == (4, 8, 16, 32, 48)
    assert b.page_buckets == (4, 8, 16, 20)
    assert pow2_buckets(3, 3) == (3,)
    assert pow2_buckets(8, 100) == (8, 16, 32, 64, 100)
    # T bucket 16 cannot carry more than 16 seqs: S=32 (17..32 seqs) is unreachable there.
    assert (16, 32, 4) not in b.shape_buckets and (32, 32, 4) in b.shape_buckets
    assert b.bucket_shape(17, 17, 5) == (32, 32, 8)


def test_ordering_and_distribution():
    builder = make_builder()
    seqs = [
        ScheduledSeq([0, 1, 2], 4, [7, 8, 9]),  # mixed: prefix of 4 + 3 new
        ScheduledSeq([3], 2, [5]),  # decode
        ScheduledSeq([4, 5], 0, [1, 2, 3, 4, 5]),  # prefill
        ScheduledSeq([6, 7], 5, [6]),  # decode
        ScheduledSeq([8], 0, [9, 9]),  # prefill
        ScheduledSeq([9], 0, [3]),  # 1-token prompt: counts as decode
    ]
    step = builder.build(seqs)
    md = step.metadata
    # Sorted rows: decodes (seqs 1, 3, 5), prefills (2, 4), mixed (0), stable within groups.
    np.testing.assert_array_equal(md.distribution, [3, 5, 6])
    np.testing.assert_array_equal(md.cu_q_lens[:7], [0, 1, 2, 3, 8, 10, 13])
    np.testing.assert_array_equal(md.kv_lens[:6], [3, 6, 1, 5, 2, 7])
    np.testing.assert_array_equal(step.input_ids[:13], [5, 6, 3, 1, 2, 3, 4, 5, 9, 9, 7, 8, 9])
    np.testing.assert_array_equal(step.logits_indices[:6], [12, 0, 7, 1, 9, 2])
    # seqs[0] positions 4..6 live in block ids[1] = 1: slots 1*4 + 0..2 = 4, 5, 6.
    np.testing.assert_array_equal(md.positions[10:13], [4, 5, 6])
    np.testing.assert_array_equal(md.slot_mapping[10:13], [4, 5, 6])
    # seqs[3]: position 5 -> block ids[1] = 7, offset 1 -> slot 29.
    assert md.slot_mapping[1] == 29
    np.testing.assert_array_equal(md.page_indices[1, :3], [6, 7, PAD])
    check_round_trip(builder, seqs, step)
    check_padding(builder, seqs, step)


def test_all_decode_distribution_and_single_seq():
    builder = make_builder()
    step = builder.build([ScheduledSeq([3, 4], 7, [11])])
    md = step.metadata
    np.testing.assert_array_equal(md.distribution, [1, 1, 1])
    assert int(md.num_seqs[0]) == 1 and md.kv_lens[0] == 8
    assert md.slot_mapping[0] == 4 * BS + 3
    assert step.logits_indices[0] == 0
    np.testing.assert_array_equal(md.page_indices[0, :3], [3, 4, PAD])


def test_build_does_not_mutate_inputs():
    builder = make_builder()
    blocks, toks = np.array([5, 6], np.int32), [1, 2, 3]
    seqs = [ScheduledSeq(blocks, 1, toks)]
    step = builder.build(seqs)
    step.metadata.page_indices[0, 0] = 99
    np.testing.assert_array_equal(blocks, [5, 6])
    assert toks == [1, 2, 3]


@pytest.mark.parametrize(
    "seqs, match",
    [
        ([], "at least one"),
        ([ScheduledSeq([0], 0, [1])] * 17, "max_num_seqs"),
        ([ScheduledSeq(list(range(17)), 0, [1] * 65), ScheduledSeq(list(range(17, 34)), 0,
          [1] * 64)], "max_num_tokens"),
        ([ScheduledSeq([0], 0, [1]), ScheduledSeq([1], 0, [])], r"seqs\[1\]: no tokens"),
        ([ScheduledSeq([0], -1, [1])], r"seqs\[0\]: negative num_computed_tokens"),
        ([ScheduledSeq([0], 0, [1]), ScheduledSeq([1], 4, [1])],
         r"seqs\[1\]: 5 tokens of KV .* need 2 blocks of size 4, but only 1"),
        ([ScheduledSeq(list(range(40)), 130, [1])], r"seqs\[0\].*max_pages_per_seq=32"),
        ([ScheduledSeq([0], 0, [1]), ScheduledSeq([NUM_BLOCKS], 0, [1])],
         r"seqs\[1\]: block id 64 out of range 0..63"),
        ([ScheduledSeq([0], 0, [1]), ScheduledSeq(np.array([-1]), 0, [1])],
         r"seqs\[1\]: block id -1 out of range"),
        ([ScheduledSeq([0], 0, [1]), ScheduledSeq([1], 0, [2, -3])],
         r"seqs\[1\]: token id -3"),
        ([(1, 2)], "ScheduledSeq"),
    ],
)
def test_errors_name_the_problem(seqs, match):
    builder = make_builder()
    with pytest.raises(ValueError, match=match):
        builder.build(seqs)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(block_size=0), "block_size"),
        (dict(num_blocks=-1), "num_blocks"),
        (dict(max_num_seqs=2.5), "max_num_seqs"),
        (dict(token_buckets=[16, 8, 128]), "strictly increasing"),
        (dict(token_buckets=[16, 64]), "must end at the configured maximum 128"),
        (dict(seq_buckets=[0, 16]), "positive"),
        (dict(page_buckets=[]), "empty"),
        (dict(num_blocks=2**28, block_size=16), "overflows int32"),
    ],
)
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        make_builder(**kw)
