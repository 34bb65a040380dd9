r"""A learned eviction policy: an MLP trained (jax + optax) to imitate Belady's choices
on the first part of a trace, evaluated on the held-out rest beside lru, belady and a
tuned policy.

  python -m experiments.learned_policy --config=configs/learned_policy.py --workdir=/tmp/lp
  python -m experiments.learned_policy --config=configs/learned_policy.py:quick --workdir=/tmp/lp

Steps (Learning-Relaxed-Belady style):
  1. The trace (``requests_from_config``) is split: the first ``train_fraction`` of its
     requests train, the rest are held out. The cache holds ``capacity_fraction`` of
     the blocks the training part would need never to evict
     (``compare.ideal_num_blocks``), the same pool for both parts.
  2. The training part is replayed under ``belady`` with a recorder: at up to
     ``max_decisions`` evictions it takes every candidate's features
     (``prefixcache.core.eviction.learned.FEATURES``, the ones ``LearnedPolicy`` keeps)
     and its label, ``log1p`` of the requests until its next use (blocks never used
     again: the training part's length), at most ``max_candidates`` per decision.
  3. An MLP (``hidden`` widths, ReLU) is fit by mean squared error with optax's adam
     (``steps`` minibatches of ``batch_size``, ``learning_rate``); deterministic for
     ``seed`` (``train``). Its parameters are saved to ``learned_policy.npz`` with
     ``learned_policy.json`` (the run's provenance and the training loss).
  4. The held-out part is replayed under ``lru``, ``belady`` (its own future only),
     ``LearnedPolicy`` with the saved parameters (``sample``: 0 ranks every candidate,
     k scores k random ones per eviction, LRB's scheme), and the tuned policy: the one of
     ``tuned_policies`` with the best hit rate on the training part.
  5. Inference cost: every ``pop`` of the learned and of the keyed ``lru`` policy timed
     in the same held-out replay (microseconds per eviction, side by side).

Outputs in ``--workdir``: ``learned_policy.npz`` / ``.json`` (the parameters and their
provenance), ``results.jsonl`` (one row per (part, policy): ``hit_rate_tokens``,
``hit_tokens``, ``evictions``; held-out lru and learned: ``pop_us_per_eviction``, the
learned one also ``rankings_per_eviction`` and ``candidates_per_ranking``), stdout a
table and the summary as JSON.

NOTE: the policy's inference is a numpy matrix product: on a machine whose cores are
oversubscribed, OpenBLAS' threads spin against each other and a ranking costs ~10x
more; the figures in ``configs/learned_policy.py`` were measured with
``OPENBLAS_NUM_THREADS=1``.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from experiments import _common
from prefixcache.core.eviction import BeladyPolicy, LRUPolicy
from prefixcache.core.eviction.belady import NEVER
from prefixcache.core.eviction.learned import FEATURES, BlockFeatures, LearnedPolicy
from prefixcache.sim import compare
from prefixcache.sim.replay import replay


RECORD_UNDER = ("belady", "lru")  # whose evictions the recorded cache follows


class BeladyRecorder(BeladyPolicy):
    """``belady`` that records, before each of its first ``max_decisions`` evictions,
    every candidate's features and ``log1p`` next-use distance into ``sink`` (a list
    of ``(X, y)`` pairs the caller owns)."""

    name = "belady_recorder"
    needs_block_size = True

    def __init__(self, num_blocks, *, future=None, block_size, sink, horizon,
                 max_decisions, max_candidates, seed, record_under="belady"):
        super().__init__(num_blocks, future=future)
        if record_under not in RECORD_UNDER:
            raise ValueError(f"record_under must be one of {RECORD_UNDER}, got {record_under!r}")
        self.record_under = record_under
        self.features = BlockFeatures(num_blocks, block_size)
        self.sink, self.horizon = sink, horizon
        self.max_decisions, self.max_candidates = max_decisions, max_candidates
        self._rng = np.random.default_rng(seed)

    def on_cached(self, block, block_hash, request, position):
        super().on_cached(block, block_hash, request, position)
        self.features.cached(block.block_id, position)

    def on_hit(self, block, request):
        super().on_hit(block, request)
        self.features.hit(block.block_id)

    def on_release(self, block, request, position):
        super().on_release(block, request, position)
        self.features.released(block.block_id)

    def pop(self):
        if len(self.sink) < self.max_decisions:
            bids = np.flatnonzero(np.asarray(self._token))
            if len(bids) > self.max_candidates:
                bids = np.sort(self._rng.choice(bids, self.max_candidates, replace=False))
            now = self.future.index
            nxt = np.array([self.future.next_use(self.slot[b]) for b in bids], np.int64)
            dist = np.where(nxt >= NEVER, self.horizon, np.minimum(nxt - now, self.horizon))
            self.sink.append((self.features.matrix(bids), np.log1p(dist.astype(np.float64))))
        if self.record_under == "belady":
            return super().pop()
        # "lru": the cache evolves as lru's would (the states a deployed online policy
        # sees), the labels are still belady's next uses.
        live = np.flatnonzero(np.asarray(self._token))
        if not len(live):
            return super().pop()  # (raises: no candidates)
        bid = int(live[np.argmin(np.asarray(self.released_at)[live])])
        self._token[bid] = 0
        self._n -= 1
        return self._block_objs[bid]


class _Timed:
    """A policy class whose ``pop`` calls are timed into ``timer`` (a list the caller
    owns: ``[seconds, pops, rankings, rows scored]``)."""

    @staticmethod
    def wrap(cls):
        class Timed(cls):
            name = cls.name

            def __init__(self, num_blocks, *, timer, **options):
                super().__init__(num_blocks, **options)
                self._timer = timer

            def pop(self):
                t0 = time.perf_counter()
                block = super().pop()
                self._timer[0] += time.perf_counter() - t0
                self._timer[1] += 1
                # (the learned policy's batched inferences and rows scored so far)
                self._timer[2] = getattr(self, "num_rankings", 0)
                self._timer[3] = getattr(self, "num_scored", 0)
                return block

        Timed.__name__ = f"Timed{cls.__name__}"
        return Timed


def init_params(key, sizes: Sequence[int]):
    """He-initialized dense layers ``w0, b0, ...`` for ``sizes`` (inputs ... 1)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        key, sub = jax.random.split(key)
        params[f"w{i}"] = jax.random.normal(sub, (a, b), jnp.float32) * jnp.sqrt(2.0 / a)
        params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
    return params


