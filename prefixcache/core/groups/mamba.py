"""State-space (Mamba / linear-attention) layers: the spec and its single-type manager
(vLLM 0.33's ``MambaSpec`` / ``MambaManager`` with ``mamba_cache_mode="align"``).

A state-space layer carries one fixed-size state per request, not one KV entry per
token, so a block of this group holds a *state snapshot*: slot ``i`` of the table holds
the state after exactly ``(i + 1) * block_size`` tokens once those are computed. The
rules, as vLLM's "align" mode with one block size for every group, no speculative
blocks, no prefill checkpoint blocks and hash block = block (the configuration the
peer harness drives; ``tests/data/replay_golden_state``):

* **Which states are kept.** A step that reaches ``num_tokens`` needs only the running
  state: the table gets one new block at slot ``ceil(num_tokens / block_size) - 1``,
  the slots before it are null (vLLM's ``allocate_new_blocks``). The block of the
  previous step stays one more step (the kernel copies the state from it), then is
  released (``remove_skipped_blocks``: ``num_skipped_tokens = num_computed - 1``, plus
  vLLM's ``last_state_block_idx``). A block is cached under its prefix's hash when its
  slot is full (dense retention), so the states kept for reuse are those at the
  block-aligned positions a step *ends* on: the chunk ends of a prefill and every block
  boundary a decode crosses.
* **Where prefills stop** (``prefill_stops``, vLLM's scheduler
  ``_mamba_block_aligned_split``): at the prompt's last block boundary before its last
  token, ``(num_tokens - 1) // block_size * block_size``, and at the junction -- the
  longest hit of another group when it is longer than the joint hit -- so that the
  state there is kept for the next request (Marconi's shared-prefix checkpoint).
* **How a hit is aligned.** The kind's hit is the rightmost cached block within the
  candidate length (``[null] * i + [block_i]``, ``(i + 1) * block_size`` tokens); the
  coordinator's fixed point takes the minimum with full attention (downward closed,
  trimmed to it) and sliding windows.
* **Admission.** A step takes at most one new block of this group, plus the hit block
  if it sits in the free queue.
* **Sparse retention** (``MambaSpec(retention_interval=0)``, vLLM's
  ``prefix_cache_retention_interval=0``): only the states a later request can resume
  at are cached -- the prompt's replay boundary and the lookup's junction (vLLM's
  Marconi-style admission); decode and intermediate chunk states are not.

* **Host tier** (``num_host_blocks=N``, hash index). A cached state block is one
  state snapshot, one page of the group's state arrays, under its ``(hash, group)``
  key: when the device evicts it, it is demoted like any block; the lookup above reads
  ``get_cached``, which with a tier answers a host entry as a hit, so the rightmost
  state within the candidate length may be host-resident (dense or sparse retention
  alike); admission loads it into a fresh block (counted by ``blocks_to_allocate``:
  ``HostHit.ref_cnt`` is 0), which then plays the hit block (the previous step's
  state, released a step later). Sound because a state is demoted by its key, not by
  table position (vLLM's connectors hand mamba states off the same way, exact block
  and boundary, because the table is not append-only), and a joint hit needs every
  other group's blocks too (full attention's, device or host, loaded with it).

NOTE: not modelled (off in the configuration above): speculative blocks, prefill
checkpoint blocks, partial (sub-block) hash hits and their copy-on-write, sparse
retention intervals other than 0 (``MambaSpec.retention_interval``), vLLM's "cached this step" deferral (a
hit on a block cached in the same scheduler step waits a step: the replay schedules one
request per step, so it never applies), lookahead slots (refused), the "none" and "all"
cache modes (refused: vLLM serves prefix caching with "align" only).
"""

from __future__ import annotations

import dataclasses

from prefixcache.core.block_pool import InvariantError
from prefixcache.core.groups.base import SingleTypeManager

_CACHE_MODES = ("align",)


