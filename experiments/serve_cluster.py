r"""Many `prefixcache serve` replicas behind a real router (sglang-router), beside the
simulation of the same policies on the same requests.

  python -m experiments.serve_cluster --config=configs/serve_cluster.py --workdir=/tmp/sc
  python -m experiments.serve_cluster --config=configs/serve_cluster.py:quick --workdir=/tmp/scq
  # replicas already running elsewhere (one per URL; nothing is started for them):
  python -m experiments.serve_cluster --config=configs/serve_cluster.py --workdir=/tmp/sc \
      --config.replica_urls=http://10.0.0.1:8000,http://10.0.0.2:8000

Per routing policy (``policies``: sglang-router's ``cache_aware``, ``round_robin``,
``power_of_two``, ``random``): every replica's prefix cache is reset, sglang-router
(PyPI ``sglang-router``; its default backend: the ``openai`` one routes every request of
a model to one endpoint whatever the policy) starts in front of the replicas, and a
streaming client replays the requests (chat completions, one user message each) at
their arrival times (open loop). Then each
replica's ``/metrics`` gives its prefix-cache queries and hits and its finished
requests; the client gives TTFT and end-to-end latency per request. The same requests
(tokenized by the served model's own tokenizer) go through
``prefixcache.sim.cluster.simulate_cluster`` with the router of the same name
(``prefixcache.sim.routing``), one replica's cache each, so the served and simulated hit
rates and load balance sit side by side.

The workload is text, many tenants each with a private prefix (``tenant_prefixes`` in
words): a prefix-aware router should keep a tenant on one replica. Default model:
``tiny`` (random weights, its built-in byte-level tokenizer).

Outputs in ``--workdir``: ``serve_cluster.jsonl`` (one row per policy and source,
``source`` = ``served`` or ``simulated``: ``requests``, ``prompt_tokens``,
``hit_tokens``, ``hit_rate_tokens``, per-replica ``replica_requests`` /
``replica_hit_rate_tokens``, ``load_imbalance`` (max over mean requests per replica,
the same measure for both sources),
``ttft_p50_s`` / ``ttft_p90_s`` (served: the client's wall clock; simulated: the cost
model's roofline, another unit of time), ``failed``), provenance on each;
``serve_cluster.png`` (hit rate and load imbalance per policy, served vs simulated);
the processes' logs under ``logs/``. The last stdout line is a JSON object with the
paths.

Not here: a KV-event-driven router as a real process. llm-d's precise prefix-cache
scorer (`llm-d-kv-cache-manager`) is a Go service and Dynamo's KV router needs NATS and
etcd; neither installs from PyPI alone. Our own ``kv_events`` router runs in the
simulation (``experiments.route``), fed by the same vLLM-format events the server
publishes.
"""

from __future__ import annotations

import shlex
import statistics
import sys
import time

from experiments import _common, _servers

ROWS_FILE = "serve_cluster.jsonl"
PNG_FILE = "serve_cluster.png"
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


def text_workload(config) -> list[dict]:
    """The requests: ``num_tenants`` tenants, each a private ``prefix_words``-word prefix,
    then a unique ``question_words``-word question; Poisson arrivals at
    ``arrival_rate`` req/s; deterministic for ``seed``."""
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(config.seed)
    syll = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "vo", "pe", "du", "zi", "ha"]

    def words(n):
        return " ".join("".join(syll[j] for j in rng.integers(0, len(syll), 3))
                        for _ in range(n))

    prefixes = [f"Tenant {t} context: " + words(config.prefix_words)
                for t in range(config.num_tenants)]
    gaps = rng.exponential(1.0 / config.arrival_rate, config.num_requests)
    out, now = [], 0.0
    for i in range(config.num_requests):
        t = int(rng.integers(0, config.num_tenants))
        now += float(gaps[i])
        out.append({"id": f"r{i}", "tenant": t, "arrival_s": now,
                    "text": prefixes[t] + "\nQuestion: " + words(config.question_words)})
    return out


