r"""Where a decode step's time goes, against the memory-bandwidth bound.

  python -m experiments.profile_decode --config=configs/profile_decode.py \
      --workdir=/tmp/profile_decode

See configs/profile_decode.py. Writes profile_decode.jsonl (one line per decode batch,
with provenance) into the workdir; the last stdout line is the JSON result.

Per batch b: the engine's decode step (wall and CPU ms, split into the host's schedule /
prepare / update and the device call), the bound (the weights' bytes plus the KV the
step reads, over the read bandwidth a jitted reduction measures), and the pieces timed
alone as jitted functions of the step's real shapes: the LM head, the sampler over the
full vocabulary (greedy and random), and the attention of every layer over a page table
of the step's bucket and of larger ones (padding pages the kernel walks).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from experiments import _common


def _time(fn, repeats: int) -> dict:
    """Median wall and CPU milliseconds of `fn()` (which blocks), after one warm-up."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return {"wall_ms": round(1e3 * statistics.median(walls), 3),
            "cpu_ms": round(1e3 * statistics.median(cpus), 3)}


def run(config, *, progress: bool = False) -> dict:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    import prefixcache_kernels as kernels  # noqa: PLC0415
    from experiments.bench_real_model import default_checkpoint  # noqa: PLC0415
    from experiments.bench_real_model import engine_buckets  # noqa: PLC0415
    from experiments.chat import checkpoint_path  # noqa: PLC0415
    from prefixcache.engine import Engine, SamplingParams  # noqa: PLC0415
    from prefixcache.engine.sampler import SamplingArrays, sample  # noqa: PLC0415
    from prefixcache.model import load_pretrained  # noqa: PLC0415

    engine_buckets(config, 1, 1)  # (bad bucket minima refused before the load)
    workdir = _common.prepare_workdir(config.workdir)
    path = checkpoint_path(config.checkpoint) if config.checkpoint else default_checkpoint()
    pre = load_pretrained(path, dtype=config.dtype, progress=progress)
    cfg = pre.config
    batches = [int(b) for b in config.decode_batches.split(",") if b.strip()]
    N, prompt_len, bs = config.decode_tokens, config.prompt_len, config.block_size
    max_tokens = max(prompt_len * max(batches), 64)
    engine = Engine(cfg, model=pre.model, num_blocks=config.num_blocks, block_size=bs,
                    enable_caching=False, max_num_seqs=max(batches),
                    max_num_batched_tokens=max_tokens,
                    max_model_len=prompt_len + N + 64, seed=config.seed,
                    scan_layers=config.scan_layers,
                    **engine_buckets(config, max_tokens, max(batches)))
    rng = np.random.default_rng(config.seed)
    weights = [x for x in jax.tree.leaves(nnx.state(pre.model)) if isinstance(x, jax.Array)]
    weight_bytes = sum(x.nbytes for x in weights)

    # Read bandwidth: a jitted sum over an array larger than the caches.
    big = jnp.ones((config.bandwidth_mib << 18,), jnp.float32)
    total = jax.jit(jnp.sum)
    bw = _time(lambda: total(big).block_until_ready(), config.repeats)
    read_gb_s = big.nbytes / (bw["wall_ms"] / 1e3) / 1e9
    results = []
    dt = jnp.dtype(cfg.dtype)
    head = pre.model.embedding[...] if cfg.tie_embeddings else pre.model.lm_head[...]
    with _common.AtomicJsonlWriter(workdir / "profile_decode.jsonl") as out:
        for b in batches:
            prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(b)]
            one, many = SamplingParams(max_tokens=1), SamplingParams(max_tokens=1 + N)
            engine.generate(prompts, many)  # compiles prefill and decode

            def measured(params):
                engine.reset_metrics()
                t, c = time.perf_counter(), time.process_time()
                engine.generate(prompts, params)
                m = engine.metrics()
                return (time.perf_counter() - t, time.process_time() - c, m.host_schedule_s,
                        m.host_prepare_s, m.device_s, m.host_update_s)

            runs1 = [measured(one) for _ in range(config.repeats)]
            runsN = [measured(many) for _ in range(config.repeats)]
            per_step = [1e3 * (statistics.median(r[i] for r in runsN)
                               - statistics.median(r[i] for r in runs1)) / N
                        for i in range(6)]
            step = dict(zip(("wall_ms", "cpu_ms", "schedule_ms", "prepare_ms", "device_ms",
                             "update_ms"), (round(x, 3) for x in per_step)))
            kv_len = prompt_len + N // 2  # (the mean over the decode steps)
            kv_bytes = (b * kv_len * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
                        * dt.itemsize)
            bound_ms = 1e3 * (weight_bytes + kv_bytes) / (read_gb_s * 1e9)
            # The pieces, alone.
            x = jnp.asarray(rng.standard_normal((b, cfg.d_model)), dt)
            lm = jax.jit(lambda x, w: jnp.einsum("sd,vd->sv", x, w,
                                                 preferred_element_type=jnp.float32))
            logits = lm(x, head)
            greedy = SamplingArrays.build([], b)
            rand = SamplingArrays.build([(1.0, 0, 1.0, 7, 0)] * b, b)
            samp = jax.jit(sample, static_argnames="all_greedy")
            pieces = {
                "lm_head": _time(lambda: lm(x, head).block_until_ready(), config.repeats),
                "sampler_greedy": _time(lambda: samp(logits, greedy, all_greedy=True)
                                        .block_until_ready(), config.repeats),
                "sampler_random": _time(lambda: samp(logits, rand, all_greedy=False)
                                        .block_until_ready(), config.repeats),
            }
            K, H = cfg.num_kv_heads, cfg.head_dim
            pages_needed = -(-kv_len // bs)
            kv = jnp.zeros((config.num_blocks + 1, bs, 2 * K, H), dt)
            q = jnp.asarray(rng.standard_normal((b, cfg.num_heads, H)), dt)
            kv_lens = jnp.full((b,), kv_len, jnp.int32)
            cu = jnp.arange(b + 1, dtype=jnp.int32)
            ns = jnp.asarray([b], jnp.int32)
            for P in sorted({pages_needed, 4 * pages_needed, 16 * pages_needed}):
                P = min(P, config.num_blocks // b)
                table = jnp.asarray(
                    np.arange(b * P, dtype=np.int32).reshape(b, P) % config.num_blocks)
                att = jax.jit(lambda q, kv, t: kernels.paged_attention(
                    q, kv, kv_lens, t, cu, ns, sm_scale=cfg.attention_scale))
                one_layer = _time(lambda: att(q, kv, table).block_until_ready(),
                                  config.repeats)
                pieces[f"attention_{P}_pages_all_layers"] = {
                    k: round(v * cfg.num_layers, 3) for k, v in one_layer.items()}
            rec = {"checkpoint": path, "dtype": config.dtype, "batch": b,
                   "kv_len_mean": kv_len, "step": step, "tok_s_wall": round(
                       1e3 * b / step["wall_ms"], 2) if step["wall_ms"] > 0 else None,
                   "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
                   "read_gb_s": round(read_gb_s, 2), "bound_ms": round(bound_ms, 3),
                   "fraction_of_bound": round(bound_ms / step["wall_ms"], 3)
                   if step["wall_ms"] > 0 else None,
                   "pages_in_step_bucket": pages_needed, "pieces": pieces}
            out.write({**rec, "provenance": _common.provenance(config, seed=config.seed)})
            results.append(rec)
            print(json.dumps(rec), file=sys.stderr, flush=True)
    return {"results": results}


if __name__ == "__main__":
    _common.run_cli(run, config_name="profile_decode")
