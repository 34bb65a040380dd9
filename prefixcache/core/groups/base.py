"""The per-kind interface of a KV cache group (vLLM 0.33's ``SingleTypeKVCacheManager``).

A kind is one spec class and one subclass of ``SingleTypeManager`` in one file of
``prefixcache.core.groups``, registered by name in ``kv_groups.GROUP_KINDS``. The
coordinator (``core.hybrid.HybridKVCacheManager``) builds one instance per KV cache group
and calls only the methods below; the defaults are full attention's (every block kept
until the request ends, no null slot), so a kind overrides what differs.

The request's tables live in the coordinator's per-request state ``st`` (``st.tables[g]``,
``st.num_cached[g]``, ``st.num_null[g]``); a kind that needs more per-request state keeps
it in a dict keyed by request id and drops it in ``free``.
"""

from __future__ import annotations

from itertools import islice

from prefixcache._validate import ArgumentTypeError
from prefixcache.core.block_pool import (  # noqa: F401 - the key layout lives there
    _KEY_BYTES,
    InvariantError,
    KVCacheBlock,
    group_suffix,
)


def check_block_hash_list(block_hashes) -> list[bytes]:
    """``block_hashes`` as a list, each a ``bytes`` digest (``ArgumentTypeError``
    otherwise: a string or bytes object is not a sequence of hashes); the multi-group
    managers' ``waiting_keys`` argument check."""
    if isinstance(block_hashes, (str, bytes)):
        raise ArgumentTypeError(
            f"block_hashes must be a sequence of block hashes (bytes), got {block_hashes!r}")
    hashes = list(block_hashes)
    for h in hashes:
        if type(h) is not bytes:
            raise ArgumentTypeError(f"block hashes must be bytes, got {h!r}")
    return hashes


def check_group_hits(blocks, g: int, n: int, null, null_ok: bool, is_cached,
                     is_host_hit=None) -> list:
    """Group ``g``'s hit list ``blocks`` (a list or tuple) as a list, checked as every
    multi-group manager (hash or radix index) checks ``new_computed_blocks[g]``: ``n``
    blocks (group 0's count), ``null`` slots only where ``null_ok``, else
    ``KVCacheBlock`` objects for which ``is_cached(block, g)`` (the index's "a cached
    block of group g of this manager") holds -- or, with a host tier
    (``is_host_hit = (placeholder types, predicate)``: ``HostHit``, and ``TierHit``
    with tiers below the host), placeholders for which ``predicate(b, g)`` (a current
    entry of group g in a tier) holds. ``ValueError`` / ``ArgumentTypeError``
    otherwise.
    """
    blocks = list(blocks)
    if len(blocks) != n:
        raise ValueError(
            f"new_computed_blocks[{g}] has {len(blocks)} blocks, group 0 has {n}: "
            "every group's hit covers the same tokens")
    for b in blocks:
        if b is null:
            if not null_ok:
                raise ValueError(
                    f"new_computed_blocks[{g}] holds a null slot, but group {g} is "
                    "full attention")
            continue
        t = type(b)
        if t is not KVCacheBlock:
            if is_host_hit is None or t not in is_host_hit[0]:
                raise ArgumentTypeError(
                    f"new_computed_blocks must hold KVCacheBlock objects, got {b!r}")
            if not is_host_hit[1](b, g):
                where = "host-tier" if t is is_host_hit[0][0] else "lower-tier"
                raise ValueError(
                    f"{b!r} is not a current {where} hit of group {g} of this manager "
                    "(already promoted, or the tier's entry changed since "
                    "get_computed_blocks)")
            continue
        if not is_cached(b, g):
            raise ValueError(
                f"block {b.block_id} is not a cached block of group {g} of this manager")
    return blocks