def check_config(config) -> list[str]:
    """Validates ``config`` before anything starts; returns the policies to run."""
    policies = [p.strip() for p in config.policies.split(",") if p.strip()]
    if not policies:
        raise ValueError("policies is empty")
    bad = [p for p in policies if p not in ROUTER_POLICIES]
    if bad:
        raise ValueError(f"policies: {bad} not among sglang-router's {ROUTER_POLICIES}")
    for field in ("num_requests", "num_tenants", "prefix_words", "question_words",
                  "max_tokens", "num_blocks", "block_size"):
        v = config[field]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{field} must be a positive int, got {v!r}")
    if not config.replica_urls and (not isinstance(config.replicas, int)
                                    or isinstance(config.replicas, bool) or config.replicas < 1):
        raise ValueError(f"replicas must be a positive int, got {config.replicas!r}")
    if not config.arrival_rate > 0:
        raise ValueError(f"arrival_rate must be > 0 (req/s), got {config.arrival_rate!r}")
    try:
        import sglang_router  # noqa: F401, PLC0415
    except ImportError:
        raise ValueError("sglang-router is not installed: pip install sglang-router") from None
    return policies


def _served_row(policy, results, urls, before, after) -> dict:
    ok = [r for r in results if r["status"] == 200 and r["error"] is None]
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok if r["usage"])
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                 for r in ok if r["usage"])
    reps, rep_rates = [], []
    for u in urls:
        d = {k: after[u].get(k, 0.0) - before[u].get(k, 0.0) for k in after[u]}
        q = _servers.metric_sum(d, "prefixcache:prefix_cache_queries_total")
        h = _servers.metric_sum(d, "prefixcache:prefix_cache_hits_total")
        n = _servers.metric_sum(d, "prefixcache:request_success_total")
        reps.append(int(n))
        rep_rates.append(h / q if q else None)
    ttfts = sorted(r["ttft_s"] for r in ok if r["ttft_s"] is not None)
    return {"policy": policy, "source": "served", "requests": len(results),
            "failed": len(results) - len(ok), "prompt_tokens": prompt, "hit_tokens": cached,
            "hit_rate_tokens": cached / prompt if prompt else None,
            "replica_requests": reps, "replica_hit_rate_tokens": rep_rates,
            "load_imbalance": _imbalance(reps),
            "ttft_p50_s": _q(ttfts, 0.5), "ttft_p90_s": _q(ttfts, 0.9),
            "e2e_p50_s": _q(sorted(r["e2e_s"] for r in ok), 0.5)}


def _q(xs, q):
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def simulate(config, policy: str, token_ids: list[list[int]], reqs: list[dict],
             urls: list[str]) -> dict:
    """The same requests through ``simulate_cluster`` with the router ``policy``."""
    from prefixcache.sim.cluster import simulate_cluster  # noqa: PLC0415
    from prefixcache.sim.trace import TraceRequest  # noqa: PLC0415

    trace = [TraceRequest(id=r["id"], prompt=ids, output_len=config.max_tokens,
                          timestamp=r["arrival_s"]) for r, ids in zip(reqs, token_ids)]
    res = simulate_cluster(trace, num_replicas=len(urls), router=policy,
                           cost_model=_common.cost_model(config),
                           num_blocks=config.num_blocks, block_size=config.block_size,
                           seed=config.seed)
    reps = [r["requests"] for r in res["per_replica"]]
    return {"policy": policy, "source": "simulated", "requests": res["requests"],
            "failed": res["failed"], "prompt_tokens": res["prompt_tokens"],
            "hit_tokens": res["hit_tokens"], "hit_rate_tokens": res["hit_rate_tokens"],
            "replica_requests": reps,
            "replica_hit_rate_tokens": [
                r["hit_tokens"] / (r["hit_tokens"] + r["prefill_tokens"])
                if r["hit_tokens"] + r["prefill_tokens"] else None for r in res["per_replica"]],
            "load_imbalance": _imbalance(reps),
            "ttft_p50_s": res["ttft_p50_s"], "ttft_p90_s": res["ttft_p90_s"],
            "e2e_p50_s": None}


def _imbalance(reps: list[int]) -> float | None:
    """Max over mean requests per replica (1.0: perfectly even)."""
    return max(reps) / statistics.mean(reps) if reps and sum(reps) else None


def _urls(config) -> list[str]:
    return [u.strip().rstrip("/") for u in config.replica_urls.split(",") if u.strip()]


def tokenize(config, texts: list[str]) -> list[list[int]]:
    """The prompt token ids the server computes for each chat request (one user message;
    the served model's own tokenizer and chat template, as ``prefixcache serve`` loads
    them)."""
    from prefixcache.text import Tokenizer  # noqa: PLC0415

    tok = (Tokenizer.tiny() if config.serve_model == "tiny"
           else Tokenizer.from_pretrained(config.serve_model))
    return [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True)
            for t in texts]


