"""Bad input at the boundaries added in session 7 (host tier, KV groups, KV dtypes and
byte budgets, the simulators' host-tier flags): a clear ValueError / TypeError naming
the argument, raised before anything changed (snapshots compared), nothing leaked.

Each regression below failed before its fix (round 4, s7-fuzz-new): a reordered
HostHit list was accepted by the hash index (the loaded block was then cached under
another block's hash), another manager's block with an id past this pool raised
IndexError, radix lookups of a non-Request raised AttributeError, HostHit's repr (used
in the messages) crashed on a non-bytes hash, parse_bytes overflowed on "1e400" and
rounded "9007199254740993" through a float, kv_bytes_per_block wrapped numpy ints,
parse_kv_groups read non-ASCII digits, host policy option errors did not name the
host tier.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache._validate import ArgumentTypeError
from prefixcache.core import HostHit, KVCacheManager, Request
from prefixcache.core import kv_groups as kg
from prefixcache import kv_dtypes as kd

FAST = settings(max_examples=30, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
INDEXES = ["hash", "radix"]

# Values that are never a count / name / mapping: bools, floats, numpy floats/bools,
# strings, None, containers, NaN.
NOT_INT = st.one_of(
    st.booleans(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
    st.none(), st.lists(st.integers(), max_size=2), st.just(np.float64(2.0)),
    st.just(np.bool_(True)), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))


def _admit(m, req):
    blocks, hit = m.get_computed_blocks(req)
    return m.allocate_slots(req, req.num_tokens - hit, hit, blocks)


def tiered(index):
    """A manager whose host tier holds request "a"'s blocks 1..3 (block 0 stays on the
    device): a lookup of ``range(17)`` returns one device hit then three HostHits."""
    m = KVCacheManager(6, 4, num_host_blocks=4, index=index, free_order="unhashed_first",
                       enable_events=True)
    for rid, base in (("a", 0), ("b", 100)):
        r = Request(rid, list(range(base, base + 17)))
        _admit(m, r)
        m.free(r)
    m.take_host_transfers()
    m.take_events()
    return m


def snap(m):
    tier = m.host_tier
    return (m.counters(), m.free_block_ids(), sorted(m.implementation._states),
            sorted((h, s.block_id) for h, s in tier.hash_to_slot.items()) if tier else None,
            [(s.block_hash, s.ref_cnt if hasattr(s, "ref_cnt") else None) for s in tier.slots]
            if tier else None)


def assert_refused(m, fn, match=None, exc=(ValueError, TypeError)):
    before = snap(m)
    with pytest.raises(exc, match=match):
        fn()
    assert snap(m) == before
    assert m.take_host_transfers() == [] and m.take_events() == []
    m.check_invariants()


# --------------------------------------------------------------- constructor args
@pytest.mark.parametrize("index", INDEXES)
@FAST
@given(v=st.one_of(NOT_INT, st.integers(max_value=-1), st.just(2**80)))
def test_num_host_blocks_refused(index, v):
    with pytest.raises((ValueError, TypeError), match="num_host_blocks|host tier"):
        KVCacheManager(8, 4, index=index, num_host_blocks=v)


@pytest.mark.parametrize("index", INDEXES)
@FAST
@given(v=st.one_of(NOT_INT, st.integers(), st.sampled_from(["belady", "LRU", "nope", ""])))
def test_host_eviction_refused_naming_it(index, v):
    with pytest.raises((ValueError, TypeError), match="host_eviction"):
        KVCacheManager(8, 4, index=index, num_host_blocks=2, host_eviction=v)


@pytest.mark.parametrize("index", INDEXES)
@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "slru", "priority", "length", "cost"])
@pytest.mark.parametrize("options", [{"bogus": 1}, {1: 2}, {"model": 3}, [("a", 1)], "x", 3])
def test_host_eviction_options_refused_naming_them(index, policy, options):
    with pytest.raises((ValueError, TypeError), match="host_eviction_options"):
        KVCacheManager(8, 4, index=index, num_host_blocks=2, host_eviction=policy,
                       host_eviction_options=options)


@pytest.mark.parametrize("index", INDEXES)
def test_numpy_int_host_blocks_accepted_and_combinations_refused(index):
    assert KVCacheManager(8, 4, index=index, num_host_blocks=np.int64(3)).num_host_blocks == 3
    with pytest.raises(ValueError, match="enable_caching"):
        KVCacheManager(8, 4, index=index, num_host_blocks=2, enable_caching=False)
    groups = kg.parse_kv_groups("full,sw8")
    if index == "hash":  # per-group host slots (core/hybrid.py)
        with pytest.raises(ValueError, match="enable_caching"):
            KVCacheManager(8, 4, index=index, num_host_blocks=2, enable_caching=False,
                           kv_cache_groups=groups)
        m = KVCacheManager(8, 4, index=index, num_host_blocks=np.int64(2),
                           kv_cache_groups=groups)
        assert m.num_host_blocks == 2 and m.host_tier.num_host_blocks == 2
    else:  # the radix layout index: refused by the one rule
        with pytest.raises(ValueError, match="radix layout index"):
            KVCacheManager(8, 4, index=index, num_host_blocks=2, kv_cache_groups=groups)


@FAST
@given(v=st.one_of(NOT_INT.filter(lambda x: x is not None), st.integers(),
                   st.just("full,sw8"), st.just(()), st.just([kg.FullAttentionSpec()])))
def test_kv_cache_groups_refused(v):
    with pytest.raises((ValueError, TypeError), match="kv_cache_groups|KV cache group"):
        KVCacheManager(8, 4, kv_cache_groups=v)


# --------------------------------------------------------------- HostHit sequences
@pytest.mark.parametrize("index", INDEXES)
def test_reordered_host_hits_refused(index):
    m = tiered(index)
    r = Request("c", list(range(17)))
    blocks, n = m.get_computed_blocks(r)
    assert [type(b) for b in blocks[1:]] == [HostHit] * 3
    swapped = blocks[:1] + blocks[1:][::-1]  # hash index: accepted before the fix
    assert_refused(m, lambda: m.allocate_slots(r, 1, n, swapped), "not a current host-tier")
    assert m.allocate_slots(r, 1, n, blocks) is not None  # the real list still loads
    m.check_invariants()


@pytest.mark.parametrize("index", INDEXES)
def test_host_hits_of_another_request_stale_or_reused_refused(index):
    m = tiered(index)
    r = Request("c", list(range(17)))
    blocks, n = m.get_computed_blocks(r)
    other = Request("d", list(range(1000, 1017)))
    assert_refused(m, lambda: m.allocate_slots(other, 1, n, blocks), "host-tier|cached block")
    # Copies of the entries are the same hits (block_id -1): accepted.
    copies = blocks[:1] + [copy.copy(b) for b in blocks[1:]]
    assert m.allocate_slots(r, 1, n, copies) is not None
    assert [b.block_id for b in copies[1:]] != [-1] * 3
    assert [b.block_id for b in blocks[1:]] == [-1] * 3
    m.free(r)
    m.take_host_transfers()
    m.take_events()
    r2 = Request("e", list(range(17)))
    # The original list is now stale (its host entries were promoted), the copies reused.
    assert_refused(m, lambda: m.allocate_slots(r2, 1, n, blocks), "not a current host-tier")
    assert_refused(m, lambda: m.allocate_slots(r2, 1, n, copies), "host-tier|cached block")


@pytest.mark.parametrize("index", INDEXES)
@pytest.mark.parametrize("hit", [HostHit(b"junk", 0), HostHit(None, "0"), HostHit(7, 99),
                                 HostHit(b"x", -1), HostHit(b"x", True)])
def test_forged_host_hits_refused_with_a_message(index, hit):
    m = tiered(index)
    r = Request("c", list(range(17)))
    assert_refused(m, lambda: m.allocate_slots(r, 13, 4, [hit]), "host-tier|cached block")


@pytest.mark.parametrize("index", INDEXES)
def test_another_managers_hits_refused(index):
    m = tiered(index)
    big = KVCacheManager(40, 4, num_host_blocks=4, index=index)
    a = Request("a", list(range(17)))
    _admit(big, a)
    big.free(a)
    r = Request("c", list(range(17)))
    theirs, n = big.get_computed_blocks(r)
    assert_refused(m, lambda: m.allocate_slots(r, 1, n, theirs), "cached block")
    # A block id past this pool (IndexError before the fix, hash index).
    far = [b for b in big.block_pool.blocks if b.block_id >= 6][:1] if index == "hash" else []
    if far:
        far[0].block_hash = b"x"
        assert_refused(m, lambda: m.allocate_slots(r, 13, 4, far), "not a cached block")
        plain = KVCacheManager(6, 4)
        assert_refused(plain, lambda: plain.allocate_slots(r, 13, 4, far), "not a cached block")


@pytest.mark.parametrize("index", INDEXES)
@pytest.mark.parametrize("tier", [0, 4])
@pytest.mark.parametrize("bad", [None, "a", 3, ["a"], b"a"], ids=repr)
def test_lookups_of_a_non_request_refused(index, tier, bad):
    m = KVCacheManager(6, 4, index=index, num_host_blocks=tier)
    before = snap(m)
    for fn in (m.get_computed_blocks, m.peek_computed_tokens):
        with pytest.raises(ArgumentTypeError, match="request must be a prefixcache Request"):
            fn(bad)
    assert snap(m) == before and m.num_lookups == 0


@pytest.mark.parametrize("index", INDEXES)
def test_take_host_transfers_misuse(index):
    m = tiered(index)
    with pytest.raises(TypeError):
        m.take_host_transfers(1)
    assert m.take_host_transfers() == []  # drained once, then empty
    plain = KVCacheManager(6, 4, index=index)
    assert plain.take_host_transfers() == []


def test_host_hit_repr_never_raises():
    for h in (HostHit(b"\x01" * 40, 3), HostHit(None, "x"), HostHit(5, None),
              HostHit.__new__(HostHit)):
        assert repr(h).startswith("HostHit(")


# --------------------------------------------------------------- kv_groups specs
@FAST
@given(v=st.one_of(NOT_INT, st.integers(max_value=0)))
def test_sliding_window_spec_refused(v):
    with pytest.raises((ValueError, TypeError), match="sliding_window"):
        kg.SlidingWindowSpec(v)


@FAST
@given(names=st.one_of(st.text(max_size=3), st.none(), st.integers(), st.just([]),
                       st.lists(st.one_of(st.integers(), st.just(""), st.none()),
                                min_size=1, max_size=3),
                       st.just(["a", "a"]), st.just({"a"})))
def test_kv_cache_group_layer_names_refused(names):
    with pytest.raises((ValueError, TypeError), match="layer"):
        kg.KVCacheGroup(kg.FullAttentionSpec(), names)


@FAST
@given(text=st.text(max_size=12))
def test_parse_kv_groups_any_text(text):
    try:
        groups = kg.parse_kv_groups(text)
    except ValueError as e:
        assert "kv group" in str(e) or "sliding_window" in str(e)
        return
    # Accepted: exactly the documented grammar, ASCII digits only.
    for part, g in zip(text.split(","), groups):
        p = part.strip()
        assert p == "full" or (p.startswith("sw") and p[2:].isascii() and p[2:].isdigit())
        assert g.layer_names[0].startswith("layers.")


@pytest.mark.parametrize("text", ["sw\uff11", "sw\u0663", "sw0", "sw-1", "full,", ",", "FULL",
                                  "sw", "sw8.0", None, 8, b"full"])
def test_parse_kv_groups_refused(text):
    with pytest.raises(ValueError):
        kg.parse_kv_groups(text)


def test_check_kv_cache_groups_refused():
    g = kg.KVCacheGroup(kg.FullAttentionSpec(), ("l0",))
    for bad, match in (((g, g), "is in KV cache groups 0 and 1"),
                       ((x for x in [g]), "list or tuple"),
                       ([g, "x"], r"kv_cache_groups\[1\]"), ([], "empty")):
        with pytest.raises((ValueError, TypeError), match=match):
            kg.check_kv_cache_groups(bad)


# --------------------------------------------------------------- kv dtypes / bytes
@FAST
@given(v=st.one_of(st.text(max_size=8), st.integers(), st.floats(), st.none(),
                   st.just(np.dtype("float16")), st.just(np.int32), st.just(["int8"])))
def test_check_kv_dtype(v):
    try:
        name = kd.check_kv_dtype(v)
    except ValueError as e:
        assert "kv_dtype" in str(e)
    else:
        assert name in kd.KV_DTYPES


@pytest.mark.parametrize("text", ["1e400", "1e999GiB", "9" * 400, "1e9999999", "inf", "nan",
                                  "-1", "0", "0.5", "1_000", "1e-3KiB", "2 GiBs", "", "e9"])
def test_parse_bytes_refused_without_overflow(text):
    with pytest.raises(ValueError, match="byte count|kv_bytes"):
        kd.parse_bytes(text)


def test_parse_bytes_is_exact():
    assert kd.parse_bytes("9007199254740993") == 9007199254740993  # was rounded via float
    assert kd.parse_bytes("1.5e9") == 1_500_000_000
    assert kd.parse_bytes(" 0.5 KiB ") == 512
    assert kd.parse_bytes(np.int64(7)) == 7 and type(kd.parse_bytes(np.int64(7))) is int


@FAST
@given(v=st.one_of(NOT_INT, st.integers(max_value=0)))
def test_byte_helpers_refuse_bad_counts(v):
    if not (isinstance(v, str) and any(c.isdigit() for c in v)):  # "1", "2KiB": byte specs
        with pytest.raises(ValueError):
            kd.parse_bytes(v)
    with pytest.raises((ValueError, TypeError), match="bytes_per_block"):
        kd.num_blocks_for_bytes(1 << 20, v)
    with pytest.raises((ValueError, TypeError), match="num_layers"):
        kd.kv_bytes_per_block(num_layers=v, num_kv_heads=1, head_dim=2, block_size=4,
                              kv_dtype="int8")
    if not (type(v) is int and v == 0):
        with pytest.raises((ValueError, TypeError), match="num_padding_pages"):
            kd.num_pool_blocks_for_bytes(1 << 20, 16, num_padding_pages=v)


def test_kv_bytes_per_block_numpy_ints_do_not_wrap():
    big = dict(num_layers=np.int64(2**40), num_kv_heads=np.int64(2**20),
               head_dim=np.int64(2**20), block_size=np.int64(16), kv_dtype="int8")
    got = kd.kv_bytes_per_block(**big)
    assert type(got) is int
    assert got == 2**40 * (16 * 2 * 2**20 * 2**20 + 2 * 2**20 * kd.SCALE_BYTES)


def test_pool_blocks_for_bytes_edges():
    assert kd.num_pool_blocks_for_bytes(32, 16) == 1
    with pytest.raises(ValueError, match="holds no allocatable block"):
        kd.num_pool_blocks_for_bytes(31, 16)
    assert kd.num_blocks_for_bytes("1e30", 1) == 10**30
    assert not math.isinf(kd.parse_bytes("1e38"))


# --------------------------------------------------------------- simulators
def _trace():
    from prefixcache.sim.trace import TraceRequest
    return [TraceRequest(id=str(i), prompt=list(range(i, i + 17)), output_len=2,
                         timestamp=float(i)) for i in range(4)]


BAD_SIM = [True, 3.0, -1, float("nan"), "3", None, [3], np.float64(2.0), np.bool_(True),
           {"a": 1}]


@pytest.mark.parametrize("name", ["num_host_blocks", "host_eviction", "kv_cache_groups"])
@pytest.mark.parametrize("bad", BAD_SIM + ["belady", "full,sw8"], ids=repr)
def test_replay_host_and_group_flags_refused_before_any_record(name, bad):
    from prefixcache.sim.replay import replay
    if name == "kv_cache_groups" and (bad is None or bad == "full,sw8"):
        return  # None = the plain model; "full,sw8" is parse_kv_groups' text (CacheConfig)
    recs = []
    kw = {name: bad}
    if name == "host_eviction":
        kw["num_host_blocks"] = 4
    with pytest.raises((ValueError, TypeError), match=name.split("_")[-1].rstrip("s")):
        replay(_trace(), num_blocks=16, block_size=4, on_record=recs.append, **kw)
    assert recs == []


@pytest.mark.parametrize("name", ["num_host_blocks", "host_eviction", "host_eviction_options",
                                  "host_load_overlap"])
@pytest.mark.parametrize("bad", BAD_SIM + ["belady"], ids=repr)
def test_des_host_flags_refused_before_any_record(name, bad):
    from prefixcache.sim import cost_model as cm
    from prefixcache.sim import des
    if (name, bad) in (("host_eviction_options", None), ("host_load_overlap", True)):
        return  # valid values
    cost = cm.CostModel.create("llama_3_1_8b", "h200", host_link="h200_pcie5")
    kw = {name: bad}
    if name != "num_host_blocks":
        kw["num_host_blocks"] = 4
    recs = []
    with pytest.raises((ValueError, TypeError), match=name):
        des.simulate(_trace(), cost_model=cost, num_blocks=16, block_size=4,
                     on_record=recs.append, **kw)
    assert recs == []


@pytest.mark.parametrize("name", ["num_host_blocks", "host_eviction", "host_weight"])
@pytest.mark.parametrize("bad", BAD_SIM + [1.5, -0.1], ids=repr)
def test_cluster_host_flags_refused_before_any_record(name, bad):
    from prefixcache.sim import cluster
    from prefixcache.sim import cost_model as cm
    if name != "host_weight" and bad in (1.5, -0.1):
        return
    cost = cm.CostModel.create("llama_3_1_8b", "h200", host_link="h200_pcie5")
    kw = ({"router_options": {"host_weight": bad}} if name == "host_weight"
          else {name: bad})
    if name == "host_eviction":
        kw["num_host_blocks"] = 4
    recs = []
    with pytest.raises((ValueError, TypeError), match=name):
        cluster.simulate_cluster(_trace(), num_replicas=2, router="kv_events", cost_model=cost,
                                 num_blocks=16, block_size=4, on_record=recs.append, **kw)
    assert recs == []


# --------------------------------------------------------------- random call sequences
@pytest.mark.parametrize("index", INDEXES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["admit", "free", "lookup", "stale", "reorder",
                                               "drop", "dup", "mix", "reset"]),
                              st.integers(0, 5), st.integers(0, 2**16)),
                    min_size=4, max_size=30))
def test_random_sequences_with_stale_and_mangled_hit_lists(index, ops):
    """Good admissions, frees and resets interleaved with hit lists that are stale (from
    an earlier lookup), reordered, cut, duplicated or mixed with another prompt's: every
    call either succeeds or is refused with nothing changed (snapshots, no transfers or
    events), and the invariants hold throughout."""
    m = KVCacheManager(8, 4, num_host_blocks=6, index=index, free_order="unhashed_first",
                       enable_events=True)
    prompts = [list(range(p * 8, p * 8 + 17)) for p in range(3)]  # share nothing
    running: dict[str, Request] = {}
    old_lists: list = []
    serial = 0
    for op, k, seed in ops:
        p = prompts[k % 3]
        if op == "free":
            if running:
                rid = sorted(running)[k % len(running)]
                m.free(running.pop(rid))
            continue
        if op == "reset":  # (both tiers, when nothing runs): older lists go stale
            m.reset_prefix_cache()
            m.take_host_transfers()
            continue
        serial += 1
        r = Request(f"r{serial}", p)
        blocks, n = m.get_computed_blocks(r)
        if op in ("admit", "lookup"):
            old_lists.append((p, blocks))
            if op == "admit" and len(running) < 2:
                if m.allocate_slots(r, r.num_tokens - n, n, blocks) is not None:
                    running[r.request_id] = r
            continue
        if op == "stale" and old_lists:
            p0, bad = old_lists[seed % len(old_lists)]
            r = Request(f"r{serial}s", p0)
        elif op == "reorder" and len(blocks) >= 2:
            bad = blocks[::-1]
        elif op == "drop" and len(blocks) >= 2:
            bad = blocks[1:]
        elif op == "dup" and blocks:
            bad = blocks + blocks[-1:]
        elif op == "mix" and old_lists:
            _, other = old_lists[seed % len(old_lists)]
            bad = blocks[:1] + other[1:]
        else:
            continue
        m.take_host_transfers()
        m.take_events()
        before = snap(m)
        slot_hash = {s.block_id: s.block_hash for s in m.host_tier.slots}
        nb = len(bad) * 4
        try:
            got = m.allocate_slots(r, max(r.num_tokens - nb, 1), nb, bad)
        except (ValueError, TypeError):
            assert snap(m) == before
            assert m.take_host_transfers() == [] and m.take_events() == []
        else:
            # Accepted (e.g. a device-only list, which the hash index takes as vLLM
            # does): every loaded block is cached under the hash its host slot held --
            # a reordered HostHit list cached one block under another's hash before.
            if got is not None:
                running[r.request_id] = r
                mine = {b.block_id: b for b in m.implementation._states[r.request_id].blocks}
                for t in m.take_host_transfers():
                    if t.kind == "load":
                        assert mine[t.block_id].block_hash == slot_hash[t.host_slot], op
        m.check_invariants()


# --------------------------------------------------------------- mangled device hit lists
def _device_hits(m):
    for rid in ("a", "b"):
        r = Request(rid, list(range(17)))
        _admit(m, r)
    m.free("b")
    m.take_events()
    r = Request("c", list(range(17)))
    return r, *m.get_computed_blocks(r)


MANGLE = {
    "reorder": lambda bl: bl[::-1],
    "dup": lambda bl: bl + bl[-1:],
    "cut_front": lambda bl: bl[1:],
}


@pytest.mark.parametrize("index", INDEXES)
@pytest.mark.parametrize("how", sorted(MANGLE))
def test_mangled_device_hit_lists_refused(index, how):
    """Hash index (default path, regression): a reordered / duplicated / front-cut list
    of device hits was adopted, leaving a table check_invariants rejects."""
    m = KVCacheManager(20, 4, index=index, enable_events=True)
    r, blocks, n = _device_hits(m)
    assert len(blocks) == 4
    bad = MANGLE[how](blocks)
    before = (m.counters(), m.free_block_ids(), sorted(m.implementation._states))
    with pytest.raises(ValueError, match="cached block|adopts"):
        m.allocate_slots(r, max(r.num_tokens - 4 * len(bad), 1), 4 * len(bad), bad)
    assert (m.counters(), m.free_block_ids(), sorted(m.implementation._states)) == before
    assert m.take_events() == []
    m.check_invariants()
    assert m.allocate_slots(r, r.num_tokens - n, n, blocks) is not None
    m.check_invariants()


@pytest.mark.parametrize("how", sorted(MANGLE))
def test_mangled_hybrid_hit_lists_refused(how):
    """HybridKVCacheManager (regression): the same, per group."""
    m = KVCacheManager(20, 4, kv_cache_groups=kg.parse_kv_groups("full,sw8"),
                       enable_events=True)
    r, hits, n = _device_hits(m)
    bad = tuple(MANGLE[how](list(g)) for g in hits)
    before = (m.counters(), sorted(m.implementation._states))
    nt = 4 * len(bad[0])
    with pytest.raises(ValueError, match="cached block"):
        m.allocate_slots(r, max(r.num_tokens - nt, 1), nt, bad)
    assert (m.counters(), sorted(m.implementation._states)) == before
    assert m.take_events() == []
    m.check_invariants()
    assert m.allocate_slots(r, r.num_tokens - n, n, hits) is not None
    m.check_invariants()
