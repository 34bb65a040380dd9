"""Engine-side block tables: one int32 row per running request (vLLM's BlockTable).

The scheduler appends the block ids `KVCacheManager.allocate_slots` returns (and, at
admission, the prefix-hit blocks from `get_computed_blocks`) to the request's row, so
the runner never asks the manager for whole tables (`get_block_ids` builds a fresh
Python list per call) and the MetadataBuilder gathers a step's page table in one numpy
operation (`MetadataBuilder.build_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTables:
    """Append-only int32 block tables, one row per request that holds blocks.

    Invariants:
      - a row in use holds its request's block ids in `table[row, :lengths[row]]`, in the
        manager's order (the same list as `KVCacheManager.get_block_ids`); cells past
        `lengths[row]` hold `pad_id`;
      - a row is in use iff it is not in the free list; free rows have length 0;
      - the table grows (rows or columns, doubling) when needed and never shrinks.

    Args:
      num_rows: initial rows (the most requests running at once).
      pad_id: the id of unused cells (the padding page, `num_blocks`).
      width: initial columns (block ids per row before the first growth).
    """

    def __init__(self, num_rows: int, pad_id: int, width: int = 32):
        if num_rows < 1 or width < 1:
            raise ValueError(f"num_rows and width must be >= 1, got {num_rows}, {width}")
        self.pad_id = int(pad_id)
        self.table = np.full((num_rows, width), self.pad_id, np.int32)
        self.lengths = np.zeros(num_rows, np.int64)
        # Lowest row first (pop from the end).
        self._free_rows = list(range(num_rows - 1, -1, -1))

    @property
    def num_rows_in_use(self) -> int:
        return self.table.shape[0] - len(self._free_rows)

    def _grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self.table.shape
        rows, width = max(rows, old_rows), max(width, old_width)
        table = np.full((rows, width), self.pad_id, np.int32)
        table[:old_rows, :old_width] = self.table
        self.table = table
        if rows > old_rows:
            self.lengths = np.concatenate([self.lengths, np.zeros(rows - old_rows, np.int64)])
            self._free_rows[:0] = range(rows - 1, old_rows - 1, -1)

    def add_row(self, block_ids: Sequence[int]) -> int:
        """Takes a free row and fills it with `block_ids`; returns the row."""
        if not self._free_rows:
            self._grow(2 * self.table.shape[0], 0)
        row = self._free_rows.pop()
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: Sequence[int]) -> None:
        """Appends block ids to a row in use."""
        k = len(block_ids)
        if not k:
            return
        n = int(self.lengths[row])
        if n + k > self.table.shape[1]:
            self._grow(0, max(2 * self.table.shape[1], n + k))
        self.table[row, n:n + k] = block_ids
        self.lengths[row] = n + k

    def release(self, row: int) -> None:
        """Clears a row and returns it to the free list."""
        self.table[row, :int(self.lengths[row])] = self.pad_id
        self.lengths[row] = 0
        self._free_rows.append(row)

    def block_ids(self, row: int) -> list[int]:
        """The row's block ids as a list (inspection and tests)."""
        return self.table[row, :int(self.lengths[row])].tolist()
