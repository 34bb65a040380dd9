r"""AIPerf replays a Mooncake trace against `prefixcache serve`; the served hit rate beside
the replay's prediction for the same trace and cache.

  bash experiments/peers/setup_aiperf_env.sh          # once: AIPerf in its own venv
  python -m experiments.serve_trace --config=configs/serve_trace.py --workdir=/tmp/st
  python -m experiments.serve_trace --config=configs/serve_trace.py:quick --workdir=/tmp/stq

The first ``max_requests`` requests of a Mooncake-format trace (default: the Mooncake
conversation trace, ``prefixcache.sim.datasets``) are written again with each hash id
standing for ``tokens_per_hash_id`` tokens instead of 512 (the sharing structure is kept,
the prompts shrink so a CPU serves them), outputs capped at ``max_output_tokens`` and
arrival times multiplied by ``time_scale``. One ``prefixcache serve`` process serves
them (warmed up before it answers), and AIPerf (``aiperf profile --custom-dataset-type
mooncake_trace --fixed-schedule``, streaming completions) replays the file at its
timestamps: AIPerf turns each hash id into a fixed block of text with the served model's
own tokenizer (written for it as a Hugging Face tokenizer directory), so equal hash ids
are equal text. The server's ``/metrics`` (prefix-cache queries and hits, before and
after) give the served token hit rate; ``prefixcache.sim.replay.replay`` of the same
rewritten trace, at the server's block size, pool size and concurrency
(``max_num_seqs``), gives the prediction.

Why the two differ (the rows carry what tells them apart):
  * text, not token ids, crosses the wire: the server re-tokenizes AIPerf's text, and a
    BPE merge across the boundary of two hash-id blocks shifts the token boundaries of
    the rest of the prompt (``served_prompt_tokens`` vs ``predicted_prompt_tokens``); a
    shifted prompt stops matching its prefix at the first block that moved;
  * the replay runs requests in trace order, ``max_num_seqs`` at a time, each with its
    trace output; the server runs them at their arrival times, as the scheduler admits
    them, with what the tiny model generates (never reused: Mooncake prompts do not
    contain earlier outputs);
  * the last partial block of every prompt and the last prompt token never hit
    (both sides).

Outputs in ``--workdir``: ``serve_trace.jsonl`` (one row: AIPerf's TTFT / ITL /
throughput statistics, AIPerf's own theoretical prefix-cache hit rate when it reports
one, the served and predicted hit rates and token counts; provenance), ``trace.jsonl``
(the rewritten trace), ``hf_cache/`` (the served tokenizer as AIPerf reads it: a
Hugging Face hub cache of its own), ``aiperf/`` (AIPerf's
artifacts), ``logs/``. The last stdout line is a JSON object with the paths and the two
hit rates.
"""

from __future__ import annotations

import glob
import itertools
import json
import math
import os
import shlex
import shutil
import subprocess

from experiments import _common, _servers

ROWS_FILE = "serve_trace.jsonl"
PEER_AIPERF = os.path.join("~", ".cache", "prefixcache-peers", "aiperf-venv", "bin", "aiperf")


def find_aiperf(config) -> str:
    """The ``aiperf`` executable: ``config.aiperf``, else ``$PREFIXCACHE_AIPERF``, else on
    PATH, else the peer venv of ``experiments/peers/setup_aiperf_env.sh``; ValueError
    naming the fix otherwise."""
    for cand in (config.aiperf, os.environ.get("PREFIXCACHE_AIPERF"), shutil.which("aiperf"),
                 os.path.expanduser(PEER_AIPERF)):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise ValueError("aiperf not found: set --config.aiperf=PATH or run "
                     "bash experiments/peers/setup_aiperf_env.sh")


def check_config(config) -> None:
    for field in ("max_requests", "tokens_per_hash_id", "max_output_tokens", "num_blocks",
                  "server_block_size", "max_num_seqs", "max_model_len"):
        v = config[field]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{field} must be a positive int, got {v!r}")
    if config.tokens_per_hash_id % config.server_block_size:
        raise ValueError(f"server_block_size={config.server_block_size} must divide "
                         f"tokens_per_hash_id={config.tokens_per_hash_id} (a hash id is whole "
                         "blocks)")
    if not (isinstance(config.time_scale, (int, float)) and config.time_scale > 0):
        raise ValueError(f"time_scale must be a number > 0, got {config.time_scale!r}")


