"""experiments.audit_timing: the timing leak is found without salt and gone with it.

The engine test runs the two headline scenarios on the tiny model with 30 hit and 30
miss probes each (the full run uses 250) and a 512-token secret: no salt must leak
with p < 1e-3 (measured 2e-8 to 3e-9 under a load average of ~15), a per-tenant salt
must give no cross-tenant hit at all (the manager's hit counter over the scenario is 0)
and p > 0.01. Under no leak the p-value is uniform,
so one run fails that bound 1% of the time by chance: a failing salt scenario is rerun
once with other secrets (both failing by chance: 1e-4), a real leak fails both.
"""

import importlib
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from experiments import audit_timing

ROOT = pathlib.Path(__file__).resolve().parents[2]


def config(tmp_path, **overrides):
    spec = importlib.util.spec_from_file_location("_cfg_audit", ROOT / "configs/audit_timing.py")
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


def test_engine_no_salt_leaks_tenant_salt_does_not(tmp_path):
    n = 30
    # A 512-token secret: a miss takes two 512-token steps, a hit one small one, so the
    # gap survives a loaded CI machine (256 tokens gave p = 0.017 once at n = 30 under a
    # load average of 13; 512: p 2e-8 to 3e-9, AUC 0.91-0.93 in three runs).
    small = dict(num_probes=n, warmup_trials=4, noise_rate=0.5, noise_max_tokens=(1, 2),
                 secret_len=512,
                 victim_max_tokens=(1, 1), **{"engine.token_buckets": (64, 512),
                                              "engine.max_num_batched_tokens": 512})
    c = config(tmp_path, scenarios="no_salt,tenant_salt", **small)
    out = audit_timing.run(c)
    s = out["scenarios"]
    assert set(s) == {"no_salt", "tenant_salt"} and not out["skipped_scenarios"]
    leak, salted = s["no_salt"], s["tenant_salt"]
    assert leak["p_value"] < 1e-3, leak
    assert leak["auc"] > 0.7 and leak["ttft_gap_s"] > 0
    # Every hit guess reused the victim's 16 secret blocks, and only those.
    assert leak["cross_tenant_hit_tokens"] == leak["attacker_hit_tokens"] == n * c.secret_len
    assert leak["manager_hit_tokens"] == n * c.secret_len
    # The salt: no hit across tenants at all, on the manager's own counter too.
    assert salted["cross_tenant_hit_tokens"] == salted["attacker_hit_tokens"] == 0
    assert salted["manager_hit_tokens"] == 0
    if salted["p_value"] <= 0.01:  # 1% by chance: rerun once with other secrets
        c2 = config(tmp_path, scenarios="tenant_salt", seed=1, **small)
        salted = audit_timing.run(c2)["scenarios"]["tenant_salt"]
        assert salted["manager_hit_tokens"] == 0
    assert salted["p_value"] > 0.01, salted
    work = pathlib.Path(c.workdir)
    lines = [json.loads(l) for l in (work / "results.jsonl").read_text().splitlines()]
    probes = [l for l in lines if l["record"] == "probe"]
    assert len(probes) == 4 * n
    # Provenance once per file: a header line, every other line names its id.
    head, *rest = lines
    assert head["record"] == "provenance" and all(
        l["provenance_id"] == head["provenance_id"] and "provenance" not in l for l in rest)
    prov = head["provenance"]
    assert prov["cache_state"] == "warm" and prov["jax"]["backend"] == "cpu"
    assert prov["jax"]["device_kind"]
    assert json.loads((work / "provenance.json").read_text()) == prov
    assert (work / "audit_timing.png").stat().st_size > 0


def test_engine_ordering_leak_of_prefix_aware_scheduling(tmp_path):
    # lpm admits the hit probe ahead of the queued burst; the miss waits behind it: the
    # probe's queue time alone tells hit from miss (measured: p ~1e-11, AUC 1.0 at
    # n = 20). With per-tenant salts the attacker never hits another tenant's blocks.
    n = 20
    small = dict(num_probes=n, warmup_trials=4, noise_rate=0.5, noise_max_tokens=(1, 2),
                 secret_len=512, victim_max_tokens=(1, 1),
                 **{"engine.token_buckets": (64, 512), "engine.max_num_batched_tokens": 512})
    c = config(tmp_path, scenarios="ordering,ordering_tenant_salt", **small)
    s = audit_timing.run(c)["scenarios"]
    leak, salted = s["ordering"], s["ordering_tenant_salt"]
    for v in (leak, salted):
        assert {"ks_stat", "p_value", "auc", "ttft_gap_s", "cross_tenant_hit_tokens",
                "queue_p_value", "queue_auc", "queue_gap_s"} <= set(v)
    assert leak["queue_p_value"] < 1e-3 and leak["queue_auc"] > 0.9, leak
    assert leak["queue_gap_s"] > 0
    assert leak["cross_tenant_hit_tokens"] == n * c.secret_len
    assert salted["cross_tenant_hit_tokens"] == salted["manager_hit_tokens"] == 0


