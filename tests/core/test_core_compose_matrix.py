"""Every combination of index x eviction policy x tier x group layout: it runs (with
the invariants checked after every call) or it is refused by the one composition rule
(``indexes.refusal``) with that rule's reason -- and, where the semantics say so, the
indexes agree on hit tokens.
"""

from __future__ import annotations

import random

import pytest

from prefixcache.core import KVCacheManager, Request
from prefixcache.core.eviction import POLICIES, TraceFuture, policy_clock, reads_waiting_queue
from prefixcache.core.hashing import BlockHasher
from prefixcache.core.indexes import INDEXES, refusal
from prefixcache.core.kv_cache_blocks import KVCacheBlocks
from prefixcache.core.kv_groups import parse_kv_groups

BS = 4
LAYOUTS = {"full": None, "full+sw": "full,sw6", "full+mamba": "full,mamba"}
TIERS = {"none": 0, "host": 6}
# The tiers below the host (the hash index with every layout, the radix index with one
# full-attention group): keyword sets.
LOWER = {"host+disk": {"disk_bytes": 800, "page_bytes": 100},
         "host+disk+remote": {"disk_bytes": 400, "page_bytes": 100, "remote_bytes": 1000}}


def _trace(seed: int = 0, n: int = 14) -> list[list[int]]:
    """Prompts sharing prefixes (3 system prompts, 2 turns of conversations)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 50) for _ in range(2 * BS + 1)] for _ in range(3)]
    prompts = []
    for _ in range(n):
        p = list(rng.choice(systems)) + [rng.randrange(50, 90) for _ in range(rng.randrange(1, 7))]
        prompts.append(p)
        if rng.random() < 0.5:
            prompts.append(p + [rng.randrange(90, 99) for _ in range(rng.randrange(2, 6))])
    return prompts


def _options(eviction: str, prompts) -> dict:
    if eviction == "ttl_lru":  # (a TTL of 2 requests: blocks expire within the trace)
        return {"ttl": 2, "unit": "steps"}
    if not POLICIES[eviction].needs_future:
        return {}
    h = BlockHasher("sha256", None)
    return {"future": TraceFuture.from_hashes(h.hash_token_blocks(p, BS) for p in prompts)}


def _run(index, eviction, tier, layout, num_blocks, lower=None, num_host_blocks=None):
    """Replay the trace (2 running at once, 3 decode steps each); invariants after
    every call. Returns the hit tokens per request."""
    prompts = _trace()
    groups = parse_kv_groups(LAYOUTS[layout]) if LAYOUTS[layout] else None
    m = KVCacheManager(
        num_blocks, BS, index=index, eviction=eviction, kv_cache_groups=groups,
        eviction_options=_options(eviction, prompts) or None,
        num_host_blocks=TIERS[tier] if num_host_blocks is None else num_host_blocks,
        free_order="unhashed_first", **(lower or {}))
    assert isinstance(m, KVCacheManager)
    running: list[Request] = []
    hits = []
    # A policy that reads the waiting queue (queue_aware, device or host tier): the
    # next request waits while this one runs (a look-ahead of one; admission drops it).
    reqs = [Request(f"r{i}", p) for i, p in enumerate(prompts)]
    waits = reads_waiting_queue(m)

    def announce(r):
        r.bind_hasher(m.hasher, BS)
        m.on_waiting(r.request_id, r.block_hashes[: (r.num_tokens - 1) // BS])

    if waits:
        announce(reqs[0])
    set_time = policy_clock(m)  # a time-varying policy: the request index is the clock
    for i, r in enumerate(reqs):
        if waits and i + 1 < len(reqs):
            announce(reqs[i + 1])
        if set_time is not None:
            set_time(None, i)
        m.on_arrival(r, i)
        while True:
            blocks, n = m.get_computed_blocks(r)
            assert isinstance(blocks, KVCacheBlocks)
            assert len(blocks.blocks) == m.num_groups
            # (a state group's prefill stops where it keeps a state: in chunks)
            chunks = m.prefill_chunks(r, n) if "mamba" in layout else [r.num_tokens - n]
            new = m.allocate_slots(r, chunks[0], n, blocks)
            m.check_invariants()
            if new is not None or not running:
                break
            m.free(running.pop(0))
            m.check_invariants()
        if new is None:
            hits.append(None)
            m.drop_waiting(r.request_id)  # (a no-op unless the policy reads the queue)
            continue
        assert isinstance(new, KVCacheBlocks) and len(new.blocks) == m.num_groups
        hits.append(n)
        r.num_computed_tokens = n + chunks[0]
        for c in chunks[1:]:
            while m.allocate_slots(r, c) is None:  # (the running ones make room)
                assert running, "a lone request's chunk found no blocks"
                m.free(running.pop(0))
                m.check_invariants()
            m.check_invariants()
            r.num_computed_tokens += c
        running.append(r)
        for t in range(3):
            r.append_output_token_ids(100 + t)
            step = m.allocate_slots(r, 1)
            m.check_invariants()
            if step is None:
                break
            assert isinstance(step, KVCacheBlocks)
            r.num_computed_tokens += 1
        m.take_host_transfers()
        if len(running) > 2:
            m.free(running.pop(0))
            m.check_invariants()
    for r in running:
        m.free(r)
    m.check_invariants()
    if waits:  # every request was admitted or dropped: no interest left
        held = m.policy if m.policy is not None and m.policy.needs_waiting else m.host_tier.policy
        assert held.waiting_ids() == []
    return hits


COMBOS = [(i, e, t, lay) for i in INDEXES for e in POLICIES for t in TIERS for lay in LAYOUTS]


@pytest.mark.parametrize("index,eviction,tier,layout", COMBOS)
def test_every_combination_runs_or_is_refused_by_the_rule(index, eviction, tier, layout):
    groups = parse_kv_groups(LAYOUTS[layout]) if LAYOUTS[layout] else None
    why = refusal(index, groups, eviction, TIERS[tier])
    if index == "hash":  # the host tier serves every hash-index layout of this matrix
        assert why is None or "host" not in why, why
    if why is not None:
        # (a sliding-window layout with what only one full-attention group serves)
        assert layout != "full"
        with pytest.raises(ValueError) as e:
            _run(index, eviction, tier, layout, num_blocks=12)
        assert str(e.value) == why
        return
    _run(index, eviction, tier, layout, num_blocks=12)  # bounded: evictions happen


SERVED = [(e, t, lay) for e in POLICIES for t in TIERS for lay in LAYOUTS
          if all(refusal(i, parse_kv_groups(LAYOUTS[lay]) if LAYOUTS[lay] else None, e,
                         TIERS[t]) is None for i in INDEXES)]


@pytest.mark.parametrize("eviction,tier,layout", SERVED)
def test_indexes_hit_the_same_tokens_when_nothing_is_evicted(eviction, tier, layout):
    # Unbounded (no eviction: the policy never decides): the hash chain and the radix
    # tree find the same longest cached prefix for every request (with a sliding
    # window: vLLM's hybrid hit rule, which both follow).
    got = {i: _run(i, eviction, tier, layout, num_blocks=400) for i in INDEXES}
    assert got["hash"] == got["radix"]
    assert any(got["hash"])  # the trace shares prefixes: some request hits


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("index", list(INDEXES))
@pytest.mark.parametrize("eviction", list(POLICIES))
@pytest.mark.parametrize("lower", list(LOWER))
def test_every_policy_runs_over_the_tiers_below_the_host(index, eviction, lower, layout):
    # Bounded: the chain demotes past the host to the disk and the remote store (with
    # group layouts, one (hash, group) key per entry); or the one rule refuses the
    # layout with the index.
    groups = parse_kv_groups(LAYOUTS[layout]) if LAYOUTS[layout] else None
    why = refusal(index, groups, eviction, TIERS["host"])
    if why is not None:
        assert index != "hash" and layout != "full"
        with pytest.raises(ValueError) as e:
            _run(index, eviction, "host", layout, num_blocks=12, lower=LOWER[lower])
        assert str(e.value) == why
        return
    _run(index, eviction, "host", layout, num_blocks=12, lower=LOWER[lower])


@pytest.mark.parametrize("lower", list(LOWER))
def test_indexes_agree_over_the_tiers_below_the_host_when_nothing_is_evicted(lower):
    got = {i: _run(i, "lru", "host", "full", num_blocks=400, lower=LOWER[lower])
           for i in INDEXES}
    assert got["hash"] == got["radix"] == _run("hash", "lru", "host", "full", num_blocks=400)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_host_and_disk_hit_as_one_host_of_their_size(layout):
    # Exclusive lru tiers: the disk holds what the host evicted, older than every host
    # entry, so host (6) + disk (8 pages) is one lru host of 14 slots, for every layout.
    bounded = _run("hash", "lru", "host", layout, num_blocks=12,
                   lower={"disk_bytes": 800, "page_bytes": 100})
    assert bounded == _run("hash", "lru", "host", layout, num_blocks=12, num_host_blocks=14)
    assert bounded != _run("hash", "lru", "host", layout, num_blocks=12)  # (the disk hits)