def plot(rows, path, *, title: str = "") -> None:
    fig, axes = _common.new_figure(1, 2, figsize=(9, 3.8))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for ax, field, label in ((axes[0], "hit_rate_tokens", "token hit rate"),
                             (axes[1], "load_imbalance", "load imbalance (max / mean)")):
        for k, src in enumerate(("served", "simulated")):
            vals = [next((r[field] for r in rows if r["policy"] == p and r["source"] == src),
                         None) or 0.0 for p in policies]
            ax.bar([i + 0.38 * k for i in range(len(policies))], vals, width=0.38, label=src)
        ax.set_xticks([i + 0.19 for i in range(len(policies))], policies, fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    _common.save_plot(fig, path)


def run(config, *, progress: bool = False) -> dict:
    policies = check_config(config)
    workdir = _common.prepare_workdir(config.workdir)
    reqs = text_workload(config)
    token_ids = tokenize(config, [r["text"] for r in reqs])
    rows = []
    bar = _common.progress_bar(enabled=progress, total=len(policies), desc="serve_cluster",
                               unit="policy")
    with _servers.Fleet(workdir / "logs") as fleet:
        urls = _urls(config)
        if not urls:  # start the replicas here
            opts = {"served_model_name": config.served_model_name,
                    "num_blocks": config.num_blocks, "block_size": config.block_size,
                    "max_model_len": config.max_model_len or None, "seed": config.seed}
            procs = []
            for i in range(config.replicas):
                port = _servers.free_port()
                argv = _servers.serve_argv(config.serve_model, port, opts)
                procs.append(fleet.start(f"replica{i}", argv + shlex.split(config.serve_flags)))
                urls.append(f"http://{_servers.LOCALHOST}:{port}")
                # NOTE: one at a time: the first warm-up fills the persistent compilation
                # cache, the others load from it.
                _servers.wait_healthy(urls[-1], timeout=config.startup_timeout_s,
                                      proc=procs[-1])
        # NOTE: chat completions, text: cache_aware keys its tree on the request's text.
        bodies = [{"model": config.served_model_name,
                   "messages": [{"role": "user", "content": r["text"]}],
                   "max_tokens": config.max_tokens, "temperature": 0.0, "stream": True,
                   "stream_options": {"include_usage": True}} for r in reqs]
        for policy in policies:
            for u in urls:
                _servers.post(u + "/reset_prefix_cache")
            before = {u: _servers.parse_metrics(_servers.get(u + "/metrics")[1]) for u in urls}
            port = _servers.free_port()
            rurl = f"http://{_servers.LOCALHOST}:{port}"
            router = fleet.start(f"router_{policy}", _servers.router_argv(port, urls, policy))
            try:
                _servers.wait_healthy(rurl, timeout=config.startup_timeout_s, proc=router)
                results = _servers.replay_requests(
                    rurl + "/v1/chat/completions", bodies, [r["arrival_s"] for r in reqs],
                    timeout_s=config.request_timeout_s)
            finally:
                fleet.stop(router)
            after = {u: _servers.parse_metrics(_servers.get(u + "/metrics")[1]) for u in urls}
            rows.append(_served_row(policy, results, urls, before, after))
            rows.append(simulate(config, policy, token_ids, reqs, urls))
            bar.update(1)
    bar.close()
    prov = _common.provenance(config, seed=config.seed, cache_state="cold",
                              extra={"replica_urls": urls, "router": "sglang-router"})
    rows_path, png_path = workdir / ROWS_FILE, workdir / PNG_FILE
    with _common.AtomicJsonlWriter(rows_path, provenance=prov) as w:
        for row in rows:
            w.write(row)
    plot(rows, png_path, title=f"{len(urls)} replicas of {config.serve_model} behind "
                               f"sglang-router: {len(reqs)} requests, {config.num_tenants} "
                               f"tenants, {config.num_blocks} blocks each")
    for r in rows:
        print(f"{r['policy']:>13} {r['source']:>9}: hit rate "
              f"{(r['hit_rate_tokens'] or 0):.3f}, load imbalance "
              f"{(r['load_imbalance'] or 0):.2f}, requests per replica {r['replica_requests']}",
              file=sys.stderr)
    return {"rows": str(rows_path), "png": str(png_path), "policies": policies,
            "served_hit_rate_tokens": {r["policy"]: r["hit_rate_tokens"]
                                       for r in rows if r["source"] == "served"}}


def main() -> None:
    _common.run_cli(run, config_name="serve_cluster")


if __name__ == "__main__":
    main()
