"""Sliding-window / hybrid models in the engine: one block table per KV cache group
(full-attention layers, sliding-window layers), the sliding group holding only the blocks
of its window, and tokens that never depend on the prefix cache.

The model is `ModelConfig.tiny_hybrid()` (f32, 4 layers S,S,F,S, window 16); block size
8 (the kernels' smallest page) so that a window spans 2 blocks and a 100-token request 13.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from prefixcache import CacheConfig

from prefixcache.engine import Engine, SamplingParams
from prefixcache.metadata import AttentionMetadata
from prefixcache.model import ModelConfig

BS = 8
W = 16
BUCKETS = dict(token_buckets=(64,), seq_buckets=(4,), page_buckets=(16,))
COMMON = dict(num_blocks=96, block_size=BS, seed=0, max_num_seqs=4,
              max_num_batched_tokens=64, max_model_len=128, **BUCKETS)


@pytest.fixture(scope="module")
def config():
    cfg = ModelConfig.tiny_hybrid()
    assert cfg.sliding_window == W and cfg.kv_groups == ((W, (0,)), (W, (1,)), (W, (3,)), (None, (2,)))
    assert cfg.kv_group_size == 1 and cfg.layer_kv_slots == (0, 0, 0, 0)
    return cfg


@pytest.fixture(scope="module")
def engines(config):
    cached = Engine(config, enable_caching=True, **COMMON)
    uncached = Engine(config, enable_caching=False, share_programs_with=cached, **COMMON)
    return cached, uncached


def _check_tables(engine):
    """The scheduler's per-group rows equal the manager's tables (null slots included)."""
    sched, mgr = engine.scheduler, engine.kv_cache_manager
    for state in sched.running:
        assert sched.block_ids(state.request_id) == mgr.get_block_ids(state.request_id), (
            state.request_id)


def _run(engine, prompts, max_tokens, *, check=None):
    """Adds prompts one after the other (each after the previous finished, so later ones
    can hit the earlier ones' cached blocks) and returns their outputs."""
    outs = []
    for p in prompts:
        rid = engine.add_request(p, SamplingParams(max_tokens=max_tokens))
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs.append(out)
            _check_tables(engine)
            if check is not None:
                check(engine)
        assert outs[-1].request_id == rid
    return outs


def _greedy_reference(model, config, prompts, num_tokens):
    """Greedy tokens by recomputing the whole sequence each step: one sequence, one block
    table for every layer (sliding layers mask their window over it), on the per-layer
    layout (one KV array per layer, as before vLLM's shared arrays)."""
    from prefixcache.metadata import MetadataBuilder, ScheduledSeq
    from prefixcache.model import make_kv_caches, make_step_fn

    builder = MetadataBuilder(block_size=BS, num_blocks=16, max_num_seqs=4,
                              max_num_tokens=128, max_pages_per_seq=16,
                              token_buckets=[128], seq_buckets=[4], page_buckets=[16])
    step = make_step_fn(model)
    kv = make_kv_caches(config, num_blocks=16, block_size=BS, per_layer=True)
    assert len(kv) == config.num_layers
    out = []
    for prompt in prompts:
        tokens = list(prompt)
        for _ in range(num_tokens):  # each step rewrites all the KV it reads
            blocks = list(range(-(-len(tokens) // BS)))
            inputs = builder.build([ScheduledSeq(blocks, 0, tokens)])
            logits, kv = step(kv, inputs.input_ids, inputs.metadata, inputs.logits_indices)
            tokens.append(int(np.asarray(logits)[0].argmax()))
        out.append(tokens[len(prompt):])
    return out


def test_hybrid_tokens_identical_with_cache_on_and_off(engines, config):
    cached, uncached = engines
    rng = np.random.default_rng(0)
    system = rng.integers(1, config.vocab_size, 40).tolist()
    prompts = [system + rng.integers(1, config.vocab_size, n).tolist() for n in (5, 9, 2)]
    prompts.append(list(prompts[0]))  # an exact repeat: a hit up to the last token
    outs_c = _run(cached, prompts, 12)
    outs_u = _run(uncached, prompts, 12)
    for c, u in zip(outs_c, outs_u):
        assert c.error is None and u.error is None
        assert c.token_ids == u.token_ids, c.request_id
    # ... and equal to recomputing every token over one full table (so the null slots
    # and per-group tables change nothing, whether or not the cache is on).
    want = _greedy_reference(cached.model, config, prompts[:3], 12)
    assert [c.token_ids for c in outs_c[:3]] == want
    hits = [o.metrics.num_cached_tokens for o in outs_c]
    # The later requests hit the shared 40-token prefix (whole blocks, every group valid:
    # the sliding group's W tokens before the hit point are cached).
    assert hits == [0, 40, 40, 40], hits
    assert all(o.metrics.num_cached_tokens == 0 for o in outs_u)
    # The step really is per group: four AttentionMetadata (three sliding groups, one
    # full) whose page tables differ (the groups share one KV array: disjoint block ids).
    cached.add_request(prompts[1], SamplingParams(max_tokens=1))
    sched = cached.scheduler.schedule()
    prepared = cached.runner.prepare(sched.scheduled, cached.scheduler.kv_group_tables)
    md = prepared.inputs.step.metadata
    assert isinstance(md, tuple) and len(md) == 4
    assert all(isinstance(m, AttentionMetadata) for m in md)
    real = [set(np.asarray(m.page_indices[0]).tolist()) - {cached.num_blocks} for m in md]
    assert all(real) and all(not (a & b) for i, a in enumerate(real) for b in real[i + 1:])
    # the prefix hit of 40+ tokens: the sliding groups' first slots are null (padding page)
    for g in range(3):
        assert md[g].page_indices[0, 0] == cached.num_blocks != md[3].page_indices[0, 0]
    # One table for a four-group model would have the layers read pages they never
    # wrote: refused.
    with pytest.raises(ValueError, match="4 KV cache groups: pass one BlockTables per"):
        cached.runner.prepare(sched.scheduled, cached.scheduler.block_tables)
    for s in sched.scheduled:
        cached.scheduler.finish_request(s.state, "abort")
    cached.step()


def test_sliding_group_blocks_bounded_by_the_window(engines, config):
    cached, _ = engines
    cached.kv_cache_manager.reset_prefix_cache()
    chunk = COMMON["max_num_batched_tokens"]
    seen = {"max_local": 0, "max_full": 0, "decode_steps": 0}
    decode_bound = math.ceil(W / BS) + 1
    prefill_bound = math.ceil((W - 1 + chunk) / BS) + 1

    def check(engine):
        for state in engine.scheduler.running:
            *locals_, full = engine.kv_cache_manager.get_block_ids(state.request_id)
            assert engine.num_blocks not in full
            computed = state.request.num_computed_tokens
            if computed > state.request.num_prompt_tokens:  # decoding
                seen["decode_steps"] += 1
            for local in locals_:  # each of the three sliding groups
                n_local = sum(b != engine.num_blocks for b in local)
                assert len(local) == len(full)  # same slots, the early ones null
                if computed > state.request.num_prompt_tokens:
                    assert n_local <= decode_bound, (computed, local)
                assert n_local <= prefill_bound, (computed, local)
                seen["max_local"] = max(seen["max_local"], n_local)
            seen["max_full"] = max(seen["max_full"], len(full))

    rng = np.random.default_rng(1)
    prompt = rng.integers(1, config.vocab_size, 36).tolist()
    out, = _run(cached, [prompt], 64, check=check)
    assert out.error is None and len(out.token_ids) == 64
    # The full group grew to the whole request (99 tokens of KV -> 13 blocks), the sliding
    # group stayed within its window.
    assert seen["max_full"] == math.ceil(99 / BS) and seen["decode_steps"] > 50
    assert seen["max_local"] <= prefill_bound


def test_hybrid_step_loop_has_no_hidden_transfers(engines, config):
    cached, _ = engines
    prompt = np.random.default_rng(2).integers(1, config.vocab_size, 30).tolist()
    cached.add_request(prompt, SamplingParams(max_tokens=4))
    cached.step()  # compile outside the guard
    with jax.transfer_guard("disallow"):
        while cached.has_unfinished_requests():
            cached.step()


def test_mistral_style_all_sliding_model_runs(engines):
    """One sliding-window group and no full-attention one (vLLM serves these too): the
    step's one table has null slots; tokens equal the cache-off run."""
    config = ModelConfig.tiny(architecture="MistralForCausalLM", sliding_window=8)
    kw = {**COMMON, "num_blocks": 64}
    cached = Engine(config, enable_caching=True, **kw)
    uncached = Engine(config, enable_caching=False, share_programs_with=cached, **kw)
    rng = np.random.default_rng(3)
    base = rng.integers(1, config.vocab_size, 30).tolist()
    prompts = [base + [5, 6], base + [7]]
    oc, ou = _run(cached, prompts, 10), _run(uncached, prompts, 10)
    assert [o.token_ids for o in oc] == [o.token_ids for o in ou]
    assert oc[1].metrics.num_cached_tokens > 0


def test_plain_model_keeps_one_table_and_one_metadata():
    engine = Engine(ModelConfig.tiny(), **{**COMMON, "num_blocks": 16})
    assert engine.scheduler.kv_group_tables is None
    assert type(engine.kv_cache_manager).__name__ == "KVCacheManager"
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1))
    sched = engine.scheduler.schedule()
    prepared = engine.runner.prepare(sched.scheduled, engine.scheduler.block_tables)
    assert isinstance(prepared.inputs.step.metadata, AttentionMetadata)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(index="nope"), "unknown index 'nope'"),
        (dict(eviction="belady"), "needs the trace's future"),
        (dict(manager_kwargs={"kv_cache_groups": ()}), "kv_cache_groups is empty"),
        (dict(manager_kwargs={"kv_cache_groups": "full,sw8"}),
         "kv_cache_groups must be a list or tuple of KVCacheGroup"),
        (dict(cache_config=CacheConfig(num_blocks=96, block_size=BS,
                                       kv_cache_groups="full,sw8")),
         "must group the model's layers as the model attends"),
        (dict(num_host_blocks=8, index="radix"), "radix layout index"),
    ],
)
def test_bad_hybrid_configurations_fail_before_anything_is_built(config, monkeypatch, kw,
                                                                 match):
    import prefixcache.core as core
    import prefixcache.engine.engine as engine_mod

    def boom(*a, **k):
        raise AssertionError("built before the configuration was checked")

    monkeypatch.setattr(engine_mod, "ModelRunner", boom)
    monkeypatch.setattr(core, "KVCacheManager", boom)
    with pytest.raises(ValueError, match=match):
        Engine(config, **{**COMMON, **kw})


