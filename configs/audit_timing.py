"""Timing side-channel audit of the prefix cache on the real engine (tiny model, CPU).

Runs experiments.audit_timing: per scenario, 250 trials in which a victim tenant plants
a fresh 256-token secret and the attacker then probes with the right guess (hit) and
250 with a wrong one (miss), labels shuffled, while noise tenants' requests (Poisson,
1 per probe on average, 16-256 tokens, 1-8 output tokens) arrive before each probe and
share its steps. Scenarios: no_salt, tenant_salt (vLLM's first-block salt per tenant),
public_prefix_salted_rest (a 256-token public system prompt shared by all, the salt from
its end on: Request(cache_salt_offset=256)), public_prefix_first_block_salt (the same
prompts, vLLM's salt), ordering (no salt, the engine admits longest cached prefix first
-- `lpm` -- and 6 noise requests of 256 tokens are queued before each probe),
ordering_fcfs (the same burst under FCFS: the control) and ordering_tenant_salt (lpm
with per-tenant salts). Any ModelConfig preset (`--config.model=llama_3_2_1b`) or an
HF checkpoint (`--config.checkpoint=/path`) works; `--config.backend=sim` runs the
simulator version (see configs/audit_timing_sim.py for Llama-3.1-70B).

Command:
  python -m experiments.audit_timing --config=configs/audit_timing.py --workdir=/tmp/audit

Run time: a full run did not finish within 10 minutes on the shared 2-core dev machine
(rerun with the same --workdir to resume: finished scenarios
are kept in audit_timing.cells.jsonl). Quick variant (`:quick`: 20 probes per class, 4
warm-up trials, every scenario): 50 s wall on that machine under a load average of ~5.

Expected (the numbers of one full run, under a load average of ~15):
no_salt leaks: one-sided KS p ~1e-33 (< 1e-6), AUC ~0.8 (the noise traffic overlaps the
classes), median TTFT 31.5 ms (hit) vs 76.8 ms (miss) under that load (~10 vs ~25 ms
on an idle machine), cross_tenant_hit_tokens = 250 * 256 = 64000 (every hit guess reuses
the victim's 16 secret blocks); tenant_salt: p ~0.8 (> 0.01; uniform under no leak), AUC
~0.48, cross_tenant_hit_tokens 0 and the manager's hit counter 0;
public_prefix_salted_rest: p ~0.8, AUC ~0.48, cross_tenant_private_hit_tokens 0, the
attacker's first request hits the 256-token public prompt (shared across tenants);
public_prefix_first_block_salt: p ~0.8, the attacker's first request hits nothing (each
tenant recomputes the public prompt once).
"""

import ml_collections

from configs import _base


def get_config(arg=None):
    quick = _base.variant(arg)
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = ""
    c.backend = "engine"  # "engine" (real engine, wall clock) | "sim" (cost + noise model)
    c.scenarios = ("no_salt,tenant_salt,public_prefix_salted_rest,"
                   "public_prefix_first_block_salt,ordering,ordering_fcfs,ordering_tenant_salt")
    c.num_probes = 250  # per class (hit guesses, miss guesses)
    c.warmup_trials = 8  # unmeasured trials first (compiles every step shape)
    c.secret_len = 256  # the victim's secret (the attacker's guess), tokens
    c.public_len = 256  # the public system prompt of the public_prefix scenarios
    c.query_len = 16  # each request's own question after the secret
    c.victim_max_tokens = (1, 4)
    c.num_noise_tenants = 4
    c.noise_rate = 1.0  # mean noise requests per probe (Poisson)
    c.noise_prompt_len = (16, 256)
    c.noise_max_tokens = (1, 8)
    # The ordering scenarios: noise requests queued right before each probe.
    c.ordering_burst = 6
    c.ordering_noise_len = 256
    c.block_size = 16
    c.num_blocks = 1024
    c.hash_algo = "sha256"

    # The engine backend.
    c.model = "tiny"  # a ModelConfig preset: tiny | llama_3_2_1b | qwen2_5_0_5b
    c.checkpoint = ""  # an HF checkpoint directory (overrides model)
    c.engine = ml_collections.ConfigDict()
    c.engine.max_num_seqs = 8
    c.engine.max_num_batched_tokens = 1024
    c.engine.max_model_len = 1024
    c.engine.token_buckets = (64, 256, 1024)  # few shapes: few compiles on CPU
    c.engine.seq_buckets = (8,)
    c.engine.page_buckets = (64,)  # max_model_len / block_size

    # The simulator backend (cost-model TTFT + noise model).
    c.sim = ml_collections.ConfigDict()
    c.sim.model = "llama_3_1_70b"  # a prefixcache.sim.cost_model.ModelShape preset
    c.sim.accelerator = "h100"
    c.sim.num_chips = 8
    c.sim.flops_efficiency = 0.5
    c.sim.bandwidth_efficiency = 0.7
    c.sim.step_overhead_s = 0.002
    c.sim.vocab = 32000
    c.sim.noise_decodes_mean = 16.0  # decoding sequences sharing the probe's step
    c.sim.noise_decode_context = (256, 4096)
    c.sim.jitter_sigma = 0.1  # lognormal factor on the step time
    c.sim.host_jitter_median_s = 0.005  # lognormal host / network delay
    c.sim.host_jitter_sigma = 0.5
    if quick:  # 20 probes per class, 4 warm-up trials, every scenario
        c.num_probes = 20
        c.warmup_trials = 4
    return c
