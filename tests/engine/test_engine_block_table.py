"""BlockTables: rows taken and released, appends, growth in both directions."""
import numpy as np
import pytest

from prefixcache.engine.block_table import BlockTables


def test_rows_append_release_and_reuse():
    t = BlockTables(2, pad_id=99, width=2)
    a = t.add_row([5, 6])
    b = t.add_row([])
    assert (a, b) == (0, 1) and t.num_rows_in_use == 2
    t.append(b, [7])
    t.append(b, [])
    assert t.block_ids(a) == [5, 6] and t.block_ids(b) == [7]
    t.release(a)
    assert t.num_rows_in_use == 1 and t.lengths[a] == 0 and (t.table[a] == 99).all()
    assert t.add_row([1]) == a  # the freed row is reused
    assert t.table.dtype == np.int32


def test_growth_keeps_contents():
    t = BlockTables(1, pad_id=-1, width=2)
    r0 = t.add_row([1, 2])
    t.append(r0, [3, 4, 5])  # past the width: columns grow
    assert t.table.shape[1] >= 5 and t.block_ids(r0) == [1, 2, 3, 4, 5]
    r1 = t.add_row([9])  # no free row: rows grow
    r2 = t.add_row([8])
    assert sorted((r0, r1, r2)) == [0, 1, 2] and t.num_rows_in_use == 3
    assert t.block_ids(r0) == [1, 2, 3, 4, 5] and t.block_ids(r1) == [9]
    assert t.block_ids(r2) == [8]
    assert (t.table[r1, 1:] == -1).all()


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_rows and width"):
        BlockTables(0, pad_id=1)
