"""The engine side of the host tier (issue 16 item 1).

Unit level: `HostPages` applies an ordered list of `HostTransfer` tuples to real KV
arrays exactly as sequential page copies would (a numpy reference walks them one by
one), with one device_put and at most one device_get per batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prefixcache.engine.host_pages import HostPages, plan_host_transfers

L, NB, NH, PAGE = 2, 6, 5, (4, 2, 8)  # layers, device blocks, host slots, page shape


def _kv(seed: int, dtype=np.float32):
    rng = np.random.default_rng(seed)
    # NB + 1 pages: the last one is the padding page.
    return [jnp.asarray(rng.standard_normal((NB + 1, *PAGE)).astype(dtype)) for _ in range(L)]


def _reference(dev: list[np.ndarray], host: list[np.ndarray], transfers):
    """Sequential page copies, one at a time (the semantics the plan must keep)."""
    dev = [d.copy() for d in dev]
    host = [h.copy() for h in host]
    for kind, b, s in transfers:
        for d, h in zip(dev, host):
            if kind == "store":
                h[s] = d[b]
            else:
                d[b] = h[s]
    return dev, host


def _random_transfers(rng, n):
    return [("store" if rng.random() < 0.5 else "load", int(rng.integers(NB)),
             int(rng.integers(NH))) for _ in range(n)]


def _run(pages: HostPages, kv, transfers):
    kv = pages.apply(kv, transfers)
    pages.finish()
    return kv


@pytest.fixture(scope="module")
def shared_pages():
    """One HostPages (and its compiled copy programs) for the randomized cases."""
    return HostPages(_kv(0), num_blocks=NB, num_host_blocks=NH)


@pytest.mark.parametrize("seed", range(32))
def test_batch_equals_sequential_copies(seed, shared_pages):
    rng = np.random.default_rng(seed)
    kv = _kv(seed)
    pages = shared_pages
    for p in pages.pages:  # distinct host contents too
        p[:] = rng.standard_normal(p.shape)
    dev0 = [np.asarray(x) for x in kv]
    host0 = [p.copy() for p in pages.pages]
    transfers = _random_transfers(rng, int(rng.integers(1, 12)))
    want_dev, want_host = _reference(dev0, host0, transfers)
    counts = (pages.num_h2d, pages.num_d2h)
    kv = _run(pages, kv, transfers)
    for l in range(L):
        # Exact: copies, no arithmetic. The padding page (id NB) may hold anything.
        np.testing.assert_array_equal(np.asarray(kv[l])[:NB], want_dev[l][:NB])
        np.testing.assert_array_equal(pages.pages[l], want_host[l])
    assert pages.num_h2d - counts[0] <= 1 and pages.num_d2h - counts[1] <= 1


def test_store_after_load_of_same_block_takes_the_loaded_page():
    kv = _kv(1)
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH)
    pages.pages[0][3] = 7.0
    pages.pages[1][3] = 8.0
    # load slot 3 -> block 2, then store block 2 -> slot 0: slot 0 gets slot 3's data
    # (not block 2's content before the batch).
    plan = plan_host_transfers([("load", 2, 3), ("store", 2, 0)], num_blocks=NB,
                               num_host_blocks=NH)
    assert plan.num_gather == 0 and plan.host_dst.tolist() == [0]
    assert plan.host_src.tolist() == [3]
    kv = _run(pages, kv, [("load", 2, 3), ("store", 2, 0)])
    assert np.all(pages.pages[0][0] == 7.0) and np.all(pages.pages[1][0] == 8.0)
    assert np.all(np.asarray(kv[0])[2] == 7.0) and np.all(np.asarray(kv[1])[2] == 8.0)
    assert (pages.num_h2d, pages.num_d2h) == (1, 0)


def test_load_of_a_slot_stored_in_the_same_batch_is_a_device_copy():
    kv = _kv(2)
    before = [np.asarray(x) for x in kv]
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH)
    t = [("store", 4, 1), ("load", 0, 1)]
    plan = plan_host_transfers(t, num_blocks=NB, num_host_blocks=NH)
    # one gathered page (block 4), written to slot 1 and to block 0; nothing staged.
    # Rows padded to MIN_ROWS = 4: gathers of the padding page NB, writes to it.
    assert plan.gather_ids.tolist() == [4, NB, NB, NB] and plan.staged_slots.size == 0
    assert plan.scatter_ids.tolist() == [0, NB, NB, NB]
    assert plan.scatter_src.tolist() == [0, 0, 0, 0]
    kv = _run(pages, kv, t)
    for l in range(L):
        np.testing.assert_array_equal(pages.pages[l][1], before[l][4])
        np.testing.assert_array_equal(np.asarray(kv[l])[0], before[l][4])
    assert (pages.num_h2d, pages.num_d2h) == (1, 1)
    assert (pages.num_pages_loaded, pages.num_pages_stored) == (1, 1)


def test_padding_to_powers_of_two_bounds_programs():
    kv = _kv(3)
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH)
    plan = plan_host_transfers([("store", b, b) for b in range(3)]
                               + [("load", 5, 4)], num_blocks=NB, num_host_blocks=NH)
    # 3 gathered rows -> 4 (MIN_ROWS; padding page NB); 1 staged and scattered row -> 4.
    assert plan.gather_ids.tolist() == [0, 1, 2, NB]
    assert plan.num_staged_padded == 4 and plan.staged_slots.tolist() == [4]
    assert plan.scatter_ids.tolist() == [5, NB, NB, NB]
    assert plan.scatter_src.tolist() == [4, 0, 0, 0]  # staged row 0 after 4 gathered rows
    for n in (1, 3, 4):
        kv = _run(pages, kv, [("store", b, b) for b in range(n)])
    for n in (5, 6):
        kv = _run(pages, kv, [("load", b, b % NH) for b in range(n)])
    assert pages.compiled_shapes == {(4, 0, 0), (0, 8, 8)}


def test_bfloat16_pages_keep_their_bits():
    kv = _kv(4, dtype=jnp.bfloat16)
    before = [np.asarray(x) for x in kv]
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH)
    assert pages.dtype == np.dtype(jnp.bfloat16)
    assert pages.nbytes == NH * L * int(np.prod(PAGE)) * 2
    kv = _run(pages, kv, [("store", 1, 0), ("store", 2, 4)])
    kv = _run(pages, kv, [("load", 5, 0), ("load", 3, 4)])
    for l in range(L):
        got = np.asarray(kv[l])
        assert got[5].tobytes() == before[l][1].tobytes()
        assert got[3].tobytes() == before[l][2].tobytes()


def test_bad_transfers_raise_before_any_copy():
    kv = _kv(5)
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH)
    for bad in ([("store", NB, 0)], [("load", 0, NH)], [("move", 0, 0)],
                [("load", -1, 0)]):
        with pytest.raises(ValueError, match="host transfer"):
            pages.apply(kv, bad)
    assert pages.num_h2d == 0 and not any(p.any() for p in pages.pages)


def test_apply_runs_clean_under_transfer_guard_disallow():
    kv = _kv(6)
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH)
    with jax.transfer_guard("disallow"):
        kv = pages.apply(kv, [("store", 1, 0), ("load", 2, 3)])
        pages.finish()
    assert (pages.num_h2d, pages.num_d2h) == (1, 1)


# ----------------------------------------------------------------- the engine end to end

from prefixcache.engine import Engine, SamplingParams  # noqa: E402
from prefixcache.model import ModelConfig  # noqa: E402

BS = 16
# A device pool far smaller than the working set: three families of requests, each
# sharing a 96-token (6-block) prefix; a family's prefix is evicted from the device by
# the next two before it is revisited. One shape bucket each: one compiled program.
COMMON = dict(num_blocks=20, block_size=BS, seed=0, max_num_seqs=2,
              max_num_batched_tokens=64, max_model_len=256, token_buckets=(64,),
              seq_buckets=(2,), page_buckets=(16,))
PARAMS = SamplingParams(max_tokens=4)
NUM_HOST = 48


def _rounds():
    rng = np.random.default_rng(11)
    prefixes = [rng.integers(1, 512, 6 * BS).tolist() for _ in range(3)]
    rounds = []
    for visit in range(2):
        for f, prefix in enumerate(prefixes):
            rounds.append([(f"f{f}v{visit}r{k}", prefix + rng.integers(1, 512, n).tolist())
                           for k, n in enumerate((5, 21))])
    return rounds


def _serve(engine):
    """Runs every round to completion; returns (tokens by id, logits by id)."""
    tokens, logits = {}, {}
    engine.record_logits = True
    for batch in _rounds():
        for rid, prompt in batch:
            engine.add_request(prompt, PARAMS, request_id=rid)
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, out.error
                tokens[out.request_id] = out.token_ids
    for step in engine.step_logits:
        for rid, row in step.items():
            logits.setdefault(rid, []).append(row)
    return tokens, {k: np.stack(v) for k, v in logits.items()}


@pytest.fixture(scope="module")
def off():
    eng = Engine(ModelConfig.tiny(), **COMMON)
    return eng, _serve(eng)


def _engine(off_engine, **kw):
    return Engine(ModelConfig.tiny(), share_programs_with=off_engine, **COMMON,
                  num_host_blocks=NUM_HOST, **kw)


class _Spy:
    """Wraps the runner's `apply_host_transfers`: records each batch, the counters
    around it, and checks every promoted page byte for byte against the demoted one."""

    def __init__(self, engine):
        self.engine, self.runner = engine, engine.runner
        self.batches, self.demoted, self.num_checked = [], {}, 0
        self._apply = self.runner.apply_host_transfers
        self.runner.apply_host_transfers = self

    def __call__(self, transfers):
        runner = self.runner
        with jax.transfer_guard("allow"):
            before = [np.asarray(x) for x in runner.kv_caches]
        assert all(np.isfinite(x).all() for x in before)
        cur = {}  # device page -> its content after this batch's loads so far
        for kind, b, s in transfers:
            if kind == "store":
                self.demoted[s] = cur.get(b, [x[b].copy() for x in before])
            else:
                cur[b] = self.demoted[s]
        pages = runner.host_pages
        counts = (pages.num_h2d, pages.num_d2h)
        self._apply(transfers)
        self.batches.append((list(transfers), counts, (pages.num_h2d, pages.num_d2h)))
        with jax.transfer_guard("allow"):
            after = [np.asarray(x) for x in runner.kv_caches]
        for b, want in cur.items():
            for l in range(len(after)):
                assert after[l][b].tobytes() == want[l].tobytes(), (b, l)
            self.num_checked += 1


def test_tier_on_matches_off_and_hits_more(off):
    off_engine, (want_tokens, want_logits) = off
    eng = _engine(off_engine)
    spy = _Spy(eng)
    tokens, logits = _serve(eng)
    assert tokens == want_tokens
    for rid, rows in want_logits.items():
        np.testing.assert_allclose(logits[rid], rows, atol=1e-4, rtol=0)
    m, m_off = eng.metrics(), off_engine.metrics()
    assert m.num_cached_tokens > m_off.num_cached_tokens
    assert m.host_hit_tokens > 0 and m.device_hit_tokens > 0
    assert m.host_blocks_loaded > 0 and m.host_blocks_stored > 0
    page_bytes = 2 * BS * 2 * 2 * 64 * 4  # layers x page x 2K x head_dim x f32
    assert m.host_bytes_loaded == m.host_blocks_loaded * page_bytes
    assert m.host_pool_bytes == NUM_HOST * page_bytes
    assert m_off.host_hit_tokens is None and m_off.host_pool_bytes is None
    # Every promoted page was compared byte for byte with the page demoted.
    loads = sum(t[0] == "load" for batch, _, _ in spy.batches for t in batch)
    assert spy.num_checked == loads == m.host_blocks_loaded
    eng.kv_cache_manager.check_invariants()


def test_one_h2d_and_at_most_one_d2h_per_step_under_transfer_guard(off):
    from prefixcache.engine.host_pages import plan_host_transfers

    eng = _engine(off[0])
    spy = _Spy(eng)
    real_step = eng.step

    def guarded_step():
        with jax.transfer_guard("disallow"):
            return real_step()

    eng.step = guarded_step
    num_steps_before = eng.metrics().num_steps
    _serve(eng)
    pages = eng.runner.host_pages
    assert spy.batches and any(b[1] != b[2] for b in spy.batches)
    d2h_total = 0
    for transfers, (h0, d0), (h1, _) in spy.batches:
        plan = plan_host_transfers(transfers, num_blocks=COMMON["num_blocks"],
                                   num_host_blocks=NUM_HOST)
        assert h1 - h0 == int(plan.touches_device)
        d2h_total += int(plan.store_slots.size > 0)
    assert pages.num_d2h == d2h_total > 0  # each done once, after the step's dispatch
    assert pages.num_h2d == len(spy.batches)
    assert eng.runner.num_host_transfers == pages.num_h2d + pages.num_d2h
    assert len(spy.batches) <= eng.metrics().num_steps - num_steps_before
    assert pages.num_pages_loaded == eng.metrics().host_blocks_loaded
    assert pages.num_pages_stored <= eng.metrics().host_blocks_stored


def test_tier_off_does_no_host_work(off, monkeypatch):
    eng = Engine(ModelConfig.tiny(), share_programs_with=off[0], **COMMON)
    assert eng.runner.host_pages is None

    def boom():
        raise AssertionError("take_host_transfers called with the tier off")

    monkeypatch.setattr(eng.kv_cache_manager, "take_host_transfers", boom)
    assert _serve(eng)[0] == off[1][0]


def test_failed_step_resets_both_tiers_and_serves_no_stale_slot(off):
    from prefixcache.engine.faults import StepFault

    eng = _engine(off[0])
    rounds = _rounds()
    for batch in rounds[:4]:  # families 0, 1, 2, then 0 again: the host tier is used
        for rid, prompt in batch:
            eng.add_request(prompt, PARAMS, request_id=rid)
        while eng.has_unfinished_requests():
            eng.step()
    assert eng.kv_cache_manager.num_host_cached_blocks > 0
    fault = StepFault(1, kind="kv_lost").attach(eng)
    for rid, prompt in rounds[4]:
        eng.add_request(prompt, PARAMS, request_id=rid)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
        if fault.fired:
            eng.fault_injector = None
    assert fault.fired
    assert any(o.finish_reason == "error" for o in outs.values())
    assert eng.kv_cache_manager.num_host_cached_blocks == 0  # both tiers reset
    # Afterwards: tokens as without the fault, and every load reads a slot stored
    # after the reset (a stale slot is never served).
    spy = _Spy(eng)
    for i, batch in enumerate([rounds[5], rounds[0], rounds[1], rounds[2], rounds[0]]):
        for rid, prompt in batch:
            eng.add_request(prompt, PARAMS, request_id=f"{rid}:{i}")
        while eng.has_unfinished_requests():
            for o in eng.step():
                assert o.error is None
                assert o.token_ids == off[1][0][o.request_id.split(":")[0]]
    eng.kv_cache_manager.check_invariants()
    stored, num_loads = set(), 0
    for transfers, _, _ in spy.batches:
        for kind, _, s in transfers:
            if kind == "store":
                stored.add(s)
            else:
                assert s in stored
                num_loads += 1
    assert num_loads > 0


@pytest.mark.parametrize("bad", [-1, 2.0, True, "8", None])
def test_bad_host_size_raises_before_anything_is_built(bad, monkeypatch):
    import prefixcache.engine.engine as engine_mod

    def built(*a, **k):
        raise AssertionError("built something before validating num_host_blocks")

    monkeypatch.setattr(engine_mod, "_check_runnable", built)
    monkeypatch.setattr(engine_mod, "ModelRunner", built)
    with pytest.raises(ValueError, match="num_host_blocks"):
        Engine(ModelConfig.tiny(), num_blocks=8, num_host_blocks=bad)
    for name in ("belady", "nope"):
        with pytest.raises(ValueError, match=name):
            Engine(ModelConfig.tiny(), num_blocks=8, num_host_blocks=4, host_eviction=name)
    with pytest.raises(ValueError, match="num_host_blocks"):
        Engine(ModelConfig.tiny(), num_blocks=8, manager_kwargs={"num_host_blocks": 4})


def test_tier_on_a_mesh_matches_off(off):
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    eng = Engine(ModelConfig.tiny(), **COMMON, num_host_blocks=NUM_HOST, mesh=mesh)
    spy = _Spy(eng)
    tokens, _ = _serve(eng)
    assert tokens == off[1][0]
    assert spy.num_checked == eng.metrics().host_blocks_loaded > 0
    # The copies keep the KV laid out over the mesh (kv heads over "model").
    from prefixcache.model import kv_cache_sharding
    # (the scanned step's stacked KV [A, num_pages, page, 2K, H], one array)
    assert eng.runner.kv_caches.sharding == kv_cache_sharding(mesh, stacked=True)


def test_serve_bench_rejects_a_bad_host_size_before_running(monkeypatch):
    from configs import serve_bench as serve_bench_config
    from experiments import serve_bench

    monkeypatch.setattr("prefixcache.engine.Engine.__init__", None)  # nothing may be built
    cfg = serve_bench_config.get_config()
    cfg.num_host_blocks = -4
    with pytest.raises(ValueError, match="num_host_blocks"):
        serve_bench.bench([], [], cfg)
    assert "device_hit_tokens" in serve_bench.HOST_TIER_KEYS


def test_bench_host_tier_promotion_runs_and_checks_the_pages():
    from experiments import _engine_bench as bench

    r = bench.host_tier_promotion(ModelConfig.tiny(), num_blocks_loaded=4,
                                  num_device_blocks=8, block_size=BS, num_trials=1, seed=0)
    assert r["host_tier_bytes"] == 4 * 2 * BS * 2 * 2 * 64 * 4  # blocks x layers x page
    assert r["promotion_ms"] > 0 and r["promotion_vs_device_put"] > 0


def test_radix_index_with_the_tier_matches_off(off):
    # Engine(index="radix", num_host_blocks=N): the tree demotes its evicted leaves and
    # promotes host hits through the same transfers; tokens equal the tier-off run's.
    off_engine, (want_tokens, want_logits) = off
    eng = _engine(off_engine, index="radix")
    assert type(eng.kv_cache_manager.implementation).__name__ == "RadixKVCacheManager"
    spy = _Spy(eng)
    tokens, logits = _serve(eng)
    assert tokens == want_tokens
    for rid, rows in want_logits.items():
        np.testing.assert_allclose(logits[rid], rows, atol=1e-4, rtol=0)
    m = eng.metrics()
    assert m.host_hit_tokens > 0 and m.host_blocks_loaded > 0 and m.host_blocks_stored > 0
    assert m.num_cached_tokens > off_engine.metrics().num_cached_tokens
    loads = sum(t[0] == "load" for batch, _, _ in spy.batches for t in batch)
    assert spy.num_checked == loads == m.host_blocks_loaded
    eng.kv_cache_manager.check_invariants()