def test_sim_scenarios_and_cli_last_line(tmp_path):
    """The simulator version at 70B scale, through the command line."""
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.audit_timing",
         "--config=configs/audit_timing_sim.py", f"--workdir={tmp_path / 'w'}",
         "--noprogress", "--config.num_probes=60", "--config.warmup_trials=2",
         "--config.noise_rate=0.5"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    s = out["scenarios"]
    assert out["backend"] == "sim" and set(s) == {
        "no_salt", "tenant_salt", "public_prefix_salted_rest", "public_prefix_first_block_salt",
        "ordering", "ordering_fcfs", "ordering_tenant_salt"}
    assert not out["skipped_scenarios"]
    # The ordering leak at 70B scale (des.Server queues the burst and the probe): under
    # lpm the probe's queue time alone separates hits from misses; under FCFS it does not
    # depend on the cache; per-tenant salts leave nothing to jump the queue on.
    assert s["ordering"]["queue_p_value"] < 1e-6 and s["ordering"]["queue_auc"] > 0.95
    assert s["ordering_fcfs"]["queue_p_value"] > 0.01
    assert s["ordering_tenant_salt"]["cross_tenant_hit_tokens"] == 0
    for name, v in s.items():
        assert {"ks_stat", "p_value", "auc", "ttft_gap_s", "cross_tenant_hit_tokens"} <= set(v)
    assert s["no_salt"]["p_value"] < 1e-6 and s["no_salt"]["auc"] > 0.95
    assert s["no_salt"]["cross_tenant_private_hit_tokens"] == 60 * 1024
    for name in ("tenant_salt", "public_prefix_salted_rest", "public_prefix_first_block_salt",
                 "ordering_tenant_salt"):
        assert s[name]["cross_tenant_private_hit_tokens"] == 0, name
        # The sim's noise is seeded: these p-values are fixed numbers, not a chance.
        assert s[name]["p_value"] > 0.01, (name, s[name])
    # The salt after the public prompt keeps it shared across tenants (the attacker's
    # first request hits the victim's copy); vLLM's first-block salt does not.
    assert s["public_prefix_salted_rest"]["attacker_first_request_hit_tokens"] == 1024
    assert s["public_prefix_first_block_salt"]["attacker_first_request_hit_tokens"] == 0
    assert s["tenant_salt"]["manager_hit_tokens"] == 0


def test_leak_stats_matches_its_definitions():
    rng = np.random.default_rng(0)
    hit, miss = rng.normal(1.0, 0.3, 30), rng.normal(1.4, 0.3, 25)
    got = audit_timing.leak_stats(hit, miss)
    # AUC: the share of (miss, hit) pairs a threshold orders right (ties count half).
    pairs = (miss[:, None] > hit[None, :]).mean() + 0.5 * (miss[:, None] == hit[None, :]).mean()
    assert got["auc"] == pytest.approx(pairs)
    # KS "greater": the largest amount by which the hit ECDF exceeds the miss ECDF.
    xs = np.concatenate([hit, miss])
    d = max((hit <= x).mean() - (miss <= x).mean() for x in xs)
    assert got["ks_stat"] == pytest.approx(d)
    assert got["ttft_gap_s"] == pytest.approx(np.median(miss) - np.median(hit))
    same = audit_timing.leak_stats([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert same["auc"] == 0.5 and same["ks_stat"] == 0.0
    with pytest.raises(ValueError, match="need >= 2"):
        audit_timing.leak_stats([1.0], [1.0, 2.0])


@pytest.mark.parametrize("overrides, match", [
    (dict(scenarios="no_salt,nope"), "unknown scenario 'nope'"),
    (dict(scenarios=""), "no runnable scenario"),
    (dict(ordering_burst=0), "ordering_burst must be a positive int"),
    (dict(num_probes=0), "num_probes must be a positive int"),
    (dict(noise_prompt_len=(5, 2)), "noise_prompt_len"),
    (dict(backend="gpu"), "backend must be"),
    (dict(model="gpt2"), "model must be one of"),
])
def test_bad_config_raises_before_running(tmp_path, overrides, match):
    c = config(tmp_path, **overrides)
    with pytest.raises(ValueError, match=match):
        audit_timing.run(c)
    assert not (tmp_path / "work" / "results.jsonl").exists()


def test_trials_are_shuffled_and_fresh():
    import ml_collections
    c = config(pathlib.Path("/nonexistent"), num_probes=20, warmup_trials=3)
    c = ml_collections.ConfigDict(c.to_dict())
    scen = audit_timing.SCENARIOS["public_prefix_salted_rest"]
    trials = audit_timing.make_trials(c, scen, vocab=512, seed=0)
    measured = [t for t in trials if t.measured]
    assert len(trials) == 43 and len(measured) == 40
    labels = [t.probe.label for t in measured]
    assert labels.count("hit") == labels.count("miss") == 20
    assert labels != sorted(labels)  # interleaved: one of each per consecutive pair
    assert all({a, b} == {"hit", "miss"} for a, b in zip(labels[::2], labels[1::2]))
    pub = c.public_len
    for t in trials:
        secret = t.victim.tokens[pub:pub + c.secret_len]
        guess = t.probe.tokens[pub:pub + c.secret_len]
        assert (guess == secret) == (t.probe.label == "hit")
        assert t.probe.tokens[:pub] == t.victim.tokens[:pub] and t.probe.public_len == pub
    salts = audit_timing.tenant_salts(c, 0)
    kw = audit_timing.salt_kwargs(scen, salts, measured[0].probe)
    assert kw == {"cache_salt": salts["attacker"], "cache_salt_offset": pub}
