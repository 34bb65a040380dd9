"""The host tier with quantized KV pages (kv_dtype int8 / float8_e4m3fn).

A quantized layer's cache is the pair (pages, scales f32[num_pages, 2K]); a host slot
keeps a page's values AND its scales, and every store / load moves both, in the same
batch (one device_put, at most one device_get, one copy program).

Unit level: randomized batches on random bit patterns (NaN codes of e4m3fn included)
equal one-at-a-time copies bit for bit. Engine: greedy tokens with the tier on equal
tier off, with host hits, and every promoted page + scales is the demoted one's bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prefixcache.engine.host_pages import HostPages, plan_host_transfers
from prefixcache.kv_dtypes import kv_bytes_per_block

QUANT = ["int8", "float8_e4m3fn"]
L, NB, NH, PAGE = 2, 6, 5, (4, 4, 8)  # layers, device blocks, host slots, page shape
K2 = PAGE[1]  # scale columns: 2 * kv heads


def _random_bits(rng, shape, dtype):
    """Every bit pattern of `dtype` is possible (e4m3fn NaN codes 0x7f / 0xff too)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return rng.integers(0, 256, n, dtype=np.uint8).view(dtype).reshape(shape)


def _kv(seed: int, kv_dtype: str, mesh=None):
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(kv_dtype)
    out = []
    for _ in range(L):  # NB + 1 pages: the last one is the padding page
        pages = _random_bits(rng, (NB + 1, *PAGE), dtype)
        scales = rng.standard_normal((NB + 1, K2)).astype(np.float32)
        if mesh is None:
            out.append((jnp.asarray(pages), jnp.asarray(scales)))
        else:
            from prefixcache.model import kv_cache_sharding
            out.append(jax.device_put((pages, scales), kv_cache_sharding(mesh, kv_dtype)))
    return out


def _bytes(kv):
    """Layer-major host copy: [(pages, scales)] as numpy."""
    with jax.transfer_guard("allow"):
        return [(np.asarray(p), np.asarray(s)) for p, s in kv]


def _reference(dev, host_pages, host_scales, transfers):
    """Sequential copies of (page, scales), one at a time."""
    dev = [(p.copy(), s.copy()) for p, s in dev]
    hp, hs = [h.copy() for h in host_pages], [h.copy() for h in host_scales]
    for kind, b, slot in transfers:
        for l, (p, s) in enumerate(dev):
            if kind == "store":
                hp[l][slot], hs[l][slot] = p[b], s[b]
            else:
                p[b], s[b] = hp[l][slot], hs[l][slot]
    return dev, hp, hs


def _assert_same(dev, want_dev, pages: HostPages, want_hp, want_hs):
    for l in range(L):
        # Bit for bit (NaN codes included); the padding page (id NB) may hold anything.
        assert dev[l][0][:NB].tobytes() == want_dev[l][0][:NB].tobytes(), l
        assert dev[l][1][:NB].tobytes() == want_dev[l][1][:NB].tobytes(), l
        assert pages.pages[l].tobytes() == want_hp[l].tobytes(), l
        assert pages.scales[l].tobytes() == want_hs[l].tobytes(), l


@pytest.fixture(scope="module", params=QUANT)
def shared(request):
    """One HostPages per quantized dtype (its copy programs compiled once)."""
    kv_dtype = request.param
    return kv_dtype, HostPages(_kv(0, kv_dtype), num_blocks=NB, num_host_blocks=NH)