def forward(params, x):
    """The MLP on standardized features (the same function as
    ``learned.mlp_scores``, in jax)."""
    import jax.numpy as jnp  # noqa: PLC0415

    n = len([k for k in params if k.startswith("w")])
    h = x
    for i in range(n):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i + 1 < n:
            h = jnp.maximum(h, 0.0)
    return h[:, 0]


def train(x: np.ndarray, y: np.ndarray, *, hidden: Sequence[int], steps: int,
          batch_size: int, learning_rate: float, seed: int,
          features: Sequence[str] = FEATURES) -> tuple[dict, list[float]]:
    """Fit the MLP to ``(x, y)`` (raw features, log next-use distances) by mean squared
    error with adam. Deterministic for ``seed``. Only ``features`` (a subset of
    ``FEATURES``) are read: the others' input weights are zero. Returns the numpy
    parameters (``mean``, ``std``, ``w0``, ``b0``, ...: what ``LearnedPolicy`` loads)
    and the full-batch loss before and after."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415

    unknown = sorted(set(features) - set(FEATURES))
    if unknown or not features:
        raise ValueError(f"features must be a non-empty subset of {FEATURES}, got "
                         f"{tuple(features)}")
    if len(x) == 0:
        raise ValueError("no training decisions were recorded: the training part never "
                         "evicted (raise the trace's length or lower capacity_fraction)")
    mask = np.array([f in features for f in FEATURES])
    x = np.where(mask, x, 0.0)  # (an unread feature: a constant, weight zeroed below)
    mean = x.mean(axis=0)
    std = np.where(x.std(axis=0) > 1e-6, x.std(axis=0), 1.0)
    xs = jnp.asarray((x - mean) / std, jnp.float32)
    ys = jnp.asarray(y, jnp.float32)
    key = jax.random.PRNGKey(seed)
    key, init_key = jax.random.split(key)
    params = init_params(init_key, [x.shape[1], *hidden, 1])
    opt = optax.adam(learning_rate)
    state = opt.init(params)

    def loss_fn(p, xb, yb):
        return jnp.mean((forward(p, xb) - yb) ** 2)

    def step(carry, k):
        p, s = carry
        idx = jax.random.randint(k, (batch_size,), 0, xs.shape[0])
        loss, g = jax.value_and_grad(loss_fn)(p, xs[idx], ys[idx])
        updates, s = opt.update(g, s, p)
        return (optax.apply_updates(p, updates), s), loss

    @jax.jit
    def fit(p, s, keys):  # (one compiled loop: no per-step dispatch)
        return jax.lax.scan(step, (p, s), keys)[0]

    before = float(loss_fn(params, xs, ys))
    params, state = fit(params, state, jax.random.split(key, steps))
    after = float(loss_fn(params, xs, ys))
    out = {"mean": mean.astype(np.float64), "std": std.astype(np.float64)}
    out.update({k: np.asarray(v) for k, v in params.items()})
    out["w0"] = np.where(mask[:, None], out["w0"], 0.0).astype(out["w0"].dtype)
    return out, [before, after]


def _run_part(requests, config, eviction, options=None) -> dict:
    return replay(requests, num_blocks=config.num_blocks_resolved, block_size=config.block_size,
                  concurrency=config.concurrency, hash_algo=config.hash_algo,
                  eviction=eviction, eviction_options=options)


def run(config, *, progress: bool = False) -> dict:
    del progress
    if not 0 < config.train_fraction < 1:
        raise ValueError(f"train_fraction must be in (0, 1), got {config.train_fraction}")
    if not 0 < config.capacity_fraction <= 1:
        raise ValueError(f"capacity_fraction must be in (0, 1], got {config.capacity_fraction}")
    if config.record_under not in RECORD_UNDER:
        raise ValueError(f"record_under must be one of {RECORD_UNDER}, "
                         f"got {config.record_under!r}")
    unknown = sorted(set(config.features) - set(FEATURES))
    if unknown or not config.features:
        raise ValueError(f"features must be a non-empty subset of {FEATURES}, got "
                         f"{tuple(config.features)}")
    if isinstance(config.sample, bool) or not isinstance(config.sample, int) or config.sample < 0:
        raise ValueError(f"sample must be an int >= 0, got {config.sample!r}")
    for name in config.tuned_policies:
        from prefixcache.core.eviction import get_policy_class  # noqa: PLC0415
        get_policy_class(name)  # an unknown name -> ValueError before any replay
    workdir = _common.prepare_workdir(config.workdir)
    requests = list(_common.requests_from_config(config, workdir))
    cut = int(len(requests) * config.train_fraction)
    train_part, held_out = requests[:cut], requests[cut:]
    if not train_part or not held_out:
        raise ValueError(f"{len(requests)} requests cannot be split at {config.train_fraction}")
    with config.unlocked():
        config.num_blocks_resolved = max(
            8, int(compare.ideal_num_blocks(train_part, config.block_size)
                   * config.capacity_fraction))

    # 2. Belady's choices on the training part.
    sink: list = []
    t0 = time.perf_counter()
    rec = _run_part(train_part, config, BeladyRecorder, {
        "sink": sink, "horizon": len(train_part), "max_decisions": config.max_decisions,
        "max_candidates": config.max_candidates, "seed": config.seed,
        "record_under": config.record_under})
    x = np.concatenate([s[0] for s in sink]) if sink else np.zeros((0, len(FEATURES)))
    y = np.concatenate([s[1] for s in sink]) if sink else np.zeros(0)
    record_s = time.perf_counter() - t0

    # 3. Train and save.
    t0 = time.perf_counter()
    params, losses = train(x, y, hidden=tuple(config.hidden), steps=config.steps,
                           batch_size=config.batch_size, learning_rate=config.learning_rate,
                           seed=config.seed, features=tuple(config.features))
    train_s = time.perf_counter() - t0
    npz = workdir / "learned_policy.npz"
    np.savez(npz, **params)
    prov = _common.provenance(config, seed=config.seed, hash_algo=config.hash_algo,
                              cache_state="cold", extra={"source": _common.source_name(config)})
    _common.write_json_atomic(workdir / "learned_policy.json", {
        "features": list(FEATURES), "params": str(npz), "decisions": len(sink),
        "samples": int(len(y)), "loss_before": losses[0], "loss_after": losses[1],
        "train_requests": len(train_part), "held_out_requests": len(held_out),
        "num_blocks": config.num_blocks_resolved, "train_belady_hit_rate":
        rec["hit_rate_tokens"], "record_s": record_s, "train_s": train_s,
        "provenance": prov})

    # 4. The tuned policy: the best of tuned_policies on the training part.
    tuned_scores = {name: _run_part(train_part, config, name)["hit_rate_tokens"]
                    for name in config.tuned_policies}
    tuned = max(tuned_scores, key=lambda n: (tuned_scores[n], n == "lru"))

    rows = []
    sampling = {"sample": config.sample, "seed": config.seed}
    lru_timer, learned_timer = [0.0, 0, 0, 0], [0.0, 0, 0, 0]
    runs = {
        "lru": (_Timed.wrap(LRUPolicy), {"timer": lru_timer}),
        "belady": ("belady", None),
        f"tuned ({tuned})": (tuned, None),
        "learned": (_Timed.wrap(LearnedPolicy), {"timer": learned_timer,
                                                  "params": str(npz), **sampling}),
    }
    for part, reqs in (("held_out", held_out), ("train", train_part)):
        for label, (eviction, options) in runs.items():
            if part == "train" and label not in ("learned", "lru"):
                continue
            if part == "train":  # (the timers measure the held-out replay only)
                options = None if label == "lru" else {"params": str(npz), **sampling}
                eviction = "lru" if label == "lru" else LearnedPolicy
            s = _run_part(reqs, config, eviction, options)
            row = {"part": part, "policy": label, "hit_rate_tokens": s["hit_rate_tokens"],
                   "hit_tokens": s["hit_tokens"], "prompt_tokens": s["prompt_tokens"],
                   "evictions": s["evictions"], "num_blocks": config.num_blocks_resolved}
            timer = {"lru": lru_timer, "learned": learned_timer}.get(label)
            if part == "held_out" and timer is not None and timer[1]:
                row["pop_us_per_eviction"] = 1e6 * timer[0] / timer[1]
                if timer[2]:  # (the learned policy: how its inference is batched)
                    row["rankings_per_eviction"] = timer[2] / timer[1]
                    row["candidates_per_ranking"] = timer[3] / timer[2]
            rows.append(row)
    with _common.AtomicJsonlWriter(workdir / "results.jsonl") as w:
        for row in rows:
            w.write({"record": "policy", **row}, provenance=prov)
    for row in rows:
        cost = row.get("pop_us_per_eviction")
        print(f"{row['part']:>8}  {row['policy']:<16} hit rate {row['hit_rate_tokens']:.4f}"
              f"  evictions {row['evictions']:>7}"
              + (f"  pop {cost:.1f} us/eviction" if cost is not None else "")
              + (f" ({row['rankings_per_eviction']:.2f} rankings of "
                 f"{row['candidates_per_ranking']:.0f} candidates per eviction)"
                 if "rankings_per_eviction" in row else ""))
    return {"rows": rows, "tuned": tuned, "tuned_train_hit_rates": tuned_scores,
            "params": str(npz), "samples": int(len(y)), "decisions": len(sink),
            "loss": losses, "num_blocks": config.num_blocks_resolved,
            "record_s": record_s, "train_s": train_s}


def main() -> None:
    _common.run_cli(run, config_name="learned_policy")


if __name__ == "__main__":
    main()
