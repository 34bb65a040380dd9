"""Simulator, routing, trace, fault-spec, experiment-flag and metadata arguments are
refused with an error naming the argument and the value (issue 25).

On main before issue 25: `router=None` raised AttributeError, `arrival_rate="5"` a
TypeError from `>` (and only once the arrivals were read), `arrival_rate=inf` ran with
every arrival at t=0... (exponential(0)), a router built for block size 32 behind 16-token
replicas was taken, negative Mooncake / `TraceRequest` timestamps were taken,
`parse_fault("step:3:error:kv_lost")` kept the last kind silently, `--replicas=2,2` ran
the same cell twice, `replay(hash_seed=object())` hashed with an address, and
`MetadataBuilder.build({...})` of a mapping failed with an unrelated message.
"""
from __future__ import annotations

import json
import math

import pytest

from prefixcache.engine.faults import parse_fault
from prefixcache.metadata import MetadataBuilder, ScheduledSeq
from prefixcache.sim import des
from prefixcache.sim.cluster import simulate_cluster
from prefixcache.sim.cost_model import CostModel
from prefixcache.sim.replay import replay
from prefixcache.sim.routing import make_router
from prefixcache.sim.trace import TraceError, TraceRequest, read_trace

COST = CostModel.create("llama_3_1_8b", "h100")
BS = 16


def _reqs(n=6):
    return [TraceRequest(id=f"r{i}", prompt=list(range(1, 40 + i)), output_len=2,
                         timestamp=0.1 * i) for i in range(n)]


def _cluster(**kw):
    args = dict(num_replicas=2, router="round_robin", cost_model=COST, num_blocks=64,
                block_size=BS)
    return simulate_cluster(_reqs(), **{**args, **kw})


@pytest.mark.parametrize("kw, exc, match", [
    (dict(router=None), TypeError, r"router must be a registered routing policy name or a "
                                   r"Router, got NoneType None"),
    (dict(router=3), TypeError, r"got int 3"),
    (dict(arrival_rate="5"), TypeError, r"arrival_rate must be a number .* got str '5'"),
    (dict(arrival_rate=math.inf), ValueError, r"arrival_rate must be a finite number > 0"),
    (dict(arrival_rate=math.nan), ValueError, r"arrival_rate must be a finite .* nan"),
    (dict(arrival_rate=True), TypeError, r"got bool True"),
])
def test_cluster_arguments_named(kw, exc, match):
    with pytest.raises(exc, match=match):
        _cluster(**kw)


def test_router_built_for_another_block_size():
    router = make_router("cache_aware", num_replicas=2, block_size=32, seed=0)
    before = repr(router), router.block_size
    with pytest.raises(ValueError, match=r"built for block_size=32, not block_size=16"):
        _cluster(router=router)
    assert (repr(router), router.block_size) == before
    ok = make_router("cache_aware", num_replicas=2, block_size=BS, seed=0)
    assert _cluster(router=ok)["requests"] == 6


@pytest.mark.parametrize("rate, exc", [("5", TypeError), (math.inf, ValueError)])
def test_des_arrival_rate_named_before_anything_runs(rate, exc):
    with pytest.raises(exc, match="arrival_rate"):
        des.simulate(iter(()), cost_model=COST, num_blocks=64, block_size=BS,
                     arrival_rate=rate)
    assert des.simulate(_reqs(), cost_model=COST, num_blocks=64, block_size=BS,
                        arrival_rate=5.0)["requests"] == 6


def test_negative_timestamps_refused(tmp_path):
    with pytest.raises(ValueError, match=r"timestamp must be a finite number >= 0 .* -1.5"):
        TraceRequest(id="x", prompt=[1, 2], output_len=1, timestamp=-1.5)
    assert TraceRequest(id="x", prompt=[1, 2], output_len=1, timestamp=0.0).timestamp == 0.0
    path = tmp_path / "mc.jsonl"
    line = {"timestamp": -5, "input_length": 10, "output_length": 2, "hash_ids": [1]}
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(TraceError, match=r"mc.jsonl:1: field 'timestamp' must be a finite "
                                         r"number >= 0 \(ms\), got -5"):
        list(read_trace(path, format="mooncake"))
    path.write_text(json.dumps({**line, "timestamp": 5}) + "\n")
    assert [r.timestamp for r in read_trace(path, format="mooncake")] == [0.005]


@pytest.mark.parametrize("spec, match", [
    ("step:3:error:kv_lost", r"conflicting kinds 'error' and 'kv_lost'"),
    ("step:3:before_device:after_device", r"conflicting points 'before_device' and "
                                          r"'after_device'"),
    ("step:3:kv_lost:kv_lost", r"conflicting kinds"),
])
def test_parse_fault_conflicting_parts(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_fault(spec)
    f = parse_fault("step:3:after_device:kv_lost")
    assert (f.step, f.point, f.kind) == (3, "after_device", "kv_lost")


def test_parse_fault_non_str():
    with pytest.raises(TypeError, match="fault spec must be a str, got int 3"):
        parse_fault(3)


def test_route_list_flags_refuse_repeats():
    from experiments.route import parse_list

    with pytest.raises(ValueError, match=r"--replicas='2,2' repeats 2"):
        parse_list("replicas", "2,2", int)
    with pytest.raises(ValueError, match=r"--replicas='1,2,1,2' repeats 1, 2"):
        parse_list("replicas", "1,2,1,2", int)
    with pytest.raises(ValueError, match=r"--policies=.* repeats 'random'"):
        parse_list("policies", "random, round_robin,random")
    assert parse_list("replicas", "1,2,4", int) == [1, 2, 4]


def test_replay_hash_seed_must_be_reproducible():
    for seed in (object(), 2.5, [1]):
        with pytest.raises(TypeError, match=r"hash_seed must be None, a str, an int or bytes"):
            replay(_reqs(), num_blocks=64, block_size=BS, hash_seed=seed)
    assert replay(_reqs(), num_blocks=64, block_size=BS, hash_seed="s")["requests"] == 6


def test_metadata_build_refuses_a_mapping():
    b = MetadataBuilder(block_size=8, num_blocks=8, max_num_seqs=2, max_num_tokens=16,
                        max_pages_per_seq=4)
    seq = ScheduledSeq([0], 0, [5, 6])
    for bad in ({"a": seq}, {"a", "b"}, "ab"):
        with pytest.raises(TypeError, match=r"seqs must be a sequence \(list or tuple\) of "
                                            rf"ScheduledSeq, got {type(bad).__name__}"):
            b.build(bad)
    assert b.build([seq]).input_ids[:2].tolist() == [5, 6]
    assert b.build((seq,)).input_ids[:2].tolist() == [5, 6]
