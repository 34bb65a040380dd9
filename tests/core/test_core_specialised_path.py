"""The one specialised path, checked op for op against the plain components.

A manager of one full-attention group on the hash index runs ``HashKVCacheManager``:
vLLM's unitary coordinator with the full-attention rules inlined (the fast path every
default replay, engine step and server request takes). The same layout through the
general coordinator -- ``HybridKVCacheManager`` with its one ``FullAttentionManager``
single-type manager, the path every other layout takes -- must give the same hits,
block ids, events, host copies and counters, step for step, under every online
eviction policy, with and without the host tier.
"""

from __future__ import annotations

import pytest

import prefixcache.core.hybrid as hybrid
from prefixcache.core import KVCacheManager, Request
from prefixcache.core.eviction import online_policy_names
from prefixcache.core.kv_cache_manager import HashKVCacheManager
from prefixcache.core.kv_groups import parse_kv_groups
from prefixcache.sim import workloads

NUM_BLOCKS, BS = 200, 16


class GeneralCoordinator(hybrid.HybridKVCacheManager):
    """The general coordinator as an index of its own (the composition rule sends one
    full-attention group on the hash index to the specialised class)."""

    INDEX_NAME = "general_coordinator"


def _events(m):
    return [(type(e).__name__, getattr(e, "block_hashes", None),
             getattr(e, "parent_block_hash", None), getattr(e, "medium", None))
            for e in m.take_events()]


def _copies(m):
    return [(t.kind, t.block_id, t.host_slot) for t in m.take_host_transfers()]


def _drive(m, trace, concurrency=4, decode=6):
    """Admission, a few decode steps and frees in a fixed interleaving; every
    observable after every call."""
    log = []
    live = []
    for t in trace:
        r = Request(t.id, t.prompt)
        blocks, hit = m.get_computed_blocks(r)
        hit_ids = [b.block_id for b in blocks.blocks[0]]
        got = m.allocate_slots(r, r.num_tokens - hit, hit, blocks)
        log.append(("admit", t.id, hit, hit_ids, got is None, _events(m), _copies(m)))
        if got is None:
            continue
        r.num_computed_tokens = r.num_tokens
        for _ in range(decode):
            r.append_output_token_ids(7)
            new = m.allocate_slots(r, 1)
            r.num_computed_tokens += 1
            log.append(("decode", t.id, None if new is None else
                        [b.block_id for b in new.blocks[0]], _events(m)))
        ids = m.get_block_ids(t.id)
        log.append(("table", t.id, list(ids[0] if isinstance(ids, tuple) else ids)))
        live.append(r)
        if len(live) > concurrency:
            m.free(live.pop(0))
            log.append(("free", _events(m)))
        m.check_invariants()
    for r in live:
        m.free(r)
    log.append(("end", _events(m), _copies(m), m.num_free_blocks))
    c = m.counters()
    log.append({k: c[k] for k in ("lookups", "lookup_tokens", "hit_tokens", "evictions",
                                  "blocks_cached")})
    return log


@pytest.mark.parametrize("host", [0, 64], ids=["device", "host"])
@pytest.mark.parametrize("eviction", online_policy_names())
def test_the_specialised_path_equals_the_general_coordinator(eviction, host):
    trace = workloads.generate("multi_turn", seed=1, num_conversations=12)[:60]
    kw = dict(eviction=eviction, num_host_blocks=host, free_order="unhashed_first")
    fast = KVCacheManager(NUM_BLOCKS, BS, enable_events=True, **kw)
    assert type(fast.implementation) is HashKVCacheManager
    plain = KVCacheManager(NUM_BLOCKS, BS, index=GeneralCoordinator, enable_events=True,
                           kv_cache_groups=parse_kv_groups("full"), **kw)
    assert type(plain.implementation) is GeneralCoordinator
    assert [type(k).__name__ for k in plain.implementation._kinds] == ["FullAttentionManager"]
    a, b = _drive(fast, trace), _drive(plain, trace)
    assert a == b
    # Not a vacuous check: blocks were hit, evicted and (with the tier) copied.
    assert a[-1]["hit_tokens"] > 0 and a[-1]["evictions"] > 0
    if host:
        assert any(entry[0] == "admit" and entry[6] for entry in a)