@pytest.mark.parametrize("eviction,options,error", [
    ("marconi", {"normalization": "zscore"}, ValueError),
    ("lfu", {"nope": 1}, TypeError),
])
def test_a_policys_bad_options_fail_before_the_model_runner(config, monkeypatch, eviction,
                                                            options, error):
    # Any online policy serves a sliding-window model; its options are the manager's
    # to check, before the (expensive) model runner is built.
    import prefixcache.engine.engine as engine_mod

    def boom(*a, **k):
        raise AssertionError("the model runner was built before the options were checked")

    monkeypatch.setattr(engine_mod, "ModelRunner", boom)
    with pytest.raises(error):
        Engine(config, eviction=eviction, manager_kwargs={"eviction_options": options},
               **COMMON)



def test_hybrid_preemption_under_memory_pressure_keeps_tokens(engines, config):
    """A pool far smaller than the batch needs: requests are preempted and re-admitted
    (their rows released and re-added in every group); tokens equal the ample pool's."""
    cached, _ = engines
    rng = np.random.default_rng(4)
    system = rng.integers(1, config.vocab_size, 24).tolist()
    prompts = [system + rng.integers(1, config.vocab_size, n).tolist() for n in (8, 12, 16, 4)]
    # 24 blocks of one layer page each (4 groups of 1 layer share one KV array).
    small = Engine(config, share_programs_with=cached, **{**COMMON, "num_blocks": 24})
    for p in prompts:
        small.add_request(p, SamplingParams(max_tokens=24))
    outs = {}
    while small.has_unfinished_requests():
        for o in small.step():
            outs[o.request_id] = o
        _check_tables(small)
        small.kv_cache_manager.check_invariants()
    assert small.metrics().num_preemptions > 0
    ample = cached.generate(prompts, SamplingParams(max_tokens=24))
    assert [outs[f"req-{i}"].token_ids for i in range(4)] == [o.token_ids for o in ample]