def rewrite_trace(config, path_in: str, path_out: str) -> list[dict]:
    """The first ``max_requests`` Mooncake lines with ``tokens_per_hash_id`` tokens per
    hash id, outputs capped, timestamps scaled; drops (and counts) none: a prompt longer
    than ``max_model_len`` is a config error named here."""
    b = config.tokens_per_hash_id
    lines = []
    with open(path_in) as f:
        for raw in itertools.islice(f, config.max_requests):
            d = json.loads(raw)
            m = len(d["hash_ids"])
            last = d["input_length"] - (m - 1) * 512  # tokens in the last 512-token block
            n_in = (m - 1) * b + max(1, math.ceil(last * b / 512))
            n_out = max(1, min(int(d["output_length"]), config.max_output_tokens))
            if n_in + n_out > config.max_model_len:
                raise ValueError(f"{path_in}: request {len(lines)} needs {n_in + n_out} "
                                 f"tokens at {b} tokens per hash id, over max_model_len="
                                 f"{config.max_model_len}: lower tokens_per_hash_id or "
                                 "max_requests")
            lines.append({"timestamp": int(round(d.get("timestamp", 0) * config.time_scale)),
                          "input_length": n_in, "output_length": n_out,
                          "hash_ids": d["hash_ids"]})
    if not lines:
        raise ValueError(f"{path_in} has no requests")
    with open(path_out, "w") as f:
        for d in lines:
            f.write(json.dumps(d) + "\n")
    return lines


TOKENIZER_REPO = "prefixcache/served-model"  # the repo id AIPerf is given


def write_tokenizer_cache(config, hub_cache: str) -> str:
    """The served model's tokenizer (tokenizer.json + tokenizer_config.json) as the
    snapshot of a Hugging Face repo in a hub cache of its own; returns the repo id.

    NOTE: a hub-cache snapshot, not a plain directory: AIPerf's prompt-synthesis workers
    run with HF_HUB_OFFLINE=1 and then resolve a tokenizer name through the hub cache
    only (a directory path fails there), so AIPerf runs with ``HF_HUB_CACHE`` pointing
    here and offline, and never reaches a network."""
    from prefixcache.text import Tokenizer  # noqa: PLC0415

    tok = (Tokenizer.tiny() if config.serve_model == "tiny"
           else Tokenizer.from_pretrained(config.serve_model))
    repo = os.path.join(hub_cache, "models--" + TOKENIZER_REPO.replace("/", "--"))
    rev = "0" * 40
    snap = os.path.join(repo, "snapshots", rev)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(rev)
    tok.backend.save(os.path.join(snap, "tokenizer.json"))
    with open(os.path.join(snap, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length":
                   config.max_model_len, "clean_up_tokenization_spaces": False}, f)
    return TOKENIZER_REPO


def predict(config, lines: list[dict]) -> dict:
    """``replay()`` of the rewritten trace at the server's cache configuration."""
    from prefixcache.sim.replay import replay  # noqa: PLC0415
    from prefixcache.sim.trace import MooncakePrompt, TraceRequest  # noqa: PLC0415

    b = config.tokens_per_hash_id
    reqs = [TraceRequest(id=f"mc-{i}", prompt=MooncakePrompt(d["hash_ids"], d["input_length"],
                                                               block_tokens=b),
                         output_len=d["output_length"]) for i, d in enumerate(lines)]
    return replay(reqs, num_blocks=config.num_blocks, block_size=config.server_block_size,
                  concurrency=config.max_num_seqs)


def _aiperf_metrics(art_dir: str) -> dict:
    """AIPerf's summary JSON (``profile_export_aiperf.json``): each metric's statistics."""
    paths = sorted(glob.glob(os.path.join(art_dir, "**", "profile_export_aiperf.json"),
                             recursive=True))
    if not paths:
        raise RuntimeError(f"AIPerf wrote no profile_export_aiperf.json under {art_dir}")
    with open(paths[-1]) as f:
        data = json.load(f)
    records = data.get("records", data)
    out = {}
    for name in ("time_to_first_token", "inter_token_latency", "request_latency",
                 "output_token_throughput", "request_throughput", "request_count",
                 "theoretical_prefix_cache_hit_rate", "input_sequence_length"):
        m = records.get(name)
        if isinstance(m, dict):
            out[name] = {k: m.get(k) for k in ("unit", "avg", "p50", "p90", "p99") if k in m}
    return out


