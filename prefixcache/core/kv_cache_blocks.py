"""The one result type of ``get_computed_blocks`` / ``allocate_slots``: blocks per KV
cache group (vLLM 0.33's ``KVCacheBlocks``).

    hit, num_hit = manager.get_computed_blocks(request)
    hit.blocks            # tuple: one list of blocks per KV cache group
    hit.get_block_ids()   # tuple: one list of block ids per group
    new = manager.allocate_slots(request, n, num_hit, hit)   # KVCacheBlocks or None

Every configuration answers this type (one full-attention group: ``len(blocks) == 1``),
so callers read ``result.blocks[g]`` without probing the manager's shape.

Legacy sequence access (kept because many callers and tests use it): a result acts as
the shape its manager answered before this type -- one full-attention group (hash or
radix index): the list of that group's blocks (``len``, iteration, indexing, ``==`` a
list); a group layout (the hybrid manager, ``PerGroupKVCacheBlocks``): the tuple of
per-group lists. New code reads ``.blocks``.
"""

from __future__ import annotations

from typing import Any


class KVCacheBlocks:
    """Blocks per KV cache group.

    Args:
        blocks: a tuple with one sequence of blocks (``KVCacheBlock`` or host-tier
            ``HostHit`` placeholders) per KV cache group, in group order.

    NOTE: built on the managers' hot paths without a Python ``__init__`` frame
    (``object.__new__`` then the slot), and the empty result of a decode step is one
    shared immutable instance per manager (tuples of empty tuples).
    """

    __slots__ = ("blocks",)

    def __init__(self, blocks: tuple) -> None:
        if not isinstance(blocks, tuple):
            raise TypeError(f"KVCacheBlocks takes a tuple of per-group lists, got {blocks!r}")
        self.blocks = blocks

    @property
    def num_groups(self) -> int:
        return len(self.blocks)

    def get_block_ids(self) -> tuple[list[int], ...]:
        """One list of block ids per group (vLLM's ``KVCacheBlocks.get_block_ids``)."""
        return tuple([b.block_id for b in g] for g in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks without a cached hash (one group only, as vLLM)."""
        if len(self.blocks) != 1:
            raise ValueError("get_unhashed_block_ids needs exactly one KV cache group")
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def __add__(self, other):
        """Per-group concatenation with another ``KVCacheBlocks``; with a plain list
        (one group, legacy), the plain list of both."""
        if isinstance(other, KVCacheBlocks):
            if len(other.blocks) != len(self.blocks):
                raise ValueError(
                    f"cannot add KVCacheBlocks of {len(other.blocks)} groups to one of "
                    f"{len(self.blocks)}")
            return type(self)(
                tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks)))
        if isinstance(other, list) and type(self) is KVCacheBlocks:
            return list(self.blocks[0]) + other
        return NotImplemented

    def __radd__(self, other):
        if isinstance(other, list) and type(self) is KVCacheBlocks:
            return other + list(self.blocks[0])
        return NotImplemented

    # ---- legacy sequence access: today's plain shape --------------------------------
    def _legacy(self):
        return self.blocks[0]

    def __len__(self) -> int:
        return len(self._legacy())

    def __iter__(self):
        return iter(self._legacy())

    def __getitem__(self, i):
        return self._legacy()[i]

    def __setitem__(self, i, value) -> None:
        self._legacy()[i] = value

    def __bool__(self) -> bool:
        return any(self.blocks)

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, KVCacheBlocks):
            return tuple(map(list, self.blocks)) == tuple(map(list, other.blocks))
        if isinstance(other, (list, tuple)):
            if type(self) is KVCacheBlocks:
                return list(self.blocks[0]) == list(other)
            return tuple(map(list, self.blocks)) == tuple(map(list, other))
        return NotImplemented

    __hash__ = None  # mutable lists inside

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()!r})"


class PerGroupKVCacheBlocks(KVCacheBlocks):
    """``KVCacheBlocks`` of a group layout (the hybrid manager): the same type, whose
    legacy sequence access is the tuple of per-group lists (that manager's shape
    before this type), even with one group."""

    __slots__ = ()

    def _legacy(self):
        return self.blocks

    def __setitem__(self, i, value) -> None:
        raise TypeError("set a group's blocks through .blocks[g]")


def wrap_one(blocks) -> KVCacheBlocks:
    """One group's blocks as a ``KVCacheBlocks`` (no ``__init__`` frame)."""
    r = _new(KVCacheBlocks)
    r.blocks = (blocks,)
    return r


_new = object.__new__


def empty_blocks(num_groups: int, per_group: bool = False) -> KVCacheBlocks:
    """The shared empty result for ``num_groups`` groups (immutable tuples);
    ``per_group``: a ``PerGroupKVCacheBlocks`` (a group layout's)."""
    cls = PerGroupKVCacheBlocks if per_group else KVCacheBlocks
    return cls(tuple(() for _ in range(num_groups)))


def unwrap(new_computed_blocks):
    """``new_computed_blocks`` as the plain shape the managers check: a
    ``KVCacheBlocks`` becomes its group's list, a ``PerGroupKVCacheBlocks`` the tuple of
    per-group lists; anything else is returned unchanged (the callers check it)."""
    if type(new_computed_blocks) is KVCacheBlocks:
        return list(new_computed_blocks.blocks[0])
    if type(new_computed_blocks) is PerGroupKVCacheBlocks:
        return tuple(list(g) for g in new_computed_blocks.blocks)
    return new_computed_blocks


__all__ = ["KVCacheBlocks", "PerGroupKVCacheBlocks", "empty_blocks", "unwrap", "wrap_one"]
