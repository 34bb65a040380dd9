"""The "Extending" recipes (docs/extending.md, summed up in the README), each followed
with a toy plug-in defined here.

Every registry is read-only (a ``MappingProxyType``) and no test edits one: a toy is
registered the way a user's own package registers it without editing ours -- its class
(or record, or instance) where a name goes (``CacheConfig(eviction=Toy)``,
``simulate_cluster(router=Toy)``, ``paged_attention(backend=record)``), or a NEW
registry from a ``register_*`` function handed to the call (``register_backend``,
``register_serializer``, ``datasets.path_of(registry=...)``). The toys then run through
the public entry points only.
"""

from __future__ import annotations

import hashlib
import json
import types

import numpy as np
import pytest

from prefixcache import CacheConfig
from prefixcache.sim.trace import TraceRequest


def _trace(n=8):
    # Two families of prompts sharing a 2-block prefix each.
    return [TraceRequest(id=str(i), prompt=[1 + i % 2] * 8 + [100 + i] * 4, output_len=2,
                         timestamp=0.01 * i) for i in range(n)]


# ------------------------------------------------------------------ eviction policy
def _newest_first():
    from prefixcache.core.eviction.base import KeyedPolicy

    class NewestFirst(KeyedPolicy):
        """Evict the most recently cached candidate first (MRU by cache time)."""

        name = "newest_first"

        def key(self, block):
            return -self.cached_at[block.block_id]

    return NewestFirst


def test_eviction_policy_recipe():
    from prefixcache.sim.replay import replay

    NewestFirst = _newest_first()
    # prefix A (2 blocks), three unique prompts (3 blocks each), A again: LRU evicts A
    # (the oldest), the toy evicts the newest and keeps A's 8 tokens for the last one.
    trace = [TraceRequest(id="a0", prompt=[7] * 8 + [1], output_len=1)]
    trace += [TraceRequest(id=f"u{i}", prompt=[10 + i] * 12, output_len=1) for i in range(3)]
    trace += [TraceRequest(id="a1", prompt=[7] * 8 + [2], output_len=1)]
    cfg = CacheConfig(num_blocks=6, block_size=4, eviction=NewestFirst)
    hits = {}
    toy = replay(trace, cache_config=cfg,
                 on_record=lambda r: hits.__setitem__(r["id"], r["num_computed_tokens"]))
    assert toy["eviction"] == "newest_first" and toy["evictions"] > 0
    assert hits["a1"] == 8
    assert cfg.to_dict()["eviction"] == "newest_first"  # provenance rows: its name
    lru_hits = {}
    replay(trace, cache_config=cfg.replace(eviction="lru"),
           on_record=lambda r: lru_hits.__setitem__(r["id"], r["num_computed_tokens"]))
    assert lru_hits["a1"] == 0
    # Not needing the future, it runs in the host tier too, under every index.
    for index in ("hash", "radix"):
        s = replay(trace, cache_config=cfg.replace(num_host_blocks=4, index=index,
                                                   host_eviction=NewestFirst))
        assert s["host_eviction"] == "newest_first" and s["host_blocks_stored"] > 0


def test_offline_policy_is_known_by_its_property_not_its_name():
    from prefixcache.core.eviction import online_policy_names
    from prefixcache.core.eviction.belady import BeladyPolicy
    from prefixcache.serve.cli import parse_args
    from prefixcache.sim import des

    class Oracle(BeladyPolicy):
        name = "oracle"

    with pytest.raises(ValueError, match="oracle needs the trace's future"):
        des.simulate(_trace(), cost_model=des.CostModel.create("tiny", "h100"),
                     num_blocks=8, block_size=4, eviction=Oracle)
    with pytest.raises(ValueError, match="host_eviction='oracle' needs the trace's future"):
        CacheConfig(num_host_blocks=2, host_eviction=Oracle)
    # The server offers exactly the registered policies that need no future.
    assert "belady" not in online_policy_names()
    for name in online_policy_names():
        assert parse_args(["serve", "tiny", "--eviction", name]).eviction == name
    with pytest.raises(SystemExit):
        parse_args(["serve", "tiny", "--eviction", "belady"])


