"""experiments/learned_policy.py: training deterministic for a seed, the jax forward
pass equal to the policy's numpy inference, the recorder's labels, and a tiny end-to-end
run (held-out rows, parameters saved with provenance and loadable by the policy)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("optax", reason="the training needs optax")

from configs.learned_policy import get_config  # noqa: E402
from experiments import learned_policy as lp  # noqa: E402
from prefixcache.core.eviction.learned import FEATURES, LearnedPolicy, mlp_scores  # noqa: E402


def _data(n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, len(FEATURES)))
    return x, x[:, 0] * 2.0 - x[:, 2] + 0.1 * rng.normal(size=n)


def test_training_is_deterministic_for_a_seed():
    x, y = _data()
    kw = dict(hidden=(8,), steps=5, batch_size=16, learning_rate=1e-2)
    a, loss_a = lp.train(x, y, seed=3, **kw)
    b, loss_b = lp.train(x, y, seed=3, **kw)
    c, _ = lp.train(x, y, seed=4, **kw)
    assert set(a) == {"mean", "std", "w0", "b0", "w1", "b1"}
    assert all(np.array_equal(a[k], b[k]) for k in a) and loss_a == loss_b
    assert not np.array_equal(a["w0"], c["w0"])
    # the jax forward pass is the function the policy computes with numpy
    import jax.numpy as jnp

    xs = (x - a["mean"]) / a["std"]
    jax_out = np.asarray(lp.forward({k: jnp.asarray(v) for k, v in a.items()
                                     if k[0] in "wb"}, jnp.asarray(xs, jnp.float32)))
    np.testing.assert_allclose(jax_out, mlp_scores(a, x), rtol=1e-4, atol=1e-4)


def test_tiny_run_end_to_end(tmp_path):
    c = get_config("quick")
    with c.unlocked():
        c.workdir = str(tmp_path)
        c.workload.kwargs.num_requests = 40
        c.workload.kwargs.num_documents = 10
        c.capacity_fraction = 0.2
        c.max_decisions = 40
        c.max_candidates = 8
        c.hidden = (4,)
        c.steps = 5
        c.tuned_policies = ("lru", "fifo")
    out = lp.run(c)
    parts = {(r["part"], r["policy"]) for r in out["rows"]}
    assert {("held_out", "lru"), ("held_out", "belady"), ("held_out", "learned"),
            ("train", "learned")} <= parts
    assert out["decisions"] > 0 and out["samples"] <= 8 * out["decisions"]
    learned = next(r for r in out["rows"] if r["part"] == "held_out" and r["policy"] == "learned")
    assert learned["pop_us_per_eviction"] > 0 and learned["evictions"] > 0
    meta = json.loads((tmp_path / "learned_policy.json").read_text())
    assert meta["provenance"]["seed"] == c.seed and meta["features"] == list(FEATURES)
    p = LearnedPolicy(8, block_size=16, params=str(tmp_path / "learned_policy.npz"))
    assert p.params["w0"].shape == (len(FEATURES), 4)
    unread = [FEATURES.index(f) for f in FEATURES if f not in c.features]
    assert unread and not p.params["w0"][unread].any()  # features left out: zero weights
    rows = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(rows) == len(out["rows"])


def test_bad_config_is_refused_before_any_replay(tmp_path):
    c = get_config("quick")
    with c.unlocked():
        c.workdir = str(tmp_path)
        c.train_fraction = 1.0
    with pytest.raises(ValueError, match="train_fraction"):
        lp.run(c)
    with c.unlocked():
        c.train_fraction = 0.5
        c.tuned_policies = ("lru", "nope")
    with pytest.raises(ValueError, match="nope"):
        lp.run(c)
    with c.unlocked():
        c.tuned_policies = ("lru",)
        c.features = ("recency", "colour")
    with pytest.raises(ValueError, match="colour"):
        lp.run(c)
    with c.unlocked():
        c.features = ("recency",)
        c.record_under = "mru"
    with pytest.raises(ValueError, match="record_under"):
        lp.run(c)