def _three_systems(config):
    """Six prompts over 3 system prompts of 40 tokens (5 blocks), each revisited."""
    rng = np.random.default_rng(6)
    systems = [rng.integers(1, config.vocab_size, 40).tolist() for _ in range(3)]
    return [systems[i % 3] + rng.integers(1, config.vocab_size, 5).tolist()
            for i in range(6)]


def _serve_recording(engine, prompts):
    """``(engine, the transfers it applied, its outputs)`` for ``prompts`` served one
    after the other (invariants checked after every step)."""
    seen = []
    apply = engine.runner.apply_host_transfers
    engine.runner.apply_host_transfers = lambda ts: (seen.extend(ts), apply(ts))[1]
    outs = _run(engine, prompts, 4, check=lambda e: e.kv_cache_manager.check_invariants())
    return engine, seen, outs


def test_hybrid_host_tier_restores_each_groups_pages(engines, config):
    """A host tier under a hybrid model (per-group host slots, `core/hybrid.py`): a pool
    too small to keep 3 system prompts demotes their blocks of every group, later
    requests load them back (the page of the shared KV array = that group's layer), and
    the tokens equal the ample cached engine's; without the loads they would not."""
    cached, _ = engines
    prompts = _three_systems(config)
    small, seen, outs = _serve_recording(
        Engine(config, share_programs_with=cached, num_host_blocks=200,
               **{**COMMON, "num_blocks": 40}), prompts)
    m = small.kv_cache_manager
    assert m.host_hit_tokens > 0 and m.host_blocks_loaded > 0
    loads = {t.group for t in seen if t.kind == "load"}
    assert len(loads) > 1 and loads <= set(range(len(config.kv_groups)))
    ample = cached.generate(prompts, SamplingParams(max_tokens=4))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ample]