# --------------------------------------------------------------------------- router
def test_router_recipe():
    from prefixcache.cost_model import CostModel
    from prefixcache.sim.cluster import simulate_cluster
    from prefixcache.sim.routing.base import Router

    class FirstReplica(Router):
        name = "first_replica"

        def route(self, request, loads, now):
            return 0

    s = simulate_cluster(_trace(), num_replicas=3, router=FirstReplica,
                         cost_model=CostModel.create("tiny", "h100"),
                         cache_config=CacheConfig(num_blocks=32, block_size=4))
    assert [r["requests"] for r in s["per_replica"]] == [8, 0, 0]


# ---------------------------------------------------------------- scheduling policy
def test_scheduling_policy_recipe():
    from prefixcache.cost_model import CostModel
    from prefixcache.scheduling.base import WaitingPolicy
    from prefixcache.sim import des

    class LastComeFirst(WaitingPolicy):
        name = "lcfs"

        def order(self, waiting, request_of, manager):
            return list(reversed(waiting))

    # All arrive at once into a one-sequence server: LCFS serves the last one first.
    reqs = [TraceRequest(id=str(i), prompt=[i + 1] * 8, output_len=1, timestamp=0.0)
            for i in range(4)]
    for policy in (LastComeFirst, LastComeFirst()):  # the class, or a built instance
        done = []
        des.simulate(reqs, cost_model=CostModel.create("tiny", "h100"), num_blocks=32,
                     block_size=4, scheduler=des.SchedulerConfig(max_num_seqs=1),
                     scheduling=policy, on_record=lambda r, done=done: done.append(r["id"]))
        assert done[0] == "3" and sorted(done) == ["0", "1", "2", "3"]


# ------------------------------------------------------------------- kernel backend
def test_kernel_backend_recipe():
    import prefixcache_kernels as kernels

    calls = []

    def toy_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                      sm_scale, sliding_window=None, soft_cap=None, kv_scales=None):
        """Attends to nothing: zeros (a toy; a real backend computes the reference's
        result, `ragged_paged_attention_reference`)."""
        calls.append((q.shape, sm_scale))
        return q * 0

    def only_f32_pages(query):
        if np.dtype(query.kv_dtype) != np.float32:
            return f"toy reads float32 pages only, got {np.dtype(query.kv_dtype)}"
        return None

    toy = kernels.KernelBackend("toy", toy_attention, platforms=("npu",), check=only_f32_pages)
    backends = kernels.register_backend(toy)
    assert "toy" not in kernels.KERNEL_BACKENDS  # the built-in registry is unchanged
    # Selection by name and by "auto" on its platform; the reference elsewhere.
    assert kernels.resolve_backend("auto", platform="npu", backends=backends) == "toy"
    assert kernels.resolve_backend("auto", platform="cpu", backends=backends) == "reference"
    with pytest.raises(ValueError, match="backend 'toy' needs a npu device"):
        kernels.resolve_backend("toy", platform="cpu", backends=backends)
    static = dict(page_size=16, head_dim=64, num_q_heads=4, num_kv_heads=2,
                  q_dtype=np.float32, platform="npu", backends=backends)
    assert kernels.check_backend_config("toy", kv_dtype=np.float32, **static) == "toy"
    with pytest.raises(ValueError, match="toy reads float32 pages only"):
        kernels.check_backend_config("toy", kv_dtype="bfloat16", **dict(static, q_dtype="bfloat16"))
    with pytest.raises(ValueError, match="unknown backend 'toy'"):  # not registered there
        kernels.check_backend_config("toy", kv_dtype=np.float32,
                                     **dict(static, backends=kernels.KERNEL_BACKENDS))
    # paged_attention validates the arrays, then calls the record's function; the record
    # itself may be given as the backend too (here one whose platforms are every
    # platform, so it runs on this test's CPU).
    import dataclasses

    here = dataclasses.replace(toy, platforms=())
    q = np.ones((5, 4, 64), np.float32)
    args = (q, np.zeros((3, 16, 4, 64), np.float32), np.array([5], np.int32),
            np.array([[0, 1]], np.int32), np.array([0, 5], np.int32), np.array([1], np.int32))
    out = kernels.paged_attention(*args, sm_scale=0.125, backend=here)
    assert calls == [((5, 4, 64), 0.125)] and not np.asarray(out).any()
    with pytest.raises(ValueError, match="do not fit backend 'toy'"):  # it takes no tiles
        kernels.paged_attention(*args, sm_scale=0.125, backend=here,
                                block_sizes=kernels.TPUBlockSizes())


