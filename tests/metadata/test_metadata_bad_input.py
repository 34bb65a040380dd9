"""Bad input to the MetadataBuilder (issue 13, item 4): values of the wrong type are
rejected with a message naming the sequence and field -- never silently truncated
(1.7 as block id 1) -- and the builder is unchanged (its next build equals a fresh
builder's)."""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache._validate import ArgumentTypeError
from prefixcache.metadata import MetadataBuilder, ScheduledSeq

KW = dict(block_size=4, num_blocks=10, max_num_seqs=4, max_num_tokens=32,
          max_pages_per_seq=4)
GOOD = [ScheduledSeq([1, 2], 3, [1, 2, 3]), ScheduledSeq(np.array([5], np.int32), 2, [7])]


def same(a, b):
    for x, y in zip(a.metadata + (a.input_ids, a.logits_indices),
                    b.metadata + (b.input_ids, b.logits_indices)):
        np.testing.assert_array_equal(x, y)


BAD_SEQS = {
    "float block id": (ScheduledSeq([1.7, 2.2], 3, [1, 2, 3]), r"seqs\[1\].block_ids\[0\] = 1.7"),
    "float block array": (ScheduledSeq(np.array([1.0, 2.0]), 3, [1, 2, 3]),
                          r"seqs\[1\].block_ids must be a 1-D integer array"),
    "2-D block array": (ScheduledSeq(np.array([[1, 2]]), 3, [1, 2, 3]), r"seqs\[1\]"),
    "uint64 block array": (ScheduledSeq(np.array([1, 2], np.uint64), 3, [1, 2, 3]),
                           "do not concatenate to 1-D ints"),
    "float computed": (ScheduledSeq([1, 2], 3.9, [1, 2, 3]),
                       r"seqs\[1\].num_computed_tokens must be an int, got 3.9"),
    "np.float64 computed": (ScheduledSeq([1, 2], np.float64(3.0), [1, 2, 3]),
                            r"seqs\[1\].num_computed_tokens"),
    "bool computed": (ScheduledSeq([1, 2], True, [1, 2, 3]), r"seqs\[1\].num_computed_tokens"),
    "float token": (ScheduledSeq([1, 2], 3, [1.5, 2, 3]), r"seqs\[1\].token_ids\[0\] = 1.5"),
    "set tokens": (ScheduledSeq([1, 2], 3, {1, 2, 3}), r"seqs\[1\].token_ids .* got set"),
    "dict tokens": (ScheduledSeq([1, 2], 3, {1: 0, 2: 0, 3: 0}), r"seqs\[1\].token_ids"),
    "str tokens": (ScheduledSeq([1, 2], 3, "abc"), r"seqs\[1\].token_ids"),
    "set blocks": (ScheduledSeq({1, 2}, 3, [1, 2, 3]), r"seqs\[1\].block_ids .* got set"),
    "negative block": (ScheduledSeq([-1, 2], 3, [1, 2, 3]), "block id -1 out of range"),
}


@pytest.mark.parametrize("name", sorted(BAD_SEQS))
def test_build_rejects(name):
    bad, match = BAD_SEQS[name]
    b = MetadataBuilder(**KW)
    with pytest.raises(ValueError, match=match):
        b.build([GOOD[1], bad])  # the second sequence: the message must name seqs[1]
    same(b.build(GOOD), MetadataBuilder(**KW).build(GOOD))


COLUMNS = ["rows", "num_table_blocks", "num_computed", "q_lens", "token_ids"]


@pytest.mark.parametrize("col", COLUMNS)
@pytest.mark.parametrize("kind", ["float", "bool", "set", "str", "float_array",
                                  "np_floats"])
def test_build_rows_rejects(col, kind):
    table = np.full((4, 4), 10, np.int32)
    table[0, :2] = [1, 2]
    table[1, :1] = [5]
    good = dict(rows=[0, 1], num_table_blocks=[2, 1], num_computed=[3, 2], q_lens=[3, 1],
                token_ids=[1, 2, 3, 7])
    args = dict(good)
    v = good[col]
    # (a list of Python bools is a list of ints, as everywhere in Python; a bool array
    # is not an int array)
    args[col] = {"float": [x + 0.5 for x in v], "bool": np.ones(len(v), bool),
                 "set": set(v), "str": "0" * len(v), "float_array": np.array(v, float),
                 "np_floats": [np.float64(x) for x in v]}[kind]
    b = MetadataBuilder(**KW)
    with pytest.raises(ArgumentTypeError, match=col):
        b.build_rows(table, **args)
    same(b.build_rows(table, **good), MetadataBuilder(**KW).build(GOOD))


@pytest.mark.parametrize("kw,match", [
    (dict(block_size=4.0), "block_size must be an int"),
    (dict(num_blocks=np.float64(10)), "num_blocks must be an int"),
    (dict(max_num_seqs=True), "max_num_seqs must be an int"),
    (dict(max_num_tokens=2**40), "max_num_tokens=1099511627776 does not fit the int32"),
    (dict(max_num_tokens=2**31 - 1, token_buckets=None), "host memory"),
])
def test_constructor_rejects(kw, match, monkeypatch):
    if "host memory" in match:  # without relying on this machine's memory size
        import prefixcache._validate as v
        monkeypatch.setattr(v, "available_host_memory", lambda: 2**30)
    with pytest.raises(ValueError, match=match):
        MetadataBuilder(**{**KW, **kw})
