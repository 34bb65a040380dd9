"""Every long experiment's quick variant (``--config=configs/<x>.py:quick``) runs, with
the output shape of the full run, and the numbers config docstrings state are produced.

The Mooncake ones read the local trace copies (``local_datasets``: no network).
"""

import importlib
import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Configs with a quick variant (the long experiments).
QUICK = ("compare_policies", "compare_policies_mooncake_conversation",
         "compare_policies_mooncake_synthetic", "sweep_capacity", "host_tier",
         "host_tier_mooncake_conversation", "host_tier_mooncake_synthetic", "route",
         "route_mooncake_conversation", "route_mooncake_synthetic",
         "route_mooncake_synthetic_host", "route_llmd", "latency_by_prefix_mooncake",
         "audit_timing", "audit_timing_sim", "compare_policies_mooncake_conversation_study",
         "tiers", "tiers_mooncake_conversation", "tiers_mooncake_synthetic",
         *(f"compare_policies_{d}" for d in (
             "mooncake_toolagent", "bailian_to_c", "bailian_to_b", "bailian_thinking",
             "bailian_coder", "claude_code_subagents", "claude_code_no_subagents")))


def _module(name):
    spec = importlib.util.spec_from_file_location(f"_cfg_q_{name}", ROOT / "configs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _read(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


@pytest.mark.parametrize("name", QUICK)
def test_quick_variant_is_smaller_with_the_same_fields(name):
    mod = _module(name)
    full, quick = mod.get_config(), mod.get_config("quick")
    assert set(full.to_dict()) == set(quick.to_dict())  # the same fields: the same rows
    assert quick.to_dict() != full.to_dict()
    with pytest.raises(ValueError, match="unknown config variant 'fast'"):
        mod.get_config("fast")


def _run(module, name, tmp_path, **overrides):
    exp = importlib.import_module(f"experiments.{module}")
    c = _module(name).get_config("quick")
    c.workdir = str(tmp_path / name)
    for k, v in overrides.items():
        c[k] = v
    return exp.run(c), pathlib.Path(c.workdir)


def test_quick_compare_policies_mooncake(local_datasets, tmp_path):
    out, work = _run("compare_policies", "compare_policies_mooncake_conversation", tmp_path,
                     workers=2)
    rows = _read(out["rows"])
    assert len(rows) == 4 * 3 + 1  # lru, lfu, length, belady x 3 capacities + the ideal
    from prefixcache.sim import datasets  # noqa: PLC0415

    sha = datasets.get("mooncake_conversation").sha256
    assert {r["provenance"]["trace_checksum"]["sha256"] for r in rows} == {sha}
    assert rows[0]["provenance"]["trace_checksum"]["dataset"] == "mooncake_conversation"
    assert rows[0]["requests"] == 200 and (work / "compare_policies.png").stat().st_size
    assert (work / "compare_policies.cells.jsonl").is_file()


def test_quick_route_gives_the_documented_hit_rates(tmp_path):
    out, _ = _run("route", "route", tmp_path)
    hit = {(r["policy"], r["replicas"]): round(r["hit_rate_tokens"], 3) for r in out["rows"]}
    # configs/route.py, "Quick variant".
    assert {hit[(p, 1)] for p in ("random", "round_robin", "least_loaded", "session",
                                  "cache_aware", "kv_events")} == {0.434}
    assert hit[("cache_aware", 4)] == hit[("kv_events", 4)] == 0.831
    assert hit[("session", 4)] == 0.811
    for p in ("random", "round_robin", "least_loaded"):
        assert 0.38 <= hit[(p, 4)] <= 0.46, (p, hit[(p, 4)])


def test_layout_gives_the_documented_numbers(tmp_path):
    from experiments import layout  # noqa: PLC0415

    c = _module("layout").get_config()
    c.workdir = str(tmp_path / "layout")
    layout.run(c)
    rows = {r["layout"]: r for r in _read(tmp_path / "layout" / "layout.jsonl")}
    first, last = rows["stable_first"], rows["stable_last"]
    # configs/layout.py, "Expected".
    assert (first["hit_tokens"], first["prompt_tokens"]) == (2_046_976, 2_620_378)
    assert last["hit_tokens"] == 0
    assert (first["evictions"], last["evictions"]) == (35_729, 163_665)
    assert round(first["ttft_mean_s"] * 1e3, 2) == 5.21
    assert round(last["ttft_mean_s"] * 1e3, 2) == 18.94


def test_quick_sim_experiments_run(local_datasets, tmp_path):
    out, work = _run("audit_timing", "audit_timing_sim", tmp_path)
    assert len(out["scenarios"]) == 7 and (work / "audit_timing.png").stat().st_size
    out, work = _run("sweep_capacity", "sweep_capacity", tmp_path)
    assert len(out["rows"]) == 4 * 2
    out, work = _run("latency_by_prefix", "latency_by_prefix_mooncake", tmp_path)
    assert out["simulated"][0]["ttft_s"]["count"] == 200


# The engine audit's quick variant trimmed for CI (measured ~8 s wall, ~10 s CPU, on
# the shared 2-core machine; the untrimmed quick variant took ~50 s): 2 probes per
# class, 1 warm-up trial, 64-token secrets and public prompt, two token buckets --
# every scenario still runs, so the rows and files have the full run's shape.
AUDIT_ENGINE_CI = {"num_probes": 2, "warmup_trials": 1, "secret_len": 64, "public_len": 64,
                   "noise_prompt_len": (16, 64), "ordering_noise_len": 64,
                   "ordering_burst": 2, "num_blocks": 128,
                   "engine.token_buckets": (64, 256), "engine.max_num_batched_tokens": 256,
                   "engine.max_model_len": 256, "engine.page_buckets": (16,)}


def test_quick_audit_timing_engine_trimmed(tmp_path):
    from experiments import audit_timing  # noqa: PLC0415

    c = _module("audit_timing").get_config("quick")
    c.workdir = str(tmp_path / "audit")
    for k, v in AUDIT_ENGINE_CI.items():  # as --config.<k>=<v> overrides
        target = c
        *parts, last = k.split(".")
        for p in parts:
            target = target[p]
        target[last] = v
    assert c.backend == "engine"
    out = audit_timing.run(c)
    work = pathlib.Path(c.workdir)
    names = list(audit_timing.SCENARIOS)
    assert sorted(out["scenarios"]) == sorted(names) and out["skipped_scenarios"] == {}
    rows = _read(work / "results.jsonl")
    assert rows[0]["record"] == "provenance"  # provenance once per file
    assert "provenance" not in rows[1] and "provenance" not in rows[-1]
    pid = rows[0]["provenance_id"]
    probes = [r for r in rows if r["record"] == "probe"]
    summaries = {r["scenario"]: r for r in rows if r["record"] == "scenario"}
    assert len(probes) == len(names) * 2 * c.num_probes
    assert {r["provenance_id"] for r in rows[1:]} == {pid}
    assert len({frozenset(r) for r in probes}) == 1  # one row shape
    assert set(summaries) == set(names)
    for name, s in summaries.items():
        assert set(s) == {"record", "scenario", "backend", "provenance_id",
                          *out["scenarios"][name]}
        assert {k: s[k] for k in out["scenarios"][name]} == out["scenarios"][name]
        assert (s["n_hit"], s["n_miss"]) == (c.num_probes, c.num_probes)
    # What the cache does is exact (timing is not asserted): no salt, every hit guess
    # reuses the victim's secret; a per-tenant salt, no cross-tenant hit at all.
    assert summaries["no_salt"]["cross_tenant_hit_tokens"] == c.num_probes * c.secret_len
    assert summaries["tenant_salt"]["cross_tenant_hit_tokens"] == 0
    assert summaries["tenant_salt"]["manager_hit_tokens"] == 0
    assert summaries["public_prefix_salted_rest"]["cross_tenant_private_hit_tokens"] == 0
    assert (work / "audit_timing.png").stat().st_size
    assert (work / "audit_timing.cells.jsonl").is_file() and (work / "provenance.json").is_file()


def test_quick_hybrid_state_gives_the_documented_hit_rates(tmp_path):
    """configs/hybrid_state.py's "Expected" figures (multi_turn, LRU and marconi, 2048
    blocks)."""
    out, _ = _run("hybrid_state", "hybrid_state", tmp_path)
    rates = {(r["layout"], r["policy"]): round(r["hit_rate_tokens"], 3) for r in out["rows"]}
    assert rates == {
        ("full,full", "lru"): 0.547, ("full,mamba", "lru"): 0.774,
        ("full,mamba_r0", "lru"): 0.684,
        ("full,full", "marconi"): 0.540, ("full,mamba", "marconi"): 0.778,
        ("full,mamba_r0", "marconi"): 0.681,
    }