# ------------------------------------------------------------------ hash serializer
def test_hash_serializer_recipe():
    from prefixcache.core import hashing
    from prefixcache.core.request import Request

    class JSONSerializer(hashing.HashSerializer):
        """Canonical JSON of the key (bytes as hex): a toy, not vLLM-compatible."""

        name = "json"

        def dumps(self, obj):
            def enc(v):
                if isinstance(v, bytes):
                    return {"b": v.hex()}
                if isinstance(v, tuple):
                    return [enc(x) for x in v]
                return v

            return json.dumps(enc(obj), separators=(",", ":")).encode()

    toy = JSONSerializer()
    serializers = hashing.register_serializer(toy)
    assert "json" not in hashing.SERIALIZERS  # the built-in registry is unchanged
    assert hashing.hash_algo_names(serializers) == (
        "sha256", "sha256_cbor", "sha256_json", "xxhash", "xxhash_cbor", "xxhash_json")
    with pytest.raises(ValueError, match="unknown hash algorithm 'sha256_json'"):
        hashing.BlockHasher("sha256_json")  # not in the built-in registry
    h = hashing.BlockHasher("sha256_json", seed=0, serializers=serializers)
    assert h.serializer is toy and h.root == hashlib.sha256(toy.dumps("0")).digest()
    tokens = list(range(40))
    # The spec: digest = H(dumps((parent, tuple(ids), extra_keys))), chained.
    want, parent = [], h.root
    for b in range(2):
        extra = (("cache_salt", "s"),) if b == 0 else None
        key = (parent, tuple(tokens[16 * b:16 * b + 16]), extra)
        parent = hashlib.sha256(toy.dumps(key)).digest()
        want.append(parent)
    assert h.hash_token_blocks(tokens, 16, cache_salt="s") == want
    # A request (its decode path too) hashes through the same spec.
    req = Request("r", tokens[:20], cache_salt="s", hasher=h, block_size=16)
    req.append_output_token_ids(list(range(20, 32)))
    assert list(req.block_hashes) == want
    # The same key under another serializer is another digest (no "not CBOR = pickle").
    pickled = hashing.BlockHasher("sha256", seed=0)
    assert pickled.hash_token_blocks(tokens, 16, cache_salt="s") != want
    with pytest.raises(ValueError, match="already registered"):
        hashing.register_serializer(toy, serializers)


# -------------------------------------------------------------------- index / tier
def _counting_index():
    # A user's own index: the radix tree that counts its lookups, with its own
    # implementation for sliding-window layouts (LAYOUT_CLASS / LAYOUT_KINDS).
    from prefixcache.core.radix import RadixKVCacheManager
    from prefixcache.core.radix_hybrid import RadixHybridKVCacheManager

    class Counting:
        lookups = 0

        def find_longest_cache_hit(self, request):
            self.lookups += 1
            return super().find_longest_cache_hit(request)

    class CountingRadixLayouts(Counting, RadixHybridKVCacheManager):
        pass

    class CountingRadix(Counting, RadixKVCacheManager):
        INDEX_NAME = "counting_radix"
        LAYOUT_CLASS = CountingRadixLayouts
        LAYOUT_KINDS = ("full_attention", "sliding_window")

    return CountingRadix, CountingRadixLayouts