@pytest.mark.parametrize("seed", range(16))
def test_batch_equals_sequential_copies_pages_and_scales(seed, shared):
    kv_dtype, pages = shared
    rng = np.random.default_rng(100 + seed)
    kv = _kv(seed, kv_dtype)
    for p, s in zip(pages.pages, pages.scales):  # distinct host contents too
        p[:] = _random_bits(rng, p.shape, p.dtype)
        s[:] = rng.standard_normal(s.shape)
    dev0 = _bytes(kv)
    hp0, hs0 = [p.copy() for p in pages.pages], [s.copy() for s in pages.scales]
    transfers = [("store" if rng.random() < 0.5 else "load", int(rng.integers(NB)),
                  int(rng.integers(NH))) for _ in range(int(rng.integers(1, 12)))]
    want = _reference(dev0, hp0, hs0, transfers)
    counts = (pages.num_h2d, pages.num_d2h)
    kv = pages.apply(kv, transfers)
    pages.finish()
    assert all(isinstance(layer, tuple) and len(layer) == 2 for layer in kv)
    _assert_same(_bytes(kv), *want[:1], pages, *want[1:])
    assert pages.num_h2d - counts[0] <= 1 and pages.num_d2h - counts[1] <= 1


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_host_slots_hold_scales_and_count_their_bytes(kv_dtype):
    kv = _kv(1, kv_dtype)
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH)
    assert pages.pages[0].dtype == jnp.dtype(kv_dtype) and pages.pages[0].shape == (NH, *PAGE)
    assert pages.scales[0].dtype == np.float32 and pages.scales[0].shape == (NH, K2)
    want = kv_bytes_per_block(num_layers=L, num_kv_heads=K2 // 2, head_dim=PAGE[2],
                              block_size=PAGE[0], kv_dtype=kv_dtype)
    assert pages.page_bytes == want == L * (4 * 4 * 8 + 4 * 4)  # values + f32 scales
    assert pages.nbytes == NH * want
    # One copy program, pages and scales donated (nothing here holds a host view of them).
    new = pages.apply(kv, [("store", 1, 0), ("load", 2, 3)])
    pages.finish()
    assert all(x.is_deleted() for x in jax.tree.leaves(kv))
    assert not any(x.is_deleted() for x in jax.tree.leaves(new))
    assert (pages.num_h2d, pages.num_d2h) == (1, 1) and len(pages.compiled_shapes) == 1
    # Unquantized pages: no scales, as before.
    plain = HostPages([jnp.zeros((NB + 1, *PAGE), jnp.bfloat16)] * L, num_blocks=NB,
                      num_host_blocks=NH)
    assert plain.scales is None and plain.page_bytes == L * 4 * 4 * 8 * 2


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_copy_program_moves_raw_bytes_on_cpu(kv_dtype):
    """XLA CPU widens a float8_e4m3fn scatter to f16 over the whole pool (convert,
    scatter, convert back): fp8 pages go through uint8; int8 and f32 scales scatter
    natively. No convert in the compiled copy program either way."""
    kv = _kv(2, kv_dtype)
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH)
    plan = plan_host_transfers([("store", 1, 0), ("load", 2, 3)], num_blocks=NB,
                               num_host_blocks=NH)
    staged = (np.zeros((L, plan.num_staged_padded, *PAGE), jnp.dtype(kv_dtype)),
              np.zeros((L, plan.num_staged_padded, K2), np.float32))
    hlo = pages._copy.lower(kv, plan.gather_ids, plan.scatter_ids, plan.scatter_src,
                            staged).compile().as_text()
    assert " convert(" not in hlo and "f16[" not in hlo


def test_quantized_pages_on_a_mesh_keep_their_layout_and_bytes():
    from jax.sharding import Mesh
    from prefixcache.model import kv_cache_sharding

    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    kv = _kv(3, "int8", mesh=mesh)
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH, mesh=mesh)
    dev0 = _bytes(kv)
    hp0, hs0 = [p.copy() for p in pages.pages], [s.copy() for s in pages.scales]
    transfers = [("store", 1, 0), ("store", 4, 2), ("load", 3, 0), ("load", 1, 4)]
    want = _reference(dev0, hp0, hs0, transfers)
    kv = pages.apply(kv, transfers)
    pages.finish()
    _assert_same(_bytes(kv), *want[:1], pages, *want[1:])
    assert all(layer == kv_cache_sharding(mesh, "int8")
               for layer in ((p.sharding, s.sharding) for p, s in kv))
    assert (pages.num_h2d, pages.num_d2h) == (1, 1)


