"""MetadataBuilder.build_rows (columnar inputs + one 2-D block table) == build."""
import numpy as np
import pytest

from prefixcache.metadata import MetadataBuilder, ScheduledSeq

BS = 4
NUM_BLOCKS = 64
PAD = NUM_BLOCKS


def make_builder(**kw):
    args = dict(block_size=BS, num_blocks=NUM_BLOCKS, max_num_seqs=16, max_num_tokens=128,
                max_pages_per_seq=32)
    args.update(kw)
    return MetadataBuilder(**args)


def random_columns(rng, builder, *, kinds=3, width=40, num_rows=24, sort=False):
    """A random schedule as (table, rows, num_table_blocks, computed, q_lens, tokens)."""
    n = int(rng.integers(1, builder.max_num_seqs + 1))
    budget = builder.max_num_tokens
    free = list(rng.permutation(builder.num_blocks))
    # Junk (even out-of-range ids) past each row's blocks: build_rows must ignore it.
    table = rng.integers(-5, 3 * NUM_BLOCKS, (num_rows, width)).astype(np.int32)
    rows = rng.permutation(num_rows)[:n]
    nb, comp, qs, toks = [], [], [], []
    for r in rows:
        kind = rng.integers(kinds)  # 0 decode, 1 fresh prefill, 2 prefill over a prefix
        q = 1 if kind == 0 else int(rng.integers(2, 12))
        q = min(q, budget - (n - len(qs) - 1))
        c = 0 if kind == 1 else int(rng.integers(0, 40))
        need = -(-(c + q) // BS)
        extra = int(rng.integers(0, 2))  # a lookahead block past the need
        if q < 1 or need + extra > len(free):
            break
        table[r, :need + extra] = [free.pop() for _ in range(need + extra)]
        nb.append(need + extra)
        comp.append(c)
        qs.append(q)
        toks.append(rng.integers(0, 1000, q))
        budget -= q
    k = len(qs)
    rows = rows[:k]
    if sort:
        key = [(q > 1) * (1 + (c > 0)) for q, c in zip(qs, comp)]
        idx = np.argsort(key, kind="stable")
        rows, nb, comp, qs, toks = (rows[idx], [nb[i] for i in idx], [comp[i] for i in idx],
                                    [qs[i] for i in idx], [toks[i] for i in idx])
    return (table, np.asarray(rows), np.asarray(nb), np.asarray(comp), np.asarray(qs),
            np.concatenate(toks))


def as_seqs(table, rows, nb, comp, qs, tokens):
    cu = np.concatenate([[0], np.cumsum(qs)])
    need = -(-(comp + qs) // BS)
    # build() range-checks every id it is given; build_rows only the needed ones.
    return [ScheduledSeq(table[r, :need[i]], int(comp[i]), tokens[cu[i]:cu[i + 1]].tolist())
            for i, r in enumerate(rows)]


def assert_same(a, b):
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.logits_indices, b.logits_indices)
    for x, y in zip(a.metadata, b.metadata):
        assert x.dtype == y.dtype == np.int32
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kinds, sort", [(3, False), (3, True), (1, False)])
def test_build_rows_equals_build(kinds, sort):
    rng = np.random.default_rng(0)
    builder = make_builder()
    for _ in range(200):
        cols = random_columns(rng, builder, kinds=kinds, sort=sort)
        assert_same(builder.build_rows(*cols), builder.build(as_seqs(*cols)))


def test_build_rows_narrow_table_and_python_columns():
    # A table narrower than the page bucket, and plain Python lists as columns.
    builder = make_builder()
    table = np.full((3, 3), PAD, np.int32)
    table[2] = [7, 8, 9]
    table[0, :1] = [5]
    cols = (table, [2, 0], [3, 1], [8, 0], [1, 3], [11, 12, 13, 14])
    step = builder.build_rows(*cols)
    assert step.metadata.page_indices.shape[1] == 4
    assert_same(step, builder.build([ScheduledSeq([7, 8, 9], 8, [11]),
                                     ScheduledSeq([5], 0, [12, 13, 14])]))


def good_cols():
    table = np.full((4, 8), PAD, np.int32)
    table[1, :3] = [3, 4, 5]
    return [table, [1], [3], [8], [2], [21, 22]]


@pytest.mark.parametrize("index, value, match", [
    (0, np.zeros((4, 8), np.int64), "2-D int32"),
    (0, np.zeros(8, np.int32), "2-D int32"),
    (1, [4], r"seqs\[0\]: row 4 outside"),
    (1, [-1], r"seqs\[0\]: row -1 outside"),
    (2, [9], r"seqs\[0\]: 9 block ids but the block table is 8 wide"),
    (2, [2], r"seqs\[0\]: 10 tokens of KV .* only 2 block ids"),
    (3, [-1], r"seqs\[0\]: negative num_computed_tokens"),
    (4, [0], r"seqs\[0\]: no tokens scheduled"),
    (5, [21], "1 token ids given for 2 scheduled tokens"),
    (5, [21, -2], r"seqs\[0\]: token id -2"),
    (5, [21, 2**31], r"seqs\[0\]: token id 2147483648"),
    (3, [200], r"seqs\[0\]: 202 tokens of KV need 51 pages"),
    (1, [[1]], "must be 1-D"),
])
def test_build_rows_errors(index, value, match):
    builder = make_builder()
    cols = good_cols()
    builder.build_rows(*cols)  # the unmodified call is fine
    cols[index] = value
    with pytest.raises(ValueError, match=match):
        builder.build_rows(*cols)


def test_build_rows_block_id_range_checked_only_where_needed():
    builder = make_builder()
    cols = good_cols()
    cols[0][1, 3:] = -7  # junk past the 3 held ids: ignored
    builder.build_rows(*cols)
    for bad in (-1, PAD, PAD + 5):
        cols = good_cols()
        cols[0][1, 2] = bad
        with pytest.raises(ValueError, match=rf"seqs\[0\]: block id {bad} out of range"):
            builder.build_rows(*cols)
    # The culprit is named in caller order when the rows get sorted.
    table = np.full((4, 8), PAD, np.int32)
    table[0, :2] = [1, 2]
    table[1, :1] = [PAD]
    with pytest.raises(ValueError, match=r"seqs\[1\]: block id 64"):
        builder.build_rows(table, [0, 1], [2, 1], [0, 3], [5, 1], [1, 2, 3, 4, 5, 6])


def test_build_rows_empty_and_too_many():
    builder = make_builder(max_num_seqs=2, max_pages_per_seq=64)
    table = np.zeros((4, 4), np.int32)
    with pytest.raises(ValueError, match="at least one"):
        builder.build_rows(table, [], [], [], [], [])
    with pytest.raises(ValueError, match="max_num_seqs=2"):
        builder.build_rows(table, [0, 1, 2], [1, 1, 1], [0, 0, 0], [1, 1, 1], [1, 1, 1])
    with pytest.raises(ValueError, match="max_num_tokens=128"):
        builder.build_rows(np.zeros((4, 40), np.int32), [0], [33], [0], [129], [1] * 129)