def test_index_recipe():
    # An index of the user's own package, through every driver; no registry edited.
    from prefixcache.core import KVCacheManager, Request
    from prefixcache.core.indexes import INDEXES
    from prefixcache.core.kv_cache_blocks import KVCacheBlocks
    from prefixcache.core.kv_cache_manager import HashKVCacheManager
    from prefixcache.cost_model import CostModel
    from prefixcache.sim import compare, des
    from prefixcache.sim.cluster import simulate_cluster
    from prefixcache.sim.replay import replay

    CountingRadix, CountingRadixLayouts = _counting_index()
    assert "counting_radix" not in INDEXES
    m = KVCacheManager(8, 4, index=CountingRadix, eviction=_newest_first())
    assert type(m.implementation) is CountingRadix and m.index == "counting_radix"
    r = Request("a", list(range(9)))
    blocks, hit = m.get_computed_blocks(r)
    # (the index's own attributes are read on the implementation; its methods are bound)
    assert isinstance(blocks, KVCacheBlocks) and hit == 0 and m.implementation.lookups == 1
    assert isinstance(m.allocate_slots(r, 9, hit, blocks), KVCacheBlocks)
    m.free(r)
    m.check_invariants()

    # CacheConfig and replay: the same hits as the registered radix index, its name shown.
    trace = _trace()
    cfg = CacheConfig(num_blocks=32, block_size=4, index=CountingRadix)
    assert cfg.to_dict()["index"] == "counting_radix"
    for groups in (None, "full,sw8"):
        toy = replay(trace, cache_config=cfg.replace(kv_cache_groups=groups))
        ref = replay(trace, cache_config=cfg.replace(kv_cache_groups=groups, index="radix"))
        assert toy["index"] == "counting_radix" and toy["hit_tokens"] == ref["hit_tokens"] > 0
    sliding = cfg.replace(kv_cache_groups="full,sw8").kv_cache_groups
    layouts = KVCacheManager(32, 4, index=CountingRadix, kv_cache_groups=sliding)
    assert type(layouts.implementation) is CountingRadixLayouts
    assert layouts.index == "counting_radix"
    row = compare.cell_row(toy, policy="lru", index=CountingRadix, num_blocks=32,
                           block_size=4, concurrency=1)
    assert row["index"] == "counting_radix"
    # The simulators.
    cost = CostModel.create("tiny", "h100")
    s = des.simulate(trace, cost_model=cost, cache_config=cfg)
    assert s["requests"] == len(trace)
    s = simulate_cluster(trace, num_replicas=2, router="round_robin", cost_model=cost,
                         cache_config=cfg)
    assert sum(r["requests"] for r in s["per_replica"]) == len(trace)

    # An index serving one full-attention group only is refused for other layouts by
    # the one rule, with its reason.
    class PlainToy(HashKVCacheManager):
        INDEX_NAME = "plain_toy"

    why = ("index='plain_toy' is not supported with KV cache groups other than one "
           "full-attention group: the index's class matches one chain")
    with pytest.raises(ValueError, match=why):
        KVCacheManager(8, 4, index=PlainToy, kv_cache_groups=sliding)
    with pytest.raises(ValueError, match=why):
        replay(trace, cache_config=cfg.replace(index=PlainToy, kv_cache_groups=sliding))
    assert replay(trace, cache_config=cfg.replace(index=PlainToy))["index"] == "plain_toy"


def test_index_recipe_bad_classes_are_refused_before_anything_is_built():
    from prefixcache.core import KVCacheManager
    from prefixcache.core.kv_cache_manager import HashKVCacheManager

    class Nameless:
        pass

    class Unnamed(HashKVCacheManager):  # inherits the registered "hash"
        pass

    class Taken(HashKVCacheManager):
        INDEX_NAME = "radix"

    class NoProtocol:
        INDEX_NAME = "no_protocol"

        def find_longest_cache_hit(self, request):
            return None

    class HalfLayout(HashKVCacheManager):
        INDEX_NAME = "half_layout"
        LAYOUT_CLASS = HashKVCacheManager

    for bad, match in [(3, "index.* 3"), (object(), "index.* <object object"),
                       (Nameless, "needs an INDEX_NAME"),
                       (Unnamed, "INDEX_NAME='hash' is the registered index's name"),
                       (Taken, "INDEX_NAME='radix' is the registered index's name"),
                       (NoProtocol, "lacks the manager protocol: no allocate_slots, free, "
                                    "check_invariants"),
                       (HalfLayout, "LAYOUT_KINDS must be a tuple")]:
        with pytest.raises(ValueError, match=match):
            KVCacheManager(8, 4, index=bad)
        with pytest.raises(ValueError, match=match):
            CacheConfig(num_blocks=8, index=bad)
    # The registered classes are the registered indexes.
    assert KVCacheManager(8, 4, index=HashKVCacheManager).index == "hash"
    assert CacheConfig(index=HashKVCacheManager).to_dict()["index"] == "hash"


def test_engine_takes_an_index_class():
    from prefixcache.engine import Engine, SamplingParams
    from prefixcache.model import ModelConfig

    CountingRadix, _ = _counting_index()
    eng = Engine(ModelConfig.tiny(), cache_config=CacheConfig(num_blocks=16, block_size=8,
                                                              index=CountingRadix),
                 max_num_seqs=2, max_num_batched_tokens=32)
    assert type(eng.kv_cache_manager.implementation) is CountingRadix
    eng.generate([[1, 2, 3, 4, 5, 6]] * 2, SamplingParams(max_tokens=2))
    assert eng.kv_cache_manager.implementation.lookups >= 2


