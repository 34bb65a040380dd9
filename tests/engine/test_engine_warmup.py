"""Engine.warmup: every step program compiled before any request, nothing after.

One (T, S, P) shape (single buckets), so warm-up builds two programs (greedy and
sampling); compiling them is most of this module's time on CPU.
"""

import jax
import numpy as np
import pytest

from prefixcache.engine import Engine, SamplingParams
from prefixcache.model import ModelConfig

BLOCK = 16
ENGINE_KW = dict(num_blocks=16, block_size=BLOCK, max_num_seqs=4, seq_buckets=(4,),
                 max_num_batched_tokens=32, token_buckets=(32,), max_model_len=96,
                 page_buckets=(6,), seed=0)


class _CompileEvents:
    """Counts jax's backend compiles (jax.monitoring; persistent-cache loads too) in
    the whole process while open: a second witness beside the engine's counter."""

    def __enter__(self):
        from jax._src import dispatch

        self.count = 0
        self._event = dispatch.BACKEND_COMPILE_EVENT

        def listener(event, duration, **kw):
            if event == self._event:
                self.count += 1

        self._listener = listener
        jax.monitoring.register_event_duration_secs_listener(listener)
        return self

    def __exit__(self, *exc):
        from jax._src import monitoring

        monitoring.unregister_event_duration_listener(self._listener)


def _prompt(seed, n, prefix=()):
    rng = np.random.default_rng(seed)
    return list(prefix) + rng.integers(3, 500, n).tolist()


@pytest.fixture(scope="module")
def warmed():
    engine = Engine(ModelConfig.tiny(), **ENGINE_KW)
    assert engine.num_compiles_after_warmup is None
    assert engine.metrics().num_compiles_after_warmup is None
    # (two threads: the programs are lowered here and compiled concurrently, then
    # installed by each key's dummy step; the tests below see no compile after it)
    result = engine.warmup(progress=False, threads=2)
    return engine, result


def test_warmup_builds_every_program_once(warmed):
    engine, result = warmed
    keys = engine.runner.warmup_keys()
    assert keys == [(32, 4, 6, True, False), (32, 4, 6, False, False)]
    assert result.num_programs == 2 and result.num_built == 2 and result.seconds > 0
    m = engine.metrics()
    assert m.num_programs_built == 2 and m.num_compiles_after_warmup == 0
    assert engine.warmup(progress=False).num_built == 0  # already built: nothing new
    assert engine.warmup(progress=False, threads=1).num_built == 0  # (one at a time)
    assert engine.num_compiles_after_warmup == 0


def test_concurrent_compiles_install_the_programs_steps_use(warmed):
    engine, _ = warmed
    # Each key's lowered program is the one a step of that key runs: lowering it again
    # gives the memoized executable (compiling nothing), and running it builds nothing.
    with _CompileEvents() as events:
        for key in engine.runner.warmup_keys():
            prepared = engine.runner.dummy_step(key, max_model_len=engine.max_model_len)
            engine.runner.lower(prepared).compile()
            engine.runner.execute(prepared)
    assert events.count == 0 and engine.num_compiles_after_warmup == 0


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "2"])
def test_bad_thread_counts_raise_naming_threads(warmed, threads):
    engine, _ = warmed
    with pytest.raises(ValueError, match="threads"):
        engine.warmup(progress=False, threads=threads)


def test_no_compile_after_warmup_for_a_request_mix(warmed):
    engine, _ = warmed
    prefix = _prompt(0, 40)
    with _CompileEvents() as events:
        # Greedy: prefix hits, a chunked prefill (prompts > 32 tokens), decode, and more
        # KV than the pool holds at once (preemption by recompute).
        outs = engine.generate([prefix + _prompt(i, 30) for i in range(1, 5)],
                               SamplingParams(max_tokens=14))
        # Sampling, a 1-token prompt and a full-context one.
        outs += engine.generate([_prompt(9, 1), prefix + _prompt(8, 8), _prompt(7, 80)],
                                SamplingParams(max_tokens=12, temperature=0.8, top_k=20,
                                               top_p=0.9))
    m = engine.metrics()
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    assert m.num_cached_tokens > 0 and m.num_preemptions > 0, m
    assert m.num_compiles_after_warmup == 0 and m.num_programs_built == 2
    assert events.count == 0


def test_warmup_changes_no_cache_state_kv_metrics_or_events(warmed):
    base, _ = warmed  # (its programs are built: this test compiles nothing)
    engine = Engine(ModelConfig.tiny(), share_programs_with=base,
                    manager_kwargs={"enable_events": True}, **ENGINE_KW)
    prompts = [_prompt(1, 40), _prompt(2, 20, prefix=_prompt(1, 32))]
    first = engine.generate(prompts, SamplingParams(max_tokens=4))
    engine.kv_cache_manager.take_events()
    mgr = engine.kv_cache_manager

    def snapshot():
        pages = (slice(None), slice(engine.num_blocks)) if engine.runner.stacked_kv else \
            slice(engine.num_blocks)  # (the stacked layout: [A, num_pages, ...])
        kv = [np.asarray(x)[pages] for x in jax.tree.leaves(engine.runner.kv_caches)]
        metrics = engine.metrics().to_dict()
        for k in ("num_compiled_programs", "num_programs_built", "num_compiles_after_warmup"):
            metrics.pop(k)
        return (mgr.free_block_ids(), mgr.cached_block_ids(), mgr.counters(), metrics, kv)

    before = snapshot()
    assert engine.warmup(progress=False).num_built == 0
    after = snapshot()
    assert before[:4] == after[:4]
    for a, b in zip(before[4], after[4]):
        np.testing.assert_array_equal(a, b)  # no allocatable block's KV changed
    assert mgr.take_events() == []
    mgr.check_invariants()
    again = engine.generate(prompts, SamplingParams(max_tokens=4))
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert [o.metrics.num_cached_tokens for o in again] == [32, 48]


def test_the_counter_sees_a_compile_after_warmup(warmed):
    engine, _ = warmed
    # The unpacked transfer path is another jitted function: its first step compiles.
    engine.runner.pack_transfers = False
    try:
        with _CompileEvents() as events:
            engine.generate([_prompt(3, 5)], SamplingParams(max_tokens=2))
    finally:
        engine.runner.pack_transfers = True
    assert events.count == 1
    assert engine.metrics().num_compiles_after_warmup == 1
