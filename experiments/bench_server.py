r"""Server overhead: output tokens/s and TTFT via HTTP vs the in-process engine.

  python -m experiments.bench_server --config=configs/bench_server.py --workdir=/tmp/bench_server

See configs/bench_server.py. The server (uvicorn + the engine thread) runs in this
process; the clients run in a child process (so their JSON/SSE parsing does not share
the server's GIL). Writes bench_server.jsonl (one record with provenance).
"""

from __future__ import annotations

import json
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
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(
                max_connections=args["concurrency"] + 4)) as http:
            async def worker():
                while prompts:
                    i, p = prompts.pop(0)
                    body = {"model": "tiny", "prompt": p, "max_tokens": args["max_tokens"],
                            "temperature": 0, "stream": True}
                    t0 = time.perf_counter()
                    ttft, n, rid = None, 0, None
                    async with http.stream("POST", args["url"], json=body) as r:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: {"):
                                continue
                            c = json.loads(line[6:])
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


def _prompts(config, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, 500, config.prefix_len).tolist()
                for _ in range(config.num_prefixes)]
    return [prefixes[i % config.num_prefixes] + rng.integers(3, 500, config.suffix_len).tolist()
            for i in range(config.num_requests)]


def run(config, *, progress: bool = False) -> dict:
    import socket
    import threading

    import uvicorn

    from prefixcache.engine import Engine, SamplingParams
    from prefixcache.model import ModelConfig
    from prefixcache.serve.app import build_app

    workdir = _common.prepare_workdir(config.workdir)
    # NOTE: few step shapes (two token buckets, one of seqs and pages), all compiled by
    # the warm-up passes: a shape first met while timing would time its compilation.
    bs = config.block_size
    max_len = -(-(config.prefix_len + config.suffix_len + config.max_tokens) // bs) * bs
    bar = _common.progress_bar(enabled=progress, desc="bench_server", unit="pass", total=4)
    engine = Engine(ModelConfig.tiny(), num_blocks=config.num_blocks,
                    block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                    max_num_batched_tokens=config.max_num_batched_tokens, seed=config.seed,
                    max_model_len=max_len, token_buckets=tuple(sorted({min(128, config.max_num_batched_tokens),
                                                 config.max_num_batched_tokens})),
                    seq_buckets=(config.max_num_seqs,), page_buckets=(max_len // config.block_size,))
    params = SamplingParams(max_tokens=config.max_tokens, temperature=0.0)
    prompts = _prompts(config, config.seed)

    def inprocess(ps):
        engine.kv_cache_manager.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = engine.generate(ps, params)
        wall = time.perf_counter() - t0
        return outs, wall

    inprocess(_prompts(config, config.seed + 1))  # compile (warm-up, other prompts)
    bar.update(1)
    outs, wall_in = inprocess(prompts)
    bar.update(1)
    tokens_in = sum(len(o.token_ids) for o in outs)

    # The server: uvicorn in a thread of this process, the engine on its own thread.
    app = build_app(engine, served_model_name="tiny", tokenizer=None, max_waiting=None)
    serving = app.state.serving
    done = {}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    serving.start()
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.01)
    # Engine-side TTFT of each request of the server pass (RequestOutput.metrics).
    orig = engine.step

    def step_recording():
        res = orig()
        for o in res:
            done[o.request_id] = o
        return res

    def client_pass(ps):
        serving.call(lambda e: e.kv_cache_manager.reset_prefix_cache()).result()
        arg = json.dumps({"url": f"http://127.0.0.1:{port}/v1/completions", "prompts": ps,
                          "concurrency": config.concurrency, "max_tokens": config.max_tokens})
        proc = subprocess.run([sys.executable, "-c",
                               "from experiments.bench_server import _client_main; "
                               "_client_main()"], input=arg, capture_output=True,
                              text=True, check=True)
        return json.loads(proc.stdout.strip().splitlines()[-1])

    try:
        client_pass(_prompts(config, config.seed + 2))  # warm-up (other prompts)
        engine.step = step_recording  # NOTE: set between passes (engine thread idle)
        bar.update(1)
        res = client_pass(prompts)
        bar.update(1)
    finally:
        engine.step = orig
        server.should_exit = True
        th.join(60)
        serving.shutdown()
    bar.close()
    reqs = res["requests"]
    tokens_srv = sum(r["tokens"] for r in reqs)
    server_tps = tokens_srv / res["wall_s"]
    inproc_tps = tokens_in / wall_in
    overhead = []
    for r in reqs:
        o = done.get(f"{r['id']}-0")
        if o is not None and o.metrics.ttft_s is not None and r["ttft_s"] is not None:
            overhead.append((r["ttft_s"] - o.metrics.ttft_s) * 1e3)
    srv_tokens_equal = tokens_srv == tokens_in
    result = {
        "inprocess_tokens_per_s": inproc_tps, "server_tokens_per_s": server_tps,
        "throughput_ratio": server_tps / inproc_tps,
        "inprocess_wall_s": wall_in, "server_wall_s": res["wall_s"],
        "output_tokens": tokens_in, "server_output_tokens": tokens_srv,
        "same_token_count": srv_tokens_equal,
        "server_ttft_median_ms": statistics.median(r["ttft_s"] for r in reqs) * 1e3,
        "inprocess_ttft_median_ms": statistics.median(
            o.metrics.ttft_s for o in outs) * 1e3,
        "ttft_overhead_median_ms": statistics.median(overhead) if overhead else None,
        "ttft_overhead_p90_ms": (statistics.quantiles(overhead, n=10)[-1]
                                 if len(overhead) > 10 else None),
        "num_ttft_pairs": len(overhead),
        "throughput_ratio_target": config.throughput_ratio_target,
        "ttft_overhead_target_ms": config.ttft_overhead_target_ms,
        "load_average_1min": __import__("os").getloadavg()[0],
    }
    result["throughput_ok"] = result["throughput_ratio"] >= config.throughput_ratio_target
    result["ttft_overhead_ok"] = (result["ttft_overhead_median_ms"] is not None and
                                  result["ttft_overhead_median_ms"]
                                  < config.ttft_overhead_target_ms)
    prov = _common.provenance(config, seed=config.seed, cache_state="cold",
                              extra={"model": "tiny"})
    with _common.AtomicJsonlWriter(workdir / "bench_server.jsonl", provenance=prov) as w:
        w.write(result)
    return result


def main() -> None:
    _common.run_cli(run, config_name="bench_server")


if __name__ == "__main__":
    main()