def test_tier_recipe_host_policy():
    # Today's tier seam is its policy: any policy without the future, a toy's class too.
    from prefixcache.core import KVCacheManager, Request

    m = KVCacheManager(4, 2, num_host_blocks=4, host_eviction=_newest_first())
    for i in range(4):
        r = Request(str(i), [i * 10 + k for k in range(5)])
        blocks, hit = m.get_computed_blocks(r)
        assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
        m.free(r)
        m.check_invariants()
    assert m.host_blocks_stored > 0 and m.host_tier.policy.name == "newest_first"


def _slow_memory(latency_s):
    from prefixcache.core.tiers import KeyTier, TierLink

    class SlowMemory(KeyTier):
        """A toy slow-memory tier under the host: exclusive, its own link."""

        name = "slow"
        medium = "SLOW"
        link = TierLink(1e9, latency_s)

    return SlowMemory


def test_tier_recipe_toy_slow_memory_through_replay_and_des():
    # A tier of one's own: a KeyTier subclass passed where a tier name goes, no edit of
    # prefixcache/. Eight prompt families, each seen twice, through a 4-block device pool
    # and a 2-slot host: the second visits hit the toy tier.
    from prefixcache.cost_model import CostModel
    from prefixcache.sim import des
    from prefixcache.sim.replay import replay

    trace = [TraceRequest(id=str(i), prompt=[1 + i % 8] * 8 + [100 + i] * 3, output_len=2,
                          timestamp=0.5 * i) for i in range(16)]
    ttft = {}
    for latency in (1e-4, 1.0):
        cfg = CacheConfig(num_blocks=4, block_size=4, num_host_blocks=2, page_bytes=1024,
                          tiers=({"tier": _slow_memory(latency), "num_blocks": 64},))
        s = replay(trace, cache_config=cfg)
        assert s["hit_tokens_by_tier"]["slow"] > 0
        assert sum(s["hit_tokens_by_tier"].values()) == s["hit_tokens"]
        assert s["tiers"]["slow"]["link"]["latency_s"] == latency
        d = des.simulate(trace, cost_model=CostModel.create("tiny", "h100",
                                                            host_link="h200_pcie5"),
                         cache_config=cfg)
        assert d["hit_tokens_by_tier"]["slow"] > 0
        ttft[latency] = d["ttft_s"]["mean"]
    assert ttft[1.0] > ttft[1e-4] + 0.1  # the DES charges the toy tier's own link
    assert cfg.to_dict()["tiers"] == [{"tier": "SlowMemory", "num_blocks": 64}]


# ------------------------------------------------------------------------- dataset
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


# ------------------------------------------------------------ time-varying policy
def _stale_first():
    import math

    from prefixcache.core.eviction.base import TimedPolicy

    class StaleFirst(TimedPolicy):
        """Blocks cached more than ``max_age`` ago go first (an insertion TTL: hits do
        not refresh it), LRU among each class: one method, ``priority(block, now)``."""

        name = "stale_first"

        def __init__(self, num_blocks, *, max_age=2, unit="steps"):
            super().__init__(num_blocks, unit=unit)
            self.max_age = max_age
            self.born = [0.0] * num_blocks

        def on_cached(self, block, block_hash, request, position):
            super().on_cached(block, block_hash, request, position)
            self.born[block.block_id] = self.now

        def priority(self, block, now):
            bid = block.block_id
            stale_at = self.born[bid] + self.max_age
            if now > stale_at:  # stale: stays so (until it is cached again)
                return (0, self.released_at[bid]), math.inf
            return (1, self.released_at[bid]), stale_at

    return StaleFirst


