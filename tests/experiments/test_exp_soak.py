"""experiments.soak: the short soak passes (CI), and its checks catch what they claim to.

The long soak (10^6 manager operations, 5,000 engine requests) runs only when
PREFIXCACHE_LONG_SOAK=1 is set (minutes).
"""

import importlib.util
import json
import os
import pathlib

import pytest

from experiments import soak
from prefixcache.core.block_pool import InvariantError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def config(tmp_path, **overrides):
    spec = importlib.util.spec_from_file_location("_cfg_soak", ROOT / "configs/soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.workdir = str(tmp_path / "work")
    for k, v in overrides.items():
        target = c
        *parts, last = k.split(".")
        for p in parts:
            target = target[p]
        target[last] = v
    return c


def test_short_soak_passes(tmp_path):
    c = config(tmp_path)
    out = soak.run(c)
    m, e = out["manager"], out["engine"]
    assert m["num_ops"] == 30_000 and m["invariant_checks"] == 5  # 0, 1e4, 2e4, 3e4, end
    assert all(m["op_counts"][k] > 0 for k in m["op_counts"])
    # Pressure and reuse really happened: refusals, preemptions, evictions, hits.
    assert m["failed_allocations"] > 0 and m["preempted"] > 0 and m["evictions"] > 0
    assert m["hit_tokens"] > 0 and m["resets_done"] > 0 and m["resets_refused"] > 0
    assert m["bad_calls_rejected"] == m["op_counts"]["bad_call"]
    assert not m["rss_checked"]  # too short for the RSS bound (see the config)
    assert e["num_requests"] == sum(e["outcomes"].values()) == 150
    assert e["pool_blocks"] <= 0.1 * e["demand_blocks"] + 1
    assert e["preemptions"] > 0 and e["outcomes"].get("abort", 0) > 0
    assert e["outcomes"].get("error", 0) > 0  # the planted rejections, with reasons
    work = pathlib.Path(c.workdir)
    lines = [json.loads(l) for l in (work / "results.jsonl").read_text().splitlines()]
    assert [l["part"] for l in lines] == ["manager", "engine"]
    assert all("provenance" in l for l in lines)
    assert (work / "soak_rss.png").stat().st_size > 0


def test_manager_soak_catches_a_leak(tmp_path, monkeypatch):
    """A free that forgets one request's blocks must fail the soak."""
    # NOTE: KVCacheManager binds its implementation's methods at construction: patch the
    # hash index's implementation class (the soak's default).
    from prefixcache.core.kv_cache_manager import HashKVCacheManager

    real_free = HashKVCacheManager.free
    calls = []

    def leaky_free(self, request):
        calls.append(1)
        if len(calls) == 50:
            return  # the blocks stay held
        real_free(self, request)

    monkeypatch.setattr(HashKVCacheManager, "free", leaky_free)
    c = config(tmp_path, **{"manager.num_ops": 3000, "manager.check_every": 1000})
    with pytest.raises((soak.SoakError, InvariantError)):
        soak.manager_soak(c.manager, seed=0)


def test_manager_soak_rss_bound_enforced(tmp_path, monkeypatch):
    """A run long enough for the RSS check fails when the RSS keeps growing."""
    grow = iter(range(100, 10_000, 10))
    monkeypatch.setattr(soak, "current_rss_mib", lambda: float(next(grow)))
    c = config(tmp_path, **{"manager.num_ops": 4000, "manager.check_every": 1000,
                            "manager.rss_min_ops": 4000})
    with pytest.raises(soak.SoakError, match="RSS grew by"):
        soak.manager_soak(c.manager, seed=0)
    # Peak after the warm-up against the peak up to its end (a trough at the warm-up's
    # end does not count as growth).
    assert soak.rss_growth([(0, 50.0), (10, 80.0), (20, 78.0), (30, 81.6)], 20) == (
        pytest.approx(0.02))
    assert soak.rss_growth([(0, 50.0), (10, 80.0), (20, 70.0), (30, 79.0)], 20) < 0
    assert soak.rss_growth([(0, 100.0)], 0) is None


def test_engine_soak_catches_a_lost_request(tmp_path, monkeypatch):
    from prefixcache.engine import Engine

    real_step = Engine.step
    dropped = []

    def lossy_step(self):
        outs = real_step(self)
        if outs and not dropped:
            dropped.append(outs.pop())
        return outs

    monkeypatch.setattr(Engine, "step", lossy_step)
    # Tiny shapes: one compiled program.
    c = config(tmp_path, **{"engine.num_requests": 6, "engine.inflight": 6,
                            "engine.reject_prob": 0.0, "engine.mm_prob": 0.0,
                            "engine.max_prompt_len": 16, "engine.max_tokens": 2,
                            "engine.max_model_len": 32, "engine.max_num_batched_tokens": 32,
                            "engine.token_buckets": (32,)})
    with pytest.raises(soak.SoakError, match="never came back"):
        soak.engine_soak(c.engine, seed=0)


@pytest.mark.parametrize("overrides, match", [
    ({"manager.num_ops": 0}, "manager.num_ops must be a positive int"),
    ({"manager.warmup_fraction": 1.0}, "warmup_fraction"),
    ({"manager.enable": False, "engine.enable": False}, "nothing to run"),
    ({"engine.max_tokens": 200}, "exceeds max_model_len"),
    ({"engine.abort_prob": 2.0}, "abort_prob must be in"),
])
def test_bad_config(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        soak.run(config(tmp_path, **overrides))
    assert not (tmp_path / "work" / "results.jsonl").exists()


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PREFIXCACHE_LONG_SOAK"),
                    reason="long soak (minutes): set PREFIXCACHE_LONG_SOAK=1")
def test_long_soak(tmp_path):
    out = soak.run(config(tmp_path, long=True))
    assert out["manager"]["num_ops"] == 1_000_000 and out["manager"]["rss_checked"]
    assert out["manager"]["rss_growth_after_warmup"] < 0.05
    assert out["engine"]["num_requests"] == 5000
