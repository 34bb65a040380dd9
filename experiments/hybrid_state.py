r"""Replay study: a hybrid state-space layout (full attention + Mamba) beside full
attention only, per eviction policy and capacity.

  python -m experiments.hybrid_state --config=configs/hybrid_state.py --workdir=/tmp/hs

Every cell (workload, layout, policy, capacity) replays the generated trace through a
fresh ``KVCacheManager(kv_cache_groups=...)`` (``prefixcache.sim.replay.replay``); a
layout with a state-space group splits each prompt where vLLM's scheduler does
(``HybridKVCacheManager.prefill_chunks``). Rows: hit tokens and token hit rate, requests
with a hit, prompts split, evictions, peak and mean cached blocks (after each
admission: attention and state blocks alike, one page each), with provenance. Policies
include ``marconi`` (Marconi's FLOP-aware eviction score, which reads each block's group:
``prefixcache.core.eviction.marconi``) beside LRU and the Marconi admission layout
``mamba_r0``.

Outputs in ``--workdir``: ``hybrid_state.jsonl`` (one row per cell, each with its
provenance). stdout: a table; the last line one JSON object (the rows without
provenance).

A ``policies`` entry is a registered policy name or a label of ``policy_variants``
(label -> ``{"eviction": name, "options": {...}}``: the policy with those
``eviction_options``, e.g. ``marconi_minmax``: marconi with Marconi's min-max
normalisation); rows carry the label as ``policy`` and the ``eviction`` /
``eviction_options`` they ran.

Tuning (Marconi's "retrospective" search, offline): a variant with ``"tune": {"option":
name, "grid": [values]}`` replays the first ``tune_fraction`` of the trace (arrival
order) once per grid value, takes the value with the most hit tokens there (ties: the
first in the grid), and runs the whole trace with it; its row carries ``tuned``
(``option``, the chosen ``value``, the prefix's ``requests`` and
``hit_tokens_by_value`` there). Every row reports
``heldout_hit_rate_tokens``: the token hit rate of the requests after that prefix (the
part no tuning saw), so tuned and untuned policies compare on equal ground.

Bad input (unknown workload, layout entry, policy or variant; a variant's options its
policy refuses; a policy that needs the trace's future; a non-positive capacity) ->
``ValueError`` before any cell runs.
"""

from __future__ import annotations

import time

from experiments import _common


def _split(text: str, sep: str = ",") -> list[str]:
    return [p.strip() for p in str(text).split(sep) if p.strip()]


def cells(config) -> list[dict]:
    """The grid, validated (``ValueError`` naming the bad field)."""
    from prefixcache.core.kv_groups import parse_kv_groups  # noqa: PLC0415
    from prefixcache.sim.compare import (  # noqa: PLC0415
        check_policy_options,
        resolve_policy_variants,
    )
    from prefixcache.sim.workloads import WORKLOADS  # noqa: PLC0415

    workloads = _split(config.workloads)
    for w in workloads:
        if w not in WORKLOADS:
            raise ValueError(f"unknown workload {w!r}: known {sorted(WORKLOADS)}")
    layouts = [layout.replace(";", ",") for layout in _split(config.layouts, "|")]
    for layout in layouts:
        parse_kv_groups(layout)  # bad entry -> ValueError
    policies = _split(config.policies)
    variants = resolve_policy_variants(
        policies, _common.to_jsonable(config.get("policy_variants") or {}),
        block_size=config.block_size, extra_keys=("tune",), offline=False)
    runs = {}  # label -> (policy name, options, tune entry or None)
    for p, v in variants.items():
        tune = _check_tune(p, v.get("tune"))
        for x in tune["grid"] if tune else ():  # (every tuned value, before any cell runs)
            check_policy_options(p, v["eviction"], {**v["options"], tune["option"]: x},
                                 block_size=config.block_size)
        runs[p] = (v["eviction"], v["options"], tune)
    fraction = config.get("tune_fraction", 0.25)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
            or not 0 < fraction < 1:
        raise ValueError(f"tune_fraction must be a number in (0, 1), got {fraction!r}")
    capacities = []
    for c in _split(config.capacities):
        if not c.isdigit() or int(c) < 1:
            raise ValueError(f"capacities must be positive block counts, got {c!r}")
        capacities.append(int(c))
    if not (workloads and layouts and policies and capacities):
        raise ValueError("workloads, layouts, policies and capacities must be non-empty")
    return [dict(workload=w, layout=lay, policy=p, eviction=runs[p][0],
                 eviction_options=runs[p][1], tune=runs[p][2], num_blocks=n)
            for w in workloads for lay in layouts for p in policies for n in capacities]