def test_time_varying_policy_recipe():
    from prefixcache import cost_model as cm
    from prefixcache.core import KVCacheManager, Request
    from prefixcache.engine.sampling_params import SamplingParams
    from prefixcache.engine.scheduler import EngineRequest, Scheduler
    from prefixcache.sim.des import simulate
    from prefixcache.sim.replay import replay

    StaleFirst = _stale_first()
    # A hot prefix A (2 blocks) alternating with unique prompts: LRU keeps A; the toy
    # evicts it once it was cached more than 2 requests ago (the replay's clock: the
    # request index), so the later A requests lose their hits.
    trace = []
    for i in range(4):
        trace.append(TraceRequest(id=f"a{i}", prompt=[7] * 8 + [i + 1], output_len=1))
        trace.append(TraceRequest(id=f"u{i}", prompt=[10 + i] * 8 + [1], output_len=1))
    hits = {}
    for ev in ("lru", StaleFirst):
        got = hits[ev if isinstance(ev, str) else ev.name] = {}
        replay(trace, cache_config=CacheConfig(num_blocks=6, block_size=4, eviction=ev,
                                               free_order="unhashed_first"),
               on_record=lambda r, got=got: got.__setitem__(r["id"], r["num_computed_tokens"]))
    assert [hits["lru"][f"a{i}"] for i in range(4)] == [0, 8, 8, 8]
    assert [hits["stale_first"][f"a{i}"] for i in range(4)] == [0, 8, 4, 0]
    # The DES and the engine's scheduler tell it their clocks (steps here).
    toy = cm.ModelShape(num_layers=1, d_model=4, num_q_heads=2, num_kv_heads=1, head_dim=2,
                        ffn_dim=8, vocab_size=10, dtype_bytes=2)
    s = simulate([TraceRequest(r.id, r.prompt, r.output_len, timestamp=float(i))
                  for i, r in enumerate(trace)],
                 cost_model=cm.CostModel(toy, cm.Accelerator("toy", peak_flops=1000.0,
                                                             hbm_bandwidth=1e30,
                                                             hbm_bytes=1e6)),
                 cache_config=CacheConfig(num_blocks=6, block_size=4, eviction=StaleFirst))
    assert s["finished"] == len(trace)
    m = KVCacheManager(6, 4, eviction=StaleFirst)
    sched = Scheduler(m, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64)
    sched.add_request(EngineRequest(Request("e", [1, 2, 3, 4, 5]),
                                    SamplingParams(max_tokens=3), seed=0))
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, {r.request_id: 9 for r in out.scheduled
                                       if r.completes_sequence})
    assert m.policy.now == 2  # told before each step: steps 0, 1, 2