@dataclasses.dataclass(frozen=True)
class MambaSpec:
    """A state-space layer group: a fixed-size state per request, snapshotted at block
    boundaries (vLLM's ``MambaSpec``).

    Args:
        mamba_cache_mode: ``"align"`` (vLLM's prefix-caching mode; the only one).
        retention_interval: which states are cached (vLLM's
            ``prefix_cache_retention_interval`` for this group): ``None`` every full
            block's state (dense, vLLM's default); ``0`` only the states a later
            request can resume at -- the prompt's replay boundary (its last block
            boundary before its last token) and the junction of its lookup (the
            longest single-group hit, Marconi's branch point): vLLM's Marconi-style
            admission. Other intervals are not modelled.
    """

    mamba_cache_mode: str = "align"
    retention_interval: int | None = None
    kind = "mamba"  # vLLM's KV event spec kind

    def __post_init__(self):
        if self.mamba_cache_mode not in _CACHE_MODES:
            raise ValueError(
                f"mamba_cache_mode must be one of {_CACHE_MODES} (vLLM's prefix caching of "
                f"state-space layers), got {self.mamba_cache_mode!r}")
        r = self.retention_interval
        if r is not None and (type(r) is not int or r != 0):
            raise ValueError(
                f"retention_interval must be None (dense) or 0 (only the states a later "
                f"request can resume at); got {r!r} (sparse intervals are not modelled)")

    @property
    def sliding_window(self) -> None:
        return None


