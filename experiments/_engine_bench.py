"""Engine benchmarks (library code behind `python -m experiments.bench_engine`).

Three measurements, each on its own engine, all after compile warm-up:

* `ttft_cold_vs_warm`: a request whose first `prefix_len` tokens are cached and
  `new_len` are new, against the same-length request with nothing cached (fresh random
  tokens every trial), side by side; median over trials.
* `host_step_cost`: with `num_running` requests all decoding, the host side of one
  engine step (scheduling + metadata/input building) and the device part (transfer +
  run + fetch of the sampled ids) timed separately; median over steps; plus the same
  host work timed back to back without device steps in between (`*_isolated_ms`).
  NOTE: with CPU JAX the "device" step runs on the same cores and evicts the host's
  CPU caches (weights + KV, tens of MB) between host phases, so the in-loop figure is
  pessimistic for an accelerator; the isolated figure is the host work itself.
* `compiled_programs`: a mixed workload of `num_requests` requests (shared prefixes,
  random lengths, greedy and sampled); the number of distinct step programs run, against
  the builder's bound.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np

from prefixcache.engine.engine import Engine
from prefixcache.engine.sampling_params import SamplingParams


def ttft_cold_vs_warm(model_config, *, prefix_len: int, new_len: int, block_size: int,
                      num_trials: int, seed: int, attention_backend: str = "auto"
                      ) -> dict[str, Any]:
    """Cold vs warm TTFT of a (prefix_len cached + new_len new)-token prompt.

    Returns:
      cold_ttft_s, warm_ttft_s (medians), ttft_ratio (warm / cold), the same from the
      minima (`*_min_s`, ttft_ratio_min: the figures least disturbed by a shared CPU),
      where the warm request's step went (`warm_{schedule,prepare,device}_ms`, medians
      of `Engine.last_step_times`; TTFT also holds admission and the start of the
      update), the scheduled token count of the warm request and its cached tokens
      (asserted == new_len, prefix_len).
    """
    total = prefix_len + new_len
    if prefix_len % block_size:
        raise ValueError(f"prefix_len {prefix_len} must be a multiple of block_size")
    num_blocks = 4 * (-(-total // block_size)) + 8
    # NOTE: the largest token bucket is exactly the cold prompt, so the cold step is not
    # padded (padding would inflate cold TTFT and flatter the ratio).
    engine = Engine(model_config, num_blocks=num_blocks, block_size=block_size, seed=seed,
                    max_num_seqs=4, max_num_batched_tokens=total,
                    max_model_len=total + block_size,
                    attention_backend=attention_backend)
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=1)
    vocab = model_config.vocab_size

    def one(prompt):
        (out,) = engine.generate([prompt], params)
        return out

    cold, warm, warm_steps = [], [], []
    for trial in range(num_trials + 1):  # trial 0 compiles both programs
        prefix = rng.integers(1, vocab, prefix_len).tolist()
        c = one(prefix + rng.integers(1, vocab, new_len).tolist())
        assert c.metrics.num_cached_tokens == 0
        w = one(prefix + rng.integers(1, vocab, new_len).tolist())
        # The warm request ran in one step that computed only its new tokens.
        warm_scheduled = engine.last_scheduler_output.total_num_scheduled_tokens
        assert w.metrics.num_cached_tokens == prefix_len, w.metrics
        assert warm_scheduled == new_len, warm_scheduled
        if trial:
            cold.append(c.metrics.ttft_s)
            warm.append(w.metrics.ttft_s)
            warm_steps.append(engine.last_step_times)
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    phases = [statistics.median(x) * 1e3 for x in zip(*warm_steps)]
    return dict(cold_ttft_s=cold_s, warm_ttft_s=warm_s, ttft_ratio=warm_s / cold_s,
                cold_ttft_min_s=min(cold), warm_ttft_min_s=min(warm),
                ttft_ratio_min=min(warm) / min(cold), warm_schedule_ms=phases[0],
                warm_prepare_ms=phases[1], warm_device_ms=phases[2],
                prefix_len=prefix_len, new_len=new_len, num_trials=num_trials,
                warm_cached_tokens=prefix_len, warm_scheduled_tokens=warm_scheduled)


def host_step_cost(model_config, *, num_running: int, prompt_len: int, block_size: int,
                   num_steps: int, seed: int, attention_backend: str = "auto"
                   ) -> dict[str, Any]:
    """Host vs device time of one decode step with `num_running` running requests."""
    max_tokens = 2 * num_steps + 8
    tokens_per_req = prompt_len + max_tokens
    num_blocks = num_running * (-(-tokens_per_req // block_size)) + 16
    engine = Engine(model_config, num_blocks=num_blocks, block_size=block_size, seed=seed,
                    max_num_seqs=num_running,
                    max_num_batched_tokens=max(num_running * prompt_len, 64),
                    attention_backend=attention_backend)
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, model_config.vocab_size, prompt_len // 2).tolist()
    for _ in range(num_running):
        tail = rng.integers(1, model_config.vocab_size, prompt_len - len(shared)).tolist()
        engine.add_request(shared + tail, SamplingParams(max_tokens=max_tokens))
    engine.step()  # all prefills
    engine.step()  # first decode step compiles the decode program
    sched_ms, prep_ms, dev_ms, upd_ms = [], [], [], []
    for _ in range(num_steps):
        engine.step()
        out = engine.last_scheduler_output
        assert len(out.scheduled) == num_running and out.total_num_scheduled_tokens == num_running
        s, p, d, u = engine.last_step_times
        sched_ms.append(s * 1e3)
        prep_ms.append(p * 1e3)
        dev_ms.append(d * 1e3)
        upd_ms.append(u * 1e3)
    host = [s + p for s, p in zip(sched_ms, prep_ms)]
    # The same host work back to back, without the device step in between (warm CPU
    # caches, no XLA threads competing): the inherent cost of scheduling + metadata.
    isolated = []
    sched, runner = engine.scheduler, engine.runner
    for _ in range(num_steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        runner.prepare(out.scheduled, sched.block_tables)
        isolated.append((time.perf_counter() - t0) * 1e3)
        assert len(out.scheduled) == num_running
        sched.update_from_output(out, {s.request_id: 1 for s in out.scheduled})
    # NOTE: the median inside real engine steps is the headline; the minimum is the cost
    # without OS preemption (the CPU is shared), and the load average says how shared.
    return dict(host_step_ms=statistics.median(host), host_step_min_ms=min(host),
                host_step_isolated_ms=statistics.median(isolated),
                host_step_p90_ms=float(np.percentile(host, 90)),
                load_average_1min=os.getloadavg()[0], num_cpus=os.cpu_count(),
                host_schedule_ms=statistics.median(sched_ms),
                host_metadata_ms=statistics.median(prep_ms),
                host_update_ms=statistics.median(upd_ms),
                device_step_ms=statistics.median(dev_ms),
                num_running=num_running, num_steps=num_steps)


def compiled_programs(model_config, *, num_requests: int, block_size: int, num_blocks: int,
                      max_num_seqs: int, max_num_batched_tokens: int, seed: int,
                      attention_backend: str = "auto") -> dict[str, Any]:
    """Distinct step programs over a mixed `num_requests`-request run."""
    engine = Engine(model_config, num_blocks=num_blocks, block_size=block_size, seed=seed,
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                    attention_backend=attention_backend)
    rng = np.random.default_rng(seed)
    vocab = model_config.vocab_size
    prefixes = [rng.integers(1, vocab, int(n)).tolist() for n in (64, 200, 400)]
    prompts, params = [], []
    for i in range(num_requests):
        p = prefixes[i % 3] if rng.random() < 0.7 else []
        prompts.append(p + rng.integers(1, vocab, int(rng.integers(1, 120))).tolist())
        sampled = rng.random() < 0.3
        params.append(SamplingParams(max_tokens=int(rng.integers(1, 12)),
                                     temperature=0.8 if sampled else 0.0, top_p=0.9,
                                     seed=i))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    m = engine.metrics()
    assert all(o.error is None for o in outs)
    # Bound: every (T, S, P) bucket x greedy/sampled (no multimodal items here).
    bound = engine.runner.builder.num_buckets * 2
    return dict(num_compiled_programs=m.num_compiled_programs, compiled_programs_bound=bound,
                num_requests=num_requests, num_steps=m.num_steps, wall_s=wall,
                token_hit_rate=m.token_hit_rate, num_preemptions=m.num_preemptions,
                num_evictions=m.num_evictions)


def host_tier_promotion(model_config, *, num_blocks_loaded: int, num_device_blocks: int,
                        block_size: int, num_trials: int, seed: int, **_unused
                        ) -> dict[str, Any]:
    """The host tier's promotion path against a plain `jax.device_put` of the same bytes.

    Per trial, interleaved: (a) `HostPages.apply` of `num_blocks_loaded` loads (host
    slots staged into one buffer, ONE device_put, ONE jitted scatter into donated KV
    arrays of `model_config`'s shapes) until the KV is ready; (b) `jax.device_put` of a
    numpy array holding the same bytes until ready. Medians; `promotion_vs_device_put`
    = (b) / (a): the share of plain transfer speed the promotion path reaches (issue
    16's target on an accelerator: >= 0.7).
    """
    import jax  # noqa: PLC0415

    from prefixcache.engine.host_pages import HostPages  # noqa: PLC0415
    from prefixcache.model import make_kv_caches  # noqa: PLC0415

    n = num_blocks_loaded
    # (the engine's layout: the scanned step's stacked KV [L, num_pages, ...])
    kv = make_kv_caches(model_config, num_blocks=num_device_blocks, block_size=block_size,
                        stacked=True)
    pages = HostPages(kv, num_blocks=num_device_blocks, num_host_blocks=n)
    rng = np.random.default_rng(seed)
    for p in pages.pages:
        p[:] = rng.standard_normal(p.shape).astype(p.dtype)
    plain = np.stack([p.copy() for p in pages.pages])  # [L, n, page, 2K, H]
    loads = [("load", b, s) for s, b in enumerate(range(num_device_blocks - n,
                                                        num_device_blocks))]
    promo_ms, put_ms = [], []
    for trial in range(num_trials + 1):  # trial 0 compiles
        t0 = time.perf_counter()
        kv = pages.apply(kv, loads)
        jax.block_until_ready(kv)
        t1 = time.perf_counter()
        x = jax.block_until_ready(jax.device_put(plain))
        t2 = time.perf_counter()
        del x
        if trial:
            promo_ms.append((t1 - t0) * 1e3)
            put_ms.append((t2 - t1) * 1e3)
    got = np.asarray(jax.device_get(kv[0][num_device_blocks - n:num_device_blocks]))
    assert got.tobytes() == pages.pages[0].tobytes(), "promoted pages differ"
    promo, put = statistics.median(promo_ms), statistics.median(put_ms)
    return dict(host_tier_blocks=n, host_tier_bytes=int(plain.nbytes),
                host_tier_dtype=str(plain.dtype), promotion_ms=promo, device_put_ms=put,
                promotion_gb_s=plain.nbytes / promo / 1e6,
                device_put_gb_s=plain.nbytes / put / 1e6,
                promotion_vs_device_put=put / promo,
                host_tier_device=str(jax.devices()[0].device_kind))
