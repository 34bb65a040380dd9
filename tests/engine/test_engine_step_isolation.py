"""A model step that one request makes fail fails that request only: the other requests
of the step and of the engine finish with the tokens of a run without it, and every
block that was cached stays cached, holding its KV (a later hit reads what a cache-off
run computes)."""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache.engine import Engine, SamplingParams
from prefixcache.model import ModelConfig

NUM_BLOCKS = 64
COMMON = dict(num_blocks=NUM_BLOCKS, block_size=16, seed=0, max_num_seqs=4,
              max_num_batched_tokens=128, max_model_len=512, token_buckets=(128,),
              seq_buckets=(4,), page_buckets=(32,))


def _smuggled(params: SamplingParams, **values) -> SamplingParams:
    """`params` with values its validation refuses (as a value it once let through)."""
    out = SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                         seed=params.seed)
    for k, v in values.items():
        object.__setattr__(out, k, v)
    return out


def _run(eng):
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o
        eng.kv_cache_manager.check_invariants()
    return done


@pytest.fixture(scope="module")
def engines():
    ref = Engine(ModelConfig.tiny(), **COMMON)
    off = Engine(ModelConfig.tiny(), enable_caching=False, share_programs_with=ref, **COMMON)
    return ref, off


def test_a_request_the_step_cannot_represent_fails_alone(engines):
    ref, off = engines
    rng = np.random.default_rng(3)
    warm = rng.integers(1, 512, 40).tolist()  # cached before the failure
    shared = rng.integers(1, 512, 32).tolist()  # the culprit's prefix, hit in its step
    victims = [shared + rng.integers(1, 512, 9).tolist(), warm + [7, 8, 9],
               rng.integers(1, 512, 20).tolist()]
    culprit = shared + rng.integers(1, 512, 5).tolist()
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=11)
    want = [o.token_ids for o in off.generate(victims, sampled)]

    eng = Engine(ModelConfig.tiny(), share_programs_with=ref, **COMMON)
    eng.generate([warm], SamplingParams(max_tokens=2))
    cached_before = set(eng.kv_cache_manager.cached_block_ids())
    assert cached_before
    bad = eng.add_request(culprit, _smuggled(sampled, top_k=2 ** 40), request_id="bad")
    ids = [eng.add_request(p, sampled, request_id=f"v{i}") for i, p in enumerate(victims)]
    done = _run(eng)

    assert done[bad].finish_reason == "error"
    assert done[bad].error.startswith("model step failed: OverflowError"), done[bad].error
    for i, w in zip(ids, want):
        assert done[i].error is None, done[i].error
        assert done[i].token_ids == w, i
    assert done["v1"].metrics.num_cached_tokens == 32  # the warm prefix was still there
    cached = set(eng.kv_cache_manager.cached_block_ids())
    assert cached_before <= cached  # nothing intact was dropped
    assert eng.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    assert eng.scheduler.stats()["num_preemptions"] == 0

    # The culprit's own cached blocks hold their KV: a hit on them computes what a
    # cache-off engine computes.
    again = eng.generate([culprit], SamplingParams(max_tokens=6))[0]
    assert again.metrics.num_cached_tokens == 32
    assert again.token_ids == off.generate([culprit], SamplingParams(max_tokens=6))[0].token_ids


def test_a_failure_no_request_causes_alone_still_keeps_the_cache(engines):
    """A fault before the device call that no single request causes: the step's requests
    fail (as before), the prefix cache and the requests outside the step go on."""
    from prefixcache.engine.faults import StepFault

    ref, off = engines
    rng = np.random.default_rng(4)
    warm = rng.integers(1, 512, 48).tolist()
    eng = Engine(ModelConfig.tiny(), share_programs_with=ref, **COMMON)
    eng.generate([warm], SamplingParams(max_tokens=2))
    cached_before = set(eng.kv_cache_manager.cached_block_ids())
    fault = StepFault(1).attach(eng)
    eng.add_request(warm + [1, 2], SamplingParams(max_tokens=3), request_id="hit")
    done = _run(eng)
    assert fault.hit_request_ids == ["hit"] and done["hit"].finish_reason == "error"
    assert cached_before <= set(eng.kv_cache_manager.cached_block_ids())
    eng.fault_injector = None
    again = eng.generate([warm + [1, 2]], SamplingParams(max_tokens=3))[0]
    assert again.metrics.num_cached_tokens == 48
    assert again.token_ids == off.generate([warm + [1, 2]],
                                           SamplingParams(max_tokens=3))[0].token_ids