class MambaManager(SingleTypeManager):
    """vLLM's ``MambaManager`` ("align"): one running state block per request, the
    previous one released a step later, states cached at full block boundaries."""

    spec_class = MambaSpec
    allows_null_hits = True
    aligned_prefill = True
    supports_lookahead = False

    def __init__(self, spec, group_id, coordinator):
        super().__init__(spec, group_id, coordinator)
        # Per running request (by id): vLLM's last_state_block_idx and
        # _num_retired_blocks.
        self._last_state: dict[str, int] = {}
        self._retired: dict[str, int] = {}
        # retention_interval=0: only reachable boundaries' states are cached; the
        # junction of each request's lookup (by id, from prefill_chunks).
        self.dense_caching = spec.retention_interval is None
        self._junctions: dict[str, int] = {}

    def find_longest_cache_hit(self, hashes, max_length, group_ids, suffixes):
        """``MambaManager.find_longest_cache_hit``: the rightmost cached block within
        ``max_length`` (earlier slots null)."""
        bs = self.block_size
        get_cached = self.get_cached
        null = self.null_block
        for i in range(max_length // bs - 1, -1, -1):
            got = get_cached(hashes[i], group_ids, suffixes)
            if got is not None:
                return [[null] * i + [b] for b in got], (i + 1) * bs
        return [[] for _ in group_ids], 0

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Only the state of the last computed token is needed (vLLM's
        ``num_computed_tokens - 1``, here never below 0)."""
        return num_computed_tokens - 1 if num_computed_tokens > 1 else 0

    def prefill_stops(self, request, start: int, junction: int) -> tuple[int, ...]:
        bs = self.block_size
        return ((request.num_tokens - 1) // bs * bs,
                start + (junction - start) // bs * bs if junction else 0)

    def note_junction(self, request, junction: int) -> None:
        if not self.dense_caching:
            self._junctions[request.request_id] = junction

    def cache_blocks(self, request, table, hashes, num_cached, num_full) -> None:
        """Dense: every full block. ``retention_interval=0`` (vLLM's
        ``reachable_block_mask``): only the blocks ending on the replay boundary
        ``num_prompt_tokens - 1`` and on the lookup's junction, block-aligned down."""
        if self.dense_caching:
            super().cache_blocks(request, table, hashes, num_cached, num_full)
            return
        bs = self.block_size
        null = self.null_block
        boundaries = [request.num_prompt_tokens - 1]
        junction = self._junctions.get(request.request_id, 0)
        if junction:
            boundaries.append(junction)
        for b in sorted({t // bs - 1 for t in boundaries}):
            if num_cached <= b < num_full and table[b] is not null:
                self.block_pool.cache_group_blocks(request, table, hashes, b, b + 1, bs,
                                                   self.group_id)

    def blocks_to_allocate(self, st, hit, num_required, num_local_computed) -> int:
        held = len(st.tables[self.group_id]) if st is not None else 0
        hit = hit if hit is not None else ()
        n = num_required - len(hit) - held
        if n > 1:
            n = 1  # vLLM's physical_block_cap: one running state block a step
        null = self.null_block
        return n + sum(1 for b in hit if b is not null and b.ref_cnt == 0)

    def allocate_new_blocks(self, st, num_required: int):
        table = st.tables[self.group_id]
        prev = len(table)
        if num_required <= prev:
            return []
        if prev > 0:
            # The previous step's state block (or the hit's): released next step.
            self._last_state[st.request.request_id] = prev - 1
        null = self.null_block
        if prev < num_required - 1:
            table.extend([null] * (num_required - 1 - prev))
        got = self.block_pool.get_new_blocks(num_required - len(table))
        out = table[prev:]
        table.extend(got)
        out.extend(got)
        return out

    def remove_skipped_blocks(self, st, num_computed_tokens: int) -> None:
        """Release the state blocks before the last computed token's (vLLM's range
        release, null slots skipped, then its ``last_state_block_idx``)."""
        g = self.group_id
        rid = st.request.request_id
        table = st.tables[g]
        null = self.null_block
        bs = self.block_size
        n = (num_computed_tokens - 1) // bs if num_computed_tokens > 1 else 0
        if n > len(table):
            n = len(table)
        first = self._retired.get(rid, 0)
        if first < n:
            freed = []
            for i in range(n - 1, first - 1, -1):
                b = table[i]
                if b is null:
                    continue
                freed.append((i, b))
                table[i] = null
            if freed:
                self._release(freed, st.request)
            self._retired[rid] = n
        last = self._last_state.get(rid)
        if last is not None and last < -(-num_computed_tokens // bs) - 1:
            b = table[last]
            if b is not null:
                table[last] = null
                self._release([(last, b)], st.request)

    def _release(self, freed, request) -> None:
        if self.policy is None:  # one call, vLLM's order
            self.block_pool.free_blocks([b for _, b in freed], request)
        else:  # the table positions, one by one, for the policy
            for i, b in freed:
                self.block_pool.free_blocks([b], request, i)

    def idle_limit(self, st) -> int:
        # A real block at slot j is released once num_computed_tokens passes
        # (j + 1) * block_size (by the range or as the last state block); the real
        # slots are the last one and the previous step's.
        table = st.tables[self.group_id]
        j = len(table) - 1
        last = self._last_state.get(st.request.request_id)
        if last is not None and last < j and table[last] is not self.null_block:
            j = last
        return (j + 1) * self.block_size if j >= 0 else 1 << 62

    def free(self, st) -> None:
        rid = st.request.request_id
        self._last_state.pop(rid, None)
        self._retired.pop(rid, None)
        self._junctions.pop(rid, None)
        table = st.tables[self.group_id]
        null = self.null_block
        if self.policy is None:
            blocks = [b for b in reversed(table) if b is not null]
            if blocks:
                self.block_pool.free_blocks(blocks, st.request)
        else:
            held = [(i, b) for i, b in enumerate(table) if b is not null]
            self._release(held[::-1], st.request)

    def check_slots(self, st, rid) -> None:
        """At most two real blocks (the running state, in the last slot, and the
        previous step's)."""
        g = self.group_id
        table = st.tables[g]
        null = self.null_block
        real = [i for i, b in enumerate(table) if b is not null]
        if len(real) > 2:
            raise InvariantError(
                f"request {rid!r} state group {g} holds {len(real)} state blocks at "
                f"slots {real} (at most 2: the running state and the previous one)")
        if table and table[-1] is null:
            raise InvariantError(f"request {rid!r} state group {g}: the last slot is null")
        last = self._last_state.get(rid)
        extra = [i for i in real if i != len(table) - 1 and i != last]
        if extra:
            raise InvariantError(
                f"request {rid!r} state group {g}: state blocks at slots {extra} are neither "
                "the running state nor the previous step's")


__all__ = ["MambaManager", "MambaSpec"]
