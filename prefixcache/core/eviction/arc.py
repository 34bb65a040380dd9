"""``arc``: Adaptive Replacement Cache (Megiddo & Modha, FAST'03), over cached blocks.

Asked for in vllm#40268. ARC splits the cache into ``T1`` (blocks seen once since they
were cached: recency) and ``T2`` (blocks hit at least once: frequency), and keeps two
*ghost* lists of recently evicted hashes, ``B1`` (evicted from ``T1``) and ``B2``
(evicted from ``T2``). A target size ``p`` for ``T1`` adapts: re-caching a hash found
in ``B1`` means ``T1`` was too small (``p`` grows), one found in ``B2`` means ``T2``
was (``p`` shrinks); both go straight to ``T2``. The victim comes from ``T1`` while
``T1`` is larger than ``p``, else from ``T2``; LRU inside each.

Mapping onto the index/policy protocol (``base.py``):

* ``|T1|`` and ``|T2|`` count every cached block, in use or not (ARC's lists are the
  cache's contents); only candidates (cached, ``ref_cnt == 0``) can be victims, each
  list's candidates in the order they became candidates (LRU first).
* A "request" for a block is a prefix-lookup hit (``on_hit``) or its caching
  (``on_cached``: a miss). ARC's ghost rule is applied at ``on_cached`` (the hash is
  computed again after a miss), ``on_evicted`` moves the hash to ``B1`` / ``B2``.
* The ghost lists are bounded as in ARC: ``|T1| + |B1| <= c`` and
  ``|T1| + |T2| + |B1| + |B2| <= 2c`` with ``c = num_blocks``.
* Duplicate blocks (two cached blocks with one hash, as vLLM's pool allows) are two
  entries; evicting one makes its hash a ghost while the other stays cached.
* When only one list has candidates, the victim comes from it (a block in use cannot
  be evicted, whatever ``p`` says).

NOTE: not a keyed policy: the victim depends on ``p`` at the time of the eviction,
not on a key fixed when the block became a candidate.
"""

from __future__ import annotations

from collections import OrderedDict

from prefixcache.core.eviction.base import EvictionPolicy, PolicyError