class SingleTypeManager:
    """One KV cache group's rules over the coordinator's shared pool.

    Class attributes (the coordinator reads them; no per-kind branch there):
        spec_class: the kind's spec (``KVCacheGroup.spec`` must be an instance).
        downward_closed: a hit of L tokens implies every shorter one (full attention):
            the coordinator's fixed-point loop looks such a group up once and trims its
            blocks to the final length (vLLM's "Full attention is downward-closed").
        allows_null_hits: hit lists may hold ``null_block`` slots.
        aligned_prefill: prefills must stop where the kind keeps a state
            (``prefill_stops``), so a scheduler splits them (vLLM's Mamba "align").
        supports_lookahead: ``num_lookahead_tokens`` is modelled.
        caches_blocks: the kind's full blocks are cached (under ``(hash, group id)``
            keys, by the coordinator as each step fills them; an instance may set it).
        dense_caching: every full block a step fills is cached (else the kind's
            ``cache_blocks`` picks some, and a held block may carry no key).

    Args:
        spec: the group's spec; group_id: its index in the layout.
        coordinator: the ``HybridKVCacheManager`` (its ``block_pool``, ``block_size``,
            ``policy``).
    """

    spec_class: type = type(None)
    caches_blocks = True
    dense_caching = True
    downward_closed = False
    allows_null_hits = False
    aligned_prefill = False
    supports_lookahead = True

    def __init__(self, spec, group_id: int, coordinator):
        self.spec = spec
        self.group_id = group_id
        self.block_size = coordinator.block_size
        self.block_pool = coordinator.block_pool
        self.null_block = coordinator.block_pool.null_block
        self.policy = coordinator.policy
        self.suffix = group_suffix(group_id)
        # The host tier (``core/host_tier.py``, keyed by this pool's group keys) or
        # None. With one, a lookup counts a host entry of the group as a hit (a
        # ``HostHit`` placeholder the coordinator promotes at admission).
        # With tiers below the host (``host_tier.lower``, a ``TierChain``), a key
        # neither on the device nor on the host is looked up there (a ``TierHit``).
        self.host_tier = getattr(coordinator, "host_tier", None)
        self._find_lower = None
        if self.host_tier is not None:
            from prefixcache.core.tiers.base import TierHit  # noqa: PLC0415 - (a cycle)
            from prefixcache.core.tiers.host import HostHit  # noqa: PLC0415

            self._host_hit_class = HostHit
            self._tier_hit_class = TierHit
            if self.host_tier.lower is not None:
                self._find_lower = self.host_tier.lower.find
            self.get_cached = self._get_cached_tiered  # (shadows the method)

    # ---------------------------------------------------------------- lookups
    def get_cached(self, h: bytes, group_ids, suffixes) -> list | None:
        """vLLM's ``BlockPool.get_cached_block``: one cached block per group, or None
        if any group misses (the first inserted block of a key)."""
        cached = self.block_pool.cached_block_hash_to_block  # (reset replaces it)
        out = []
        for g in group_ids:
            b = cached.get(h + suffixes[g])
            if b is None:
                return None
            if type(b) is dict:
                b = next(iter(b.values()))
            out.append(b)
        return out

    def _get_cached_tiered(self, h: bytes, group_ids, suffixes) -> list | None:
        """``get_cached`` with a host tier: per group a device block, else a host entry
        under the same key (a ``HostHit``), else the first tier below the host that can
        serve the key (a ``TierHit``), else None (the position misses)."""
        cached = self.block_pool.cached_block_hash_to_block  # (reset replaces it)
        on_host = self.host_tier.hash_to_slot
        find = self._find_lower
        out = []
        for g in group_ids:
            key = h + suffixes[g]
            b = cached.get(key)
            if b is None:
                slot = on_host.get(key)
                if slot is not None:
                    b = self._host_hit_class(key, slot.block_id)
                elif find is None:
                    return None
                else:
                    tier = find(key)
                    if tier is None:
                        return None
                    b = self._tier_hit_class(key, tier)
            elif type(b) is dict:
                b = next(iter(b.values()))
            out.append(b)
        return out

    def find_longest_cache_hit(self, hashes, max_length: int, group_ids, suffixes):
        """``(blocks per group of group_ids, hit tokens)``: the longest hit of at most
        ``max_length`` tokens valid for every group of the spec. Each kind's own."""
        raise NotImplementedError(f"{type(self).__name__}.find_longest_cache_hit")

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """vLLM's ``get_num_skipped_tokens``: leading tokens whose blocks the next token
        no longer needs (0: every block is kept)."""
        return 0

    def prefill_stops(self, request, start: int, junction: int) -> tuple[int, ...]:
        """Token positions a prefill chunk starting at ``start`` must stop at (only
        for ``aligned_prefill`` kinds; ``junction``: the longest single-group hit
        when it is longer than the hit, else 0)."""
        return ()

    def note_junction(self, request, junction: int) -> None:
        """The longest single-group hit of ``request``'s lookup (0 if no longer than
        the joint hit), given by ``prefill_chunks`` to ``aligned_prefill`` kinds."""

    # ------------------------------------------------------------- allocation
    def blocks_to_allocate(self, st, hit, num_required: int, num_local_computed: int) -> int:
        """vLLM's ``get_num_blocks_to_allocate``: blocks the step takes from the free
        queue (new ones, plus hit blocks that leave it when touched)."""
        if st is not None:
            n = num_required - len(st.tables[self.group_id])
            return n if n > 0 else 0
        bs = self.block_size
        null = self.null_block
        skipped = self.num_skipped_tokens(num_local_computed) // bs
        hit = hit if hit is not None else ()
        n = num_required - max(skipped, len(hit))
        n = n if n > 0 else 0
        # Hit blocks in the free queue leave it when touched.
        return n + sum(
            1 for b in islice(hit, skipped, None) if b is not null and b.ref_cnt == 0)

    def add_hit_blocks(self, request, hit, num_local_computed: int):
        """vLLM's ``add_local_computed_blocks`` for a new request: ``(table, num_null)``,
        the hit's slots before the kind's skipped tokens nulled, the rest touched."""
        null = self.null_block
        hit = hit if hit is not None else []
        skipped = self.num_skipped_tokens(num_local_computed) // self.block_size
        kept = hit[skipped:]
        if self.host_tier is None:
            self.block_pool.touch([b for b in kept if b is not null], request)
        else:  # (host hits are promoted by the coordinator, after the device hits)
            self.block_pool.touch(
                [b for b in kept if b is not null and type(b) is KVCacheBlock], request)
        return [null] * skipped + kept, skipped

    def allocate_new_blocks(self, st, num_required: int):
        """vLLM's ``allocate_new_blocks``: extend the table to ``num_required`` slots;
        the new blocks (a list, possibly empty)."""
        table = st.tables[self.group_id]
        n = num_required - len(table)
        if n > 0:
            got = self.block_pool.get_new_blocks(n)
            table.extend(got)
            return got
        return []

    def cache_blocks(self, request, table, hashes, num_cached: int, num_full: int) -> None:
        """Cache ``table[num_cached:num_full]`` under ``(hash, group id)`` keys (the
        coordinator inlines this rule for kinds that do not override it)."""
        self.block_pool.cache_group_blocks(request, table, hashes, num_cached, num_full,
                                           self.block_size, self.group_id)

    def remove_skipped_blocks(self, st, num_computed_tokens: int) -> None:
        """vLLM's ``remove_skipped_blocks``: release blocks the next token no longer
        needs, their slots nulled (nothing for full attention)."""

    def idle_limit(self, st) -> int:
        """The largest ``num_computed_tokens`` at which ``remove_skipped_blocks``
        releases nothing (the decode fast path's bound)."""
        return 1 << 62

    def free(self, st) -> None:
        """Release the request's blocks of this group: the table reversed (its last
        block evicts first), null slots skipped."""
        null = self.null_block
        table = st.tables[self.group_id]
        blocks = [b for b in reversed(table) if b is not null]
        if blocks:
            if self.policy is None:
                self.block_pool.free_blocks(blocks, st.request)
            else:  # (the table's non-null slots are its tail, for the policy)
                self.block_pool.free_blocks(blocks, st.request, len(table) - len(blocks))

    # ------------------------------------------------------------- invariants
    def check_slots(self, st, rid) -> None:
        """The kind's rule on null slots in a running request's table (full
        attention: none). ``InvariantError`` if broken."""
        g = self.group_id
        table = st.tables[g]
        null = self.null_block
        if st.num_null[g] or any(b is null for b in table):
            raise InvariantError(f"request {rid!r}: full-attention group {g} has null slots")


__all__ = ["SingleTypeManager", "check_block_hash_list", "group_suffix"]
