"""CacheConfig: validated once, round-trips, and every field reaches every driver."""

import dataclasses
import inspect

import pytest

from prefixcache import CacheConfig
from prefixcache.core import cache_config as cc
from prefixcache.core.kv_groups import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from prefixcache.cost_model import CostModel
from prefixcache.sim.trace import TraceRequest

FIELDS = tuple(f.name for f in dataclasses.fields(CacheConfig))
# Fields a driver resolves itself (the pool in bytes) instead of handing on.
RESOLVED_BY_DRIVER = {"kv_cache_bytes", "kv_dtype"}

# Every manager field away from its default (one config that a driver must hand on
# whole: a field dropped anywhere shows up as a default in the manager's kwargs).
FULL = CacheConfig(num_blocks=24, block_size=4, enable_caching=True, hash_algo="sha256_cbor",
                   hash_seed=7, free_order="unhashed_first", eviction="cost",
                   eviction_options={"model": "tiny"}, index="radix", num_host_blocks=8,
                   host_eviction="cost", host_eviction_options={"model": "tiny"},
                   enable_events=True, max_model_len=64)
COST = CostModel.create("tiny", "h100", host_link="h200_pcie5")


def _trace():
    return [TraceRequest(id=str(i), prompt=[1 + i % 2] * 9 + [i + 3] * 3, output_len=2,
                         timestamp=0.01 * i) for i in range(6)]


def test_every_field_has_a_path_to_the_manager():
    # A new field must either be a manager keyword or be resolved by the drivers.
    kw = FULL.replace(kv_cache_groups="full", disk_bytes=400, page_bytes=100).manager_kwargs()
    assert set(FIELDS) == set(kw) | RESOLVED_BY_DRIVER
    assert all(FULL.manager_kwargs()[k] == getattr(FULL, k) for k in FULL.manager_kwargs())


def test_defaults_give_todays_manager_keywords():
    from prefixcache.core.kv_cache_manager import KVCacheManager

    defaults = {k: p.default for k, p in inspect.signature(KVCacheManager.__init__)
                .parameters.items() if p.default is not inspect.Parameter.empty}
    kw = CacheConfig(num_blocks=8, block_size=4).manager_kwargs()
    for k, v in kw.items():
        if k in defaults:
            assert v == defaults[k] or (v is None and defaults[k] is None), k
    assert "kv_cache_groups" not in kw  # one full-attention group: today's manager


@pytest.mark.parametrize("bad, match", [
    (dict(num_blocks=0), "num_blocks must be >= 1"),
    (dict(block_size=2.0), "block_size must be an int"),
    (dict(enable_caching="yes"), "enable_caching must be a bool"),
    (dict(hash_algo="md5"), "hash_algo: unknown hash algorithm .md5."),
    (dict(free_order="lifo"), "unknown free_order"),
    (dict(eviction="nope"), "eviction: unknown eviction policy"),
    (dict(eviction_options=[1]), "eviction_options must be a mapping"),
    (dict(index="btree"), "index: unknown index"),
    (dict(num_host_blocks=-1), "num_host_blocks must be >= 0"),
    (dict(host_eviction="belady"), "host_eviction='belady' needs the trace's future"),
    (dict(num_host_blocks=4, enable_caching=False), "needs prefix caching"),
    (dict(kv_cache_groups="full,sliding"), "bad kv group"),
    (dict(max_model_len=0), "max_model_len must be >= 1"),
    (dict(num_blocks=8, kv_cache_bytes="1MiB"), "not both"),
    (dict(kv_cache_bytes="lots"), "kv_cache_bytes='lots'"),
    (dict(kv_dtype="int4"), "int4"),
])
def test_bad_fields_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(**bad)


