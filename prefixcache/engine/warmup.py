"""Ready means compiled: the engine's warm-up and JAX's persistent compilation cache.

    from prefixcache.engine import Engine
    from prefixcache.engine.warmup import enable_compilation_cache

    enable_compilation_cache()            # ~/.cache/prefixcache/jax_cache, before compiling
    engine = Engine(ModelConfig.tiny(), num_blocks=256)
    engine.warmup()                       # every step program, a progress bar
    ...                                   # no request waits for a compile now
    assert engine.metrics().num_compiles_after_warmup == 0

`Engine.warmup` runs one step of every program key the scheduler can produce (the
runner's `warmup_keys`: bucketed (T, S, P) x greedy/sampling, LoRA and KV-group layout
as configured) with inputs that point only at the padding page (`dummy_step`), so the
prefix cache, the block pool, the KV of every allocatable block, the metrics window and
the KV events are as before. vLLM captures its CUDA graphs and tpu-inference precompiles
its buckets the same way before the server accepts traffic.

Programs compile on a thread pool (`threads`, default the usable cores): this thread
traces and lowers each key (`ModelRunner.lower`, Python under the GIL, ~1/10 of a
compile on CPU), XLA compiles them in parallel outside the GIL, and each key's dummy
step then runs here, which finds the compiled executable in jax's memo of that lowering
(nothing compiles twice) and installs it in the jitted step's cache. The count of
programs is what costs: about 4 CPU-seconds each for `tiny` on a CPU, so
`prefixcache serve` spaces its buckets x4 (see `prefixcache.serve.cli`).

Programs are counted from jax's executable caches (`ModelRunner.num_programs_built`), not
from the keys the runner knows, so a compile that a key does not predict still counts.
Not warmed: the host tier's copy programs (one per padded transfer size; they show in
the count) and multimodal steps unless `warmup(multimodal=True)`.
"""

from __future__ import annotations

import dataclasses
import os
import time

__all__ = ["WarmupResult", "default_compilation_cache_dir", "default_warmup_threads",
           "disable_compilation_cache", "enable_compilation_cache", "warmup_engine"]


@dataclasses.dataclass(frozen=True)
class WarmupResult:
    """What `Engine.warmup` did.

    Attributes:
      num_programs: step program keys run (every key the scheduler can produce).
      num_built: programs built during the warm-up (compiled, or loaded from the
        persistent compilation cache); 0 when every one was already built.
      seconds: wall time of the warm-up.
    """

    num_programs: int
    num_built: int
    seconds: float


def default_warmup_threads() -> int:
    """Compile threads `warmup_engine` uses by default: the CPU cores this process may
    run on (XLA's compile is C++ that releases the GIL, so programs compile in parallel
    up to the core count; tracing and lowering stay on the calling thread)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # (not on Linux)
        return max(1, os.cpu_count() or 1)


def warmup_engine(engine, *, progress: bool = True, multimodal: bool = False,
                  threads: int | None = None) -> WarmupResult:
    """`Engine.warmup` (see there).

    With `threads` > 1 the programs are traced and lowered on this thread
    (`ModelRunner.lower`: Python, holding the GIL) and compiled by a pool of `threads`
    threads; each dummy step then runs here once its program is compiled, which installs
    that executable in the jitted step's cache (jax memoizes the lowering and its
    compiled executable, so the run compiles nothing). `threads=1`: one key after the
    other, each step compiled by its first run.
    """
    from tqdm.auto import tqdm

    if threads is None:
        threads = default_warmup_threads()
    elif isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    runner = engine.runner
    keys = runner.warmup_keys(multimodal=multimodal)
    t0 = time.perf_counter()
    built0 = runner.num_programs_built
    bar = tqdm(total=len(keys), desc="compiling step programs", unit="program",
               disable=not progress, dynamic_ncols=True)

    def run(key, prepared):
        runner.execute(prepared)
        bar.set_postfix_str(f"T={key[0]} S={key[1]} P={key[2]}"
                            + ("" if key[3] else " sampling"), refresh=False)
        bar.update(1)

    if threads == 1:
        for key in keys:
            run(key, runner.dummy_step(key, max_model_len=engine.max_model_len))
    else:
        _compile_concurrently(runner, keys, engine.max_model_len, threads, run)
    bar.close()
    if runner.lora_slots is not None:
        runner.lora_slots.warmup()
    built = runner.num_programs_built
    return WarmupResult(num_programs=len(keys), num_built=built - built0,
                        seconds=time.perf_counter() - t0)


def _compile_concurrently(runner, keys, max_model_len: int, threads: int, run) -> None:
    """Lowers each key here, compiles on `threads` threads, runs each compiled key's
    dummy step here (in key order) as soon as it is compiled."""
    import collections
    from concurrent.futures import ThreadPoolExecutor

    # NOTE: at most 2 x threads lowered programs wait at once: the workers always have
    # the next one ready (lowering takes ~1/10 of a compile on CPU) and the lowered
    # modules of a large bucket grid are never all held in memory together.
    pending: collections.deque = collections.deque()
    with ThreadPoolExecutor(threads, thread_name_prefix="prefixcache-compile") as pool:
        try:
            for key in keys:
                prepared = runner.dummy_step(key, max_model_len=max_model_len)
                lowered = runner.lower(prepared)
                pending.append((key, prepared, pool.submit(lowered.compile)))
                while len(pending) > 2 * threads or (pending and pending[0][2].done()):
                    key0, prepared0, fut = pending.popleft()
                    fut.result()
                    run(key0, prepared0)
            while pending:
                key0, prepared0, fut = pending.popleft()
                fut.result()
                run(key0, prepared0)
        except BaseException:
            for _, _, fut in pending:
                fut.cancel()
            raise


def default_compilation_cache_dir() -> str:
    """`$XDG_CACHE_HOME/prefixcache/jax_cache` (`~/.cache/...` without XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                            ".cache")
    return os.path.join(base, "prefixcache", "jax_cache")


def enable_compilation_cache(cache_dir: str | os.PathLike | None = None) -> str:
    """Turns on JAX's persistent compilation cache in `cache_dir` (created if needed).

    A later process with the same model, configuration and jax version loads its
    programs from there instead of compiling them (`prefixcache serve` does this by
    default). Every program is written, however fast it compiled (jax's default keeps
    only those over one second). This sets jax's process-wide configuration: call it
    before the first compile (it also resets jax's memo of whether the cache is in
    use, so a call after earlier compiles takes effect from then on).

    Args:
      cache_dir: the directory; None: `default_compilation_cache_dir()`.

    Returns:
      The directory used (absolute).

    Raises:
      ValueError: `cache_dir` exists and is not a directory, or cannot be created.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = os.path.abspath(os.fspath(default_compilation_cache_dir() if cache_dir is None
                                     else cache_dir))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compilation cache dir {path!r}: {e}") from None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    # NOTE: jax writes only programs that took >= 1 s to compile by default; a step of
    # a small model compiles faster than that and would be compiled again every start.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    cc.reset_cache()
    return path


def disable_compilation_cache() -> None:
    """Turns JAX's persistent compilation cache off for this process (also one set up
    through `JAX_COMPILATION_CACHE_DIR`)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    jax.config.update("jax_enable_compilation_cache", False)
    cc.reset_cache()
