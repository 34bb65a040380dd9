"""The simulator and routing APIs follow the one rule per kind of argument
(``prefixcache._validate``; issue 25's re-probe, round 9): a clear error naming the
argument instead of a raw Python error, numpy ints taken as ints, refused before
anything runs.

On main before the fix: ``des.simulate(cost_model=None)`` / ``simulate_cluster`` raised
AttributeError ('NoneType' object has no attribute ...); ``num_replicas=np.int64(2)``
was refused by ``simulate_cluster`` and ``make_router`` (numpy ints are taken by
``num_blocks`` next to it); a router seed of ``"x"`` or ``1.5`` was taken;
``TraceRequest(output_len=np.int64(2))`` was refused; ``CacheConfig(hash_seed=object())``
was taken (its str holds an address; ``replay`` and the managers refused it); and
``experiments.route`` refusing ``--replicas=2,2`` was only tested on the helper, not on
``run``.
"""
from __future__ import annotations

import numpy as np
import pytest

from prefixcache import CacheConfig
from prefixcache.sim import des
from prefixcache.sim.cluster import simulate_cluster
from prefixcache.sim.cost_model import CostModel
from prefixcache.sim.routing import make_router
from prefixcache.sim.trace import TraceRequest

COST = CostModel.create("llama_3_1_8b", "h100")
BS = 16


def _reqs(n=4):
    return [TraceRequest(id=f"r{i}", prompt=list(range(1, 40 + i)), output_len=2,
                         timestamp=0.1 * i) for i in range(n)]


@pytest.mark.parametrize("bad", [None, "llama_3_1_8b", object()], 
                         ids=lambda v: "object()" if type(v) is object else repr(v))
def test_cost_model_named(bad):
    with pytest.raises(TypeError, match=r"cost_model must be a prefixcache.cost_model.CostModel"):
        des.simulate(_reqs(), cost_model=bad, num_blocks=64, block_size=BS)
    with pytest.raises(TypeError, match=r"cost_model must be a prefixcache.cost_model.CostModel"):
        simulate_cluster(_reqs(), num_replicas=2, router="random", cost_model=bad,
                         num_blocks=64, block_size=BS)
    assert des.simulate(_reqs(), cost_model=COST, num_blocks=64, block_size=BS)["requests"] == 4


def test_replica_counts_numpy_ints_are_ints_bools_are_not():
    a = simulate_cluster(_reqs(), num_replicas=np.int64(2), router="round_robin",
                         cost_model=COST, num_blocks=np.int64(64), block_size=BS)
    b = simulate_cluster(_reqs(), num_replicas=2, router="round_robin", cost_model=COST,
                         num_blocks=64, block_size=BS)
    assert a["hit_rate_tokens"] == b["hit_rate_tokens"] and a["requests"] == 4
    r = make_router("cache_aware", num_replicas=np.int32(2), block_size=np.int64(BS),
                    seed=np.int64(0))
    assert (type(r.num_replicas), type(r.block_size), type(r.seed)) == (int, int, int)
    for bad in (True, 2.0, "2", 0):
        with pytest.raises(ValueError, match="num_replicas must be a positive int"):
            make_router("random", num_replicas=bad, block_size=BS)
        with pytest.raises(ValueError, match="num_replicas must be a positive int"):
            simulate_cluster(_reqs(), num_replicas=bad, router="random", cost_model=COST,
                             num_blocks=64, block_size=BS)


@pytest.mark.parametrize("seed", ["x", 1.5, None, True], ids=repr)
def test_router_seed_is_an_int(seed):
    with pytest.raises(TypeError, match="seed must be an int"):
        make_router("random", num_replicas=2, block_size=BS, seed=seed)


def test_trace_request_numpy_ints():
    t = TraceRequest(id="x", prompt=[1, 2], output_len=np.int64(3), priority=np.int8(-2))
    assert (type(t.output_len), t.output_len, type(t.priority), t.priority) == (int, 3, int, -2)
    assert t == TraceRequest(id="x", prompt=[1, 2], output_len=3, priority=-2)
    for kw in (dict(output_len=True), dict(output_len=np.bool_(True)), dict(priority=1.0)):
        with pytest.raises(ValueError):
            TraceRequest(id="x", prompt=[1, 2], **{"output_len": 1, **kw})


def test_cache_config_hash_seed_reproducible():
    for seed in (object(), 1.5, [1]):
        with pytest.raises(TypeError, match=r"hash_seed must be None, a str, an int or bytes"):
            CacheConfig(num_blocks=8, hash_seed=seed)
    for seed in (None, "s", 3, b"b"):
        assert CacheConfig(num_blocks=8, hash_seed=seed).hash_seed == seed


def test_route_run_refuses_repeated_replicas_before_anything_runs(tmp_path):
    import importlib.util  # noqa: PLC0415
    import pathlib  # noqa: PLC0415

    from experiments import route  # noqa: PLC0415

    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("_cfg_route_r", root / "configs/route.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config("quick")
    c.workdir = str(tmp_path / "route")
    c.replicas = "2,2"
    with pytest.raises(ValueError, match=r"--replicas='2,2' repeats 2"):
        route.run(c)
    assert not (tmp_path / "route").exists() or not any((tmp_path / "route").iterdir())


def test_trace_paths_str_or_pathlike(tmp_path):
    from prefixcache.sim.trace import read_trace, write_trace  # noqa: PLC0415

    reqs = _reqs(2)
    assert write_trace(tmp_path / "t.jsonl", reqs) == 2
    assert [r.id for r in read_trace(tmp_path / "t.jsonl")] == ["r0", "r1"]
    assert [r.id for r in read_trace(str(tmp_path / "t.jsonl"))] == ["r0", "r1"]
    for bad in (bytes(tmp_path / "t.jsonl"), None, 3, ""):
        with pytest.raises(ValueError, match="path"):
            list(read_trace(bad))
        with pytest.raises(ValueError, match="path"):
            write_trace(bad, reqs)


@pytest.mark.parametrize("ts", [-1, -0.5, "1", True, float("nan")], ids=repr)
def test_jsonl_reader_refuses_bad_timestamps(tmp_path, ts):
    import json  # noqa: PLC0415

    from prefixcache.sim.trace import TraceError, read_trace  # noqa: PLC0415

    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"id": "a", "prompt": [1, 2], "output_len": 1, "timestamp": ts})
                 + "\n")
    with pytest.raises(TraceError, match=r"t.jsonl:1: field 'timestamp' must be a finite "
                                         r"number >= 0 \(seconds\)"):
        list(read_trace(p, format="jsonl"))
