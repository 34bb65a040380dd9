r"""Serving benchmark: the engine + the tiny model on a workload, prefix caching off vs on.

  python -m experiments.serve_bench --config=configs/serve_bench.py --workdir=/tmp/serve

The workload's requests are served in arrival order, ``batch_size`` at a time
(one ``Engine.generate`` call per batch, continuous batching inside it), three
times on engines built with the same seed:

* ``off``: prefix caching disabled (the baseline; cache state ``cold``);
* ``on_cold``: caching enabled, cache empty at the start;
* ``on_warm``: the same engine again, its cache warm from the ``on_cold`` pass.

Each engine first serves an untimed copy of the workload drawn with another seed
(same shapes; twice with caching on, cold then warm), so every bucketed step
program is compiled before timing (``num_compiled_programs`` stays constant). Greedy
decoding: the generated tokens must be identical in all three passes (checked and
reported). Output lengths are capped at ``max_tokens``. Multimodal items get
deterministic random embeddings per identifier.

KV pool: ``num_blocks`` blocks, or ``kv_cache_bytes`` (a byte budget such as
``"1MiB"``; then ``num_blocks`` must be 0) turned into blocks by the engine for
``kv_dtype`` ("" = the model's dtype; `prefixcache.kv_dtypes.KV_DTYPES`), the
padding page counted (`Engine(kv_cache_bytes=...)`): so fp8 and bf16 can be compared
at one budget. Summary rows carry ``kv_dtype``, ``kv_bytes_per_block``,
``num_blocks``, ``kv_pool_bytes`` (the KV arrays' bytes) and ``kv_cache_bytes`` (the
budget, or None).

NOTE: the tiny model's outputs are not the trace's ``output_token`` tokens, so a
multi-turn workload hits only its prompt blocks here, not earlier outputs.

Writes ``results.jsonl`` (per-request rows and one summary per pass, provenance
on each) and ``serve_bench.png`` (TTFT by cached tokens per pass); prints one
summary JSON line.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence

from experiments import _common

PASSES = (("off", False, "cold"), ("on_cold", True, "cold"), ("on_warm", True, "warm"))


def _mm_embeddings(tr, d_model: int):
    """Deterministic f32[length, d_model] rows per multimodal identifier (None if none)."""
    import numpy as np  # noqa: PLC0415

    if not tr.mm:
        return None
    return {ident: np.random.default_rng(zlib.crc32(ident.encode()))
            .standard_normal((length, d_model)).astype(np.float32)
            for ident, _, length in tr.mm}


def serve(engine, requests: Sequence, *, tag: str, batch_size: int, max_tokens: int,
          progress: bool = False) -> tuple[list[dict], list[list[int]], float]:
    """Serves ``requests`` in batches; returns (per-request rows, outputs, wall seconds)."""
    from prefixcache.core.request import LoRARequest, MultiModalFeature, Request  # noqa: PLC0415
    from prefixcache.engine import SamplingParams  # noqa: PLC0415

    d_model = engine.model_config.d_model
    rows, outputs = [], []
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        batches = tqdm(batches, desc=f"serve {tag}", unit="batch")
    t0 = time.perf_counter()
    for batch in batches:
        reqs = [Request(f"{tr.id}#{tag}", tr.prompt,
                        mm_features=tuple(MultiModalFeature(*m) for m in tr.mm),
                        lora=tr.lora and LoRARequest(*tr.lora), cache_salt=tr.cache_salt)
                for tr in batch]
        params = [SamplingParams(max_tokens=max(1, min(tr.output_len, max_tokens)),
                                 temperature=0.0) for tr in batch]
        mms = [_mm_embeddings(tr, d_model) for tr in batch]
        for tr, out in zip(batch, engine.generate(reqs, params, mm_embeddings=mms)):
            m = out.metrics
            rows.append({"id": tr.id, "prompt_tokens": m.num_prompt_tokens,
                         "num_cached_tokens": m.num_cached_tokens, "ttft_s": m.ttft_s,
                         "e2e_s": m.e2e_s, "queue_s": m.queue_s,
                         "output_tokens": m.num_output_tokens, "error": out.error})
            outputs.append(list(out.token_ids))
    return rows, outputs, time.perf_counter() - t0


# EngineMetrics fields of the KV pool in every summary row.
KV_POOL_KEYS = ("kv_dtype", "kv_bytes_per_block", "num_blocks", "kv_pool_bytes",
                "kv_cache_bytes")


def pool_kwargs(config, model_config) -> dict:
    """The Engine's pool arguments (num_blocks or kv_cache_bytes, kv_dtype) of ``config``.

    Raises:
      ValueError: an unknown kv_dtype; a bad budget or one without room for a block
        and the padding page; both a budget and num_blocks (set num_blocks=0) or
        neither -- before anything runs.
    """
    from prefixcache.kv_dtypes import (check_kv_dtype, kv_bytes_per_block,  # noqa: PLC0415
                                       num_pool_blocks_for_bytes, parse_bytes)

    kv_dtype = check_kv_dtype(config.kv_dtype or model_config.dtype)
    budget = str(config.kv_cache_bytes).strip()
    if not budget:
        if config.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 without kv_cache_bytes, got "
                             f"{config.num_blocks}")
        return {"num_blocks": config.num_blocks, "kv_dtype": kv_dtype}
    if config.num_blocks:
        raise ValueError(f"give the KV pool as num_blocks or kv_cache_bytes, not both "
                         f"(num_blocks={config.num_blocks}, kv_cache_bytes={budget!r}): "
                         "set --config.num_blocks=0 with a byte budget")
    num_pool_blocks_for_bytes(parse_bytes(budget), kv_bytes_per_block(
        num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim, block_size=config.block_size, kv_dtype=kv_dtype))
    return {"kv_cache_bytes": budget, "kv_dtype": kv_dtype}


# EngineMetrics fields of the host tier shown in the summary rows (None: no tier).
HOST_TIER_KEYS = ("device_hit_tokens", "host_hit_tokens", "host_blocks_loaded",
                  "host_blocks_stored", "host_bytes_loaded", "host_bytes_stored",
                  "host_pool_bytes", "host_copy_programs")


def bench(requests: Sequence, warmup_requests: Sequence, config, *,
          progress: bool = False) -> tuple[list[dict], list[dict]]:
    """Runs the three passes; returns (summaries, per-request rows)."""
    from prefixcache._validate import check_count  # noqa: PLC0415
    from prefixcache.engine import Engine  # noqa: PLC0415
    from prefixcache.engine.faults import parse_fault  # noqa: PLC0415
    from prefixcache.model import ModelConfig  # noqa: PLC0415
    from prefixcache.sim.des import percentiles  # noqa: PLC0415

    model_config = ModelConfig.tiny()
    parse_fault(config.inject)  # a malformed spec fails before anything runs
    check_count("num_host_blocks", config.num_host_blocks)  # likewise
    pool = pool_kwargs(config, model_config)  # likewise
    bad = [tr.id for tr in requests if max(tr.prompt) >= model_config.vocab_size]
    if bad:
        raise ValueError(f"{len(bad)} requests (first {bad[0]!r}) hold token ids >= the tiny "
                         f"model's vocabulary of {model_config.vocab_size}; set "
                         "workload.kwargs.vocab")
    summaries, all_rows, outputs = [], [], {}
    engine = None
    for name, caching, state in PASSES:
        if name != "on_warm":  # on_warm reuses the on_cold engine and its cache
            # NOTE: the second engine reuses the first one's model: the same weights
            # by construction, and one initialisation less.
            engine = Engine(model_config, **pool, block_size=config.block_size,
                            enable_caching=caching,
                            seed=config.seed, max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            hash_algo=config.hash_algo, eviction=config.eviction,
                            num_host_blocks=config.num_host_blocks if caching else 0,
                            host_eviction=config.host_eviction,
                            model=None if engine is None else engine.model)
            # NOTE: a caching engine serves the compile set twice (cold, then warm):
            # warm steps have other (smaller) bucketed shapes than cold ones.
            for k in range(2 if caching else 1):
                serve(engine, warmup_requests, tag=f"compile{k}-{name}",
                      batch_size=config.batch_size, max_tokens=config.max_tokens)
            engine.kv_cache_manager.reset_prefix_cache()
        engine.reset_metrics()
        programs_before = engine.metrics().num_compiled_programs
        copies_before = engine.metrics().host_copy_programs
        fault = parse_fault(config.inject) if name == "on_cold" else None
        if fault is not None:
            fault.attach(engine)
        rows, outs, wall = serve(engine, requests, tag=name, batch_size=config.batch_size,
                                 max_tokens=config.max_tokens, progress=progress)
        engine.fault_injector = None
        outputs[name] = outs
        m = engine.metrics()
        ok = [r for r in rows if r["error"] is None]
        out_tokens = sum(r["output_tokens"] for r in ok)
        summaries.append({
            "record": "summary", "pass": name, "enable_caching": caching, "cache_state": state,
            "requests": len(rows), "errors": len(rows) - len(ok),
            "prompt_tokens": m.num_prompt_tokens, "cached_tokens": m.num_cached_tokens,
            "token_hit_rate": m.token_hit_rate, "request_hit_rate": m.request_hit_rate,
            "computed_tokens": m.num_computed_tokens, "evictions": m.num_evictions,
            "preemptions": m.num_preemptions, "peak_usage": m.peak_usage,
            "num_compiled_programs": m.num_compiled_programs,
            "programs_compiled_in_pass": m.num_compiled_programs - programs_before,
            "wall_s": wall,
            "requests_per_s": len(rows) / wall, "output_tokens_per_s": out_tokens / wall,
            "prompt_tokens_per_s": m.num_prompt_tokens / wall,
            "ttft_s": percentiles([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
            "e2e_s": percentiles([r["e2e_s"] for r in ok if r["e2e_s"] is not None]),
            "injected_fault": (config.inject or None) if fault is not None else None,
            **{k: getattr(m, k) for k in KV_POOL_KEYS},
        })
        if config.num_host_blocks:  # absent when off: default rows unchanged
            summaries[-1].update({k: getattr(m, k) for k in HOST_TIER_KEYS})
            if m.host_copy_programs is not None:  # the caching passes (off has no tier)
                summaries[-1]["host_copy_programs_compiled_in_pass"] = (
                    m.host_copy_programs - copies_before)
        all_rows += [{"record": "request", "pass": name, "cache_state": state, **r}
                     for r in rows]
    base = outputs["off"]
    errors = {name: [r["error"] for r in all_rows if r["pass"] == name] for name, _, _ in PASSES}
    for s in summaries:
        s["outputs_identical_to_off"] = outputs[s["pass"]] == base
        # Requests a fault failed excluded (with --config.inject: the others must match).
        s["outputs_identical_to_off_where_ok"] = all(
            o == b for o, b, e in zip(outputs[s["pass"]], base, errors[s["pass"]])
            if e is None)
        s["speedup_vs_off"] = summaries[0]["wall_s"] / s["wall_s"]
    return summaries, all_rows


def plot(rows: Sequence[dict], path, *, title: str = "") -> None:
    """TTFT vs cached tokens per request, one colour per pass."""
    fig, ax = _common.new_figure(figsize=(6.5, 4))
    for name, _, _ in PASSES:
        pts = [r for r in rows if r["pass"] == name and r["ttft_s"] is not None]
        ax.scatter([r["num_cached_tokens"] for r in pts], [r["ttft_s"] * 1e3 for r in pts],
                   s=10, alpha=0.6, label=name)
    ax.set_xlabel("cached prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    _common.save_plot(fig, path)


def run(config, *, progress: bool = False) -> dict:
    """Runs the benchmark; writes results.jsonl and serve_bench.png into config.workdir."""
    import itertools  # noqa: PLC0415

    if not config.workdir:
        raise ValueError("a workdir is needed (--workdir or config.workdir)")
    if config.batch_size < 1 or config.max_tokens < 1:
        raise ValueError("batch_size and max_tokens must be >= 1")
    from prefixcache.model import ModelConfig  # noqa: PLC0415

    pool_kwargs(config, ModelConfig.tiny())  # a bad pool size fails before anything runs
    workdir = _common.prepare_workdir(config.workdir)
    requests = list(_common.requests_from_config(config, workdir))
    compile_config = config.copy_and_resolve_references()
    compile_config.seed = config.seed + 1  # the compile pass: same shapes, other tokens
    warm = list(itertools.islice(_common.requests_from_config(compile_config, workdir),
                                 len(requests)))
    summaries, rows = bench(requests, warm, config, progress=progress)
    source = _common.source_name(config)
    provs = {s: _common.provenance(config, seed=config.seed, hash_algo=config.hash_algo,
                                   cache_state=s, extra={"source": source, "model": "tiny"})
             for s in _common.CACHE_STATES}
    with _common.AtomicJsonlWriter(workdir / "results.jsonl") as w:
        for r in [*rows, *summaries]:
            w.write(r, provenance=provs[r["cache_state"]])
    plot(rows, workdir / "serve_bench.png", title=f"{source}: tiny model, engine")
    return {"source": source, "summaries": summaries}


def main() -> None:
    _common.run_cli(run, config_name="serve_bench")


if __name__ == "__main__":
    main()
