"""End-to-end engine tests on the tiny model (CPU).

The cache must never change an output token: every comparison runs the same requests
through an engine with prefix caching and one without (or with an ample pool) and checks
tokens (greedy) and, in f32, the next-token logits of every step.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from prefixcache.core import BlockHasher, LoRARequest, MultiModalFeature, Request
from prefixcache.engine import Engine, SamplingParams
from prefixcache.model import ModelConfig

BS = 16
LOGITS_ATOL = 1e-4
# NOTE: one shape bucket each keeps the number of compiled programs (the test's cost on
# CPU) minimal; bucketing itself is covered by the metadata tests and the benchmark.
BUCKETS = dict(token_buckets=(256,), seq_buckets=(8,), page_buckets=(64,))
COMMON = dict(num_blocks=128, block_size=BS, seed=0, max_num_seqs=8,
              max_num_batched_tokens=256, max_model_len=1024, **BUCKETS)


@pytest.fixture(scope="module")
def config():
    return ModelConfig.tiny()


@pytest.fixture(scope="module")
def engines(config):
    """(cached, uncached) engines sharing one model, same pool and buckets."""
    cached = Engine(config, enable_caching=True, **COMMON)
    uncached = Engine(config, enable_caching=False, share_programs_with=cached, **COMMON)
    cached.record_logits = uncached.record_logits = True
    return cached, uncached


def rand_tokens(rng, n, vocab):
    return rng.integers(1, vocab, n).tolist()


def logits_by_request(engine):
    """request id -> list of the logits of each sampled position, in order."""
    out = {}
    for step in engine.step_logits:
        for rid, row in step.items():
            out.setdefault(rid, []).append(row)
    engine.step_logits.clear()
    return out


def assert_same(cached_outs, uncached_outs, cached_logits=None, uncached_logits=None):
    for c, u in zip(cached_outs, uncached_outs):
        assert c.error is None and u.error is None
        if cached_logits is not None:
            lc, lu = cached_logits[c.request_id], uncached_logits[u.request_id]
            assert len(lc) == len(lu) == len(c.token_ids)
            for pos, (a, b) in enumerate(zip(lc, lu)):
                diff = float(np.max(np.abs(a - b)))
                assert diff <= LOGITS_ATOL, (c.request_id, pos, diff)
        if c.token_ids != u.token_ids:
            # Only a measured near-tie may flip a greedy token; report its margin.
            i = next(i for i, (a, b) in enumerate(zip(c.token_ids, u.token_ids)) if a != b)
            row = (uncached_logits or {}).get(u.request_id, [None] * (i + 1))[i]
            margin = None if row is None else float(np.sort(row)[-1] - np.sort(row)[-2])
            pytest.fail(f"{c.request_id}: token {i} differs ({c.token_ids[i]} vs "
                        f"{u.token_ids[i]}), top-2 logit margin {margin}")


def run_both(engines, prompts, params, **kw):
    cached, uncached = engines
    outs_c = cached.generate(prompts, params, **kw)
    outs_u = uncached.generate(
        [Request(p.request_id + "-u", list(p.prompt_token_ids), mm_features=p.mm_features,
                 cache_salt=p.cache_salt) if isinstance(p, Request) else p for p in prompts],
        params, **kw)
    assert_same(outs_c, outs_u, logits_by_request(cached), logits_by_request(uncached))
    return outs_c, outs_u


def test_f32(config):
    # The logits tolerance below is for f32 compute.
    assert np.dtype(getattr(config, "dtype", np.float32)) == np.float32


def test_shared_system_prompt_and_multi_turn_identical(engines, config):
    rng = np.random.default_rng(0)
    v = config.vocab_size
    system = rand_tokens(rng, 100, v)
    prompts = [system + rand_tokens(rng, n, v) for n in (5, 17, 33, 1)]
    params = SamplingParams(max_tokens=6)
    cached = engines[0]
    cached.reset_metrics()
    outs, _ = run_both(engines, prompts, params)
    # Later requests of the batch hit the system prompt's full blocks (96 tokens).
    assert [o.metrics.num_cached_tokens for o in outs][1:] == [96, 96, 96]
    # Multi-turn: the conversation so far + a new message hits almost all of it.
    turn2 = [p + o.token_ids + rand_tokens(rng, 9, v) for p, o in zip(prompts, outs)]
    outs2, _ = run_both(engines, turn2, params)
    for p, o in zip(prompts, outs2):
        # Turn 1 computed KV for its prompt + 5 of its 6 outputs (the last sampled token
        # is never fed back); all of its full blocks hit.
        assert o.metrics.num_cached_tokens == (len(p) + 5) // BS * BS
    m = cached.metrics()
    everything = outs + outs2
    assert m.num_requests == 8 and m.num_rejected == 0 and m.request_hit_rate == 7 / 8
    assert m.num_cached_tokens == sum(o.metrics.num_cached_tokens for o in everything)
    assert m.num_prompt_tokens == sum(o.metrics.num_prompt_tokens for o in everything)
    # The cache only skipped work: computed = prompt - cached + decode steps.
    assert m.num_computed_tokens == m.num_prompt_tokens - m.num_cached_tokens + 8 * 5
    assert 0 < m.mean_usage <= m.peak_usage <= 1 and m.num_steps > 0


def test_salts_isolate_and_stay_identical(engines, config):
    rng = np.random.default_rng(1)
    toks = rand_tokens(rng, 70, config.vocab_size)
    reqs = [Request(f"salt-{i}", toks, cache_salt=s) for i, s in
            enumerate(["alice", "bob", "alice"])]
    cached = engines[0]
    outs = []
    for r in reqs:  # one at a time so that the hits are from earlier requests
        c, _ = run_both(engines, [r], SamplingParams(max_tokens=4))
        outs += c
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 0, 64]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids


def _mm_request(rid, tokens, offset, length, ident):
    return Request(rid, tokens, mm_features=(MultiModalFeature(ident, offset, length),))


def test_multimodal_no_false_hit(engines, config):
    rng = np.random.default_rng(2)
    v = config.vocab_size
    d_model = engines[0].runner.d_model
    placeholder = 3
    head = rand_tokens(rng, 20, v)
    tail = rand_tokens(rng, 30, v)
    tokens = head + [placeholder] * 40 + tail  # image at [20, 60)
    img_a = rng.normal(size=(40, d_model)).astype(np.float32)
    img_b = rng.normal(size=(40, d_model)).astype(np.float32)
    params = SamplingParams(max_tokens=6)

    def run(rid, ident, emb):
        r = _mm_request(rid, tokens, 20, 40, ident)
        (c,), (u,) = run_both(engines, [r], params, mm_embeddings=[{ident: emb}])
        return c, u

    a, a_u = run("mm-a", "img-a", img_a)
    b, b_u = run("mm-b", "img-b", img_b)
    # Same placeholder tokens, different image: only the block before the image hits.
    assert a.metrics.num_cached_tokens == 0
    assert b.metrics.num_cached_tokens == 16
    # The image really reaches the model: different images, different outputs.
    assert a.token_ids != b.token_ids
    # Same image again: a full hit, outputs identical to the uncached run.
    a2, a2_u = run("mm-a2", "img-a", img_a)
    assert a2.metrics.num_cached_tokens == 80
    assert a2.token_ids == a.token_ids == a_u.token_ids == a2_u.token_ids


def test_memory_pressure_preemption_and_eviction_identical(config, engines):
    rng = np.random.default_rng(3)
    v = config.vocab_size
    system = rand_tokens(rng, 40, v)
    prompts = [system + rand_tokens(rng, int(n), v) for n in rng.integers(5, 40, 8)]
    prompts += [rand_tokens(rng, 60, v) for _ in range(2)]
    params = SamplingParams(max_tokens=24)
    # 14 blocks of 16 for ten requests growing to ~100 tokens each: preemption by
    # recompute and eviction of cached blocks are forced.
    small = Engine(config, enable_caching=True, share_programs_with=engines[0],
                   **{**COMMON, "num_blocks": 14})
    small.record_logits = True
    # Every step, the scheduler's incremental block tables equal the manager's, and the
    # inputs prepared from them equal those prepared from get_block_ids.
    prepare, checked = small.runner.prepare, []

    def checking_prepare(scheduled, block_tables):
        mgr = small.kv_cache_manager
        for st in small.scheduler.running:
            assert small.scheduler.block_ids(st.request_id) == mgr.get_block_ids(st.request_id)
        got = prepare(scheduled, block_tables)
        ref = prepare(scheduled, mgr.get_block_ids)
        for a, b in zip(jax.tree.leaves(got.inputs), jax.tree.leaves(ref.inputs)):
            np.testing.assert_array_equal(a, b)
        checked.append(len(scheduled))
        return got

    small.runner.prepare = checking_prepare
    outs = small.generate(prompts, params)
    assert len(checked) == small.metrics().num_steps
    m = small.metrics()
    assert m.num_preemptions > 0, m
    assert m.num_evictions > 0, m
    assert sum(o.metrics.num_preemptions for o in outs) == m.num_preemptions
    ref = engines[1].generate(prompts, params)
    assert_same(outs, ref, logits_by_request(small), logits_by_request(engines[1]))
    small.kv_cache_manager.check_invariants()
    assert small.kv_cache_manager.num_free_blocks == 14


def test_cached_1024_prefix_skips_prefill_and_shares_pages(config):
    rng = np.random.default_rng(4)
    v = config.vocab_size
    engine = Engine(config, num_blocks=160, block_size=BS, max_num_seqs=4,
                    max_num_batched_tokens=2048, max_model_len=2048,
                    token_buckets=(2048,), seq_buckets=(4,), page_buckets=(128,))
    prefix = rand_tokens(rng, 1024, v)
    engine.add_request(prefix + rand_tokens(rng, 8, v), SamplingParams(max_tokens=8),
                       request_id="first")
    engine.step()  # prefill of "first" (1032 tokens); it keeps running (decoding)
    first_table = engine.kv_cache_manager.get_block_ids("first")
    engine.add_request(prefix + rand_tokens(rng, 32, v), SamplingParams(max_tokens=2),
                       request_id="second")
    engine.step()
    sched = engine.last_scheduler_output
    counts = sched.num_scheduled_tokens
    assert counts == {"first": 1, "second": 32}  # only the uncached tokens
    assert sched.num_cached_tokens["second"] == 1024
    second_table = engine.kv_cache_manager.get_block_ids("second")
    assert engine.scheduler.block_ids("second") == second_table  # hit blocks included
    # The first 64 pages are the very same blocks (shared, not copied)...
    assert second_table[:64] == first_table[:64]
    # ...and the only newly allocated ones are past the prefix.
    assert sched.new_block_ids["second"] == second_table[64:]
    assert not set(second_table[64:]) & set(first_table)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache_manager.num_free_blocks == 160


def test_no_hidden_transfers_in_step_loop(engines, config):
    cached = engines[0]
    rng = np.random.default_rng(5)
    prompts = [rand_tokens(rng, 30, config.vocab_size) for _ in range(3)]
    params = [SamplingParams(max_tokens=5), SamplingParams(max_tokens=5, temperature=0.7,
                                                          top_k=20, top_p=0.9, seed=3),
              SamplingParams(max_tokens=5)]
    cached.record_logits = False
    try:
        ref = cached.generate(prompts, params)  # compiles outside the guard
        with jax.transfer_guard("disallow"):
            outs = cached.generate(prompts, params)  # now with prefix hits
    finally:
        cached.record_logits = True
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_seeded_sampling_is_batch_and_cache_independent(engines, config):
    rng = np.random.default_rng(6)
    v = config.vocab_size
    p = rand_tokens(rng, 40, v)
    sp = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=11)
    cached, uncached = engines
    alone = cached.generate([p], sp)[0].token_ids
    crowd = cached.generate([rand_tokens(rng, 25, v), p, rand_tokens(rng, 9, v)],
                            [SamplingParams(max_tokens=3), sp, sp])[1].token_ids
    uncached_run = uncached.generate([p], sp)[0].token_ids
    other_seed = cached.generate([p], SamplingParams(max_tokens=8, temperature=1.0,
                                                     top_p=0.95, seed=12))[0].token_ids
    logits_by_request(cached), logits_by_request(uncached)
    assert alone == crowd == uncached_run
    assert other_seed != alone
    # top_k=1 sampling is greedy.
    g = cached.generate([p], SamplingParams(max_tokens=8))[0].token_ids
    k1 = cached.generate([p], SamplingParams(max_tokens=8, temperature=2.0, top_k=1,
                                             seed=5))[0].token_ids
    logits_by_request(cached)
    assert g == k1


def test_request_too_large_errors_others_finish(config, engines):
    rng = np.random.default_rng(7)
    v = config.vocab_size
    engine = Engine(config, share_programs_with=engines[0], **{**COMMON, "num_blocks": 8})
    prompts = [rand_tokens(rng, 20, v), rand_tokens(rng, 200, v),  # 13 blocks > 8
               rand_tokens(rng, 10, v) + [v + 5],  # out of the vocabulary
               rand_tokens(rng, 1100, v), rand_tokens(rng, 30, v)]  # > max_model_len
    outs = engine.generate(prompts, SamplingParams(max_tokens=4))
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "length"]
    assert "whole pool has 8 blocks" in outs[1].error
    assert "vocabulary" in outs[2].error
    assert "max_model_len" in outs[3].error
    assert len(outs[0].token_ids) == len(outs[4].token_ids) == 4
    assert outs[1].token_ids == [] and outs[1].metrics.num_prompt_tokens == 200
    assert engine.metrics().num_rejected == 3


@pytest.mark.parametrize("kw", [
    dict(max_tokens=0), dict(temperature=-1.0), dict(temperature=float("nan")),
    dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(seed=-3),
    dict(stop_token_ids=(-1,)), dict(max_tokens=2.5)])
def test_bad_sampling_params(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_lora_only_as_cache_key_when_asked(engines, config):
    cached = engines[0]
    keyed = Engine(config, share_programs_with=cached, lora_cache_key_only=True, **COMMON)
    toks = list(range(1, 40))
    a, b, c = keyed.generate([Request("l1", toks, lora=LoRARequest("a", "/a")),
                              Request("l2", toks, lora=LoRARequest("b", "/b")),
                              Request("l3", toks, lora=LoRARequest("a", "/a"))],
                             SamplingParams(max_tokens=2))
    # Adapters isolate the cache; the same adapter shares it (32 = two full blocks).
    assert [o.metrics.num_cached_tokens for o in (a, b, c)] == [0, 0, 32]
    assert a.token_ids == b.token_ids == c.token_ids


def test_top_k_minus_one_disables_as_in_vllm():
    assert SamplingParams(top_k=-1).top_k == 0


def test_bad_add_request_leaves_engine_unchanged(engines):
    cached = engines[0]
    with pytest.raises(ValueError, match="SamplingParams"):
        cached.add_request([1, 2, 3], {"max_tokens": 3})
    with pytest.raises(ValueError, match="empty"):
        cached.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="ints"):
        cached.add_request([1, "x"], SamplingParams())
    with pytest.raises(ValueError, match="no embedding rows"):
        cached.add_request(Request("mm-bad", [3] * 8, mm_features=(
            MultiModalFeature("img", 0, 8),)), SamplingParams())
    bound = Request("bound", [1, 2, 3])
    bound.bind_hasher(BlockHasher("xxhash", seed=1), BS)
    with pytest.raises(ValueError, match="another hasher"):
        cached.add_request(bound, SamplingParams())
    with pytest.raises(ValueError, match="no adapters"):
        cached.add_request([1, 2, 3], SamplingParams(), lora=LoRARequest("a", "/x"))
    assert not cached.has_unfinished_requests()
    rid = cached.add_request([1, 2, 3], SamplingParams(max_tokens=1), request_id="dup")
    with pytest.raises(ValueError, match="duplicate"):
        cached.add_request([4, 5], SamplingParams(), request_id="dup")
    while cached.has_unfinished_requests():
        cached.step()
    logits_by_request(cached)
    assert rid == "dup"


def test_bad_generate_batch_adds_nothing(engines):
    cached = engines[0]
    before = cached.metrics()
    with pytest.raises(ValueError, match="ints"):
        cached.generate([[1, 2, 3], [4, None]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="duplicate"):
        cached.generate([Request("same", [1, 2]), Request("same", [3, 4])],
                        SamplingParams(max_tokens=2))
    assert not cached.has_unfinished_requests()
    assert cached.metrics() == before
    # Auto ids stay unique next to caller-chosen ones.
    outs = cached.generate([Request("req-900", [5, 6, 7]), [5, 6, 8], [5, 6, 9]],
                           SamplingParams(max_tokens=1))
    assert len({o.request_id for o in outs}) == 3
    logits_by_request(cached)


def test_eviction_policy_never_changes_outputs(config, engines):
    # A non-default policy (lfu) in a small pool that must evict: same tokens as the
    # engine without caching.
    cached, uncached = engines
    engine = Engine(config, share_programs_with=cached, eviction="lfu",
                    **{**COMMON, "num_blocks": 24})
    assert engine.kv_cache_manager.eviction == "lfu"
    rng = np.random.default_rng(11)
    v = config.vocab_size
    stems = [rand_tokens(rng, 64, v) for _ in range(3)]
    prompts = [stems[i % 3] + rand_tokens(rng, 20 + i, v) for i in range(9)]
    params = SamplingParams(max_tokens=3)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    want = [o.token_ids for o in uncached.generate(prompts, params)]
    assert got == want
    assert engine.kv_cache_manager.num_evictions > 0
    engine.kv_cache_manager.check_invariants()


def test_belady_and_unknown_policies_are_rejected(config):
    with pytest.raises(ValueError, match="needs the trace's future"):
        Engine(config, eviction="belady", **COMMON)
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'"):
        Engine(config, eviction="nope", **COMMON)
