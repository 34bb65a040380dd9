"""State-space (Mamba) KV cache groups (``core/groups/mamba.py``, vLLM 0.33's
``MambaManager`` in "align" mode) and the group-kind registry (``kv_groups.GROUP_KINDS``).

Block-for-block parity with vLLM is tests/sim/test_sim_replay_golden_state.py; here: the
rules on small cases, invariants under random operations, bad input, and the recipe of a
new kind (one class, one registration) with a toy kind defined in this file.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import KVCacheManager, Request
from prefixcache.core import kv_groups
from prefixcache.core.cache_config import CacheConfig
from prefixcache.core.groups.full_attention import FullAttentionManager
from prefixcache.core.groups.mamba import MambaSpec
from prefixcache.core.hybrid import HybridKVCacheManager
from prefixcache.core.kv_groups import KVCacheGroup, parse_kv_groups


def _new(m, rid, tokens):
    """Admit a request the way the replay does: the lookup, then the prefill in the
    chunks ``prefill_chunks`` gives (the first one is the admission)."""
    req = Request(rid, list(tokens))
    blocks, hit = m.get_computed_blocks(req)
    chunks = m.prefill_chunks(req, hit)
    assert m.allocate_slots(req, chunks[0], hit, blocks) is not None
    req.num_computed_tokens = hit + chunks[0]
    m.check_invariants()
    for c in chunks[1:]:
        assert m.allocate_slots(req, c) is not None
        req.num_computed_tokens += c
        m.check_invariants()
    return req, hit, chunks


def _decode(m, req, n):
    for i in range(n):
        req.append_output_token_ids(900 + i)
        assert m.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        m.check_invariants()


def test_one_running_state_block_and_states_kept_at_chunk_ends():
    m = KVCacheManager(64, 4, kv_cache_groups=parse_kv_groups("full,mamba"))
    null = m.null_block_id
    req, hit, chunks = _new(m, "a", range(30))
    assert hit == 0 and chunks == [28, 2]  # stop at the last block boundary before 29
    full, state = m.get_block_ids("a")
    assert len(full) == len(state) == 8 and null not in full
    # The running state (slot 7) and the previous chunk's (slot 6, released next step).
    assert [i for i, b in enumerate(state) if b != null] == [6, 7]
    _decode(m, req, 1)
    assert [i for i, b in enumerate(m.get_block_ids("a")[1]) if b != null] == [7]
    # A request sharing the 28-token prefix hits the state kept at 28 (slot 6, cached
    # and released to the free queue), aligned with full attention.
    r2, hit2, chunks2 = _new(m, "b", list(range(28)) + [77] * 9)
    assert hit2 == 28 and chunks2 == [8, 1]
    m.free(req)
    m.free(r2)
    m.check_invariants()
    assert m.num_free_blocks == 64


def test_a_state_hit_stops_at_the_last_kept_state_and_the_prefill_stops_at_the_junction():
    m = KVCacheManager(64, 4, kv_cache_groups=parse_kv_groups("full,mamba"))
    req, _, chunks = _new(m, "a", range(40))
    assert chunks == [36, 4]  # states kept at 36 (and, after decode, at 40, 44, ...)
    m.free(req)
    # Shares 20 tokens: full attention hits 20, the state group only 0 (no state was
    # kept at 20), so the joint hit is 0 and the prefill stops at the junction 20
    # (vLLM's shared-prefix stop) to keep that state for the next sibling.
    r2, hit, chunks = _new(m, "b", list(range(20)) + [5] * 21)
    assert hit == 0 and chunks == [20, 20, 1]
    m.free(r2)
    r3, hit, _ = _new(m, "c", list(range(20)) + [6] * 21)
    assert hit == 20
    m.free(r3)


def test_sparse_retention_keeps_only_the_replay_boundary_and_the_junction():
    dense = KVCacheManager(64, 4, kv_cache_groups=parse_kv_groups("full,mamba"))
    sparse = KVCacheManager(64, 4, kv_cache_groups=parse_kv_groups("full,mamba_r0"))
    follow = Request("x", list(range(30)) + [900 + i for i in range(10)] + [1])
    for m in (dense, sparse):
        req, _, chunks = _new(m, "a", range(30))
        assert chunks == [28, 2]
        _decode(m, req, 10)  # reaches 32, 36, 40: dense keeps those states, sparse not
        m.free(req)
    assert dense.peek_computed_tokens(follow) == 40
    assert sparse.peek_computed_tokens(follow) == 28  # the replay boundary (29 -> 28)
    # The junction's state is kept: a sibling sharing 12 tokens stops its prefill
    # there, and the next sibling hits it.
    r, hit, chunks = _new(sparse, "b", list(range(12)) + [3] * 9)
    assert hit == 0 and chunks == [12, 8, 1]
    sparse.free(r)
    assert sparse.peek_computed_tokens(Request("c", list(range(12)) + [4] * 9)) == 12


def test_state_only_layout_is_unitary_and_hits_the_rightmost_state():
    m = KVCacheManager(32, 4, kv_cache_groups=parse_kv_groups("mamba"))
    assert type(m.implementation) is HybridKVCacheManager
    req, _, chunks = _new(m, "a", range(18))
    assert chunks == [16, 2]
    _decode(m, req, 7)  # crosses 20 and 24: states kept there
    m.free(req)
    r2 = Request("b", list(range(18)) + [900 + i for i in range(7)] + [1, 2, 3])
    assert m.peek_computed_tokens(r2) == 24


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(["full,mamba", "mamba", "full,sw8,mamba", "mamba,full,mamba",
                            "full,mamba_r0"]),
    eviction=st.sampled_from(["lru", "lfu"]),
    num_blocks=st.integers(6, 40),
    ops=st.lists(st.one_of(
        st.tuples(st.just("new"), st.integers(0, 2), st.lists(st.integers(0, 9), max_size=30)),
        st.tuples(st.just("decode"), st.integers(0, 5), st.integers(1, 12)),
        st.tuples(st.just("free"), st.integers(0, 5)),
    ), max_size=25),
)
def test_random_sequences_keep_invariants(layout, eviction, num_blocks, ops):
    bs = 4
    stems = [list(range(100, 124)), list(range(100, 112)) + [1] * 9, list(range(200, 207))]
    m = KVCacheManager(num_blocks, bs, kv_cache_groups=parse_kv_groups(layout),
                       eviction=eviction)
    state_groups = [i for i, g in enumerate(m.kv_cache_groups) if isinstance(g.spec, MambaSpec)]
    null = m.null_block_id
    running: list[Request] = []
    n = 0
    for op in ops:
        if op[0] == "new":
            req = Request(f"r{n}", stems[op[1]] + op[2] + [3])
            n += 1
            blocks, hit = m.get_computed_blocks(req)
            chunks = m.prefill_chunks(req, hit)
            assert sum(chunks) == req.num_tokens - hit
            assert all((hit + sum(chunks[:i + 1])) % bs == 0 for i in range(len(chunks) - 1))
            if m.allocate_slots(req, chunks[0], hit, blocks) is not None:
                req.num_computed_tokens = hit + chunks[0]
                running.append(req)
                for c in chunks[1:]:
                    m.check_invariants()
                    if m.allocate_slots(req, c) is None:
                        break
                    req.num_computed_tokens += c
        elif op[0] == "decode" and running:
            req = running[op[1] % len(running)]
            if req.num_computed_tokens < req.num_tokens:
                continue  # (a prefill cut short: not decoding)
            for step in range(op[2]):
                req.append_output_token_ids(7 + step % 3)
                if m.allocate_slots(req, 1) is None:
                    break
                req.num_computed_tokens += 1
                for g in state_groups:
                    ids = m.get_block_ids(req.request_id)[g]
                    assert ids[-1] != null and sum(b != null for b in ids) <= 2
        elif op[0] == "free" and running:
            m.free(running.pop(op[1] % len(running)))
        m.check_invariants()
    for req in running:
        m.free(req)
    m.check_invariants()
    assert m.num_free_blocks == num_blocks and m.usage == 0.0  # nothing leaked


@pytest.mark.parametrize("layout", ["full,sw8", "full,mamba", "mamba"])
def test_lookups_follow_a_reset_prefix_cache(layout):
    m = KVCacheManager(32, 4, kv_cache_groups=parse_kv_groups(layout))
    req, _, _ = _new(m, "a", range(21))
    m.free(req)
    probe = Request("p", list(range(21)))
    assert m.peek_computed_tokens(probe) > 0
    assert m.reset_prefix_cache()
    assert m.peek_computed_tokens(probe) == 0
    req, _, _ = _new(m, "b", range(21))  # cached again in the new map
    m.free(req)
    assert m.peek_computed_tokens(probe) > 0
    m.check_invariants()


# ------------------------------------------------------------------------ bad input
def test_bad_state_specs_and_combinations():
    with pytest.raises(ValueError, match="mamba_cache_mode"):
        MambaSpec("none")
    for bad in (16, -1, True, 0.0):
        with pytest.raises(ValueError, match="retention_interval"):
            MambaSpec(retention_interval=bad)
    with pytest.raises(ValueError, match="bad kv group"):
        parse_kv_groups("full,mamba2")
    m = KVCacheManager(16, 4, kv_cache_groups=parse_kv_groups("full,mamba"))
    req = Request("a", list(range(9)))
    blocks, hit = m.get_computed_blocks(req)
    with pytest.raises(ValueError, match="num_lookahead_tokens=2 with a MambaSpec group"):
        m.allocate_slots(req, 9, hit, blocks, num_lookahead_tokens=2)
    with pytest.raises(ValueError, match="num_computed_tokens must be an int"):
        m.prefill_chunks(req, 9)
    assert m.num_free_blocks == 16 and not m.implementation._states  # nothing changed
    with pytest.raises(ValueError, match="index=.radix. is not supported with a .mamba. KV cache group"):
        KVCacheManager(16, 4, kv_cache_groups=parse_kv_groups("full,mamba"), index="radix")


def test_the_engine_refuses_a_state_group_up_front(monkeypatch):
    import prefixcache.engine.engine as engine_mod
    from prefixcache.engine.engine import Engine
    from prefixcache.model.config import ModelConfig

    def boom(*a, **k):
        raise AssertionError("built before the configuration was checked")

    monkeypatch.setattr(engine_mod, "ModelRunner", boom)
    cfg = CacheConfig(num_blocks=8, block_size=4, kv_cache_groups="full,mamba")
    with pytest.raises(ValueError, match="no state-space layers"):
        Engine(None, cache_config=cfg)
    with pytest.raises(ValueError, match="no state-space layers"):
        Engine(ModelConfig.tiny_hybrid(), num_blocks=8, block_size=4,
               manager_kwargs={"kv_cache_groups": parse_kv_groups("full,mamba")})


@pytest.mark.parametrize("layout", ["full,mamba", "full,sw8,mamba_r0"])
def test_cache_config_rows_round_trip_a_state_group(layout):
    from prefixcache.core.cache_config import _groups_to_rows

    cfg = CacheConfig(num_blocks=8, block_size=4, kv_cache_groups=layout)
    rows = _groups_to_rows(cfg.kv_cache_groups)
    again = CacheConfig(num_blocks=8, block_size=4, kv_cache_groups=rows)
    assert again.kv_cache_groups == cfg.kv_cache_groups


def test_registry_is_read_only_and_names_the_kinds():
    assert set(kv_groups.GROUP_KINDS) == {"full_attention", "sliding_window", "mamba"}
    with pytest.raises(TypeError):
        kv_groups.GROUP_KINDS["x"] = "a:b"  # type: ignore[index]
    with pytest.raises(ValueError, match="unknown KV cache group kind 'x'"):
        kv_groups.group_manager_class("x")


# ------------------------------------------------- the recipe: a toy kind in one class
@dataclasses.dataclass(frozen=True)
class ToySpec:
    """A toy kind: full attention under another name."""

    kind = "toy_full"

    @property
    def sliding_window(self) -> None:
        return None


class ToyManager(FullAttentionManager):
    spec_class = ToySpec


def test_a_new_kind_is_one_class_plus_one_registration(monkeypatch):
    monkeypatch.setattr(kv_groups, "GROUP_KINDS", MappingProxyType(
        {**kv_groups.GROUP_KINDS, "toy_full": f"{__name__}:ToyManager"}))
    layout = [KVCacheGroup(kv_groups.FullAttentionSpec(), ["a"]), KVCacheGroup(ToySpec(), ["b"])]
    m = KVCacheManager(32, 4, kv_cache_groups=layout)
    ref = KVCacheManager(32, 4, kv_cache_groups=parse_kv_groups("full,full"))
    for mgr in (m, ref):
        req, _, _ = _new(mgr, "a", range(21))
        mgr.free(req)
    r = Request("b", list(range(21)))
    assert m.peek_computed_tokens(r) == ref.peek_computed_tokens(r) == 20