def run(config, *, progress: bool = False) -> dict:
    check_config(config)
    aiperf = find_aiperf(config)
    workdir = _common.prepare_workdir(config.workdir)
    src = _common.trace_path(config, progress=progress)
    lines = rewrite_trace(config, src, str(workdir / "trace.jsonl"))
    hub_cache = str(workdir / "hf_cache")
    shutil.rmtree(hub_cache, ignore_errors=True)
    tokenizer = write_tokenizer_cache(config, hub_cache)
    art = workdir / "aiperf"
    shutil.rmtree(art, ignore_errors=True)
    with _servers.Fleet(workdir / "logs") as fleet:
        port = _servers.free_port()
        url = f"http://{_servers.LOCALHOST}:{port}"
        opts = {"served_model_name": config.served_model_name, "num_blocks": config.num_blocks,
                "block_size": config.server_block_size, "max_num_seqs": config.max_num_seqs,
                "max_model_len": config.max_model_len, "seed": config.seed}
        proc = fleet.start("server", _servers.serve_argv(config.serve_model, port, opts)
                           + shlex.split(config.serve_flags))
        _servers.wait_healthy(url, timeout=config.startup_timeout_s, proc=proc)
        _servers.post(url + "/reset_prefix_cache")
        before = _servers.parse_metrics(_servers.get(url + "/metrics")[1])
        argv = [aiperf, "profile", "--model", config.served_model_name, "--url", url,
                "--endpoint-type", "completions", "--streaming", "--tokenizer", tokenizer,
                "--input-file", str(workdir / "trace.jsonl"),
                "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
                "--prompt-input-tokens-block-size", str(config.tokens_per_hash_id),
                "--random-seed", str(config.seed), "--artifact-dir", str(art),
                "--request-timeout-seconds", str(config.request_timeout_s),
                *shlex.split(config.aiperf_flags)]
        with open(workdir / "logs" / "aiperf.log", "wb") as log:
            res = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, timeout=config.aiperf_timeout_s,
                                 env={**os.environ, "HF_HUB_CACHE": hub_cache,
                                      "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        if res.returncode != 0:
            raise RuntimeError(f"aiperf exited with {res.returncode}: see "
                               f"{workdir / 'logs' / 'aiperf.log'}")
        after = _servers.parse_metrics(_servers.get(url + "/metrics")[1])
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    queries = _servers.metric_sum(delta, "prefixcache:prefix_cache_queries_total")
    hits = _servers.metric_sum(delta, "prefixcache:prefix_cache_hits_total")
    served_prompt = _servers.metric_sum(delta, "prefixcache:prompt_tokens_total")
    pred = predict(config, lines)
    row = {"trace": os.path.basename(src), "requests": len(lines),
           "tokens_per_hash_id": config.tokens_per_hash_id,
           "served_hit_rate_tokens": hits / queries if queries else None,
           "served_hit_tokens": hits, "served_queried_tokens": queries,
           "served_prompt_tokens": served_prompt,
           "predicted_hit_rate_tokens": pred["hit_rate_tokens"],
           "predicted_hit_tokens": pred["hit_tokens"],
           "predicted_prompt_tokens": pred["prompt_tokens"],
           "served_requests": _servers.metric_sum(delta, "prefixcache:request_success_total"),
           "aiperf": _aiperf_metrics(str(art))}
    prov = _common.provenance(config, seed=config.seed, cache_state="cold",
                              extra={"aiperf": aiperf, "source": src})
    rows_path = workdir / ROWS_FILE
    with _common.AtomicJsonlWriter(rows_path, provenance=prov) as w:
        w.write(row)
    return {"rows": str(rows_path), "served_hit_rate_tokens": row["served_hit_rate_tokens"],
            "predicted_hit_rate_tokens": row["predicted_hit_rate_tokens"],
            "requests": len(lines)}


def main() -> None:
    _common.run_cli(run, config_name="serve_trace")


if __name__ == "__main__":
    main()