# ----------------------------------------------- the recipes in the Engine and server
def _server_thread(app):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent / "serve" / "serve_support.py"
    spec = importlib.util.spec_from_file_location("_serve_support_for_recipes", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ServerThread(app)


def test_index_tier_and_time_varying_policy_recipes_serve_through_the_engine_and_server():
    # The toy index, the toy slow-memory tier and the toy time-varying policy together
    # in one Engine, driven through the OpenAI-compatible server: no edit of prefixcache/.
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from prefixcache.engine import Engine
    from prefixcache.model import ModelConfig
    from prefixcache.serve.app import build_app

    CountingRadix, _ = _counting_index()
    cfg = CacheConfig(num_blocks=12, block_size=8, index=CountingRadix,
                      eviction=_stale_first(), num_host_blocks=2,
                      tiers=({"tier": _slow_memory(1e-4), "num_blocks": 64},))
    eng = Engine(ModelConfig.tiny(), cache_config=cfg, max_num_seqs=2,
                 max_num_batched_tokens=64)
    srv = _server_thread(build_app(eng, served_model_name="tiny", tokenizer=None))
    try:
        # Five 3-block prompt families, twice: 12 device blocks and 2 host slots cannot
        # keep them, so the second round hits blocks demoted to the toy tier.
        families = [[f * 10 + k for k in range(24)] for f in range(1, 6)]
        cached = []
        for rnd in range(2):
            for fam in families:
                body = {"model": "tiny", "prompt": fam + [99, 98, rnd], "max_tokens": 2,
                        "temperature": 0}
                r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
                cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached[:5] == [0] * 5 and all(c == 24 for c in cached[5:])
        by_tier = {}
        for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
            for s in fam.samples:
                if s.name == "prefixcache:prefix_cache_hits_total" and "tier" in s.labels:
                    by_tier[s.labels["tier"]] = s.value
        assert by_tier["slow"] > 0 and sum(by_tier.values()) == sum(cached)
        impl, policy = srv.on_engine(lambda e: (e.kv_cache_manager.implementation,
                                                e.kv_cache_manager.policy))
        assert type(impl) is CountingRadix and impl.lookups >= 10
        assert policy.name == "stale_first" and policy.now > 0  # the engine's step clock
    finally:
        srv.close()


# --------------------------------------------------------------------- group kind
def _toy_kind():
    import dataclasses

    from prefixcache.core.groups.full_attention import FullAttentionManager

    class CountingFullManager(FullAttentionManager):
        """Full attention's rules, counting the lookups it answers."""

        lookups = 0

        def find_longest_cache_hit(self, *args):
            type(self).lookups += 1
            return super().find_longest_cache_hit(*args)

    @dataclasses.dataclass(frozen=True)
    class CountingFullSpec:
        """A toy kind: full attention under a name of its own."""

        kind = "counting_full"
        manager_class = CountingFullManager

        @property
        def sliding_window(self) -> None:
            return None

    CountingFullManager.spec_class = CountingFullSpec
    return CountingFullSpec, CountingFullManager


def test_group_kind_recipe_needs_no_registry_edit():
    # A kind of one's own package: its spec class names its manager; then the layout
    # runs through the manager and the replay like a registered kind. (The Engine takes
    # its groups from the model's layers: a kind there is also the model's attention.)
    from prefixcache.core import KVCacheManager, Request
    from prefixcache.core import kv_groups
    from prefixcache.sim.replay import replay

    Spec, Manager = _toy_kind()
    assert "counting_full" not in kv_groups.GROUP_KINDS
    toy = (kv_groups.KVCacheGroup(kv_groups.FullAttentionSpec(), ["a"]),
           kv_groups.KVCacheGroup(Spec(), ["b"]))
    ref = kv_groups.parse_kv_groups("full,full")
    m = KVCacheManager(32, 4, kv_cache_groups=toy)
    assert [type(k) for k in m.implementation._kinds][1] is Manager
    r = Request("r", list(range(21)))
    m.get_computed_blocks(r)
    assert Manager.lookups == 1
    trace = _trace(12)
    got = {}
    for name, layout in (("toy", toy), ("ref", ref)):
        cfg = CacheConfig(num_blocks=24, block_size=4, kv_cache_groups=layout)
        s = replay(trace, cache_config=cfg)
        got[name] = (s["hit_tokens"], s["evictions"])
    assert got["toy"] == got["ref"] and got["toy"][0] > 0
    assert Manager.lookups > 1

    class Stray:  # a manager_class that is not a single-type manager
        kind = "stray"
        manager_class = object

    with pytest.raises(TypeError, match="Stray.manager_class must be a SingleTypeManager"):
        kv_groups.KVCacheGroup(Stray(), ["c"])

    class Taken(Spec):  # a registered kind's name
        kind = "sliding_window"

    with pytest.raises(ValueError, match="registered group kind's name"):
        kv_groups.KVCacheGroup(Taken(), ["c"])


def test_group_kind_recipe_serves_through_the_engine_and_server():
    # The toy kind in place of a sliding-window model's full-attention group, through
    # the Engine and the OpenAI-compatible server: the same tokens and hits as the
    # model's own layout, the toy manager answering the full group's lookups.
    import httpx

    from prefixcache.core.kv_groups import KVCacheGroup
    from prefixcache.engine import Engine, SamplingParams, model_kv_cache_groups
    from prefixcache.model import ModelConfig
    from prefixcache.serve.app import build_app

    Spec, Manager = _toy_kind()
    model = ModelConfig.tiny_hybrid()
    own = tuple(KVCacheGroup(Spec(), g.layer_names) if g.spec.sliding_window is None else g
                for g in model_kv_cache_groups(model))
    assert [type(g.spec) for g in own].count(Spec) == 1
    kw = dict(num_blocks=48, block_size=4)
    run = dict(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=96)
    ref = Engine(model, cache_config=CacheConfig(**kw), **run)
    eng = Engine(model, cache_config=CacheConfig(**kw, kv_cache_groups=own),
                 share_programs_with=ref, **run)
    assert [type(k) for k in eng.kv_cache_manager.implementation._kinds].count(Manager) == 1
    prompts = [[5 + i % 2] * 12 + [40 + i] * 3 for i in range(4)]
    sp = SamplingParams(max_tokens=3, temperature=0.0)
    got = {}
    for name, e in (("ref", ref), ("own", eng)):
        outs = [e.generate([p], sp)[0] for p in prompts]
        got[name] = [(o.token_ids, o.metrics.num_cached_tokens) for o in outs]
    assert got["own"] == got["ref"] and sum(c for _, c in got["own"]) > 0
    lookups = Manager.lookups
    assert lookups > 0
    srv = _server_thread(build_app(eng, served_model_name="tiny", tokenizer=None))
    try:
        body = {"model": "tiny", "prompt": prompts[0], "max_tokens": 3, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert Manager.lookups > lookups
    finally:
        srv.close()
