"""``queue_aware``: LRU that keeps the blocks waiting requests will hit (vllm#48485).

A block that a request in the waiting queue holds in its prompt is about to be hit:
evicting it now turns that hit into a recompute a few steps later. This policy splits
the candidates in two classes and evicts every *unwanted* candidate (no waiting
request holds its hash) before any *wanted* one; within a class the order is LRU
(vLLM's free-queue order). Wanted blocks are still evicted when nothing else is left:
the policy never makes an allocation fail.

What the policy knows of the queue comes from its driver, through the manager
(``needs_waiting``, ``base.py``):

* ``on_waiting(request_id, block_hashes)``: the request joined the waiting queue
  (the engine's ``add_request`` and a preemption; the replay's look-ahead window);
* ``drop_waiting(request_id)``: it left the queue. The manager calls it itself when
  the request is admitted (its first ``allocate_slots``), so a driver only reports a
  request that leaves without admission (aborted, failed); dropping a request that is
  not waiting is a no-op.

Per block hash the policy keeps the number of waiting requests whose prompt holds it
(``wanted``); a candidate is re-keyed only when its hash's count goes from 0 to 1 or
back. NOTE: every full prompt block of a waiting request counts, also blocks after the
first one it would miss (the hash chain cannot reach them for that request); counting
only the currently reachable prefix would need a lookup per queue change, and the
deeper blocks are the ones a later chain extension reuses.

Several KV cache groups (``needs_groups``; the hash index's hybrid coordinator and the
radix index's multi-group tree): a block is known by ``(hash, group id)``
(``on_cached_group``) and the manager announces a waiting request with such keys, per
group only the blocks its hit would use (``HybridKVCacheManager.waiting_keys``,
``RadixHybridKVCacheManager.waiting_keys``: a sliding window's blocks inside the window
at the aligned hit, not every block holding the hash). One group: plain hashes, as above.

Invariants (``check_invariants``): ``wanted`` is exactly the per-hash count over the
waiting requests' hashes, every cached block is listed under its hash, and each
candidate's key matches its hash's current class.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from prefixcache.core.eviction.base import KeyedPolicy, PolicyError


class QueueAwarePolicy(KeyedPolicy):
    """LRU with the blocks waiting requests hold evicted last (module docstring).

    Args:
        num_blocks: blocks in the pool.
    """

    name = "queue_aware"
    needs_waiting = True
    needs_groups = True  # (a multi-group pool keys blocks by (hash, group id))

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.wanted: dict[bytes, int] = {}  # hash -> waiting requests holding it
        self._waiting: dict = {}  # request id -> its registered hashes (a tuple)
        self._hash_of: list[bytes | None] = [None] * num_blocks  # cached block -> hash
        self._holders: dict[bytes, list[int]] = {}  # hash -> ids of cached blocks
        self._block_objs: list = [None] * num_blocks  # block objects, as add() saw them

    # -- the waiting queue ---------------------------------------------------------
    def on_waiting(self, request_id, block_hashes: Iterable[bytes]) -> None:
        """``request_id`` joined the waiting queue holding ``block_hashes``.

        Raises:
            ValueError: the request is already waiting (nothing changed).
        """
        if request_id in self._waiting:
            raise ValueError(f"queue_aware: request {request_id!r} is already waiting")
        hashes = tuple(dict.fromkeys(block_hashes))  # a hash counts once per request
        self._waiting[request_id] = hashes
        wanted = self.wanted
        for h in hashes:
            c = wanted.get(h, 0)
            wanted[h] = c + 1
            if not c:
                self._rekey_holders(h)

    def drop_waiting(self, request_id) -> None:
        """``request_id`` left the waiting queue (admitted or finished); a request that
        is not waiting is ignored."""
        hashes = self._waiting.pop(request_id, None)
        if hashes is None:
            return
        wanted = self.wanted
        for h in hashes:
            c = wanted[h] - 1
            if c:
                wanted[h] = c
            else:
                del wanted[h]
                self._rekey_holders(h)

    def waiting_ids(self) -> list:
        """Ids of the requests the policy holds as waiting (arrival order)."""
        return list(self._waiting)

    def _rekey_holders(self, h: bytes) -> None:
        held = self._holders.get(h)
        if held:
            token, blocks = self._token, self._block_objs
            for bid in held:
                if token[bid]:
                    self.rekey(blocks[bid])

    # -- block notifications -------------------------------------------------------
    def on_cached(self, block, block_hash, request, position) -> None:
        super().on_cached(block, block_hash, request, position)
        bid = block.block_id
        self._hash_of[bid] = block_hash
        held = self._holders.get(block_hash)
        if held is None:
            self._holders[block_hash] = [bid]
        else:
            held.append(bid)

    def on_cached_group(self, block, block_hash, request, position, group_id) -> None:
        # A multi-group pool: the block is known by (hash, group), the key its
        # coordinator announces waiting requests with (waiting_keys).
        self.on_cached(block, (block_hash, group_id), request, position)

    def on_evicted(self, block) -> None:
        bid = block.block_id
        h = self._hash_of[bid]
        if h is not None:
            held = self._holders[h]
            held.remove(bid)
            if not held:
                del self._holders[h]
            self._hash_of[bid] = None

    def add(self, block) -> None:
        self._block_objs[block.block_id] = block
        super().add(block)

    def key(self, block) -> tuple[int, int]:
        bid = block.block_id
        h = self._hash_of[bid]
        return (1 if h is not None and h in self.wanted else 0, self.released_at[bid])

    def clear(self) -> None:
        # Every block left the cache; the waiting requests are still waiting.
        super().clear()
        self._holders = {}
        self._hash_of = [None] * self.num_blocks

    def check_invariants(self, candidate_ids: Sequence[int]) -> None:
        super().check_invariants(candidate_ids)  # incl. every candidate's key is current
        counts: dict[bytes, int] = {}
        for hashes in self._waiting.values():
            for h in hashes:
                counts[h] = counts.get(h, 0) + 1
        if counts != self.wanted:
            bad = sorted(set(counts.items()) ^ set(self.wanted.items()))[:5]
            raise PolicyError(f"queue_aware: wanted counts differ from the waiting "
                              f"requests' hashes: {bad}")
        for h, held in self._holders.items():
            for bid in held:
                if self._hash_of[bid] != h:
                    raise PolicyError(f"queue_aware: block {bid} listed under hash "
                                      f"{h!r} but holds {self._hash_of[bid]!r}")
        listed = sum(len(v) for v in self._holders.values())
        cached = sum(1 for h in self._hash_of if h is not None)
        if listed != cached:
            raise PolicyError(f"queue_aware: {cached} cached blocks but {listed} listed "
                              "under their hashes")
