"""The README's "Extending" recipes, each followed with a toy plug-in defined here.

Each registry is read-only (a ``MappingProxyType``); the recipe's "one registration"
is one line in it, which the tests make with ``monkeypatch`` (a new read-only map with
the toy added), then drive the toy through the public entry points only.
"""

from __future__ import annotations

import types

import pytest

from prefixcache import CacheConfig
from prefixcache.sim.trace import TraceRequest


def _trace(n=8):
    # Two families of prompts sharing a 2-block prefix each.
    return [TraceRequest(id=str(i), prompt=[1 + i % 2] * 8 + [100 + i] * 4, output_len=2,
                         timestamp=0.01 * i) for i in range(n)]


def _register(monkeypatch, module, attr, name, value):
    monkeypatch.setattr(module, attr, types.MappingProxyType({**getattr(module, attr),
                                                              name: value}))


def test_eviction_policy_recipe(monkeypatch):
    from prefixcache.core import eviction
    from prefixcache.core.eviction.base import KeyedPolicy
    from prefixcache.sim.replay import replay

    class NewestFirst(KeyedPolicy):
        """Evict the most recently cached candidate first (MRU by cache time)."""

        name = "newest_first"

        def key(self, block):
            return -self.cached_at[block.block_id]

    _register(monkeypatch, eviction, "POLICIES", "newest_first", NewestFirst)
    # prefix A (2 blocks), three unique prompts (3 blocks each), A again: LRU evicts A
    # (the oldest), the toy evicts the newest and keeps A's 8 tokens for the last one.
    trace = [TraceRequest(id="a0", prompt=[7] * 8 + [1], output_len=1)]
    trace += [TraceRequest(id=f"u{i}", prompt=[10 + i] * 12, output_len=1) for i in range(3)]
    trace += [TraceRequest(id="a1", prompt=[7] * 8 + [2], output_len=1)]
    cfg = CacheConfig(num_blocks=6, block_size=4, eviction="newest_first")
    hits = {}
    toy = replay(trace, cache_config=cfg,
                 on_record=lambda r: hits.__setitem__(r["id"], r["num_computed_tokens"]))
    assert toy["eviction"] == "newest_first" and toy["evictions"] > 0
    assert hits["a1"] == 8
    lru_hits = {}
    replay(trace, cache_config=cfg.replace(eviction="lru"),
           on_record=lambda r: lru_hits.__setitem__(r["id"], r["num_computed_tokens"]))
    assert lru_hits["a1"] == 0
    # not needing the future, it is a valid host policy too
    assert CacheConfig(num_blocks=6, num_host_blocks=4, host_eviction="newest_first")


def test_offline_policy_is_known_by_its_property_not_its_name(monkeypatch):
    from prefixcache.core import eviction
    from prefixcache.core.eviction.belady import BeladyPolicy
    from prefixcache.sim import des

    class Oracle(BeladyPolicy):
        name = "oracle"

    _register(monkeypatch, eviction, "POLICIES", "oracle", Oracle)
    with pytest.raises(ValueError, match="oracle needs the trace's future"):
        des.simulate(_trace(), cost_model=des.CostModel.create("tiny", "h100"),
                     num_blocks=8, block_size=4, eviction="oracle")
    with pytest.raises(ValueError, match="host_eviction='oracle' needs the trace's future"):
        CacheConfig(num_host_blocks=2, host_eviction="oracle")


def test_router_recipe(monkeypatch):
    from prefixcache.cost_model import CostModel
    from prefixcache.sim import routing
    from prefixcache.sim.cluster import simulate_cluster
    from prefixcache.sim.routing.base import Router

    class FirstReplica(Router):
        name = "first_replica"

        def route(self, request, loads, now):
            return 0

    _register(monkeypatch, routing, "ROUTERS", "first_replica", FirstReplica)
    s = simulate_cluster(_trace(), num_replicas=3, router="first_replica",
                         cost_model=CostModel.create("tiny", "h100"),
                         cache_config=CacheConfig(num_blocks=32, block_size=4))
    assert [r["requests"] for r in s["per_replica"]] == [8, 0, 0]


def test_scheduling_policy_recipe(monkeypatch):
    from prefixcache import scheduling
    from prefixcache.cost_model import CostModel
    from prefixcache.scheduling.base import WaitingPolicy
    from prefixcache.sim import des

    class LastComeFirst(WaitingPolicy):
        name = "lcfs"

        def order(self, waiting, request_of, manager):
            return list(reversed(waiting))

    _register(monkeypatch, scheduling, "SCHEDULING_POLICIES", "lcfs", LastComeFirst)
    # All arrive at once into a one-sequence server: LCFS serves the last one first.
    reqs = [TraceRequest(id=str(i), prompt=[i + 1] * 8, output_len=1, timestamp=0.0)
            for i in range(4)]
    done = []
    des.simulate(reqs, cost_model=CostModel.create("tiny", "h100"), num_blocks=32,
                 block_size=4, scheduler=des.SchedulerConfig(max_num_seqs=1),
                 scheduling="lcfs", on_record=lambda r: done.append(r["id"]))
    assert done[0] == "3" and sorted(done) == ["0", "1", "2", "3"]


def test_dataset_recipe(tmp_path):
    from prefixcache.sim import datasets
    from prefixcache.sim.trace import read_trace

    trace = tmp_path / "toy.jsonl"
    trace.write_text('{"id": "a", "prompt": [1, 2, 3], "output_len": 2}\n')
    toy = datasets.Dataset(name="toy", url=trace.as_uri(), sha256=datasets.sha256_of(trace),
                           filename="toy.jsonl", trace_format="jsonl", num_requests=1,
                           description="one request")
    registry = types.MappingProxyType({**datasets.DATASETS, "toy": toy})
    path = datasets.path_of("toy", root=tmp_path / "data", registry=registry, progress=False)
    assert [r.id for r in read_trace(str(path))] == ["a"]
    bad = datasets.Dataset(**{**vars(toy), "sha256": "0" * 64})
    with pytest.raises(datasets.DatasetError):
        datasets.path_of("toy", local_path=trace,
                         registry=types.MappingProxyType({"toy": bad}))


def test_cache_config_field_recipe():
    # A new cache option is one CacheConfig field; manager_kwargs hands it to every
    # driver (tests/core/test_cache_config.py checks each driver).
    import dataclasses

    names = {f.name for f in dataclasses.fields(CacheConfig)}
    assert {"eviction", "index", "num_host_blocks", "kv_cache_groups"} <= names