def test_hybrid_disk_tier_restores_each_groups_pages(engines, config, tmp_path):
    """A disk tier under the host tier of a hybrid model: the host (8 slots) is too
    small for the evicted blocks of every group, which go on to page files named by
    (digest, group); later requests load them back (sliding groups' pages too) and the
    tokens equal the ample cached engine's."""
    cached, _ = engines
    prompts = _three_systems(config)
    small, seen, outs = _serve_recording(
        Engine(config, share_programs_with=cached, num_host_blocks=8, disk_dir=tmp_path,
               disk_bytes="64MiB", **{**COMMON, "num_blocks": 40}), prompts)
    m = small.kv_cache_manager
    assert m.hit_tokens_by_tier["disk"] > 0
    disk_loads = {t.group for t in seen if t.kind == "load" and len(t) == 7}
    assert len(disk_loads) > 1 and disk_loads <= set(range(len(config.kv_groups)))
    small.runner.host_pages.flush_files()
    assert any(g > 0 for _, g in small.disk_files.keys())
    ample = cached.generate(prompts, SamplingParams(max_tokens=4))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ample]
    # A restart over the directory preloads every group's pages (disk_reuse) and
    # serves them.
    again = Engine(config, share_programs_with=cached, num_host_blocks=8, disk_dir=tmp_path,
                   disk_bytes="64MiB", disk_reuse=True, **{**COMMON, "num_blocks": 40})
    tier = again.kv_cache_manager.tier_chain.get("disk")
    assert {tier.page_key(h)[1] for h in tier.entries} == set(range(len(config.kv_groups)))
    out = again.generate(prompts[:1], SamplingParams(max_tokens=4))
    assert out[0].token_ids == ample[0].token_ids
    assert again.kv_cache_manager.hit_tokens_by_tier["disk"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_pallas_backends_read_per_group_tables_with_null_slots(engines, config, backend):
    """The Pallas kernels (interpret mode) over the per-group tables, a prefix hit with
    null slots included: the tokens of the reference backend (~5-10 s each on CPU)."""
    from jax.experimental.pallas import tpu as pltpu

    cached, _ = engines
    base = np.random.default_rng(5).integers(1, config.vocab_size, 40).tolist()
    prompts = [base + [3, 4], base + [5]]
    kw = {**COMMON, "num_blocks": 32}
    ref = Engine(config, model=cached.model, attention_backend="reference", **kw)
    want = [o.token_ids for o in ref.generate(prompts, SamplingParams(max_tokens=4))]
    engine = Engine(config, model=cached.model, attention_backend=backend, interpret=True,
                    **kw)
    if backend == "pallas_tpu":
        with pltpu.force_tpu_interpret_mode():
            outs = engine.generate(prompts, SamplingParams(max_tokens=4))
    else:
        outs = engine.generate(prompts, SamplingParams(max_tokens=4))
    assert [o.token_ids for o in outs] == want
    assert outs[1].metrics.num_cached_tokens == 40


def test_long_request_fits_a_pool_too_small_for_per_layer_arrays(engines, config):
    """vLLM's layout bounds the sliding groups' BYTES: the pool is num_blocks x one group's
    layers (tiny_hybrid: 1 of 4), the sliding groups hold <= ceil(W/bs)+1 blocks while
    decoding, so a 128-token request runs in a pool whose bytes, cut into per-layer
    blocks (4 layer pages each), would not even hold its full-attention blocks."""
    cached, _ = engines
    num_blocks = 48
    engine = Engine(config, share_programs_with=cached, **{**COMMON, "num_blocks": num_blocks})
    page = BS * 2 * config.num_kv_heads * config.head_dim * np.dtype(config.dtype).itemsize
    kv = engine.runner.kv_caches
    assert len(kv) == config.kv_group_size == 1
    pool = sum(a.nbytes for a in kv)
    assert pool == (num_blocks + 1) * config.kv_group_size * page
    total = COMMON["max_model_len"]
    full_blocks = math.ceil(total / BS)
    per_layer_blocks = pool // (config.num_layers * page)  # the same bytes, per-layer blocks
    assert per_layer_blocks < full_blocks, (per_layer_blocks, full_blocks)
    bound = math.ceil(W / BS) + 1
    seen = {"decode_steps": 0, "max_used": 0}

    def check(engine):
        for state in engine.scheduler.running:
            _check_request(engine, state)

    def _check_request(engine, state):
        *locals_, full = engine.kv_cache_manager.get_block_ids(state.request_id)
        real = [[b for b in t if b != engine.num_blocks] for t in (*locals_, full)]
        flat = [b for t in real for b in t]
        assert len(flat) == len(set(flat))  # a block id belongs to one group at a time
        seen["max_used"] = max(seen["max_used"], len(flat))
        if state.request.num_computed_tokens > state.request.num_prompt_tokens:
            seen["decode_steps"] += 1
            assert all(len(t) <= bound for t in real[:3]), real

    prompt = np.random.default_rng(6).integers(1, config.vocab_size, 96).tolist()
    out, = _run(engine, [prompt], total - len(prompt), check=check)
    assert out.error is None and len(out.token_ids) == total - len(prompt)
    assert engine.metrics().num_preemptions == 0 and seen["decode_steps"] > 20
    assert seen["max_used"] <= num_blocks
    # The same tokens as an ample pool (the module's 96 blocks).
    want, = cached.generate([prompt], SamplingParams(max_tokens=total - len(prompt)))
    assert out.token_ids == want.token_ids