# ----------------------------------------------------------------- the engine end to end

from prefixcache.engine import Engine, SamplingParams  # noqa: E402
from prefixcache.model import ModelConfig  # noqa: E402

BS = 16
# A device pool far smaller than the working set (as tests/engine/test_host_tier_engine.py):
# three families sharing a 96-token prefix each, evicted by the next two before a revisit.
COMMON = dict(num_blocks=20, block_size=BS, seed=0, max_num_seqs=2,
              max_num_batched_tokens=64, max_model_len=256, token_buckets=(64,),
              seq_buckets=(2,), page_buckets=(16,))
PARAMS = SamplingParams(max_tokens=4)
NUM_HOST = 48


def _rounds():
    rng = np.random.default_rng(11)
    prefixes = [rng.integers(1, 512, 6 * BS).tolist() for _ in range(3)]
    return [[(f"f{f}v{visit}r{k}", prefix + rng.integers(1, 512, n).tolist())
             for k, n in enumerate((5, 21))]
            for visit in range(2) for f, prefix in enumerate(prefixes)]


def _serve(engine) -> dict:
    tokens = {}
    for batch in _rounds():
        for rid, prompt in batch:
            engine.add_request(prompt, PARAMS, request_id=rid)
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, out.error
                tokens[out.request_id] = out.token_ids
    return tokens


class _Spy:
    """Wraps the runner's `apply_host_transfers`: each promoted page's values AND
    scales, compared byte for byte with what was demoted into that slot."""

    def __init__(self, engine):
        self.runner = engine.runner
        self.demoted, self.num_checked, self.num_batches = {}, 0, 0
        self._apply = self.runner.apply_host_transfers
        self.runner.apply_host_transfers = self

    def __call__(self, transfers):
        before = _bytes(self.runner.kv_caches)
        cur = {}  # device page -> [(page, scales) per layer] after this batch's loads
        for kind, b, s in transfers:
            if kind == "store":
                self.demoted[s] = cur.get(b, [(p[b].copy(), sc[b].copy()) for p, sc in before])
            else:
                cur[b] = self.demoted[s]
        self._apply(transfers)
        self.num_batches += 1
        after = _bytes(self.runner.kv_caches)
        for b, want in cur.items():
            for (p, sc), (wp, ws) in zip(after, want):
                assert p[b].tobytes() == wp.tobytes() and sc[b].tobytes() == ws.tobytes(), b
            self.num_checked += 1


@pytest.fixture(scope="module")
def offs():
    """kv_dtype -> (engine without a host tier, its greedy tokens), built on first use."""
    cache = {}

    def get(kv_dtype):
        if kv_dtype not in cache:
            off = Engine(ModelConfig.tiny(), kv_dtype=kv_dtype, **COMMON)
            cache[kv_dtype] = (off, _serve(off))
        return cache[kv_dtype]

    return get


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_tier_on_matches_off_with_quantized_pages(kv_dtype, offs):
    config = ModelConfig.tiny()
    off, want = offs(kv_dtype)
    eng = Engine(config, kv_dtype=kv_dtype, share_programs_with=off, **COMMON,
                 num_host_blocks=NUM_HOST)
    spy = _Spy(eng)
    real_step = eng.step

    def guarded_step():  # the copies are the step's only transfers besides its own
        with jax.transfer_guard("disallow"):
            return real_step()

    eng.step = guarded_step
    assert _serve(eng) == want
    m, m_off = eng.metrics(), off.metrics()
    assert m.num_cached_tokens > m_off.num_cached_tokens
    assert m.host_hit_tokens > 0 and m.host_blocks_loaded > 0 and m.host_blocks_stored > 0
    # Every promoted page + scales was the demoted one, byte for byte.
    assert spy.num_checked == m.host_blocks_loaded
    pages = eng.runner.host_pages
    assert pages.num_h2d == spy.num_batches and pages.num_d2h <= spy.num_batches
    page_bytes = kv_bytes_per_block(num_layers=config.num_layers,
                                    num_kv_heads=config.num_kv_heads,
                                    head_dim=config.head_dim, block_size=BS,
                                    kv_dtype=kv_dtype)
    assert page_bytes == 2 * (BS * 2 * 2 * 64 * 1 + 2 * 2 * 4)  # int8/fp8 values + scales
    assert m.host_bytes_loaded == m.host_blocks_loaded * page_bytes
    assert m.host_pool_bytes == NUM_HOST * page_bytes
    eng.kv_cache_manager.check_invariants()


