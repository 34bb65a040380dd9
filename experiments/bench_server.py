r"""Server overhead: TTFT, e2e and output tokens/s via HTTP vs the in-process engine.

  python -m experiments.bench_server --config=configs/bench_server.py --workdir=/tmp/bench_server

See configs/bench_server.py. For each concurrency c: the same prompts through the
in-process engine (closed loop, c in flight) and through the server (c closed-loop
streaming clients in a child process, so their JSON/SSE parsing shares no GIL with the
server). The server runs uvicorn in a thread of this process with the engine in its
own process (`server_mode` "process", `prefixcache serve`'s default) or on a thread
of this one ("thread", `--engine-in-process`). Both engines are compiled by warm-up
passes on other prompts before anything is timed. Writes bench_server.jsonl (one record
per concurrency, with provenance).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from experiments import _common


def _client_main() -> None:
    """Child process: closed-loop streaming clients; prints one JSON line of results."""
    import asyncio

    import httpx

    args = json.loads(sys.stdin.read())

    async def run():
        prompts = list(enumerate(args["prompts"]))
        out = []

        # NOTE: one connection (one AsyncClient) per worker: a shared httpx pool scans
        # all its connections per request (O(concurrency) each), which made this
        # client, not the server, the bottleneck at concurrency 64. SSE events are split
        # from the raw bytes (not aiter_lines) for the same reason.
        async def worker():
            async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(
                    max_connections=1)) as http:
                while prompts:
                    i, p = prompts.pop(0)
                    body = {"model": "tiny", "prompt": p, "max_tokens": args["max_tokens"],
                            "temperature": 0, "stream": True}
                    t0 = time.perf_counter()
                    ttft, n, rid, buf = None, 0, None, b""
                    async with http.stream("POST", args["url"], json=body) as r:
                        async for data in r.aiter_raw():
                            buf += data
                            *events, buf = buf.split(b"\n\n")
                            for ev in events:
                                if not ev.startswith(b"data: {"):
                                    continue
                                c = json.loads(ev[6:])
                                rid = c["id"]
                                k = len(c["choices"][0]["token_ids"])
                                if k and ttft is None:
                                    ttft = time.perf_counter() - t0
                                n += k
                    out.append({"index": i, "id": rid, "ttft_s": ttft, "tokens": n,
                                "e2e_s": time.perf_counter() - t0})

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args["concurrency"])))
        return out, time.perf_counter() - t0

    out, wall = asyncio.run(run())
    print(json.dumps({"requests": out, "wall_s": wall}))


def _prompts(config, seed, num_requests):
    import numpy as np

    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, 500, config.prefix_len).tolist()
                for _ in range(config.num_prefixes)]
    return [prefixes[i % config.num_prefixes] + rng.integers(3, 500, config.suffix_len).tolist()
            for i in range(num_requests)]


def _engine_kwargs(c: dict) -> dict:
    """The Engine both sides build: few step shapes (two token buckets, one of seqs and
    pages), all compiled by the warm-up passes before any timing."""
    bs = c["block_size"]
    max_len = -(-(c["prefix_len"] + c["suffix_len"] + c["max_tokens"]) // bs) * bs
    mbt = c["max_num_batched_tokens"]
    return dict(num_blocks=c["num_blocks"], block_size=bs, max_num_seqs=c["max_num_seqs"],
                max_num_batched_tokens=mbt, seed=c["seed"], max_model_len=max_len,
                token_buckets=tuple(sorted({min(128, mbt), mbt})),
                seq_buckets=(c["max_num_seqs"],), page_buckets=(max_len // bs,))


def build_engine(c: dict):
    """The engine-core process's `build` (picklable): the tiny model with the bench's
    shapes."""
    from prefixcache.engine import Engine
    from prefixcache.model import ModelConfig

    return Engine(ModelConfig.tiny(), **_engine_kwargs(c))


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _warm_cold(rows, ttft_key: str):
    """median TTFT of warm requests (some prompt tokens cached) / of cold ones."""
    warm = _median(r[ttft_key] for r in rows if r["cached"] > 0)
    cold = _median(r[ttft_key] for r in rows if r["cached"] == 0)
    return _ratio(warm, cold), warm, cold


def _inprocess(engine, prompts, concurrency: int, params, tag: str):
    """Closed loop in-process: `concurrency` requests in flight, the next one added as
    one finishes (the server clients' loop without HTTP). Rows per request, wall s."""
    engine.kv_cache_manager.reset_prefix_cache()
    m0 = engine.metrics()
    pending = list(enumerate(prompts))
    inflight, rows = {}, {}
    t0 = time.perf_counter()
    while pending or inflight:
        while pending and len(inflight) < concurrency:
            i, p = pending.pop(0)
            rid = f"{tag}-{i}"
            engine.add_request(p, params, request_id=rid)
            inflight[rid] = (i, time.perf_counter())
        for o in engine.step():
            i, t_add = inflight.pop(o.request_id)
            rows[i] = {"ttft_s": o.metrics.ttft_s, "e2e_s": time.perf_counter() - t_add,
                       "tokens": len(o.token_ids), "cached": o.metrics.num_cached_tokens}
    wall = time.perf_counter() - t0
    m1 = engine.metrics()
    steps = {"num_steps": m1.num_steps - m0.num_steps, "device_s": m1.device_s - m0.device_s}
    return [rows[i] for i in range(len(prompts))], wall, steps


def run(config, *, progress: bool = False) -> dict:
    import socket
    import threading

    import uvicorn

    from prefixcache.engine import SamplingParams
    from prefixcache.serve.app import build_app
    from prefixcache.serve.engine_loop import EngineCoreClient

    workdir = _common.prepare_workdir(config.workdir)
    concurrencies = [int(c) for c in config.concurrencies]
    counts = [int(n) for n in config.num_requests]
    if len(counts) != len(concurrencies):
        raise ValueError(f"num_requests ({counts}) needs one count per concurrency "
                         f"({concurrencies})")
    if config.server_mode not in ("process", "thread"):
        raise ValueError(f"server_mode must be 'process' or 'thread', got "
                         f"{config.server_mode!r}")
    plain = {k: config[k] for k in ("seed", "block_size", "num_blocks", "max_num_seqs",
                                     "max_num_batched_tokens", "prefix_len", "suffix_len",
                                     "max_tokens")}
    bar = _common.progress_bar(enabled=progress, desc="bench_server", unit="pass",
                               total=2 + 2 * len(concurrencies))
    engine = build_engine(plain)
    params = SamplingParams(max_tokens=config.max_tokens, temperature=0.0)
    warm_c = max(concurrencies)
    _inprocess(engine, _prompts(config, config.seed + 1, max(counts)), warm_c, params,
               "warmup")  # compile (other prompts)
    bar.update(1)

    # The server: uvicorn in a thread of this process; the engine in its own process
    # (server_mode "process", `prefixcache serve`'s default) or on a thread here.
    if config.server_mode == "process":
        serving = EngineCoreClient(plain, build=build_engine)
        app = build_app(serving, served_model_name="tiny", tokenizer=None)
    else:
        app = build_app(build_engine(plain), served_model_name="tiny", tokenizer=None)
        serving = app.state.serving
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    serving.start()
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.01)

    def client_pass(ps, concurrency):
        serving.utility("reset_prefix_cache").result()
        serving.utility("record_timings", True).result()
        m0 = serving.utility("metrics").result()
        h0 = _ttft_histogram(port)
        arg = json.dumps({"url": f"http://127.0.0.1:{port}/v1/completions", "prompts": ps,
                          "concurrency": concurrency, "max_tokens": config.max_tokens})
        proc = subprocess.run([sys.executable, "-c",
                               "from experiments.bench_server import _client_main; "
                               "_client_main()"], input=arg, capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the client process failed:\n{proc.stderr[-3000:]}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        res["engine"] = serving.utility("take_timings").result()
        m1 = serving.utility("metrics").result()
        h1 = _ttft_histogram(port)
        res["server_ttft_mean_s"] = _ratio(h1[0] - h0[0], h1[1] - h0[1])
        res["steps"] = {"num_steps": m1["num_steps"] - m0["num_steps"],
                        "device_s": m1["device_s"] - m0["device_s"]}
        serving.utility("record_timings", False).result()
        return res

    passes = []
    try:
        client_pass(_prompts(config, config.seed + 2, max(counts)), warm_c)  # compile
        bar.update(1)
        for c, n in zip(concurrencies, counts):
            prompts = _prompts(config, config.seed, n)
            rows_in, wall_in, steps_in = _inprocess(engine, prompts, c, params, f"c{c}")
            bar.update(1)
            res = client_pass(prompts, c)
            bar.update(1)
            passes.append(_pass_record(config, c, prompts, rows_in, wall_in, steps_in, res))
    finally:
        server.should_exit = True
        th.join(60)
        serving.shutdown()
    bar.close()
    result = {"server_mode": config.server_mode, "passes": passes,
              "load_average_1min": os.getloadavg()[0]}
    prov = _common.provenance(config, seed=config.seed, cache_state="cold",
                              extra={"model": "tiny"})
    with _common.AtomicJsonlWriter(workdir / "bench_server.jsonl", provenance=prov) as w:
        for p in passes:
            w.write({"server_mode": config.server_mode, **p})
    return result


def _ttft_histogram(port: int) -> tuple[float, float]:
    """(sum, count) of the server's own TTFT histogram (HTTP arrival at the handler to
    the first token handed to it)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=60).text
    vals = {}
    for line in text.splitlines():
        if line.startswith("prefixcache:time_to_first_token_seconds_sum") or \
                line.startswith("prefixcache:time_to_first_token_seconds_count"):
            name = line.split("{")[0]
            vals[name] = float(line.rsplit(" ", 1)[1])
    return (vals.get("prefixcache:time_to_first_token_seconds_sum", 0.0),
            vals.get("prefixcache:time_to_first_token_seconds_count", 0.0))


def _pass_record(config, c, prompts, rows_in, wall_in, steps_in, res) -> dict:
    reqs = sorted(res["requests"], key=lambda r: r["index"])
    engine = res["engine"]
    rows_srv = []
    for r in reqs:
        ttft_engine, cached = engine.get(f"{r['id']}-0", (None, 0))
        rows_srv.append({"ttft_s": r["ttft_s"], "e2e_s": r["e2e_s"], "tokens": r["tokens"],
                         "engine_ttft_s": ttft_engine, "cached": cached})
    tokens_in = sum(r["tokens"] for r in rows_in)
    tokens_srv = sum(r["tokens"] for r in rows_srv)
    tps_in, tps_srv = tokens_in / wall_in, tokens_srv / res["wall_s"]
    overhead = [(r["ttft_s"] - r["engine_ttft_s"]) * 1e3 for r in rows_srv
                if r["ttft_s"] is not None and r["engine_ttft_s"] is not None]
    e2e_in, e2e_srv = _median(r["e2e_s"] for r in rows_in), _median(r["e2e_s"] for r in rows_srv)
    wc_client, warm_client, cold_client = _warm_cold(rows_srv, "ttft_s")
    wc_server_engine, _, _ = _warm_cold(rows_srv, "engine_ttft_s")
    wc_in, warm_in, cold_in = _warm_cold(rows_in, "ttft_s")
    rec = {
        "concurrency": c, "num_requests": len(prompts),
        "inprocess_tokens_per_s": tps_in, "server_tokens_per_s": tps_srv,
        "throughput_ratio": tps_srv / tps_in,
        "output_tokens": tokens_in, "server_output_tokens": tokens_srv,
        "same_token_count": tokens_in == tokens_srv,
        "inprocess_ttft_median_ms": _median(r["ttft_s"] for r in rows_in) * 1e3,
        "server_ttft_median_ms": _median(r["ttft_s"] for r in rows_srv) * 1e3,
        "ttft_overhead_median_ms": _median(overhead),
        "ttft_overhead_p90_ms": (statistics.quantiles(overhead, n=10)[-1]
                                 if len(overhead) > 10 else None),
        "num_ttft_pairs": len(overhead),
        # Means, to split the overhead: client -> handler (HTTP, the client's own
        # loop) and handler -> engine -> handler (the engine-core hop).
        "client_ttft_mean_ms": statistics.mean(
            r["ttft_s"] for r in rows_srv if r["ttft_s"] is not None) * 1e3,
        "server_handler_ttft_mean_ms": (None if res["server_ttft_mean_s"] is None
                                        else res["server_ttft_mean_s"] * 1e3),
        "server_engine_ttft_mean_ms": statistics.mean(
            r["engine_ttft_s"] for r in rows_srv if r["engine_ttft_s"] is not None) * 1e3,
        # Engine steps and their device time in each pass: fewer tokens per step in the
        # server pass means the clients kept fewer requests in the batch.
        "inprocess_steps": steps_in["num_steps"], "server_steps": res["steps"]["num_steps"],
        "inprocess_device_s": steps_in["device_s"],
        "server_device_s": res["steps"]["device_s"],
        "inprocess_e2e_median_ms": e2e_in * 1e3, "server_e2e_median_ms": e2e_srv * 1e3,
        "e2e_ratio": e2e_srv / e2e_in,
        "warm_cold_ttft_ratio_client": wc_client,
        "warm_cold_ttft_ratio_server_engine": wc_server_engine,
        "warm_cold_ttft_ratio_inprocess": wc_in,
        "warm_cold_ratio_client_vs_inprocess": _ratio(wc_client, wc_in),
        "client_warm_ttft_median_ms": warm_client and warm_client * 1e3,
        "client_cold_ttft_median_ms": cold_client and cold_client * 1e3,
        "inprocess_warm_ttft_median_ms": warm_in and warm_in * 1e3,
        "inprocess_cold_ttft_median_ms": cold_in and cold_in * 1e3,
    }
    t = config.targets
    rec["targets_met"] = {
        "ttft_overhead": (None if c != 1 or rec["ttft_overhead_median_ms"] is None
                          else rec["ttft_overhead_median_ms"] <= t.ttft_overhead_ms_c1),
        "e2e_ratio": None if c != 1 else rec["e2e_ratio"] <= t.e2e_ratio_c1,
        "throughput_ratio": (None if c == 1 else rec["throughput_ratio"]
                             >= t.throughput_ratio),
        "warm_cold": (None if rec["warm_cold_ratio_client_vs_inprocess"] is None
                      else abs(rec["warm_cold_ratio_client_vs_inprocess"] - 1)
                      <= t.warm_cold_tolerance),
    }
    return rec


def main() -> None:
    _common.run_cli(run, config_name="bench_server")


if __name__ == "__main__":
    main()
