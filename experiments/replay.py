r"""Replay a request trace (or a generated workload) through the KV cache manager.

  python -m experiments.replay --trace=T.jsonl --num_blocks=4096 --block_size=16 \
      --hash_algo=sha256 --free_order=append --concurrency=8 --out=O.jsonl
  python -m experiments.replay --config=configs/replay_few_shot.py --workdir=/tmp/r

Flags given on the command line override the config (default:
``configs/replay.py``); ``--config.<field>=...`` overrides work too.

Outputs:
  * ``--out`` (default ``<workdir>/requests.jsonl`` when ``--workdir`` is set):
    one JSON line per request, exactly the replay records (``id``,
    ``num_computed_tokens``, ``block_ids``, ``prompt_tokens``, ``failed`` /
    ``decode_truncated_at``) -- no timing and no provenance, so the same trace,
    flags and seed give a byte-identical file (and it can be diffed against
    ``../shared/peers/vllm_replay.py --out``).
  * the last stdout line: the summary JSON (``requests``, ``prompt_tokens``,
    ``hit_tokens``, ``hit_rate_tokens``, ``evictions``, ``failed``, ``timing``
    with ``loop_s``/``hashing_s``/``manager_s``, rates, ``peak_rss_mib``).
  * ``--workdir``: ``results.jsonl`` (the summary with provenance, cache state
    ``cold``) and ``replay.png`` (cumulative token hit rate over the trace).

Bad input (malformed line, missing field, negative length, mm range outside
the prompt, unknown hash algorithm, missing file) -> ``error: ...`` on stderr,
exit status 1, and no output file is left behind (outputs are written to a
temporary file and renamed only when the replay completed).
"""

from __future__ import annotations

import array
import json
import sys

from absl import app, flags
from ml_collections import config_flags

from experiments import _common

_CONFIG = config_flags.DEFINE_config_file(
    "config", _common.config_path("replay"), "Replay config (configs/replay*.py).", lock_config=True)
_TRACE = flags.DEFINE_string("trace", None, "Trace file (our JSONL or Mooncake); overrides config.trace.")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", None, "KV cache blocks.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", None, "Tokens per block.")
_HASH_ALGO = flags.DEFINE_string("hash_algo", None, "sha256 | sha256_cbor | xxhash | xxhash_cbor.")
_FREE_ORDER = flags.DEFINE_string("free_order", None, "append | unhashed_first (vLLM's).")
_CONCURRENCY = flags.DEFINE_integer("concurrency", None, "Most requests holding blocks at once.")
_MAX_REQUESTS = flags.DEFINE_integer("max_requests", None, "Replay only the first N requests (0: all).")
_OUT = flags.DEFINE_string("out", None, "Per-request JSONL output.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for results.jsonl, replay.png, requests.jsonl.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a tqdm progress bar (stderr).")

# Command-line flag -> config field.
_FLAG_FIELDS = {
    "trace": _TRACE, "num_blocks": _NUM_BLOCKS, "block_size": _BLOCK_SIZE,
    "hash_algo": _HASH_ALGO, "free_order": _FREE_ORDER, "concurrency": _CONCURRENCY,
    "max_requests": _MAX_REQUESTS, "out": _OUT, "workdir": _WORKDIR,
}


def run(config, *, progress: bool = False) -> dict:
    """Replays the config's trace; writes ``config.out`` and the workdir outputs.

    Args:
      config: a replay config (see ``configs/replay.py``): trace / workload,
        ``num_blocks``, ``block_size``, ``hash_algo``, ``hash_seed``,
        ``free_order``, ``concurrency``, ``max_model_len`` (0: none), ``out``,
        ``workdir``, ``max_requests``, ``seed``.
      progress: tqdm progress bar.

    Returns:
      The summary (as printed by the script).

    Raises:
      ValueError / FileNotFoundError: bad config or trace; no output file is
        then left at ``config.out`` or in the workdir.
    """
    from prefixcache.sim.replay import replay  # noqa: PLC0415

    workdir = _common.prepare_workdir(config.workdir) if config.workdir else None
    out = config.out or (str(workdir / "requests.jsonl") if workdir else "")
    requests = _common.requests_from_config(config, workdir)
    prompt = array.array("q")  # per-request prompt tokens, for the plot
    hits = array.array("q")

    def run_with(writer):
        def on_record(rec):
            if writer is not None:
                writer.write(rec)
            prompt.append(rec["prompt_tokens"])
            hits.append(rec["num_computed_tokens"])

        return replay(
            requests, num_blocks=config.num_blocks, block_size=config.block_size,
            hash_algo=config.hash_algo, hash_seed=config.hash_seed or None,
            free_order=config.free_order, concurrency=config.concurrency,
            max_model_len=config.max_model_len or None, on_record=on_record, progress=progress)

    if out:
        with _common.AtomicJsonlWriter(out) as writer:
            summary = run_with(writer)
    else:
        summary = run_with(None)
    summary = {"trace": config.trace or f"workload:{config.workload.name}", **summary,
               "peak_rss_mib": _common.peak_rss_mib()}
    if workdir is not None:
        prov = _common.provenance(config, seed=config.seed, hash_algo=config.hash_algo,
                                  cache_state="cold")
        with _common.AtomicJsonlWriter(workdir / "results.jsonl", provenance=prov) as w:
            w.write({"record": "summary", **summary})
        plot_cumulative_hit_rate(prompt, hits, workdir / "replay.png",
                                 title=f"{summary['trace']} ({config.hash_algo}, "
                                       f"{config.num_blocks} x {config.block_size})")
    return summary


def plot_cumulative_hit_rate(prompt_tokens, hit_tokens, path, *, title: str = "") -> None:
    """Cumulative token hit rate over the trace's requests, as a PNG."""
    import numpy as np  # noqa: PLC0415

    p = np.cumsum(np.asarray(prompt_tokens, dtype=np.float64))
    h = np.cumsum(np.asarray(hit_tokens, dtype=np.float64))
    fig, ax = _common.new_figure(figsize=(6, 3.5))
    if len(p):
        ax.plot(np.arange(1, len(p) + 1), h / np.maximum(p, 1))
    ax.set_xlabel("requests replayed")
    ax.set_ylabel("cumulative token hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    _common.save_plot(fig, path)


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    _common.apply_flag_overrides(config, _FLAG_FIELDS)
    try:
        summary = run(config, progress=_PROGRESS.value)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    app.run(main)
