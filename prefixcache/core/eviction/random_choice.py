"""``random``: the victim is drawn uniformly at random among the current candidates,
from a seeded generator (the same operations with the same ``seed`` evict the same
blocks).

Each ``pop`` draws one index uniformly over the candidates present at that moment
(not a random key fixed when a block became a candidate: a key drawn at ``add`` would
make a block that survived earlier pops less likely to go than a newcomer).

Under the radix index the candidates are the tree's unlocked leaves, and a parent
becomes one when its last child leaves: there ``random`` is the Randomized Leaf Token
eviction (RLT) of Wu, Silwal and Zhang ("Randomization Boosts KV Caching, Learning
Balances Query Load", arXiv 2601.18999; their SGLang fork's ``evict_core``: draw a leaf
uniformly, take one unit from its tail, a parent left childless joins the leaves) at
block granularity, one block per draw. Under the hash index every cached block with no
reference is a candidate (vLLM's rule), leaf or not: uniform random eviction.

Options: ``seed`` (an int, default 0).
"""

from __future__ import annotations

import random

from prefixcache._validate import check_int
from prefixcache.core.eviction.base import EvictionPolicy, PolicyError


class RandomPolicy(EvictionPolicy):
    """Uniform random victims among the candidates, seeded (see the module docstring).

    Args:
        num_blocks: blocks in the pool.
        seed: the generator's seed (an int).
    """

    name = "random"

    def __init__(self, num_blocks: int, *, seed: int = 0):
        self.seed = check_int("random: seed", seed)
        super().__init__(num_blocks)
        self._rng = random.Random(self.seed)
        self._items: list = []  # the candidate blocks, in no particular order
        self._slot = [-1] * num_blocks  # each candidate's index in _items; -1: none

    def add(self, block) -> None:
        bid = block.block_id
        if self._slot[bid] >= 0:
            raise PolicyError(f"random: block {bid} is already a candidate")
        self._slot[bid] = len(self._items)
        self._items.append(block)

    def _remove_at(self, i: int):
        items = self._items
        block = items[i]
        last = items.pop()
        if last is not block:  # (swap the last one into the hole: O(1))
            items[i] = last
            self._slot[last.block_id] = i
        self._slot[block.block_id] = -1
        return block

    def discard(self, block) -> None:
        i = self._slot[block.block_id]
        if i < 0:
            raise PolicyError(f"random: block {block.block_id} is not a candidate")
        self._remove_at(i)

    def pop(self):
        if not self._items:
            raise PolicyError("random: pop() with no candidates")
        return self._remove_at(self._rng.randrange(len(self._items)))

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items = []
        self._slot = [-1] * self.num_blocks

    def candidate_ids(self) -> list[int]:
        """The candidates' ids (in no victim order: the next victim is drawn at ``pop``)."""
        return [b.block_id for b in self._items]

    def check_invariants(self, candidate_ids) -> None:
        for i, b in enumerate(self._items):
            if self._slot[b.block_id] != i:
                raise PolicyError(f"random: block {b.block_id} at {i} is indexed "
                                  f"{self._slot[b.block_id]}")
        if sum(1 for s in self._slot if s >= 0) != len(self._items):
            raise PolicyError("random: stale candidate slots")
        super().check_invariants(candidate_ids)