def test_replace_to_dict_from_dict_round_trip():
    cfg = FULL.replace(kv_cache_groups=(
        KVCacheGroup(FullAttentionSpec(), ("a",)), KVCacheGroup(SlidingWindowSpec(8), ("b",))))
    row = cfg.to_dict()
    import json
    assert CacheConfig.from_dict(json.loads(json.dumps(row))) == cfg
    assert cfg.replace(num_blocks=5).num_blocks == 5 and cfg.num_blocks == 24
    assert cfg.replace(kv_cache_bytes="1MiB").num_blocks is None
    with pytest.raises(ValueError, match="unknown CacheConfig field"):
        cfg.replace(num_block=5)
    with pytest.raises(ValueError, match="unknown CacheConfig field"):
        CacheConfig.from_dict({**row, "typo": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_blocks = 3


def test_from_config_dict_and_flags():
    ml_collections = pytest.importorskip("ml_collections")
    config = ml_collections.ConfigDict(dict(num_blocks=32, block_size=8, eviction="fifo",
                                            kv_cache_groups="", max_model_len=-1,
                                            workload="chat", seed=3))
    cfg = CacheConfig.from_config_dict(config, index="radix")
    assert (cfg.num_blocks, cfg.block_size, cfg.eviction, cfg.index) == (32, 8, "fifo", "radix")
    assert cfg.kv_cache_groups is None and cfg.max_model_len is None
    from absl import flags
    fv = flags.FlagValues()
    flags.DEFINE_integer("num_blocks", 12, "", flag_values=fv)
    flags.DEFINE_string("eviction", "slru", "", flag_values=fv)
    fv(["prog"])
    assert CacheConfig.from_flags(fv, block_size=2) == CacheConfig(num_blocks=12, block_size=2,
                                                                     eviction="slru")


def test_kv_cache_bytes_resolves_by_the_block_bytes():
    cfg = CacheConfig(kv_cache_bytes=10 * 1000, block_size=4)
    with pytest.raises(ValueError, match="with_pool_blocks"):
        cfg.manager_kwargs()
    assert cfg.with_pool_blocks(1000).num_blocks == 10
    assert cfg.with_pool_blocks(1000, num_padding_pages=1).num_blocks == 9


def test_resolve_keywords_override_the_config():
    assert cc.resolve(None, num_blocks=4, block_size=cc.UNSET) == CacheConfig(num_blocks=4)
    assert cc.resolve(FULL, eviction="lru").eviction == "lru"
    with pytest.raises(TypeError, match="cache_config must be"):
        cc.resolve({"num_blocks": 4})


class _Spy:
    """Records the keywords of every KVCacheManager built, then builds it."""

    def __init__(self, real):
        self.real, self.calls = real, []
        sig = inspect.signature(real.__init__)
        self.params = list(sig.parameters)[1:]
        # A keyword left out is the manager's default (drivers omit some when off).
        self.defaults = {k: p.default for k, p in sig.parameters.items()
                         if p.default is not inspect.Parameter.empty}

    def __call__(self, *args, **kwargs):
        self.calls.append({**self.defaults, **dict(zip(self.params, args)), **kwargs})
        return self.real(*args, **kwargs)


def _assert_handed_on(calls, cfg, *, skip=()):
    assert calls, "no manager was built"
    want = cfg.manager_kwargs()
    for kw in calls:
        for name, value in want.items():
            if name not in skip:
                assert kw.get(name) == value, (name, kw.get(name), value)


@pytest.fixture
def spy(monkeypatch):
    from prefixcache.core.kv_cache_manager import KVCacheManager

    s = _Spy(KVCacheManager)

    def install(*modules):
        for m in modules:
            monkeypatch.setattr(m, "KVCacheManager", s)
        return s
    return install


def test_replay_hands_every_field_on(spy):
    from prefixcache.sim import replay as replay_mod

    s = spy(replay_mod)
    replay_mod.replay(_trace(), cache_config=FULL)
    _assert_handed_on(s.calls, FULL)
    # keywords override the config's fields and meet the same path
    s.calls.clear()
    replay_mod.replay(_trace(), cache_config=FULL, num_blocks=30, enable_caching=False,
                      num_host_blocks=0)
    _assert_handed_on(s.calls, FULL.replace(num_blocks=30, enable_caching=False,
                                            num_host_blocks=0))


def test_des_and_cluster_hand_every_field_on(spy):
    from prefixcache.sim import cluster, des

    s = spy(des, cluster)
    des.simulate(_trace(), cost_model=COST, cache_config=FULL)
    _assert_handed_on(s.calls, FULL)
    s.calls.clear()
    cluster.simulate_cluster(_trace(), num_replicas=2, router="round_robin",
                             cost_model=COST, cache_config=FULL)
    assert len(s.calls) == 2
    _assert_handed_on(s.calls, FULL)


def test_sim_drivers_size_a_byte_budget_and_refuse_what_they_cannot_run():
    from prefixcache.sim import des, replay

    per_block = COST.shape.kv_bytes_per_block(4)
    cfg = CacheConfig(kv_cache_bytes=per_block * 20, block_size=4)
    assert des.simulate(_trace(), cost_model=COST, cache_config=cfg)["requests"] == 6
    assert replay.replay(_trace(), cache_config=cfg, model="tiny")["num_blocks"] == 20
    with pytest.raises(ValueError, match="with_pool_blocks"):
        replay.replay(_trace(), cache_config=cfg)
    with pytest.raises(ValueError, match="needs the trace's future"):
        des.simulate(_trace(), cost_model=COST, cache_config=cfg.replace(eviction="belady"))
    with pytest.raises(ValueError, match="kv_cache_groups"):
        des.simulate(_trace(), cost_model=COST,
                     cache_config=cfg.replace(kv_cache_groups="full,sw8"))


def test_engine_takes_the_config(monkeypatch):
    from prefixcache.engine import engine as engine_mod

    # Every field reaches the engine's manager (or is the model's: the groups).
    assert set(FIELDS) == (set(engine_mod._ENGINE_CACHE)
                           | set(engine_mod._ENGINE_MANAGER_FIELDS)
                           | {"kv_cache_groups"})
    from prefixcache.model import ModelConfig

    import prefixcache.core as core

    cfg = FULL.replace(block_size=8, num_host_blocks=4, max_model_len=48)
    s = _Spy(core.KVCacheManager)
    monkeypatch.setattr(core, "KVCacheManager", s)
    eng = engine_mod.Engine(ModelConfig.tiny(), cache_config=cfg, max_num_seqs=2,
                            max_num_batched_tokens=32)
    _assert_handed_on(s.calls, cfg)
    assert eng.num_blocks == 24 and eng.block_size == 8
    # a cache keyword given with a non-default value overrides the field
    s.calls.clear()
    engine_mod.Engine(ModelConfig.tiny(), cache_config=cfg, hash_algo="xxhash", model=eng.model)
    _assert_handed_on(s.calls, cfg.replace(hash_algo="xxhash"))
    with pytest.raises(ValueError, match="must group the model.s layers as the model attends"):
        engine_mod.Engine(ModelConfig.tiny(), cache_config=cfg.replace(kv_cache_groups="full"))
    with pytest.raises(ValueError, match="not both"):
        engine_mod.Engine(ModelConfig.tiny(), cache_config=cfg,
                          manager_kwargs={"free_order": "append"})


def _driver_signatures():
    """Every driver and manager class that takes cache keywords, by name."""
    from prefixcache.core.hybrid import HybridKVCacheManager
    from prefixcache.core.kv_cache_manager import HashKVCacheManager, KVCacheManager
    from prefixcache.core.radix import RadixKVCacheManager
    from prefixcache.core.radix_hybrid import RadixHybridKVCacheManager
    from prefixcache.engine.engine import Engine
    from prefixcache.sim.cluster import simulate_cluster
    from prefixcache.sim.des import simulate
    from prefixcache.sim.replay import replay

    fns = {"replay": replay, "des.simulate": simulate, "simulate_cluster": simulate_cluster,
           "Engine": Engine.__init__, "KVCacheManager": KVCacheManager.__init__}
    for cls in (HashKVCacheManager, RadixKVCacheManager, HybridKVCacheManager,
                RadixHybridKVCacheManager):
        fns[cls.__name__] = cls.__init__
    return {name: inspect.signature(fn).parameters for name, fn in fns.items()}


def test_driver_keyword_defaults_are_the_config_defaults():
    # One table of defaults: a driver keyword named as a CacheConfig field is either
    # UNSET (the config's field applies) or spells exactly the field's default, so a
    # default changed in CacheConfig cannot silently differ in one driver.
    defaults = {f.name: f.default for f in dataclasses.fields(CacheConfig)}
    from prefixcache.engine import engine as engine_mod

    assert engine_mod._ENGINE_CACHE == {k: defaults[k] for k in engine_mod._ENGINE_CACHE}
    checked = set()
    for driver, params in _driver_signatures().items():
        for name, p in params.items():
            if name not in defaults or p.default is inspect.Parameter.empty:
                continue
            checked.add((driver, name))
            if name == "index" and driver.startswith("Radix"):
                assert p.default == "radix"  # (the radix index's own classes)
                continue
            assert p.default is cc.UNSET or p.default == defaults[name], (driver, name)
    # (the check sees every driver: each takes the pool's block size or the policy)
    managers = {"HashKVCacheManager", "RadixKVCacheManager", "HybridKVCacheManager",
                "RadixHybridKVCacheManager"}
    assert {d for d, _ in checked} == set(_driver_signatures()) - managers
    # The index and layout classes spell no default: they read the one table.
    from prefixcache.core.kv_cache_manager import MANAGER_DEFAULTS

    for name in managers:
        params = _driver_signatures()[name]
        assert [p.kind for p in params.values()][-1] is inspect.Parameter.VAR_KEYWORD
        assert not set(params) & set(defaults) - {"num_blocks", "block_size"}, name
    assert {k: v for k, v in MANAGER_DEFAULTS.items() if k in defaults} == {
        k: defaults[k] for k in MANAGER_DEFAULTS if k in defaults}
