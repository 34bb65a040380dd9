r"""Timing side-channel audit of the prefix cache: can one tenant tell what another cached?

  python -m experiments.audit_timing --config=configs/audit_timing.py --workdir=/tmp/audit

Threat model: tenants share one server and its prefix cache. A victim sends a prompt
holding a secret (a document, a password in a system prompt); the attacker, another
tenant, sends a guess of that prompt and times its own time to first token (TTFT). A
guess that shares the victim's cached prefix skips its prefill (a hit: fast), a wrong
one does not (a miss: slow). Per scenario and trial: the victim plants a fresh secret,
then the attacker sends the right guess (hit) or a fresh wrong one (miss) --
``num_probes`` of each, one of each per consecutive pair in random order -- while noise tenants' requests arrive around the
probes (Poisson, random lengths) and share its steps.

Scenarios (``SCENARIOS``; pick with ``config.scenarios``):

* ``no_salt``: no isolation (the leak).
* ``tenant_salt``: every tenant's requests carry its own secret ``cache_salt``
  (vLLM's: the salt enters the first block's key), so nothing hits across tenants.
* ``public_prefix_salted_rest``: every prompt starts with one public system prompt;
  the salt protects what follows it (``Request(cache_salt_offset=len(public))``): the
  public prompt stays shared across tenants, the tenant's content does not.
* ``public_prefix_first_block_salt``: the same prompts with vLLM's first-block salt:
  no leak, but no tenant shares the public prompt either.
* ``ordering``: no salt, the engine admits waiting requests longest-cached-prefix
  first (``lpm``, ``prefixcache.scheduling``), and a burst of ``ordering_burst``
  noise requests of ``ordering_noise_len`` tokens is queued just before each probe.
  A hit probe jumps the queue, a miss waits behind the burst: besides the prefill it
  saves, the hit now also shortens the probe's *queue* time (``queue_*`` statistics:
  the leak prefix-aware scheduling adds, present even if compute time were hidden).
* ``ordering_fcfs``: the same burst under FCFS (the control: queue time does not
  depend on the cache, ``queue_p_value`` uniform).
* ``ordering_tenant_salt``: ``lpm`` and the burst with per-tenant salts: the attacker
  can only jump the queue on its own prefixes, so nothing leaks.

The simulator backend serves the ordering scenarios' burst and probe through one
simulated server (``prefixcache.sim.des.Server``: the scenario's waiting-queue policy,
the cost model's step times, the engine config's batching limits); the other scenarios
one request at a time.

Statistics (scipy only): the one-sided two-sample KS test that hits are faster
(``ks_2samp(hit, miss, alternative="greater")``), the ROC AUC of the best threshold
attack ("TTFT below t -> hit"; Mann-Whitney ``U / (n_miss n_hit)`` equals it) and the
gap of the median TTFTs. ``cross_tenant_hit_tokens``: tokens of the attacker's probes
served from cached blocks that only other tenants had computed (each request's block
hashes are attributed to its tenant); ``cross_tenant_private_hit_tokens``: those past
the public prompt -- the ones that leak. ``manager_hit_tokens``: the manager's own
hit counter over the scenario's measured trials (every request in these trials is
fresh random text past the public prompt, so only cross-tenant or public-prompt hits
can count). ``attacker_first_request_hit_tokens``: what the attacker's very first
request (warm-up included) hit -- the public prompt computed by others, when it is
shared across tenants.

Backends (``config.backend``): ``engine`` -- the real engine (tiny model on CPU by
default, any ``ModelConfig`` preset or an HF checkpoint), TTFT from its request
metrics; ``sim`` -- the same trials through the real ``KVCacheManager`` with TTFT from
the roofline ``CostModel`` (e.g. Llama-3.1-70B on 8 H100s) plus a noise model: the
trial's noise prefills and Poisson(``noise_decodes_mean``) decoding sequences share the
probe's step, times a lognormal factor (``jitter_sigma``), plus a lognormal host /
network delay (``host_jitter_median_s``, ``host_jitter_sigma``).

Writes ``results.jsonl`` (one ``probe`` row per attacker request, one ``scenario`` row
per scenario; the provenance once, as the first line ``{"record": "provenance",
"provenance_id", "provenance"}``, every other line carrying its ``provenance_id``; the
same record in ``provenance.json``) and ``audit_timing.png`` (TTFT histograms of
hits and misses per scenario) into ``--workdir``; the last stdout line is
``{"backend", "scenarios": {name: {ks_stat, p_value, auc, ttft_gap_s,
cross_tenant_hit_tokens, ...}}, "skipped_scenarios": {...}}``.

Resume: each finished cell is appended to ``<workdir>/audit_timing.cells.jsonl``
(``_common.CellLog``); a rerun with the same workdir runs only the missing cells and
refuses a workdir of another config, seed or trace. (Every scenario starts from an
empty prefix cache either way; on the engine backend a resumed run builds the engine
again, and the warm-up trials compile its step programs before anything is measured.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments import _common


@dataclasses.dataclass(frozen=True)
class Scenario:
    """How tenants are isolated in one scenario.

    Attributes:
      name: its key in ``SCENARIOS``.
      salted: every tenant's requests carry the tenant's secret salt.
      public_prefix: every prompt starts with the shared public system prompt.
      salt_after_public: the salt protects from the end of the public prompt on
        (``cache_salt_offset``); else vLLM's first-block salt.
      scheduling: the engine's waiting-queue policy (``prefixcache.scheduling``).
      burst: queue ``ordering_burst`` noise requests right before each probe.
    """

    name: str
    salted: bool
    public_prefix: bool
    salt_after_public: bool = False
    scheduling: str = "fcfs"
    burst: bool = False


SCENARIOS = {s.name: s for s in (
    Scenario("no_salt", salted=False, public_prefix=False),
    Scenario("tenant_salt", salted=True, public_prefix=False),
    Scenario("public_prefix_salted_rest", salted=True, public_prefix=True,
             salt_after_public=True),
    Scenario("public_prefix_first_block_salt", salted=True, public_prefix=True),
    Scenario("ordering", salted=False, public_prefix=False, scheduling="lpm", burst=True),
    Scenario("ordering_fcfs", salted=False, public_prefix=False, burst=True),
    Scenario("ordering_tenant_salt", salted=True, public_prefix=False, scheduling="lpm",
             burst=True),
)}

# Scenarios the audit cannot run yet (name -> why), reported as skipped.
PENDING_SCENARIOS: dict[str, str] = {}

ATTACKER, VICTIM = "attacker", "victim"
MODELS = ("tiny", "llama_3_2_1b", "qwen2_5_0_5b")  # ModelConfig presets (engine backend)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One request of a trial (backend-independent)."""

    role: str  # "victim" | "noise" | "probe"
    tenant: str
    tokens: tuple[int, ...]
    public_len: int  # leading tokens of the public prompt (0 if none)
    max_tokens: int
    label: str | None = None  # "hit" | "miss" for probes


