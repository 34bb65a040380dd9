"""Miss accounting (issue 26 item 1): every missed prompt block gets exactly one reason.

The issue's checks: the reasons sum exactly to the missed prompt blocks on every trace
and configuration (property test over workloads x policies x indexes x tiers);
``cold`` blocks equal the ideal's misses on an unbounded cache; a salt change moves
blocks from hits to ``isolated``, not to ``cold``; plus hand-computed cases for
``partial``, ``last_token`` and ``evicted`` (with the tier that dropped the block)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from prefixcache.core import KVCacheManager
from prefixcache.core.kv_groups import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from prefixcache.sim import workloads
from prefixcache.core.kv_groups import parse_kv_groups
from prefixcache.sim.misses import REASONS, GroupProbeAccountant, MissAccountant, _tracked_group
from prefixcache.sim.replay import replay
from prefixcache.sim.trace import TraceRequest

BS = 4


def _run(trace, **kw):
    recs = []
    summary = replay(trace, block_size=BS, miss_reasons=True, on_record=recs.append, **kw)
    return summary, recs


def _missed(rec):
    return -(-rec["prompt_tokens"] // BS) - rec["num_computed_tokens"] // BS


def test_hand_computed_reasons():
    t = [
        TraceRequest("a", list(range(1, 11)), 1),  # 2 full blocks + 2 tokens: cold, cold, partial
        TraceRequest("b", list(range(1, 9)), 1),  # exactly blocks 0-1, both cached: last_token
        TraceRequest("c", list(range(1, 11)), 1, cache_salt="t1"),  # same tokens, another salt
        TraceRequest("d", [99] * 12, 1),  # 3 new blocks
    ]
    summary, recs = _run(t, num_blocks=64)
    assert [r["miss_reasons"] for r in recs] == [
        {"cold": 2, "partial": 1},
        {"last_token": 1},
        {"isolated": 2, "partial": 1},
        {"cold": 3},
    ]
    mr = summary["miss_reasons"]
    assert mr["reasons"] == {"cold": 5, "evicted": 0, "isolated": 2, "partial": 2,
                             "last_token": 1, "window": 0, "preempted": 0,
                             "evicted_device": 0, "evicted_host": 0}
    assert mr["missed_blocks"] == sum(_missed(r) for r in recs) == 10
    assert mr["per_tenant"]["t1"]["isolated"] == 2 and mr["per_tenant"][""]["isolated"] == 0


@pytest.mark.parametrize("num_host_blocks,tier", [(0, "evicted_device"), (1, "evicted_host")])
def test_evicted_blocks_name_the_tier_that_dropped_them(num_host_blocks, tier):
    # 3 device blocks: a's two blocks are evicted by b's three; then a comes back.
    t = [TraceRequest("a", [1] * 4 + [2] * 4 + [3], 1),
         TraceRequest("b", [7] * 12 + [8], 1),
         TraceRequest("a2", [1] * 4 + [2] * 4 + [3], 1)]
    summary, recs = _run(t, num_blocks=4, num_host_blocks=num_host_blocks)
    last = recs[-1]
    # With one host slot one of a's blocks may survive on the host (a hit); every
    # block still missing was dropped -- by the tier this configuration has.
    assert last["miss_reasons"].get("evicted", 0) >= 1
    assert last["miss_reasons"].get(tier, 0) == last["miss_reasons"]["evicted"]
    assert summary["miss_reasons"]["missed_blocks"] == sum(_missed(r) for r in recs)


def test_cold_equals_the_ideal_misses_on_an_unbounded_cache():
    trace = workloads.generate("multi_turn", num_conversations=6, num_turns=4, seed=3,
                               new_tokens=(10, 40), output_len=(2, 8))
    summary, recs = _run(trace, num_blocks=100_000)
    # The ideal: a full block misses iff its key was never cached before; with an
    # unbounded cache nothing is evicted, so every such miss is cold or isolated.
    mr = summary["miss_reasons"]["reasons"]
    assert mr["evicted"] == 0
    full_missed = sum(_missed(r) for r in recs) - mr["partial"] - mr["last_token"]
    assert mr["cold"] + mr["isolated"] == full_missed
    assert mr["isolated"] == 0  # no salts, adapters or images in this workload


def test_a_salt_change_moves_hits_to_isolated_not_cold():
    base = [TraceRequest(f"r{i}", [5] * 8 + [6] * 8 + [i + 10], 1) for i in range(3)]
    salted = [TraceRequest(f"s{i}", [5] * 8 + [6] * 8 + [i + 10], 1,
                           cache_salt=("x" if i else None)) for i in range(3)]
    s0, _ = _run(base, num_blocks=64)
    s1, _ = _run(salted, num_blocks=64)
    moved = s0["hit_tokens"] // BS - s1["hit_tokens"] // BS
    assert moved == 4  # s1 misses its 4 full blocks (s2 then hits s1's salted ones)
    assert s1["miss_reasons"]["reasons"]["isolated"] - s0["miss_reasons"]["reasons"][
        "isolated"] == moved
    assert s1["miss_reasons"]["reasons"]["cold"] == s0["miss_reasons"]["reasons"]["cold"]


SLIDING = (KVCacheGroup(FullAttentionSpec(), ("full",)),
           KVCacheGroup(SlidingWindowSpec(8), ("swa",)))


@settings(max_examples=30, deadline=None)
@given(workload=st.sampled_from(["multi_turn", "shared_system_prompt", "rag", "mm_salt"]),
       eviction=st.sampled_from(["lru", "lfu", "arc", "s3fifo", "fifo"]),
       index=st.sampled_from(["hash", "radix"]),
       num_host_blocks=st.sampled_from([0, 8]),
       sliding=st.booleans(),
       num_blocks=st.integers(24, 200), seed=st.integers(0, 3))
def test_reasons_sum_to_the_missed_blocks(workload, eviction, index, num_host_blocks,
                                          sliding, num_blocks, seed):
    if sliding:  # (the hybrid layout runs on the hash index without a host tier)
        index, num_host_blocks = "hash", 0
    out = dict(output_len=(2, 8))
    kwargs = {"multi_turn": dict(num_conversations=4, num_turns=3, new_tokens=(10, 40), **out),
              "shared_system_prompt": dict(num_requests=12, system_len=64,
                                           unique_len=(8, 32), **out),
              "rag": dict(num_requests=12, num_documents=10, doc_len=(16, 64),
                          system_len=16, question_len=(4, 16), **out),
              "mm_salt": dict(num_requests=12, prefix_len=4, image_len=16, num_images=3,
                              suffix_len=(4, 16), **out)}[workload]
    trace = workloads.generate(workload, seed=seed, **kwargs)
    summary, recs = _run(trace, num_blocks=num_blocks, eviction=eviction, index=index,
                         num_host_blocks=num_host_blocks, concurrency=2,
                         kv_cache_groups=SLIDING if sliding else None)
    admitted = [r for r in recs if not r.get("failed")]
    for r in admitted:
        assert sum(v for k, v in r["miss_reasons"].items() if k in REASONS) == _missed(r), r
    mr = summary["miss_reasons"]
    assert mr["missed_blocks"] == sum(_missed(r) for r in admitted)
    assert sum(mr["reasons"][k] for k in REASONS) == mr["missed_blocks"]
    assert mr["reasons"]["evicted"] == mr["reasons"]["evicted_device"] + mr["reasons"][
        "evicted_host"]
    assert sum(sum(v[k] for k in REASONS) for v in mr["per_tenant"].values()) == mr[
        "missed_blocks"]


def test_window_misses_in_a_sliding_window_layout():
    # fifo evicts the sliding-window group's released blocks while the full-attention
    # group still holds the shared prefix: those blocks miss for the window.
    trace = workloads.generate("shared_system_prompt", seed=0, num_requests=30, system_len=64,
                               unique_len=(8, 32), output_len=(2, 8))
    summary, recs = _run(trace, num_blocks=50, eviction="fifo", concurrency=2,
                         kv_cache_groups=SLIDING)
    mr = summary["miss_reasons"]
    assert mr["reasons"]["window"] > 0
    assert mr["missed_blocks"] == sum(_missed(r) for r in recs if not r.get("failed"))
    # Without the window group the same trace has no window misses.
    full, _ = _run(trace, num_blocks=50, eviction="fifo", concurrency=2)
    assert full["miss_reasons"]["reasons"]["window"] == 0


def _with_plain_copies(trace):
    """``trace`` with an unsalted, adapter-free, text-only copy after every other
    request: the same tokens under another key (``isolated`` both ways)."""
    import dataclasses

    out = []
    for i, t in enumerate(trace):
        out.append(t)
        if i % 2 == 0:
            out.append(dataclasses.replace(t, id=t.id + "-plain", cache_salt=None, lora=None,
                                           mm=()))
    return out


class _EagerPlain(MissAccountant):
    """Hashes every plain block it needs (never trusts "no plain request admitted")."""

    _plain_admitted = property(lambda self: True, lambda self, value: None)


@settings(max_examples=30, deadline=None)
@given(workload=st.sampled_from(["multi_turn", "rag", "mm_salt", "mm_salt_plain"]),
       eviction=st.sampled_from(["lru", "s3fifo", "fifo"]),
       index=st.sampled_from(["hash", "radix"]),
       num_host_blocks=st.sampled_from([0, 6]),
       num_blocks=st.integers(20, 120), seed=st.integers(0, 3),
       layout=st.sampled_from([None, "full,sw8", "sw8,full"]),
       reset_at=st.integers(0, 14),
       lower=st.sampled_from(["", "disk", "disk+remote"]))
def test_probes_equal_events(workload, eviction, index, num_host_blocks, num_blocks, seed,
                             layout, reset_at, lower):
    # The hash index and the radix tree are followed by probes (pool / tree / host
    # hash maps, evicted_by hooks; plain chains hashed lazily); the KV events of the
    # same manager give the same reasons at every admission.
    kwargs = {"multi_turn": dict(num_conversations=4, num_turns=3, new_tokens=(10, 40)),
              "rag": dict(num_requests=12, num_documents=6, doc_len=(16, 48), system_len=8,
                          question_len=(4, 12)),
              "mm_salt": dict(num_requests=10, prefix_len=4, image_len=12, num_images=3,
                              suffix_len=(4, 12))}
    kwargs["mm_salt_plain"] = kwargs["mm_salt"]
    trace = workloads.generate(workload.replace("_plain", ""), seed=seed, output_len=(2, 6),
                               **kwargs[workload])
    if workload == "mm_salt_plain":
        trace = _with_plain_copies(trace)
    groups = None if layout is None else parse_kv_groups(layout)
    if groups is not None and index == "radix":
        num_host_blocks = 0  # (the radix multi-group manager takes no host tier)
    # The tiers below the host (with a host tier): a disk, and a remote store under it.
    # NOTE: a reset keeps the (shared, inclusive) remote store, which the events of one
    # manager cannot tell from its own tiers: no reset with one.
    tiers = {}
    if num_host_blocks and lower:
        tiers = {"disk_bytes": 6 * 100, "page_bytes": 100}
        if "remote" in lower:
            tiers["remote_bytes"] = 8 * 100
            reset_at = 0
    m = KVCacheManager(num_blocks * (1 if groups is None else 2), BS, eviction=eviction,
                       num_host_blocks=num_host_blocks, index=index, enable_events=True,
                       int_event_hashes=False, free_order="unhashed_first",
                       kv_cache_groups=groups, **tiers)
    probe = MissAccountant.for_manager(m)  # (a layout with groups: GroupProbeAccountant)
    assert not probe.uses_events
    assert (type(probe) is GroupProbeAccountant) == (groups is not None)
    g, windowed = _tracked_group(groups)
    events = MissAccountant(BS, m.hasher, track_group=g, windowed=windowed)
    # and an accountant that hashes a plain block even before any request without
    # extra keys was admitted (where the others know it was never cached, unhashed)
    eager = _EagerPlain(BS, m.hasher, track_group=g, windowed=windowed)
    running = []
    from prefixcache.core.request import LoRARequest, MultiModalFeature, Request

    for i, tr in enumerate(trace):
        if i == reset_at and i:  # a prefix-cache reset part-way (not an eviction)
            while running:
                m.free(running.pop(0))
            assert m.reset_prefix_cache()
        if len(running) >= 2:
            m.free(running.pop(0))
        req = Request(tr.id, tr.prompt, cache_salt=tr.cache_salt, hasher=m.hasher,
                      block_size=BS, lora=LoRARequest(*tr.lora) if tr.lora else None,
                      mm_features=[MultiModalFeature(*x) for x in tr.mm])
        while True:
            evs = m.take_events()
            events.observe(evs)
            eager.observe(evs)
            computed, hit = m.get_computed_blocks(req)
            a, b = probe.lookup(req, hit), events.lookup(req, hit)
            assert a == b == eager.lookup(req, hit), (tr.id, a, b)
            admitted = m.allocate_slots(req, req.num_tokens - hit, hit, computed) is not None
            if admitted or not running:
                break
            m.free(running.pop(0))
        if not admitted:
            continue
        probe.admit(req, hit, a)
        events.admit(req, hit, b)
        eager.admit(req, hit, b)
        req.num_computed_tokens = req.num_tokens
        for step in range(tr.output_len - 1):
            req.append_output_token_ids(7 + step)
            if m.allocate_slots(req, 1) is None:
                break
            req.num_computed_tokens += 1
        running.append(req)
    assert probe.summary() == events.summary() == eager.summary()


def test_bad_input():
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        MissAccountant(0)
    m = KVCacheManager(8, BS, kv_cache_groups=parse_kv_groups("full,mamba"))
    with pytest.raises(ValueError, match="enable_events=True, int_event_hashes=False"):
        MissAccountant.for_manager(m)  # (state groups are followed by events)
    assert type(MissAccountant.for_manager(KVCacheManager(8, BS, kv_cache_groups=SLIDING))
                ) is GroupProbeAccountant
    r = KVCacheManager(8, BS, index="radix")
    assert not MissAccountant.for_manager(r).uses_events  # the tree is probed
    with pytest.raises(ValueError, match="already has a miss accountant"):
        MissAccountant.for_manager(r)
    h = KVCacheManager(8, BS)
    MissAccountant.for_manager(h)
    with pytest.raises(ValueError, match="already has a miss accountant"):
        MissAccountant.for_manager(h)


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_des_preempted_and_the_sum_per_request(index):
    # The DES preempts (6 blocks of 4, six requests growing by decode): re-admissions
    # lose KV they had computed -> ``preempted``; a request never preempted has exactly
    # its first admission's missed blocks.
    from prefixcache.sim import cost_model as cm
    from prefixcache.sim import des

    toy = cm.CostModel(
        cm.ModelShape(num_layers=1, d_model=4, num_q_heads=2, num_kv_heads=1, head_dim=2,
                      ffn_dim=8, vocab_size=10, dtype_bytes=2),
        cm.Accelerator("toy", peak_flops=1000.0, hbm_bandwidth=1e30, hbm_bytes=1e6))
    reqs = [TraceRequest(id=f"r{i}", prompt=[i + 1] * 12, output_len=8, timestamp=0.0)
            for i in range(6)]
    recs = []
    summary = des.simulate(reqs, cost_model=toy, num_blocks=6, block_size=BS, index=index,
                           miss_reasons=True, on_record=recs.append)
    assert summary["preemptions"] > 0 and summary["finished"] == 6
    mr = summary["miss_reasons"]
    assert mr["reasons"]["preempted"] > 0
    assert sum(sum(v for k, v in r["miss_reasons"].items() if k in REASONS)
               for r in recs) == mr["missed_blocks"]
    for r in recs:
        if not r["num_preemptions"]:
            assert sum(r["miss_reasons"].get(k, 0) for k in REASONS) == (
                -(-r["prompt_tokens"] // BS) - r["num_cached_tokens"] // BS)
            assert "preempted" not in r["miss_reasons"]
    plain = des.simulate(reqs, cost_model=toy, num_blocks=6, block_size=BS, index=index)
    assert "miss_reasons" not in plain
    assert {k: v for k, v in plain.items() if k != "makespan_s"} == {
        k: v for k, v in summary.items() if k not in ("makespan_s", "miss_reasons")}


@pytest.mark.parametrize("router,index", [("kv_events", "hash"), ("round_robin", "radix")])
def test_cluster_sums_are_the_replicas_sums(router, index):
    # One accountant per replica: the summary's reasons are the per-replica rows'
    # sums, each replica's the sum of its records'; routing and every other field
    # unchanged.
    from prefixcache.sim import des
    from prefixcache.sim.cluster import simulate_cluster
    from prefixcache.sim.cost_model import CostModel

    trace = workloads.generate("rag", seed=1, num_requests=40, num_documents=8, doc_len=(16, 64),
                               system_len=16, question_len=(4, 16), output_len=(2, 8),
                               arrival_rate=50.0)
    kw = dict(num_replicas=3, router=router, cost_model=CostModel.create("llama_3_1_8b", "h100"),
              num_blocks=40, block_size=BS, index=index,
              scheduler=des.SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4))
    recs = []
    on = simulate_cluster(trace, miss_reasons=True, on_record=recs.append, **kw)
    off = simulate_cluster(trace, **kw)
    assert {k: v for k, v in off.items() if k not in ("route_us", "route_hash_us",
                                                      "per_replica")} == {
        k: v for k, v in on.items() if k not in ("route_us", "route_hash_us", "per_replica",
                                                 "miss_reasons")}
    rows = on["per_replica"]
    assert [{k: v for k, v in r.items() if k != "miss_reasons"} for r in rows] == off[
        "per_replica"]
    mr = on["miss_reasons"]
    for k in REASONS:
        assert mr["reasons"][k] == sum(r["miss_reasons"]["reasons"][k] for r in rows), k
    for r in rows:
        mine = [x for x in recs if x["replica"] == r["replica"]]
        assert r["miss_reasons"]["missed_blocks"] == sum(
            sum(x["miss_reasons"].get(k, 0) for k in REASONS) for x in mine)
    assert mr["missed_blocks"] > 0
    assert sum(sum(v[k] for k in REASONS) for v in mr["per_tenant"].values()) == mr[
        "missed_blocks"]