def _check_tune(label: str, tune) -> dict | None:
    """A variant's ``tune`` entry, checked: ``{"option": name, "grid": [values]}``."""
    if tune is None:
        return None
    if (not isinstance(tune, dict) or set(tune) != {"option", "grid"}
            or not isinstance(tune["option"], str)
            or not isinstance(tune["grid"], (list, tuple)) or not tune["grid"]):
        raise ValueError(f"policy_variants[{label!r}]['tune'] must be {{'option': name, "
                         f"'grid': [one or more values]}}, got {tune!r}")
    return {"option": tune["option"], "grid": list(tune["grid"])}


def run(config, *, progress: bool = False) -> dict:
    from prefixcache.core.kv_groups import parse_kv_groups  # noqa: PLC0415
    from prefixcache.sim import workloads  # noqa: PLC0415
    from prefixcache.sim.replay import replay  # noqa: PLC0415

    grid = cells(config)
    fraction = config.get("tune_fraction", 0.25)
    workdir = _common.prepare_workdir(config.workdir) if config.workdir else None
    traces = {}
    rows = []
    bar = _common.progress_bar(enabled=progress, desc="hybrid_state", unit="cell",
                               total=len(grid))
    for cell in grid:
        w = cell["workload"]
        if w not in traces:
            kwargs = dict(config.workload_kwargs.get(w, {}))
            traces[w] = workloads.generate(w, seed=config.seed, **{
                k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()})
        trace = traces[w]
        n_tune = max(1, int(len(trace) * fraction))

        def run_cell(requests, options, on_record=None, cell=cell):
            return replay(requests, num_blocks=cell["num_blocks"],
                          block_size=config.block_size, hash_algo=config.hash_algo,
                          hash_seed=0, free_order=config.free_order,
                          concurrency=config.concurrency, eviction=cell["eviction"],
                          eviction_options=options or None,
                          kv_cache_groups=parse_kv_groups(cell["layout"]),
                          on_record=on_record)

        t0 = time.perf_counter()
        options, tuned, tune = dict(cell["eviction_options"]), None, cell.pop("tune")
        if tune is not None:  # the grid on the tuning prefix only; the best value runs
            values = tune["grid"]
            hits = [run_cell(trace[:n_tune], {**options, tune["option"]: x})["hit_tokens"]
                    for x in values]
            best = max(range(len(values)), key=lambda i: (hits[i], -i))  # (ties: first)
            tuned = {"option": tune["option"], "value": values[best], "requests": n_tune,
                     "hit_tokens_by_value": {str(x): h for x, h in zip(values, hits)}}
            options[tune["option"]] = values[best]
        chunked = []
        held = [0, 0]  # prompt tokens, hit tokens of the requests after the prefix

        def on_record(r):
            chunked.append("prefill_chunks" in r)
            if len(chunked) > n_tune:
                held[0] += r["prompt_tokens"]
                held[1] += r["num_computed_tokens"]

        s = run_cell(trace, options, on_record)
        rows.append({
            **cell, "eviction_options": options, "tuned": tuned,
            "heldout_hit_rate_tokens": held[1] / held[0] if held[0] else 0.0,
            "block_size": config.block_size, "concurrency": config.concurrency,
            "requests": s["requests"], "prompt_tokens": s["prompt_tokens"],
            "hit_tokens": s["hit_tokens"], "hit_rate_tokens": s["hit_rate_tokens"],
            "requests_with_hit": s["requests_with_hit"], "prompts_split": sum(chunked),
            "failed": s["failed"], "evictions": s["evictions"],
            "peak_cached_blocks": s["peak_cached_blocks"],
            "mean_cached_blocks": round(s["mean_cached_blocks"], 1),
            "cell_s": round(time.perf_counter() - t0, 3),
        })
        bar.update(1)
    bar.close()
    print(f"{'workload':>22} {'layout':>13} {'policy':>14} {'blocks':>6} {'hit':>6} "
          f"{'hit tok':>9} {'evict':>7} {'peak':>6} {'mean':>7}")
    for r in rows:
        print(f"{r['workload']:>22} {r['layout']:>13} {r['policy']:>14} {r['num_blocks']:>6} "
              f"{r['hit_rate_tokens']:6.3f} {r['hit_tokens']:>9} {r['evictions']:>7} "
              f"{r['peak_cached_blocks']:>6} {r['mean_cached_blocks']:>7}")
    if workdir is not None:
        prov = _common.provenance(config, seed=config.seed, hash_algo=config.hash_algo,
                                  cache_state="cold")
        with _common.AtomicJsonlWriter(workdir / "hybrid_state.jsonl", provenance=prov) as f:
            for r in rows:
                f.write(r)
    return {"rows": rows}


def main() -> None:
    _common.run_cli(run, config_name="hybrid_state")


if __name__ == "__main__":
    main()