@dataclasses.dataclass(frozen=True)
class Trial:
    victim: Spec
    noise: tuple[Spec, ...]
    probe: Spec
    measured: bool


def parse_scenarios(names: str | Sequence[str], backend: str = "engine"
                    ) -> tuple[list[Scenario], dict[str, str]]:
    """The scenarios to run and the pending ones asked for (name -> why skipped).

    Raises:
      ValueError: an unknown name, or none given.
    """
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    run, skipped = [], {}
    for n in names:
        if n in SCENARIOS:
            run.append(SCENARIOS[n])
        elif n in PENDING_SCENARIOS:
            skipped[n] = PENDING_SCENARIOS[n]
        else:
            raise ValueError(f"unknown scenario {n!r}; known: {sorted(SCENARIOS)}, "
                             f"pending: {sorted(PENDING_SCENARIOS)}")
    if not run:
        raise ValueError(f"no runnable scenario in {list(names)}")
    return run, skipped


def _check_config(config) -> None:
    for name in ("num_probes", "secret_len", "query_len", "block_size", "num_blocks"):
        v = config[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    for name in ("public_len", "warmup_trials", "num_noise_tenants"):
        v = config[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if config.noise_rate < 0:
        raise ValueError(f"noise_rate must be >= 0, got {config.noise_rate}")
    for name in ("noise_prompt_len", "noise_max_tokens", "victim_max_tokens"):
        lo, hi = config[name]
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
    if config.noise_rate and not config.num_noise_tenants:
        raise ValueError("noise_rate > 0 needs num_noise_tenants >= 1")
    for name in ("ordering_burst", "ordering_noise_len"):
        v = config[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if config.backend not in ("engine", "sim"):
        raise ValueError(f"backend must be 'engine' or 'sim', got {config.backend!r}")
    if config.backend == "engine" and not config.checkpoint and config.model not in MODELS:
        raise ValueError(f"model must be one of {MODELS} (or set checkpoint), "
                         f"got {config.model!r}")


def make_trials(config, scenario: Scenario, vocab: int, seed: int) -> list[Trial]:
    """The scenario's trials: ``warmup_trials`` unmeasured, then 2 * ``num_probes``.

    Every secret and every wrong guess is fresh random text (ids in [1, vocab)), so
    the attacker never sent any of it before: a hit on it can only come from another
    tenant. Noise prompts are random too (they never hit).
    """
    rng = np.random.default_rng([seed, 11])
    public = (tuple(rng.integers(1, vocab, config.public_len).tolist())
              if scenario.public_prefix else ())

    def text(n):
        return tuple(rng.integers(1, vocab, n).tolist())

    def rand_in(lo_hi):
        return int(rng.integers(lo_hi[0], lo_hi[1] + 1))

    # NOTE: one hit and one miss per consecutive pair, in random order: the machine's
    # load drifts (other processes), and a plain shuffle lets a quiet or a busy spell
    # fall on more probes of one class -- non-stationary noise that makes the KS
    # p-value anti-conservative (seen once at n = 250 under a load average of 15:
    # p = 0.006 with identical cache state for both classes). Pairs match the classes
    # to the same spells.
    labels = [x for _ in range(config.num_probes)
              for x in (("hit", "miss") if rng.random() < 0.5 else ("miss", "hit"))]
    # Warm-up trials alternate, so both probe shapes are compiled before measuring.
    labels = [("hit", "miss")[i % 2] for i in range(config.warmup_trials)] + labels
    trials = []
    for i, label in enumerate(labels):
        secret = text(config.secret_len)
        victim = Spec("victim", VICTIM, public + secret + text(config.query_len),
                      len(public), rand_in(config.victim_max_tokens))
        guess = secret if label == "hit" else text(config.secret_len)
        probe = Spec("probe", ATTACKER, public + guess + text(config.query_len), len(public),
                     1, label)
        noise = tuple(
            Spec("noise", f"noise-{int(rng.integers(config.num_noise_tenants))}",
                 public + text(rand_in(config.noise_prompt_len)), len(public),
                 rand_in(config.noise_max_tokens))
            for _ in range(int(rng.poisson(config.noise_rate))))
        if scenario.burst:  # queued right before the probe: it waits behind them (FCFS)
            noise += tuple(
                Spec("noise", f"noise-{int(rng.integers(max(config.num_noise_tenants, 1)))}",
                     public + text(config.ordering_noise_len), len(public), 1)
                for _ in range(config.ordering_burst))
        trials.append(Trial(victim, noise, probe, measured=i >= config.warmup_trials))
    return trials


def salt_kwargs(scenario: Scenario, salts: dict[str, str], spec: Spec) -> dict[str, Any]:
    """``cache_salt`` / ``cache_salt_offset`` of a request under the scenario."""
    if not scenario.salted:
        return {}
    kw = {"cache_salt": salts[spec.tenant]}
    if scenario.salt_after_public and spec.public_len:
        kw["cache_salt_offset"] = spec.public_len
    return kw


def tenant_salts(config, seed: int) -> dict[str, str]:
    """A secret random salt per tenant (what a server would derive per tenant)."""
    rng = np.random.default_rng([seed, 13])
    tenants = [VICTIM, ATTACKER] + [f"noise-{i}" for i in range(config.num_noise_tenants)]
    return {t: rng.bytes(16).hex() for t in tenants}


class Attribution:
    """Which tenants computed each cached block (by block hash)."""

    def __init__(self):
        self._owners: dict[bytes, set[str]] = {}

    def note(self, tenant: str, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self._owners.setdefault(h, set()).add(tenant)

    def cross_tenant_blocks(self, tenant: str, hit_hashes: Sequence[bytes]) -> int:
        """How many of ``hit_hashes`` only other tenants had computed."""
        return sum(1 for h in hit_hashes if tenant not in self._owners.get(h, ()))


def _probe_row(scenario: Scenario, trial: Trial, req, ttft_s: float, cached: int,
               attribution: Attribution, bs: int, queue_s: float | None = None
               ) -> dict[str, Any]:
    probe = trial.probe
    hit_hashes = list(req.block_hashes[: cached // bs])
    cross = attribution.cross_tenant_blocks(ATTACKER, hit_hashes)
    public_blocks = probe.public_len // bs
    cross_private = attribution.cross_tenant_blocks(ATTACKER, hit_hashes[public_blocks:])
    return {"record": "probe", "scenario": scenario.name, "label": probe.label,
            "ttft_s": ttft_s, "num_cached_tokens": cached,
            "prompt_tokens": len(probe.tokens), "public_tokens": probe.public_len,
            "cross_tenant_hit_tokens": cross * bs,
            "cross_tenant_private_hit_tokens": cross_private * bs, "queue_s": queue_s}


# ----------------------------------------------------------------------------
# engine backend
# ----------------------------------------------------------------------------


def load_model(config):
    """(ModelConfig, model or None) from ``config.model`` / ``config.checkpoint``."""
    from prefixcache.model import ModelConfig, load_hf_checkpoint  # noqa: PLC0415

    if config.checkpoint:
        return load_hf_checkpoint(config.checkpoint)
    return getattr(ModelConfig, config.model)(), None


def make_engine(config, *, scheduling_policy: str = "fcfs", share_programs_with=None):
    from prefixcache.engine import Engine  # noqa: PLC0415

    if share_programs_with is not None:
        model_config, model = share_programs_with.model_config, share_programs_with.model
    else:
        model_config, model = load_model(config)
    e = config.engine
    return Engine(model_config, model=model, num_blocks=config.num_blocks,
                  scheduling_policy=scheduling_policy, share_programs_with=share_programs_with,
                  block_size=config.block_size, seed=config.seed, hash_algo=config.hash_algo,
                  max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                  max_model_len=e.max_model_len,
                  token_buckets=tuple(e.token_buckets) or None,
                  seq_buckets=tuple(e.seq_buckets) or None,
                  page_buckets=tuple(e.page_buckets) or None)


def run_engine_scenario(engine, scenario: Scenario, trials: Sequence[Trial],
                        salts: dict[str, str], *, progress: bool = False) -> list[dict]:
    """Runs the trials on the engine; returns one probe row per measured trial.

    The engine must be idle; its prefix cache is reset first (so scenarios do not
    see each other's blocks).
    """
    from prefixcache.core import Request  # noqa: PLC0415
    from prefixcache.engine import SamplingParams  # noqa: PLC0415

    if engine.has_unfinished_requests():
        raise ValueError("the engine must be idle")
    mgr = engine.kv_cache_manager
    if not mgr.reset_prefix_cache():
        raise ValueError("could not reset the prefix cache (blocks still held)")
    bs = engine.block_size
    attribution = Attribution()
    done: dict[str, Any] = {}
    live: dict[str, tuple[str, Any]] = {}  # request id -> (tenant, Request), not probes
    counter = iter(range(1 << 62))
    rows: list[dict] = []

    def add(spec: Spec) -> tuple[str, Any]:
        rid = f"{scenario.name}-{spec.role}-{next(counter)}"
        req = Request(rid, list(spec.tokens), hasher=mgr.hasher, block_size=bs,
                      **salt_kwargs(scenario, salts, spec))
        if spec.role != "probe":  # the probe's blocks are noted after its hits are read
            attribution.note(spec.tenant, req.block_hashes)
            live[rid] = (spec.tenant, req)
        engine.add_request(req, SamplingParams(max_tokens=spec.max_tokens, temperature=0.0))
        return rid, req

    def step_until(rid: str):
        while rid not in done:
            for out in engine.step():
                done[out.request_id] = out
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                if out.request_id in live:
                    tenant, req = live.pop(out.request_id)
                    attribution.note(tenant, req.block_hashes)  # incl. output blocks
        return done.pop(rid)

    hits0 = first_hit = None
    it = trials
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        it = tqdm(trials, desc=f"engine {scenario.name}", unit="trial")
    for trial in it:
        if trial.measured and hits0 is None:
            hits0 = mgr.counters()["hit_tokens"]  # from the first measured trial on
        vid, _ = add(trial.victim)
        step_until(vid)
        for spec in trial.noise:
            add(spec)
        pid, preq = add(trial.probe)
        out = step_until(pid)
        if first_hit is None:
            first_hit = out.metrics.num_cached_tokens
        if trial.measured:
            rows.append(_probe_row(scenario, trial, preq, out.metrics.ttft_s,
                                   out.metrics.num_cached_tokens, attribution, bs,
                                   out.metrics.queue_s))
        attribution.note(ATTACKER, preq.block_hashes)
        done.clear()  # the noise outputs nobody waits for
    while engine.has_unfinished_requests():
        for out in engine.step():
            done.pop(out.request_id, None)
            live.pop(out.request_id, None)
    _annotate(rows, mgr.counters()["hit_tokens"] - hits0, first_hit)
    return rows


def _annotate(rows: list[dict], manager_hit_tokens: int, first_hit: int) -> None:
    """Scenario-wide counts ride on the last probe row (read by `summarize`)."""
    rows[-1]["manager_hit_tokens_since_first_probe"] = manager_hit_tokens
    rows[-1]["attacker_first_request_hit_tokens"] = first_hit


# ----------------------------------------------------------------------------
# simulator backend
# ----------------------------------------------------------------------------


def run_sim_scenario(config, scenario: Scenario, trials: Sequence[Trial],
                     salts: dict[str, str], *, progress: bool = False) -> list[dict]:
    """The trials through the real ``KVCacheManager``; TTFT = cost model + noise model.

    Each request is prefilled whole (``get_computed_blocks`` -> ``allocate_slots`` ->
    free): hits, evictions and attribution are the manager's. The probe's TTFT is one
    step holding its prefill over its hit, the trial's noise prefills and
    Poisson(``noise_decodes_mean``) decodes (contexts uniform in
    ``noise_decode_context``), times lognormal(0, ``jitter_sigma``), plus a lognormal
    host delay of median ``host_jitter_median_s`` and shape ``host_jitter_sigma``.
    """
    from prefixcache.core import KVCacheManager, Request  # noqa: PLC0415

    sc = config.sim
    if sc.jitter_sigma < 0 or sc.host_jitter_sigma < 0 or sc.host_jitter_median_s < 0:
        raise ValueError("sim jitter parameters must be >= 0")
    cost = _common.cost_model(sc)
    bs = config.block_size
    mgr = KVCacheManager(config.num_blocks, bs, hash_algo=config.hash_algo,
                         hash_seed=config.seed)
    rng = np.random.default_rng([config.seed, 17, len(scenario.name)])
    attribution = Attribution()
    counter = iter(range(1 << 62))
    lo, hi = sc.noise_decode_context

    def serve(spec: Spec):
        req = Request(f"{spec.role}-{next(counter)}", list(spec.tokens),
                      **salt_kwargs(scenario, salts, spec))
        blocks, hit = mgr.get_computed_blocks(req)
        if mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks) is None:
            raise ValueError(f"a {len(spec.tokens)}-token prompt does not fit in "
                             f"num_blocks={config.num_blocks}")
        req.num_computed_tokens = req.num_tokens
        mgr.free(req)
        if spec.role != "probe":
            attribution.note(spec.tenant, req.block_hashes)
        return req, hit

    def queue_and_serve(trial: Trial):
        """The ordering scenarios: the burst and the probe arrive together at one
        simulated server (``des.Server``: the scenario's waiting-queue policy, the cost
        model's step times); returns (probe Request, hit, TTFT, queue time)."""
        from prefixcache.sim import des  # noqa: PLC0415
        from prefixcache.sim.trace import TraceRequest  # noqa: PLC0415

        e = config.engine
        server = des.Server(mgr, cost, des.SchedulerConfig(
            max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs),
            on_finish=lambda s, r: None, on_fail=lambda s, r: None,
            scheduling=scenario.scheduling)
        sims = []
        for spec in (*trial.noise, trial.probe):
            salt = salt_kwargs(scenario, salts, spec)
            assert "cache_salt_offset" not in salt  # burst scenarios salt from block 0
            tr = TraceRequest(id=f"{spec.role}-{next(counter)}", prompt=list(spec.tokens),
                              output_len=spec.max_tokens, cache_salt=salt.get("cache_salt"))
            sims.append(des.make_sim_request(tr, 0.0))
            server.arrive(sims[-1])
        while server.step():
            pass
        for spec, sreq in zip(trial.noise, sims):
            attribution.note(spec.tenant, sreq.req.block_hashes)
        probe = sims[-1]
        if probe.ttft_s is None:
            raise ValueError(f"the probe did not fit in num_blocks={config.num_blocks}")
        return probe.req, probe.num_cached_tokens, probe.ttft_s, probe.first_scheduled_s

    rows: list[dict] = []
    hits0 = first_hit = None
    it = trials
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        it = tqdm(trials, desc=f"sim {scenario.name}", unit="trial")
    for trial in it:
        if trial.measured and hits0 is None:
            hits0 = mgr.counters()["hit_tokens"]
        serve(trial.victim)
        if scenario.burst:
            req, hit, ttft, queue = queue_and_serve(trial)
            if first_hit is None:
                first_hit = hit
            if trial.measured:
                ttft = ttft * float(rng.lognormal(0.0, sc.jitter_sigma)) + float(
                    sc.host_jitter_median_s * rng.lognormal(0.0, sc.host_jitter_sigma))
                rows.append(_probe_row(scenario, trial, req, ttft, hit, attribution,
                                       bs, queue))
            attribution.note(ATTACKER, req.block_hashes)
            continue
        for spec in trial.noise:
            serve(spec)
        req, hit = serve(trial.probe)
        if first_hit is None:
            first_hit = hit
        if trial.measured:
            chunks = [(req.num_tokens - hit, hit)] + [(len(s.tokens), 0) for s in trial.noise]
            decodes = rng.integers(lo, hi + 1, int(rng.poisson(sc.noise_decodes_mean)))
            step = cost.step_time(chunks, decodes.tolist())
            ttft = step * float(rng.lognormal(0.0, sc.jitter_sigma)) + float(
                sc.host_jitter_median_s * rng.lognormal(0.0, sc.host_jitter_sigma))
            rows.append(_probe_row(scenario, trial, req, ttft, hit, attribution, bs))
        attribution.note(ATTACKER, req.block_hashes)
    mgr.check_invariants()
    _annotate(rows, mgr.counters()["hit_tokens"] - hits0, first_hit)
    return rows


# ----------------------------------------------------------------------------
# statistics, plot, run
# ----------------------------------------------------------------------------


def leak_stats(hit_ttft: Sequence[float], miss_ttft: Sequence[float]) -> dict[str, float]:
    """How well TTFT separates hits from misses.

    Returns:
      ``ks_stat``, ``p_value``: ``scipy.stats.ks_2samp(hit, miss,
      alternative="greater")`` (H1: hits are faster: their CDF lies above);
      ``auc``: ROC AUC of the threshold attack "TTFT < t -> hit" over all t,
      ``mannwhitneyu(miss, hit).statistic / (n_miss * n_hit)`` (0.5: no better than a
      coin); ``ttft_gap_s``: median(miss) - median(hit); the medians.

    Raises:
      ValueError: fewer than 2 of either.
    """
    from scipy import stats  # noqa: PLC0415

    hit = np.asarray(hit_ttft, np.float64)
    miss = np.asarray(miss_ttft, np.float64)
    if hit.size < 2 or miss.size < 2:
        raise ValueError(f"need >= 2 hit and miss samples, got {hit.size} and {miss.size}")
    ks = stats.ks_2samp(hit, miss, alternative="greater")
    u = stats.mannwhitneyu(miss, hit, alternative="greater")
    return {"n_hit": int(hit.size), "n_miss": int(miss.size),
            "ks_stat": float(ks.statistic), "p_value": float(ks.pvalue),
            "auc": float(u.statistic) / (hit.size * miss.size),
            "ttft_gap_s": float(np.median(miss) - np.median(hit)),
            "median_hit_s": float(np.median(hit)), "median_miss_s": float(np.median(miss))}


_SCENARIO_WIDE = ("manager_hit_tokens_since_first_probe", "attacker_first_request_hit_tokens")


def summarize(rows: Sequence[dict]) -> dict[str, Any]:
    """The scenario summary of its probe rows (``leak_stats`` + hit-token counts)."""
    hit = [r["ttft_s"] for r in rows if r["label"] == "hit"]
    miss = [r["ttft_s"] for r in rows if r["label"] == "miss"]
    out = leak_stats(hit, miss)
    qhit = [r["queue_s"] for r in rows if r["label"] == "hit" and r.get("queue_s") is not None]
    qmiss = [r["queue_s"] for r in rows if r["label"] == "miss" and r.get("queue_s") is not None]
    if len(qhit) >= 2 and len(qmiss) >= 2:
        q = leak_stats(qhit, qmiss)
        out.update({"queue_ks_stat": q["ks_stat"], "queue_p_value": q["p_value"],
                    "queue_auc": q["auc"], "queue_gap_s": q["ttft_gap_s"]})
    out.update({
        "cross_tenant_hit_tokens": sum(r["cross_tenant_hit_tokens"] for r in rows),
        "cross_tenant_private_hit_tokens": sum(r["cross_tenant_private_hit_tokens"]
                                               for r in rows),
        "attacker_hit_tokens": sum(r["num_cached_tokens"] for r in rows),
        "attacker_hit_tokens_on_hit_guesses": sum(r["num_cached_tokens"] for r in rows
                                                  if r["label"] == "hit"),
        "manager_hit_tokens": rows[-1]["manager_hit_tokens_since_first_probe"],
        "attacker_first_request_hit_tokens": rows[-1]["attacker_first_request_hit_tokens"],
        "public_tokens": rows[0]["public_tokens"],
    })
    return out


def plot(by_scenario: dict[str, list[dict]], summaries: dict[str, dict], path, *,
         title: str) -> None:
    """One panel per scenario in a grid of up to 3 columns: TTFT histograms of hit and
    miss probes (log x)."""
    from matplotlib.ticker import (FormatStrFormatter, LogLocator,  # noqa: PLC0415
                                   NullFormatter)

    n = len(by_scenario)
    ncols = min(n, 3)
    nrows = -(-n // ncols)
    fig, axes = _common.new_figure(nrows, ncols, figsize=(4.4 * ncols, 3.3 * nrows),
                                   squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    for ax, (name, rows) in zip(flat, by_scenario.items()):
        ms = np.asarray([r["ttft_s"] for r in rows]) * 1e3
        lo, hi = max(ms.min(), 1e-6), ms.max()
        bins = np.geomspace(lo, hi * 1.0001 if hi > lo else lo * 2, 40)
        for label, color in (("hit", "tab:red"), ("miss", "tab:blue")):
            ax.hist([r["ttft_s"] * 1e3 for r in rows if r["label"] == label], bins=bins,
                    histtype="step", color=color, label=f"{label} guess")
        s = summaries[name]
        ax.set_xscale("log")
        # Ticks at 1-2-5 steps as plain numbers (a log axis within one decade has none).
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("attacker TTFT (ms)")
        ax.set_title(f"{name}\nKS p={s['p_value']:.2g}  AUC={s['auc']:.2f}  "
                     f"x-tenant hit tok={s['cross_tenant_hit_tokens']}", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for row in axes:
        row[0].set_ylabel("probes")
    fig.tight_layout()
    fig.suptitle(title, fontsize=9, y=1.02)
    _common.save_plot(fig, path)


def run(config, *, progress: bool = False) -> dict:
    """Runs every scenario on ``config.backend``; writes results.jsonl and the PNG."""
    _check_config(config)
    scenarios, skipped = parse_scenarios(config.scenarios, config.backend)
    workdir = _common.prepare_workdir(config.workdir)
    salts = tenant_salts(config, config.seed)
    # NOTE: provenance (git revision, dirty flag) taken before the run: the code that ran.
    prov = _common.provenance(config, seed=config.seed, hash_algo=config.hash_algo,
                              cache_state="warm", extra={"backend": config.backend})
    # Each finished scenario's probe rows are saved at once; a rerun resumes from them.
    log = _common.CellLog(workdir, "audit_timing",
                          _common.run_fingerprint(config, seed=config.seed))
    by_scenario: dict[str, list[dict]] = {}
    summaries: dict[str, dict] = {}
    engines: dict[str, Any] = {}
    engine = None
    if config.backend == "sim":
        vocab = int(config.sim.vocab)
        sc = config.sim
        what = f"sim: {sc.model} on {sc.num_chips}x {sc.accelerator} + noise model"
    else:
        what = f"engine: {config.checkpoint or config.model} on this machine"
    for k, scenario in enumerate(scenarios):
        key = _common.cell_key({"scenario": scenario.name, "index": k})
        if key not in log:
            if config.backend == "engine" and engine is None:  # built only when needed
                engine = engines["fcfs"] = make_engine(config)
            if engine is not None:
                vocab = engine.vocab_size
            trials = make_trials(config, scenario, vocab, config.seed + k)
            if engine is not None:
                if scenario.scheduling not in engines:  # same model and compiled programs
                    engines[scenario.scheduling] = make_engine(
                        config, scheduling_policy=scenario.scheduling,
                        share_programs_with=engine)
                rows = run_engine_scenario(engines[scenario.scheduling], scenario, trials,
                                           salts, progress=progress)
            else:
                rows = run_sim_scenario(config, scenario, trials, salts, progress=progress)
            log.add(key, rows)
        by_scenario[scenario.name] = log.get(key)
        summaries[scenario.name] = summarize(by_scenario[scenario.name])
    # Cache state warm: the warm-up trials ran before every measured probe. The JAX
    # backend and device once the engine (if any) was built.
    prov["jax"] = _common.jax_devices()
    prov["resumed_scenarios"] = log.resumed
    _common.write_json_atomic(workdir / "provenance.json", prov)
    # Provenance once per file (a header line, rows carry its provenance_id).
    with _common.AtomicJsonlWriter(workdir / "results.jsonl", prov,
                                   provenance_once=True) as w:
        for name, rows in by_scenario.items():
            for r in rows:
                w.write({k: v for k, v in r.items() if k not in _SCENARIO_WIDE})
            w.write({"record": "scenario", "scenario": name, "backend": config.backend,
                     **summaries[name]})
        for name, why in skipped.items():
            w.write({"record": "skipped_scenario", "scenario": name, "reason": why})
    plot(by_scenario, summaries, workdir / "audit_timing.png",
         title=f"prefix-cache timing audit ({what}); {config.num_probes} hit + "
               f"{config.num_probes} miss probes per scenario")
    return {"backend": config.backend, "model": what, "num_probes": config.num_probes,
            "scenarios": summaries, "skipped_scenarios": skipped}


def main() -> None:
    _common.run_cli(run, config_name="audit_timing")


if __name__ == "__main__":
    main()

