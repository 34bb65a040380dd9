"""One rule per kind of argument, the same in every manager (issue 25): the hash index,
the radix tree and the hybrid (sliding-window) manager, with and without the host
tier, refuse the same bad ``free`` / ``on_arrival`` / size arguments with the same
error (``prefixcache._validate``), before any state changes (snapshots compared), and
then take a valid call. And ``free()`` cannot fail half way: what its release reads is
checked first, for every eviction policy.

Each test here failed on main before the fix: the radix index raised AttributeError
on ``free(7)`` (an int request id, accepted by the hash index), every manager freed the
blocks of the RUNNING request when given another ``Request`` object with its id,
``on_arrival`` took an id, a negative / bool / float index, constructors refused numpy
ints that ``CacheConfig`` took (and the hash index took ``max_model_len=True``), and a
priority forced past the setter made ``free()`` raise half way under the priority
policy (``check_invariants`` then failed).
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from prefixcache import KVCacheManager, Request
from prefixcache._validate import ArgumentTypeError
from prefixcache.core.eviction import POLICIES, TraceFuture
from prefixcache.core.hashing import BlockHasher
from prefixcache.core.indexes import INDEXES, refusal
from prefixcache.core.kv_groups import parse_kv_groups

BS = 4
LAYOUTS = {"full": None, "full+sw": "full,sw6"}
TIERS = {"none": 0, "host": 6}
PROMPTS = [list(range(1, 10)), list(range(1, 6)) + [50, 51, 52, 53], [70, 71, 72, 73, 74]]


def _impls(eviction="lru"):
    out = []
    for index in INDEXES:
        for layout in LAYOUTS:
            for tier in TIERS:
                groups = parse_kv_groups(LAYOUTS[layout]) if LAYOUTS[layout] else None
                if refusal(index, groups, eviction, TIERS[tier]) is None:
                    out.append((index, layout, tier))
    return out


IMPLS = _impls()


def _make(index, layout, tier, eviction="lru", num_blocks=12):
    groups = parse_kv_groups(LAYOUTS[layout]) if LAYOUTS[layout] else None
    options = None
    if POLICIES[eviction].needs_future:
        h = BlockHasher("sha256", None)
        options = {"future": TraceFuture.from_hashes(h.hash_token_blocks(p, BS)
                                                     for p in PROMPTS)}
    return KVCacheManager(num_blocks, BS, index=index, kv_cache_groups=groups,
                          eviction=eviction, eviction_options=options,
                          num_host_blocks=TIERS[tier], free_order="unhashed_first")


def _admit(m, r, index=None):
    if index is not None:
        m.on_arrival(r, index)
    blocks, n = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - n, n, blocks) is not None
    r.num_computed_tokens = r.num_tokens
    return n


def snap(m):
    """What a refused call could change, read through the public API (every manager)."""
    tier = m.host_tier
    policy = m.policy
    return (
        m.counters(), m.free_block_ids(), m.cached_block_ids(), m.num_cached_blocks,
        {rid: m.get_block_ids(rid) for rid in sorted(m.running_request_ids, key=repr)},
        sorted((h, s.block_id) for h, s in tier.hash_to_slot.items()) if tier else None,
        sorted(policy.candidate_ids()) if policy is not None else None,
        [(r.request_id, r.num_computed_tokens, r.priority) for r in _live(m)],
    )


def _live(m):
    states = m.implementation._states
    return [states[k].request for k in sorted(states, key=repr)]


def _setup(index, layout, tier, eviction="lru", num_blocks=12):
    """A manager with a freed (cached) prompt, and two running requests."""
    m = _make(index, layout, tier, eviction, num_blocks)
    first = Request("first", PROMPTS[0])
    _admit(m, first, 0)
    m.free(first)
    a = Request("a", PROMPTS[1])
    _admit(m, a, 1)
    b = Request(7, PROMPTS[2])  # an int id: request ids are any hashable
    _admit(m, b, 2)
    m.take_host_transfers()
    m.check_invariants()
    return m, a, b


def refused(m, fn, exc=ValueError, match=None):
    before = snap(m)
    with pytest.raises(exc, match=match):
        fn()
    assert snap(m) == before
    m.check_invariants()


# ------------------------------------------------------------------------- free
@pytest.mark.parametrize("index,layout,tier", IMPLS)
def test_free_takes_the_admitted_request_or_its_id_of_any_type(index, layout, tier):
    m, a, b = _setup(index, layout, tier)
    # Another Request object with a running id: refused (it used to free the running
    # request's blocks).
    refused(m, lambda: m.free(Request("a", PROMPTS[1])), match="not the one holding")
    for bad in (None, 7.5, "7", [7], ("a",), b"a"):
        refused(m, lambda bad=bad: m.free(bad), match="holds no blocks")
    m.free(7)  # by a non-str id (radix: AttributeError on main)
    refused(m, lambda: m.free(b), match="holds no blocks")  # twice
    m.free(a)
    m.check_invariants()
    assert m.running_request_ids == []
    assert len(m.free_block_ids()) == m.num_blocks


# ------------------------------------------------------------------- on_arrival
@pytest.mark.parametrize("eviction", ["lru", "belady"])
@pytest.mark.parametrize("index,layout,tier", _impls("belady"))
def test_on_arrival_takes_a_request_and_an_index(index, layout, tier, eviction):
    m = _make(index, layout, tier, eviction)
    r = Request("r", PROMPTS[0])
    for bad_req in ("r", None, 0, PROMPTS[0]):
        refused(m, lambda q=bad_req: m.on_arrival(q, 0), ArgumentTypeError,
                "on_arrival: request must be a prefixcache Request")
    for bad, exc in ((-1, ValueError), (True, ArgumentTypeError), (1.0, ArgumentTypeError),
                     ("0", ArgumentTypeError), (None, ArgumentTypeError),
                     (np.float64(0), ArgumentTypeError), (np.bool_(False), ArgumentTypeError)):
        refused(m, lambda i=bad: m.on_arrival(r, i), exc, "on_arrival: index")
    _admit(m, r, np.int64(0))  # numpy ints are ints
    m.check_invariants()
    m.free(r)
    m.check_invariants()


# ------------------------------------------------------------------------ sizes
@pytest.mark.parametrize("index,layout,tier", IMPLS)
def test_sizes_numpy_ints_accepted_bools_refused(index, layout, tier):
    groups = parse_kv_groups(LAYOUTS[layout]) if LAYOUTS[layout] else None
    kw = dict(index=index, kv_cache_groups=groups)
    m = KVCacheManager(np.int64(12), np.int32(BS), max_model_len=np.int64(64),
                       num_host_blocks=np.int64(TIERS[tier]), **kw)
    for name in ("num_blocks", "block_size", "max_model_len"):
        assert type(getattr(m, name)) is int
    r = Request("r", PROMPTS[0])
    _admit(m, r)
    m.check_invariants()
    for args, extra, name in (((True, BS), {}, "num_blocks"), ((12, True), {}, "block_size"),
                              ((12, np.bool_(True)), {}, "block_size"),
                              ((12.0, BS), {}, "num_blocks"),
                              ((12, BS), {"max_model_len": True}, "max_model_len"),
                              ((12, BS), {"max_model_len": 64.0}, "max_model_len")):
        with pytest.raises(ArgumentTypeError, match=f"{name} must be a positive int"):
            KVCacheManager(*args, num_host_blocks=TIERS[tier], **kw, **extra)
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        KVCacheManager(0, BS, num_host_blocks=TIERS[tier], **kw)


# ------------------------------------------------- free() cannot fail half way
@pytest.mark.parametrize("eviction", sorted(POLICIES))
@pytest.mark.parametrize("index,layout,tier", IMPLS)
def test_free_refuses_a_bad_policy_input_whole(index, layout, tier, eviction):
    groups = parse_kv_groups(LAYOUTS[layout]) if LAYOUTS[layout] else None
    if refusal(index, groups, eviction, TIERS[tier]) is not None:
        pytest.skip("combination refused by the composition rule")
    m, a, b = _setup(index, layout, tier, eviction, num_blocks=32)
    for t in range(4):  # a decode step of 4 tokens then fills a block (caches it)
        a.append_output_token_ids(90 + t)
    for bad in (None, float("nan"), 1.5, "2", True):
        a._priority = bad  # forced past the validating setter
        refused(m, lambda: m.free(a), ValueError, "priority=")
        refused(m, lambda: m.allocate_slots(a, 4), ValueError, "priority=")
        # ... and a new request that carries it is refused at admission, whole.
        q = Request("q", PROMPTS[0])
        q._priority = bad
        refused(m, lambda q=q: m.allocate_slots(q, q.num_tokens), ValueError, "priority=")
    a.priority = 3
    assert m.allocate_slots(a, 4) is not None
    a.num_computed_tokens += 4
    m.check_invariants()
    m.free(a)
    m.check_invariants()
    m.free(b)
    m.check_invariants()
    assert len(m.free_block_ids()) == m.num_blocks
    c = Request("c", PROMPTS[1])  # the cache still works: a hit on a's prefix
    assert _admit(m, c) > 0
    m.check_invariants()


# ------------------------------------------- the same int / path rule elsewhere
def test_numpy_ints_and_paths_beyond_the_managers(tmp_path):
    from prefixcache.core.cache_config import CacheConfig
    from prefixcache.core.request import LoRARequest
    from prefixcache.sim.replay import replay
    from prefixcache.sim.trace import TraceRequest

    i64 = np.int64
    cfg = CacheConfig(num_blocks=i64(8), block_size=np.int32(4), max_model_len=i64(64))
    assert (type(cfg.num_blocks), type(cfg.block_size)) == (int, int)
    # A path is a str or an os.PathLike, everywhere (the adapter loader took a Path,
    # LoRARequest refused it); stored as the str, so block keys do not change.
    p = tmp_path / "adapter"
    assert isinstance(p, pathlib.Path)
    assert LoRARequest("x", p) == LoRARequest("x", str(p))
    assert LoRARequest("x", str(p), int_id=i64(2)).int_id == 2
    for bad in (b"/x", 3, None, ""):
        with pytest.raises(ValueError, match="LoRARequest.path"):
            LoRARequest("x", bad)
    for bad in (True, 1.0, 0):
        with pytest.raises(ValueError, match="LoRARequest.int_id"):
            LoRARequest("x", p, int_id=bad)
    assert Request("r", [1, 2], priority=i64(2)).priority == 2
    r = Request("r", [1, 2])
    r.priority = np.int16(-1)
    assert type(r.priority) is int and r.priority == -1
    trace = [TraceRequest("t", prompt=list(range(10)), output_len=2)]
    a = replay(trace, num_blocks=i64(8), block_size=i64(4), concurrency=i64(1), total=i64(1))
    assert a["hit_tokens"] == replay(trace, num_blocks=8, block_size=4)["hit_tokens"]
    for kw in (dict(concurrency=True), dict(concurrency=1.0), dict(total=True)):
        with pytest.raises(ArgumentTypeError):
            replay(trace, num_blocks=8, block_size=4, **kw)
