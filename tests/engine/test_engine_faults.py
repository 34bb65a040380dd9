"""Fault injection and bad input on the engine (issue 13, items 2 and 4).

After a fault: every block of the affected requests is freed (`check_invariants`, the
free count back to the pool size once all finish), requests outside the failed step
finish with the same tokens as in a run without the fault, and the engine keeps
working (also when the failed step had consumed the donated KV arrays).
"""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache.engine import Engine, SamplingParams
from prefixcache.engine.faults import StepFault, parse_fault
from prefixcache.model import ModelConfig, make_kv_caches

NUM_BLOCKS = 64
# One shape bucket each: one compiled program for every engine of this file.
COMMON = dict(num_blocks=NUM_BLOCKS, block_size=16, seed=0, max_num_seqs=4,
              max_num_batched_tokens=64, max_model_len=512, token_buckets=(64,),
              seq_buckets=(4,), page_buckets=(32,))
PARAMS = SamplingParams(max_tokens=6)


def prompts():
    rng = np.random.default_rng(7)
    shared = rng.integers(1, 512, 32).tolist()
    # Six requests, two sharing a 2-block prefix, one long enough for chunked prefill.
    return [shared + rng.integers(1, 512, n).tolist() for n in (8, 20)] + [
        rng.integers(1, 512, n).tolist() for n in (150, 12, 30, 5)]


@pytest.fixture(scope="module")
def base():
    """The engine whose compiled program the others share, and the fault-free tokens."""
    eng = Engine(ModelConfig.tiny(), **COMMON)
    outs = eng.generate(prompts(), PARAMS)
    assert all(o.error is None for o in outs)
    return eng, [o.token_ids for o in outs]


def fresh(base):
    return Engine(ModelConfig.tiny(), share_programs_with=base[0], **COMMON)


def run_all(eng, ids):
    """Steps to completion, checking the manager after every step; outputs by id."""
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            done[out.request_id] = out
        eng.kv_cache_manager.check_invariants()
    assert eng.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    return [done[i] for i in ids]


def add_all(eng):
    return [eng.add_request(p, PARAMS, request_id=f"r{i}") for i, p in enumerate(prompts())]


def check_outcome(outs, hit_ids, want_tokens):
    assert hit_ids, "the fault never fired"
    for out, want in zip(outs, want_tokens):
        if out.request_id in hit_ids:
            assert out.finish_reason == "error"
            assert out.error.startswith("model step failed: "), out.error
            assert "injected fault" in out.error
        else:
            assert out.error is None, out.error
            assert out.token_ids == want, out.request_id


@pytest.mark.parametrize("point,at", [("before_device", 2), ("after_device", 3)])
def test_model_step_raising_mid_batch(base, point, at):
    eng = fresh(base)
    fault = StepFault(at, point=point).attach(eng)
    ids = add_all(eng)
    outs = run_all(eng, ids)
    check_outcome(outs, fault.hit_request_ids, base[1])
    assert len(fault.hit_request_ids) < len(ids)  # some requests were outside the failed step
    # The engine goes on: the same prompts again give the fault-free tokens.
    eng.fault_injector = None
    assert [o.token_ids for o in eng.generate(prompts(), PARAMS)] == base[1]


def test_failed_step_that_consumed_the_donated_kv(base):
    """The step raised after taking the donated KV arrays (deleted): they are re-created
    and later steps run on valid arrays."""
    eng = fresh(base)
    fault = parse_fault("step:2:kv_lost").attach(eng)
    ids = add_all(eng)
    outs = run_all(eng, ids)
    check_outcome(outs, fault.hit_request_ids, base[1])
    assert not any(x.is_deleted() for x in eng.runner.kv_caches)


def test_failure_inside_the_jitted_call(base):
    """The real program runs (the KV arrays are donated to it), then the call fails."""
    eng = fresh(base)
    real = eng.runner.program
    state = {"n": 0, "hit": []}

    class Failing:
        input_sharding = real.input_sharding

        def __call__(self, kv, inputs, *, all_greedy):
            state["n"] += 1
            out = real(kv, inputs, all_greedy=all_greedy)
            if state["n"] == 2:
                state["hit"] = list(eng.last_hit_ids)
                raise RuntimeError("injected fault")
            return out

    def remember(point, sched):
        if point == "before_device":
            eng.last_hit_ids = [s.request_id for s in sched.scheduled]

    eng.fault_injector = remember
    eng.runner.program = Failing()
    ids = add_all(eng)
    outs = run_all(eng, ids)
    check_outcome(outs, state["hit"], base[1])