def test_failed_step_with_int8_pages_resets_both_tiers(offs):
    """A lost KV (fresh (pages, scales) pairs) resets both tiers; afterwards the tier
    serves again, promoted pages + scales byte-identical, tokens as without the fault."""
    from prefixcache.engine.faults import StepFault

    off, want = offs("int8")
    eng = Engine(ModelConfig.tiny(), kv_dtype="int8", share_programs_with=off, **COMMON,
                 num_host_blocks=NUM_HOST)
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
    while eng.has_unfinished_requests():
        eng.step()
        if fault.fired:
            eng.fault_injector = None
    assert fault.fired and eng.kv_cache_manager.num_host_cached_blocks == 0
    spy = _Spy(eng)
    for i, batch in enumerate([rounds[5], rounds[0], rounds[1], rounds[2], rounds[0]]):
        for rid, prompt in batch:
            eng.add_request(prompt, PARAMS, request_id=f"{rid}:{i}")
        while eng.has_unfinished_requests():
            for o in eng.step():
                assert o.error is None and o.token_ids == want[o.request_id.split(":")[0]]
    assert spy.num_checked > 0
    eng.kv_cache_manager.check_invariants()


def test_tier_on_a_mesh_with_int8_pages_matches_off():
    from jax.sharding import Mesh
    from prefixcache.model import kv_cache_sharding

    config = ModelConfig.tiny()  # 2 kv heads: one per device
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    off = Engine(config, kv_dtype="int8", mesh=mesh, **COMMON)
    want = _serve(off)
    eng = Engine(config, kv_dtype="int8", mesh=mesh, share_programs_with=off, **COMMON,
                 num_host_blocks=NUM_HOST)
    spy = _Spy(eng)
    assert _serve(eng) == want
    assert spy.num_checked == eng.metrics().host_blocks_loaded > 0
    # The copies keep pages and scales laid out over the mesh (kv heads over "model").
    # (the scanned step's stacked pair: pages [A, ...] and scales [A, num_pages, 2K])
    p, s = eng.runner.kv_caches
    assert (p.sharding, s.sharding) == kv_cache_sharding(mesh, "int8", stacked=True)


def test_host_memory_check_counts_quantized_bytes(monkeypatch):
    import prefixcache._validate as validate
    import prefixcache.engine.engine as engine_mod

    seen = {}
    monkeypatch.setattr(validate, "check_host_memory",
                        lambda what, n: seen.__setitem__(what, n))
    config = ModelConfig.tiny()
    for kv_dtype in ("bfloat16", *QUANT):
        engine_mod._check_runnable(config, num_blocks=8, block_size=BS, max_num_seqs=2,
                                   attention_backend="auto", interpret=False, mesh=None,
                                   num_host_blocks=10, kv_dtype=kv_dtype)
        assert seen["the host tier's 10 pages"] == 10 * kv_bytes_per_block(
            num_layers=2, num_kv_heads=2, head_dim=64, block_size=BS, kv_dtype=kv_dtype)
    assert seen["the host tier's 10 pages"] == 10 * 2 * (BS * 2 * 2 * 64 + 2 * 2 * 4)
