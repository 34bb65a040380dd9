"""Sliding-window attention: the spec and its single-type manager (vLLM's
``SlidingWindowSpec`` / ``SlidingWindowManager``)."""

from __future__ import annotations

import dataclasses

from prefixcache._validate import check_count
from prefixcache.core.block_pool import InvariantError
from prefixcache.core.groups.base import SingleTypeManager


@dataclasses.dataclass(frozen=True)
class SlidingWindowSpec:
    """Sliding-window attention: a query at position p attends to positions
    ``p - sliding_window + 1 .. p`` (the window counts the query's own token, as
    vLLM's ``SlidingWindowSpec`` and the kernels' mask do).

    Args:
        sliding_window: W, a positive int.
    """

    sliding_window: int
    kind = "sliding_window"

    def __post_init__(self):
        # NOTE: numpy ints are accepted (as int), bools and floats are not.
        object.__setattr__(
            self, "sliding_window", check_count("sliding_window", self.sliding_window, min=1))


def longest_window_hit(keys, max_num_blocks: int, need: int, null, num_lists: int,
                       get, *args) -> list[list]:
    """The sliding-window hit rule (vLLM's ``SlidingWindowManager.find_longest_cache_hit``)
    over positions ``0 .. max_num_blocks - 1``, for the hash index and the radix tree.

    ``get(keys[i], *args)`` is position ``i``'s blocks (one per list) or ``None`` when
    any is missing. From the right, the first run of ``need`` present positions ends the
    hit (earlier slots ``null``); without one, the present run at the start (shorter
    than the window). Returns ``num_lists`` equal-length lists.
    """
    computed = [[null] * max_num_blocks for _ in range(num_lists)]
    n = 0
    found = False
    for i in range(max_num_blocks - 1, -1, -1):
        got = get(keys[i], *args)
        if got is not None:
            for c, b in zip(computed, got):
                c[i] = b
            n += 1
            if n >= need:
                for c in computed:
                    del c[i + n:]
                found = True
                break
        else:
            n = 0
    if not found:
        for c in computed:
            del c[n:]
    return computed


def check_leading_nulls(table, null, tracked: int, rid, g: int) -> int:
    """The length of ``table``'s leading run of ``null`` slots (a running request's
    group ``g`` table); ``InvariantError`` unless it is ``tracked`` (``st.num_null[g]``).
    The hash kind's and the radix tree's ``check_invariants`` rule."""
    num_null = 0
    while num_null < len(table) and table[num_null] is null:
        num_null += 1
    if num_null != tracked:
        raise InvariantError(
            f"request {rid!r} group {g}: {num_null} leading null slots, tracked {tracked}")
    return num_null


class SlidingWindowManager(SingleTypeManager):
    """Blocks wholly before the window of the next token are released (their slots
    become a leading run of null slots); a hit needs the window's blocks only."""

    spec_class = SlidingWindowSpec
    allows_null_hits = True

    def __init__(self, spec, group_id, coordinator):
        super().__init__(spec, group_id, coordinator)
        self.window = spec.sliding_window
        # NOTE: vLLM's reachable_block_mask (dense retention, alignment = block
        # size) caches every block, except W == 1: no block is ever needed.
        self.caches_blocks = self.window > 1

    def find_longest_cache_hit(self, hashes, max_length, group_ids, suffixes):
        """``SlidingWindowManager.find_longest_cache_hit``: from the right, the first
        run of ``ceil((W - 1) / block_size)`` cached blocks ends the hit (earlier slots
        null); without one, the cached run at the start (shorter than the window)."""
        bs = self.block_size
        computed = longest_window_hit(
            hashes, max_length // bs, -(-(self.window - 1) // bs), self.null_block,
            len(group_ids), self.get_cached, group_ids, suffixes)
        return computed, len(computed[0]) * bs

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token."""
        s = num_computed_tokens - self.window + 1
        return s if s > 0 else 0

    def remove_skipped_blocks(self, st, num_computed_tokens: int) -> None:
        """Release the table's blocks wholly before the window (last slot first,
        stopping at a null one); their slots become null. One ``free_blocks`` call."""
        g = self.group_id
        table = st.tables[g]
        null = self.null_block
        n = num_computed_tokens - self.window + 1  # (num_skipped_tokens, inlined)
        n = n // self.block_size if n > 0 else 0
        if n > len(table):
            n = len(table)
        freed = []
        for i in range(n - 1, -1, -1):
            b = table[i]
            if b is null:
                break
            freed.append(b)
            table[i] = null
        if freed:
            st.num_null[g] = n  # nulls are the table's head: slots 0 .. n-1 now
            if self.policy is None:
                self.block_pool.free_blocks(freed, st.request)
            else:  # (positions n - len(freed) .. n - 1, for the policy)
                self.block_pool.free_blocks(freed, st.request, n - len(freed))

    def idle_limit(self, st) -> int:
        # One more computed token than this moves the window past the first real
        # block: release it.
        return (st.num_null[self.group_id] + 1) * self.block_size + self.window - 2

    def check_slots(self, st, rid) -> None:
        """Null slots only as the table's leading run, of tracked length."""
        g = self.group_id
        table = st.tables[g]
        null = self.null_block
        num_null = check_leading_nulls(table, null, st.num_null[g], rid, g)
        if any(b is null for b in table[num_null:]):
            raise InvariantError(
                f"request {rid!r} group {g}: a null slot after a real block "
                f"{[b.block_id for b in table]}")


__all__ = ["SlidingWindowManager", "SlidingWindowSpec", "check_leading_nulls",
           "longest_window_hit"]