def test_keyboard_interrupt_mid_step_requeues_everything(base):
    eng = fresh(base)
    StepFault(2, kind="interrupt").attach(eng)
    ids = add_all(eng)
    eng.step()
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    mgr = eng.kv_cache_manager
    mgr.check_invariants()
    assert mgr.num_free_blocks == NUM_BLOCKS and not eng.scheduler.running
    # Nothing failed: resuming gives every request its fault-free tokens.
    outs = run_all(eng, ids)
    assert [o.token_ids for o in outs] == base[1]
    assert all(o.error is None for o in outs)


def test_abort_during_chunked_prefill(base):
    eng = fresh(base)
    ids = add_all(eng)
    long_id = ids[2]  # 150 tokens: chunks of at most 64
    while True:
        eng.step()
        state = eng.scheduler.requests.get(long_id)
        req = state.request
        if state.block_row is not None and 0 < req.num_computed_tokens < req.num_prompt_tokens:
            break
    eng.abort_request(long_id)
    eng.kv_cache_manager.check_invariants()
    assert long_id not in eng.kv_cache_manager.running_request_ids
    outs = run_all(eng, ids)
    for out, want in zip(outs, base[1]):
        if out.request_id == long_id:
            assert out.finish_reason == "abort"
        else:
            assert out.token_ids == want


# ------------------------------------------------------------------- bad configuration

def test_unsupported_kernel_config_is_rejected_at_construction():
    tpu = dict(attention_backend="pallas_tpu", interpret=True)
    for kw, match in ((dict(block_size=4, **tpu), r"block_size=4 is not supported .*"
                       r"the Pallas tpu backend needs page_size in \[8, 128\], got 4"),
                      (dict(block_size=200, **tpu), "block_size=200 is not supported"),
                      (dict(block_size=24, attention_backend="pallas_gpu", interpret=True),
                       "block_size=24 .*the Pallas gpu backend needs a power-of-two"),
                      (dict(attention_backend="pallas_tpu"), "needs a tpu device"),
                      (dict(attention_backend="nope"), "unknown backend")):
        with pytest.raises(ValueError, match=match):
            Engine(ModelConfig.tiny(), num_blocks=8, **kw)
    with pytest.raises(ValueError, match="the Pallas tpu backend needs head_dim in"):
        Engine(ModelConfig.tiny(head_dim=32), num_blocks=8, **tpu)


def test_kv_cache_beyond_memory_is_rejected_before_allocating():
    with pytest.raises(ValueError, match=r"num_blocks=1073741824 .*KV cache .* needs about "
                       r".* GiB"):
        Engine(ModelConfig.tiny(), num_blocks=2**30, block_size=16,
               max_model_len=1024)
    # The model's own entry point: used to be XLA's RESOURCE_EXHAUSTED (or, on a host
    # with overcommit, the OOM killer while zeroing the pages).
    with pytest.raises(ValueError, match=r"KV cache .* needs about .* GiB"):
        make_kv_caches(ModelConfig.tiny(), num_blocks=2**34, block_size=16)


def test_bad_prompt_leaves_engine_unchanged(base):
    eng = fresh(base)
    bads = ({1, 2, 3}, {1: 2}, "abc", [1.0, 2.0], np.array([1.5]), [True, 2])
    for bad in bads:
        with pytest.raises(ValueError, match="prompt"):
            eng.generate([[1, 2], bad], PARAMS)
    assert not eng._known_ids and not eng.has_unfinished_requests()
    eng.add_request([1, 2, 3], PARAMS, request_id="ok")
    eng.step()  # "ok" holds blocks now
    eng.add_request([4, 5, 6], PARAMS, request_id="waiting")

    def state():
        m, sch = eng.kv_cache_manager, eng.scheduler
        return (set(eng._known_ids), [s.request_id for s in sch.waiting],
                [s.request_id for s in sch.running], m.free_block_ids(),
                m.cached_block_ids(), {r: m.get_block_ids(r) for r in m.running_request_ids},
                m.counters(), len(eng._pending_outputs))

    before = state()
    for bad in bads:
        with pytest.raises(ValueError, match="prompt"):
            eng.add_request(bad, PARAMS)
    assert state() == before
    eng.kv_cache_manager.check_invariants()


def test_parse_fault():
    f = parse_fault("step:3:after_device:kv_lost")
    assert (f.step, f.point, f.kind) == (3, "after_device", "kv_lost")
    assert parse_fault("") is None
    for bad in ("3", "step:x", "step:1:sideways", "step:0", "step:1:2:3:4"):
        with pytest.raises(ValueError, match="step"):
            parse_fault(bad)
