"""`prefixcache serve MODEL_OR_PATH [flags]` (also `python -m prefixcache.serve MODEL ...`).

MODEL: an HF checkpoint directory or a GGUF file (`Engine.from_pretrained`), or `tiny`
(the built-in random-weight tiny model with its built-in byte-level tokenizer and ChatML
template, `prefixcache.text.Tokenizer.tiny()`: text and token-id prompts). Flags carry
vLLM's names. Bad flags are an argparse error (exit 2) before anything loads.
Before `/health` answers, every step program is compiled (`Engine.warmup`, a progress
bar; `--no-warmup` skips it, for debugging); compiled programs go to JAX's persistent
compilation cache (`--compilation-cache-dir`, default ~/.cache/prefixcache/jax_cache;
`--no-compilation-cache`), so a restart of the same configuration loads them. Step
shapes are padded to `--token-buckets` / `--seq-buckets` / `--page-buckets` (one
program per reachable bucket triple, greedy and sampling; default x4 spacing).
The engine runs in its own process (the engine core; `--engine-in-process`: on a
thread of the HTTP process, for debugging). If the engine core dies, requests get a
500 / 503 OpenAI error and `/health` answers 503.
SIGTERM / SIGINT: stop accepting, let in-flight requests finish for up to
`--shutdown-grace` seconds, abort the rest, exit 0. As vLLM, the server refuses to
start (exit 1) when one request of `--max-model-len` tokens would not fit the KV pool.
`--api-key` (or the `VLLM_API_KEY` environment variable, as vLLM) guards the `/v1`
routes and `/reset_prefix_cache`; `/health` and `/metrics` stay open.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

_log = logging.getLogger("prefixcache.serve")


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _sample_rate(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {v}")
    return v


def _port(s: str) -> int:
    v = _non_negative_int(s)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {v}")
    return v


def _seconds(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {s!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


def _bytes(s: str) -> int:
    from prefixcache.kv_dtypes import parse_bytes

    try:
        return parse_bytes(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _bucket_list(s: str) -> tuple[int, ...]:
    """'16,64,256' -> (16, 64, 256): positive ints, strictly increasing."""
    parts = [x.strip() for x in s.split(",")]
    try:
        vals = tuple(int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers, got {s!r}"
                                         ) from None
    if min(vals) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {s!r}")
    if any(b <= a for a, b in zip(vals, vals[1:])):
        raise argparse.ArgumentTypeError(f"sizes must be strictly increasing, got {s!r}")
    return vals


# NOTE: the server's default bucket spacing is x4 (16, 64, 256, ... tokens; 4, 16, 64
# sequences; 4, 16, 64, ... pages per sequence; each list ends at its maximum) where the
# library's MetadataBuilder default is x2: warm-up compiles every (T, S, P) program
# before the server answers, and x4 on all three axes is 132 programs for `tiny` at the
# default flags instead of 572 (4-5 CPU-seconds each on a CPU). A step pads up to 4x (2x on
# average) instead of 2x: cheap for the token axis of a prefill (an MLP over padding
# rows) and for pages (reads of the padding page), and it only ever costs compute, never
# a cache hit. The flags set any other spacing (2 for the library's).
SERVER_BUCKET_GROWTH = 4


def server_buckets(lo: int, hi: int, growth: int = SERVER_BUCKET_GROWTH) -> tuple[int, ...]:
    """lo, lo*growth, lo*growth^2, ... below hi, then hi (hi alone when hi <= lo)."""
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= growth
    return (*out, hi)


def _with_maximum(flag: str, buckets: tuple[int, ...], maximum: int, bound: str
                  ) -> tuple[int, ...]:
    """`buckets` ending at `maximum` (appended when below it); ValueError naming the
    flag for a size above it."""
    if buckets[-1] > maximum:
        raise ValueError(f"{flag}: {buckets[-1]} exceeds {bound} ({maximum})")
    return buckets if buckets[-1] == maximum else (*buckets, maximum)


def _lora_module(s: str) -> tuple[str, str]:
    name, sep, path = s.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {s!r}")
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"LoRA module {name!r}: no adapter directory "
                                         f"{path!r}")
    return name, path


def build_parser() -> argparse.ArgumentParser:
    from prefixcache.core.eviction import online_policy_names
    from prefixcache.core.hashing import HASH_ALGOS
    from prefixcache.core.indexes import INDEXES
    from prefixcache.kv_dtypes import KV_DTYPES
    from prefixcache.scheduling import SCHEDULING_POLICIES

    parser = argparse.ArgumentParser(prog="prefixcache")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (vLLM's flags)",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL_OR_PATH",
                   help="an HF checkpoint directory, a .gguf file, or 'tiny'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name in requests (default: MODEL_OR_PATH)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="weights and activations (auto: the checkpoint's)")
    p.add_argument("--block-size", type=_positive_int, default=16)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=_positive_int, default=None,
                      help="KV pool blocks (default 1024 unless --kv-cache-memory)")
    size.add_argument("--kv-cache-memory", type=_bytes, default=None,
                      help="KV pool size in bytes ('2GiB' ok) instead of --num-blocks")
    p.add_argument("--kv-cache-dtype", choices=("auto", *KV_DTYPES), default="auto")
    p.add_argument("--max-num-seqs", type=_positive_int, default=64)
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048)
    p.add_argument("--max-model-len", type=_positive_int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
    p.add_argument("--prefix-caching-hash-algo", choices=HASH_ALGOS, default="sha256")
    p.add_argument("--eviction", choices=online_policy_names(),
                   default="lru")
    p.add_argument("--index", choices=tuple(INDEXES), default="hash")
    p.add_argument("--scheduling-policy", choices=tuple(SCHEDULING_POLICIES), default="fcfs")
    p.add_argument("--num-host-blocks", type=_non_negative_int, default=0)
    p.add_argument("--residency", type=_sample_rate, default=None, metavar="RATE",
                   help="block residency histograms in /metrics (lifetime, idle before "
                   "eviction, reuse gap, hits per stay; RATE: the share of blocks sampled, "
                   "vLLM's 0.01; not with --kv-events-endpoint)")
    disk = p.add_argument_group(
        "disk tier",
        "KV pages the host tier evicts go to page files in --disk-dir (at most "
        "--disk-bytes of pages) and are loaded back on a hit; needs --num-host-blocks. "
        "A page file that fails its checks is a miss, never wrong KV. Warm-up does not "
        "build the tiers' copy programs (host and disk share them): the first batches "
        "of copies of each padded size compile")
    disk.add_argument("--disk-dir", default=None, metavar="DIR",
                      help="directory of the disk tier's KV page files")
    disk.add_argument("--disk-bytes", type=_bytes, default=0,
                      help="the disk tier's budget ('8GiB' ok); 0: no disk tier")
    disk.add_argument("--disk-eviction", choices=online_policy_names(), default="lru")
    disk.add_argument("--disk-reuse", action="store_true",
                      help="serve the pages an earlier server of the same model, KV dtype, "
                      "block size and hash left in --disk-dir (default: delete them at start)")
    p.add_argument("--miss-reasons", action="store_true",
                   help="classify missed prompt blocks (cold, evicted, isolated, partial, "
                   "last_token, window, preempted): per request in usage.prompt_tokens_details."
                   "prefixcache_block_miss_reasons, summed in "
                   "prefixcache:prompt_block_misses_total{reason=...} (hash or radix "
                   "index; full-attention and sliding-window layers)")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--lora-modules", type=_lora_module, nargs="+", default=[],
                   metavar="NAME=PATH")
    p.add_argument("--max-loras", type=_positive_int, default=4)
    p.add_argument("--max-lora-rank", type=_positive_int, default=16)
    p.add_argument("--seed", type=_non_negative_int, default=0)
    p.add_argument("--kv-events-endpoint", default=None,
                   help="publish KV events over ZMQ (vLLM's convention: tcp://*:PORT binds, "
                   "on --kv-events-bind-host)")
    p.add_argument("--kv-events-bind-host", default="127.0.0.1",
                   help="the interface a wildcard KV events endpoint (tcp://*:PORT) binds: "
                   "loopback unless told otherwise ('*': every interface, as vLLM)")
    p.add_argument("--kv-events-topic", default="")
    p.add_argument("--kv-events-replay-endpoint", default=None)
    p.add_argument("--max-waiting", type=_non_negative_int, default=1024,
                   help="most queued requests; beyond it 503 with Retry-After")
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (one of these keys) on the /v1 "
                   "routes and /reset_prefix_cache (default: $VLLM_API_KEY, else none)")
    p.add_argument("--max-request-body-bytes", type=_bytes,
                   default=32 * 2 ** 20,
                   help="largest request body ('32MiB' ok); beyond it 413")
    p.add_argument("--max-request-output-tokens", type=_positive_int, default=2 ** 18,
                   help="most output tokens one request may ask for: prompts x n x "
                   "max_tokens; beyond it 400")
    p.add_argument("--engine-in-process", action="store_true",
                   help="step the engine on a thread of the HTTP process (debugging) "
                   "instead of its own engine-core process")
    p.add_argument("--shutdown-grace", type=_seconds, default=10.0,
                   help="seconds in-flight requests get to finish on SIGTERM/SIGINT")
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"),
                   default="info")
    buckets = p.add_argument_group(
        "step shape buckets",
        "Step shapes are padded to these sizes; warm-up compiles one program per "
        "reachable (tokens, sequences, pages) bucket, greedy and sampling. Comma lists, "
        "strictly increasing; the maximum (--max-num-batched-tokens, --max-num-seqs, "
        "pages of --max-model-len) is appended when absent. Default: x4 steps from 16 "
        "tokens, 4 sequences and 4 pages (fewer programs to compile than the library's "
        "powers of two, at up to 4x padding; pages of a checkpoint served without "
        "--max-model-len: powers of two)")
    buckets.add_argument("--token-buckets", type=_bucket_list, default=None,
                         metavar="N,N,...", help="tokens per step (e.g. 16,64,256,1024)")
    buckets.add_argument("--seq-buckets", type=_bucket_list, default=None,
                         metavar="N,N,...", help="sequences per step (e.g. 4,16,64)")
    buckets.add_argument("--page-buckets", type=_bucket_list, default=None,
                         metavar="N,N,...",
                         help="KV pages (blocks) one sequence attends to (e.g. 4,16,64)")
    p.add_argument("--no-warmup", action="store_true",
                   help="serve at once, compiling each step program when a request first "
                   "needs it (debugging; requests then wait for compiles)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--compilation-cache-dir", default=None, metavar="DIR",
                       help="JAX's persistent compilation cache (default: "
                       "$XDG_CACHE_HOME/prefixcache/jax_cache or ~/.cache/prefixcache/"
                       "jax_cache)")
    cache.add_argument("--no-compilation-cache", action="store_true",
                       help="compile every program in every process")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    sp = parser._subparsers._group_actions[0].choices["serve"]  # for its error()
    if args.model != "tiny" and not os.path.exists(args.model):
        sp.error(f"MODEL_OR_PATH {args.model!r}: no such file or directory (or 'tiny')")
    if args.lora_modules and not args.enable_lora:
        sp.error("--lora-modules needs --enable-lora")
    if args.residency is not None and args.kv_events_endpoint:
        sp.error("--residency and --kv-events-endpoint both drain the KV events; use one")
    names = [n for n, _ in args.lora_modules]
    if len(set(names)) != len(names):
        sp.error(f"--lora-modules: duplicate names {names}")
    served = args.served_model_name or args.model
    if served in names:
        sp.error(f"--lora-modules: {served!r} is the base model's name")
    if args.disk_bytes and args.disk_dir is None:
        sp.error("--disk-bytes needs --disk-dir (the directory of the KV page files)")
    if (args.disk_dir is not None or args.disk_reuse) and not args.disk_bytes:
        sp.error("--disk-dir / --disk-reuse need --disk-bytes (the disk tier's budget)")
    if args.disk_bytes and not args.num_host_blocks:
        sp.error("--disk-bytes needs --num-host-blocks (the disk tier sits under the host "
                 "tier and takes the blocks it evicts)")
    for flag in ("kv_events_topic", "kv_events_replay_endpoint"):
        if getattr(args, flag) and not args.kv_events_endpoint:
            sp.error(f"--{flag.replace('_', '-')} needs --kv-events-endpoint")
    if args.api_key is None and os.environ.get("VLLM_API_KEY"):
        args.api_key = [os.environ["VLLM_API_KEY"]]
    if args.api_key is not None and not all(args.api_key):
        sp.error("--api-key: an empty key")
    for flag, maximum, bound in (
            ("token_buckets", args.max_num_batched_tokens, "--max-num-batched-tokens"),
            ("seq_buckets", args.max_num_seqs, "--max-num-seqs")):
        if getattr(args, flag) is not None:
            try:
                setattr(args, flag, _with_maximum(f"--{flag.replace('_', '-')}",
                                                  getattr(args, flag), maximum, bound))
            except ValueError as e:
                sp.error(str(e))
    if args.page_buckets is not None and args.max_model_len is None and args.model != "tiny":
        sp.error("--page-buckets needs --max-model-len with a checkpoint (its pages end "
                 "the list)")
    if args.page_buckets is not None and args.max_model_len is not None:
        try:
            _with_maximum("--page-buckets", args.page_buckets,
                          -(-args.max_model_len // args.block_size),
                          "the pages of --max-model-len")
        except ValueError as e:
            sp.error(str(e))
    if args.max_request_body_bytes < 1:
        sp.error(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    if not args.kv_events_bind_host or any(c.isspace() or c == "/"
                                           for c in args.kv_events_bind_host):
        sp.error(f"--kv-events-bind-host: '*' or an interface address, got "
                 f"{args.kv_events_bind_host!r}")
    for flag in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        ep = getattr(args, flag)
        if ep is not None and "://" not in ep:
            sp.error(f"--{flag.replace('_', '-')}: a ZMQ endpoint such as tcp://*:5557, "
                     f"got {ep!r}")
    return args


def build_engine(args):
    """The Engine the flags describe; refuses (ValueError), as vLLM, a KV pool that cannot
    hold one `--max-model-len` request."""
    engine = _build_engine(args)
    err = pool_fit_error(engine)
    if err is not None:
        raise ValueError(err)
    return engine


def _build_engine(args):
    """The Engine the flags describe (loads the model)."""
    from prefixcache.engine import Engine

    kw = dict(
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_caching=args.enable_prefix_caching,
        hash_algo=args.prefix_caching_hash_algo, eviction=args.eviction, index=args.index,
        scheduling_policy=args.scheduling_policy, num_host_blocks=args.num_host_blocks,
        seed=args.seed,
        kv_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype)
    if args.miss_reasons:
        kw["miss_reasons"] = True
    if getattr(args, "residency", None) is not None:
        kw["residency"] = args.residency
    if args.disk_bytes or args.disk_dir is not None or args.disk_reuse:
        kw.update(disk_dir=args.disk_dir, disk_bytes=args.disk_bytes,
                  disk_eviction=args.disk_eviction, disk_reuse=args.disk_reuse)
    kw["token_buckets"] = args.token_buckets or server_buckets(16, args.max_num_batched_tokens)
    kw["seq_buckets"] = args.seq_buckets or server_buckets(4, args.max_num_seqs)
    if args.kv_cache_memory is not None:
        kw["kv_cache_bytes"] = args.kv_cache_memory
    else:
        kw["num_blocks"] = args.num_blocks or 1024
    if args.enable_lora:
        kw.update(enable_lora=True, max_loras=args.max_loras,
                  max_lora_rank=args.max_lora_rank)
    if args.kv_events_endpoint:
        kw["manager_kwargs"] = {"enable_events": True}
    dtype = None if args.dtype == "auto" else args.dtype
    if args.model == "tiny":
        from prefixcache.model import ModelConfig

        cfg = ModelConfig.tiny(**({} if dtype is None else {"dtype": dtype}))
        kw["page_buckets"] = _page_buckets(args, args.max_model_len
                                           or cfg.max_position_embeddings)
        return Engine(cfg, tokenizer=_tiny_tokenizer(), **kw)
    if not hasattr(Engine, "from_pretrained"):
        raise ValueError("loading a checkpoint needs Engine.from_pretrained, which this "
                         "installation lacks; serve 'tiny' instead")
    if args.max_model_len is not None:
        kw["page_buckets"] = _page_buckets(args, args.max_model_len)
    # (else the checkpoint's context is known only once it loads: the library's powers
    # of two; parse_args refuses --page-buckets there)
    return Engine.from_pretrained(args.model, dtype=dtype, **kw)


def _page_buckets(args, max_model_len: int) -> tuple[int, ...]:
    """--page-buckets (its maximum appended) or the server's x4 default."""
    max_pages = -(-int(max_model_len) // args.block_size)
    if args.page_buckets is None:
        return server_buckets(4, max_pages)
    return _with_maximum("--page-buckets", args.page_buckets, max_pages,
                         "the pages of max_model_len")


def pool_fit_error(engine) -> str | None:
    """Why the server must not start, or None: as vLLM, one request of max_model_len
    tokens must fit the KV pool (otherwise `/v1/models` would advertise a context that
    is never served)."""
    need = -(-int(engine.max_model_len) // int(engine.block_size))
    if need <= int(engine.num_blocks):
        return None
    fits = int(engine.num_blocks) * int(engine.block_size)
    return (f"max_model_len={engine.max_model_len} needs {need} KV blocks of "
            f"{engine.block_size} tokens per request, but the KV pool has "
            f"{engine.num_blocks} blocks ({fits} tokens): lower --max-model-len to at "
            f"most {fits}, or raise --num-blocks / --kv-cache-memory")


def _tiny_tokenizer():
    """`Tokenizer.tiny()`, or None (token-id prompts only, with a warning) when the
    tokenizers / jinja2 packages are missing."""
    try:
        from prefixcache.text import Tokenizer

        return Tokenizer.tiny()
    except ImportError as e:
        _log.warning("the tiny model serves token-id prompts only: %s", e)
        return None


def prepare_compilation(args) -> None:
    """JAX's persistent compilation cache as the flags say (before anything compiles)."""
    from prefixcache.engine.warmup import disable_compilation_cache, enable_compilation_cache

    if getattr(args, "no_compilation_cache", False):
        disable_compilation_cache()
    else:
        path = enable_compilation_cache(getattr(args, "compilation_cache_dir", None))
        _log.info("JAX persistent compilation cache: %s", path)


def warmup(engine, args) -> None:
    """Compiles every step program before the server answers (unless --no-warmup)."""
    if getattr(args, "no_warmup", False):
        _log.warning("--no-warmup: step programs compile inside the first requests "
                     "that need them")
        return
    r = engine.warmup(progress=True)
    _log.info("warm-up: %d step programs ready (%d built) in %.1f s", r.num_programs,
              r.num_built, r.seconds)


def serve(args) -> int:
    import uvicorn

    from prefixcache.core import LoRARequest
    from prefixcache.serve.app import build_app

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loras = {name: LoRARequest(name, path, int_id=i + 1)
             for i, (name, path) in enumerate(args.lora_modules)}
    name = args.served_model_name or args.model
    limits = dict(api_keys=args.api_key, max_request_body_bytes=args.max_request_body_bytes,
                  max_request_output_tokens=args.max_request_output_tokens)
    publisher = None
    if args.engine_in_process:
        from prefixcache.serve.engine_core import prepare

        try:
            prepare_compilation(args)
            engine = build_engine(args)
            prepare(engine, args)  # (the warm-up)
        except (ValueError, OSError) as e:
            print(f"prefixcache serve: error: {e}", file=sys.stderr)
            return 1
        if args.kv_events_endpoint:
            from prefixcache.serve.kv_events import KVEventPublisher

            publisher = KVEventPublisher.from_endpoint(
                args.kv_events_endpoint, topic=args.kv_events_topic,
                replay_endpoint=args.kv_events_replay_endpoint,
                bind_host=args.kv_events_bind_host)
        app = build_app(engine, served_model_name=name, lora_modules=loras,
                        max_waiting=args.max_waiting, kv_event_publisher=publisher, **limits)
    else:
        from prefixcache.serve.engine_loop import EngineCoreClient, EngineCoreError

        try:
            client = EngineCoreClient(args, max_waiting=args.max_waiting,
                                      log_level=args.log_level)
        except EngineCoreError as e:
            print(f"prefixcache serve: error: {e}", file=sys.stderr)
            return 1
        try:
            app = build_app(client, served_model_name=name, lora_modules=loras, **limits)
        except BaseException:
            client.shutdown()
            raise
    serving = app.state.serving
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_grace or None)
    server = uvicorn.Server(config)
    # NOTE: uvicorn re-raises the signal it caught once it has shut down, which would
    # kill the process by that signal; these handlers (restored by uvicorn before it
    # re-raises) make that a no-op, so a graceful shutdown exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    serving.start()
    try:
        server.run()
    finally:
        # uvicorn stopped accepting and waited up to --shutdown-grace for in-flight
        # requests; what is still unfinished is aborted here.
        serving.shutdown()
        if publisher is not None:
            publisher.close()
    _log.info("prefixcache serve: shut down")
    return 0 if serving.failure is None else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    return serve(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