_T1, _T2 = 1, 2


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (see the module docstring).

    Attributes:
        p: ARC's adaptive target size of ``T1`` (blocks), in ``[0, num_blocks]``.
        ghost_hits: re-cached hashes found in ``B1`` / ``B2`` (a dict of two counts).
    """

    name = "arc"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.p = 0.0
        self._seg = [0] * num_blocks  # 0: not cached; _T1 / _T2
        self._hash: list[bytes | None] = [None] * num_blocks
        self._count = {_T1: 0, _T2: 0}  # cached blocks per list (in use or not)
        self._free = {_T1: OrderedDict(), _T2: OrderedDict()}  # candidates, LRU first
        self._where = [0] * num_blocks  # which candidate dict holds the block; 0: none
        self._b1: OrderedDict[bytes, None] = OrderedDict()  # ghosts, oldest first
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self.ghost_hits = {"b1": 0, "b2": 0}

    # -- notifications -----------------------------------------------------------
    def on_cached(self, block, block_hash, request, position) -> None:
        bid = block.block_id
        b1, b2 = self._b1, self._b2
        seg = _T1
        if block_hash in b1:
            # NOTE: ARC's case II: T1 was too small; delta = max(1, |B2| / |B1|).
            self.p = min(float(self.num_blocks), self.p + max(1.0, len(b2) / len(b1)))
            del b1[block_hash]
            self.ghost_hits["b1"] += 1
            seg = _T2
        elif block_hash in b2:
            # ARC's case III: T2 was too small; delta = max(1, |B1| / |B2|).
            self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
            del b2[block_hash]
            self.ghost_hits["b2"] += 1
            seg = _T2
        self._seg[bid] = seg
        self._hash[bid] = block_hash
        self._count[seg] += 1
        self._trim_ghosts()  # ARC's case IV: a miss drops the oldest ghosts first

    def on_hit(self, block, request) -> None:
        bid = block.block_id
        if self._seg[bid] == _T1:  # ARC's case I: a hit moves a T1 block to T2
            self._seg[bid] = _T2
            self._count[_T1] -= 1
            self._count[_T2] += 1
            if self._where[bid] == _T1:  # a candidate: keep it in step with its list
                del self._free[_T1][bid]
                self._free[_T2][bid] = block
                self._where[bid] = _T2
        elif self._where[bid] == _T2:
            self._free[_T2].move_to_end(bid)

    def on_evicted(self, block) -> None:
        bid = block.block_id
        seg = self._seg[bid]
        if not seg:
            return
        h = self._hash[bid]
        self._seg[bid] = 0
        self._hash[bid] = None
        self._count[seg] -= 1
        ghost = self._b1 if seg == _T1 else self._b2
        ghost.pop(h, None)
        ghost[h] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self.num_blocks
        b1, b2 = self._b1, self._b2
        while b1 and self._count[_T1] + len(b1) > c:
            b1.popitem(last=False)
        while self._count[_T1] + self._count[_T2] + len(b1) + len(b2) > 2 * c:
            (b2 if b2 else b1).popitem(last=False)

    # -- candidates --------------------------------------------------------------
    def add(self, block) -> None:
        bid = block.block_id
        if self._where[bid]:
            raise PolicyError(f"arc: block {bid} is already a candidate")
        seg = self._seg[bid]
        if not seg:
            raise PolicyError(f"arc: block {bid} is a candidate but was never cached")
        self._free[seg][bid] = block
        self._where[bid] = seg

    def discard(self, block) -> None:
        bid = block.block_id
        seg = self._where[bid]
        if not seg:
            raise PolicyError(f"arc: block {bid} is not a candidate")
        del self._free[seg][bid]
        self._where[bid] = 0

    def _victim_list(self) -> int:
        t1, t2 = self._free[_T1], self._free[_T2]
        if t1 and (self._count[_T1] > self.p or not t2):
            return _T1
        if t2:
            return _T2
        raise PolicyError("arc: pop() with no candidates")

    def pop(self):
        seg = self._victim_list()
        bid, block = self._free[seg].popitem(last=False)
        self._where[bid] = 0
        return block

    def __len__(self) -> int:
        return len(self._free[_T1]) + len(self._free[_T2])

    def clear(self) -> None:
        n = self.num_blocks
        self.p = 0.0
        self._seg = [0] * n
        self._hash = [None] * n
        self._count = {_T1: 0, _T2: 0}
        self._free = {_T1: OrderedDict(), _T2: OrderedDict()}
        self._where = [0] * n
        self._b1.clear()
        self._b2.clear()

    def candidate_ids(self) -> list[int]:
        if not len(self):
            return []
        first = self._victim_list()
        second = _T2 if first == _T1 else _T1
        return list(self._free[first]) + list(self._free[second])

    def check_invariants(self, candidate_ids) -> None:
        super().check_invariants(candidate_ids)
        for seg in (_T1, _T2):
            n = sum(1 for s in self._seg if s == seg)
            if n != self._count[seg]:
                raise PolicyError(f"arc: list {seg} counts {self._count[seg]} blocks, "
                                  f"{n} are marked")
            for bid in self._free[seg]:
                if self._seg[bid] != seg or self._where[bid] != seg:
                    raise PolicyError(f"arc: candidate {bid} is in list {seg} but marked "
                                      f"{self._seg[bid]} / {self._where[bid]}")
        c = self.num_blocks
        if not 0.0 <= self.p <= c:
            raise PolicyError(f"arc: p={self.p} outside [0, {c}]")
        total = self._count[_T1] + self._count[_T2] + len(self._b1) + len(self._b2)
        if total > 2 * c or (self._b1 and self._count[_T1] + len(self._b1) > c):
            raise PolicyError(f"arc: ghost lists over their bounds (B1 {len(self._b1)}, "
                              f"B2 {len(self._b2)}, T1 {self._count[_T1]}, "
                              f"T2 {self._count[_T2]}, c {c})")
