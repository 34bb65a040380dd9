"""The engine core: one Engine stepped in a loop, fed and read through compact messages.

vLLM's EngineCore split: the HTTP process parses, tokenizes, detokenizes and streams;
the core adds requests, aborts them, steps the engine and answers one batch of outputs
per step. The same `EngineCore` runs

* in its own process (`run_engine_core`, started by
  `prefixcache.serve.engine_loop.EngineCoreClient`; the default of `prefixcache serve`):
  the messages below travel msgspec-msgpack encoded over two ZMQ PUSH/PULL sockets
  (front end -> core: commands; core -> front end: outputs), so the engine never waits
  on the HTTP event loop and never shares its GIL;
* on a thread of the HTTP process (`prefixcache.serve.engine_loop.ServingEngine`,
  `serve --engine-in-process`): the same message objects pass through a queue,
  unencoded.

Commands (front end -> core): `AddRequests`, `AbortRequests`, `UtilityCall` (a named
`EngineCore.utility_*` method, e.g. `reset_prefix_cache`), `Shutdown`.
Outputs (core -> front end): `Ready` (once, after the engine is built and prepared),
`StepOutputs` (per step: each request's new token ids, finish, usage, miss reasons;
scheduler gauges; counter deltas; the block residency histograms that changed;
utility results), `CoreFailed` (start-up or loop
failure, then the core exits).

The KV-events publisher (`serve --kv-events-endpoint`) lives with the manager: in the
core, publishing each step's events after the step.
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any

import msgspec

_log = logging.getLogger(__name__)

# -- messages ----------------------------------------------------------------------------


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One `Engine.add_request`: `params` is `SamplingParams` as a field list
    (`params_to_list`); `lora` is `(name, path, int_id)` or None."""

    request_id: str
    prompt: list[int]
    params: list
    cache_salt: str | None = None
    priority: int = 0
    lora: tuple[str, str, int | None] | None = None
    retention: Any = None  # RetentionHints in-process; its dict (to_dict) when encoded


class AddRequests(msgspec.Struct, tag="add", array_like=True):
    requests: list[NewRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    method: str
    args: list = []


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Abort every unfinished request, answer their finals, exit."""


Command = AddRequests | AbortRequests | UtilityCall | Shutdown


class RequestUpdate(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step did to one request: its new token ids and, once it finished,
    `finish_reason` ("length", "stop", "abort", "error") with the rest. `rejected`:
    `add_request` refused it (a ValueError, `error` says why; nothing was added)."""

    request_id: str
    new_token_ids: list[int] = []
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    miss_reasons: dict[str, int] | None = None
    rejected: bool = False


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    value: Any = None
    error: str | None = None


class StepOutputs(msgspec.Struct, tag="step", array_like=True, omit_defaults=True):
    """One batch of the core's outputs (after one step, or after commands alone).

    `num_added`: add commands' requests handled since the last batch (added or
    rejected); `num_running`, `num_waiting`, `kv_usage`: the scheduler's state now;
    `queries`, `hits`, `host_hits`, `preemptions`: counter increments since the last
    batch; `hits_by_tier`: the prefix-hit tokens adopted since, by tier (engines with a
    host tier; `KVCacheManager.hit_tokens_by_tier`); `done`: the core shut down after
    this batch; `residency`: the engine's block residency histograms that observed
    something since the last batch (`ResidencyTracker.take_changed`; None: none changed,
    or `Engine(residency=None)`)."""

    updates: list[RequestUpdate] = []
    num_added: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    queries: int = 0
    hits: int = 0
    host_hits: int = 0
    preemptions: int = 0
    results: list[UtilityResult] = []
    done: bool = False
    programs: int = 0
    compiles_after_warmup: int = -1  # (-1: no warm-up ran)
    hits_by_tier: dict[str, int] = {}
    residency: dict[str, dict[str, list]] | None = None


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The engine is built and prepared. `info`: what the front end needs to validate
    requests (`EngineCore.info`); `tokenizer`: the engine's tokenizer, pickled (b"": none)."""

    info: dict[str, Any]
    tokenizer: bytes = b""


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str


Output = StepOutputs | Ready | CoreFailed

PARAM_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids",
                "stop", "include_stop_str_in_output", "skip_special_tokens")


def params_to_list(params) -> list:
    return [getattr(params, f) for f in PARAM_FIELDS]


def params_from_list(values: list):
    from prefixcache.engine.sampling_params import SamplingParams

    kw = dict(zip(PARAM_FIELDS, values))
    kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
    kw["stop"] = tuple(kw["stop"])
    return SamplingParams(**kw)


def engine_info(engine) -> dict:
    """What the HTTP side needs to know of the engine (no engine object needed)."""
    return {"max_model_len": int(engine.max_model_len), "vocab_size": int(engine.vocab_size),
            "enable_lora": bool(getattr(engine, "enable_lora", False)),
            "max_num_seqs": int(engine.scheduler.max_num_seqs),
            "num_programs_built": int(engine.num_programs_built),
            "num_compiles_after_warmup": engine.num_compiles_after_warmup,
            "residency": (None if getattr(engine, "residency", None) is None
                          else engine.residency.tracker.sample_rate)}


# -- the core ----------------------------------------------------------------------------


class EngineCore:
    """Owns an Engine (and the KV-events publisher): handles commands, steps, and turns
    each step into one `StepOutputs`. Not thread-safe: one thread calls it.

    Args:
      engine: a `prefixcache.engine.Engine`.
      kv_event_publisher: an object with `.publish(events)`; the manager's
        `take_events()` go to it after each loop turn (the manager must have been built
        with `enable_events=True`).
    """

    def __init__(self, engine, kv_event_publisher=None):
        if kv_event_publisher is not None and not engine.kv_cache_manager.enable_events:
            raise ValueError("kv_event_publisher needs an engine whose KV cache manager "
                             "queues events (Engine(..., manager_kwargs={'enable_events': "
                             "True}))")
        if kv_event_publisher is not None and getattr(engine, "residency", None) is not None:
            raise ValueError("kv_event_publisher and Engine(residency=...) both drain the "
                             "manager's KV events; use one of them")
        self.engine = engine
        self.kv_event_publisher = kv_event_publisher
        self._sent: dict[str, int] = {}  # unfinished request -> output tokens sent
        self._updates: list[RequestUpdate] = []
        self._results: list[UtilityResult] = []
        self._num_added = 0
        self._timings: dict[str, tuple] | None = None
        self._preemptions_seen = engine.scheduler.stats()["num_preemptions"]
        self._host_hits_seen = int(getattr(engine.kv_cache_manager, "host_hit_tokens", 0))
        self._tier_hits_seen = self._tier_hits()

    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    # -- commands ----------------------------------------------------------------------

    def handle(self, cmd) -> bool:
        """Runs one command; True when it is `Shutdown`."""
        if isinstance(cmd, AddRequests):
            self._add(cmd.requests)
        elif isinstance(cmd, AbortRequests):
            for rid in cmd.request_ids:
                if rid in self.engine.scheduler.requests:
                    self.engine.abort_request(rid)
        elif isinstance(cmd, UtilityCall):
            fn = getattr(self, "utility_" + cmd.method, None)
            if fn is None:
                self._results.append(UtilityResult(cmd.call_id, error=f"ValueError: no "
                                                   f"engine-core utility {cmd.method!r}"))
            else:
                try:
                    self._results.append(UtilityResult(cmd.call_id, fn(*cmd.args)))
                except Exception as e:  # handed to the caller
                    self._results.append(UtilityResult(cmd.call_id,
                                                       error=f"{type(e).__name__}: {e}"))
        elif isinstance(cmd, Shutdown):
            return True
        else:  # pragma: no cover - the decoder admits only the commands above
            raise TypeError(f"unknown command {type(cmd).__name__}")
        return False

    def _add(self, requests) -> None:
        from prefixcache.core import LoRARequest

        eng = self.engine
        for r in requests:
            self._num_added += 1
            try:
                params = r.params if not isinstance(r.params, list) else params_from_list(
                    r.params)
                lora = r.lora
                if isinstance(lora, (tuple, list)):
                    lora = LoRARequest(*lora)
                eng.add_request(r.prompt, params, request_id=r.request_id,
                                cache_salt=r.cache_salt, lora_request=lora,
                                priority=r.priority, retention=r.retention)
            except ValueError as e:
                self._updates.append(RequestUpdate(r.request_id, error=str(e),
                                                   rejected=True))
                continue
            self._sent[r.request_id] = 0

    def abort_all(self) -> None:
        for rid in list(self._sent):
            if rid in self.engine.scheduler.requests:
                self.engine.abort_request(rid)

    # -- stepping ----------------------------------------------------------------------

    def step(self) -> None:
        """One engine step; its tokens and finals join the pending outputs."""
        eng = self.engine
        outs = eng.step()
        finished = {o.request_id: o for o in outs} if outs else {}
        ups = self._updates
        for rid, sent in list(self._sent.items()):
            o = finished.pop(rid, None)
            if o is None:
                new = eng.output_token_ids(rid, sent)
                if new:
                    self._sent[rid] = sent + len(new)
                    ups.append(RequestUpdate(rid, new))
                continue
            del self._sent[rid]
            ups.append(self._final(o, list(o.token_ids[sent:])))
        for o in finished.values():  # pragma: no cover - not added through this core
            ups.append(self._final(o, []))

    def _final(self, o, new: list) -> RequestUpdate:
        m = o.metrics
        if self._timings is not None:
            self._timings[o.request_id] = (m.ttft_s, m.num_cached_tokens)
        return RequestUpdate(o.request_id, new, o.finish_reason, o.error,
                             int(m.num_cached_tokens), len(o.prompt_token_ids),
                             len(o.token_ids), m.miss_reasons)

    def take_outputs(self, *, done: bool = False) -> StepOutputs:
        """The pending outputs with the scheduler's state and counter increments."""
        eng = self.engine
        mgr = eng.kv_cache_manager
        st = eng.scheduler.stats()
        queries = hits = 0
        stats = mgr.make_prefix_cache_stats()
        if stats is not None:
            queries, hits = int(stats.queries), int(stats.hits)
        host = int(getattr(mgr, "host_hit_tokens", 0))
        host_delta = max(host - self._host_hits_seen, 0)
        self._host_hits_seen = host
        pre = st["num_preemptions"]
        pre_delta = max(pre - self._preemptions_seen, 0)
        self._preemptions_seen = pre
        after = self.engine.num_compiles_after_warmup
        tiers = self._tier_hits()
        tier_delta = {k: v - self._tier_hits_seen.get(k, 0) for k, v in tiers.items()
                      if v > self._tier_hits_seen.get(k, 0)}
        self._tier_hits_seen = tiers
        res = getattr(eng, "residency", None)
        out = StepOutputs(self._updates, self._num_added, st["num_running"],
                          st["num_waiting"], float(mgr.usage), queries, hits, host_delta,
                          pre_delta, self._results, done, self.engine.num_programs_built,
                          -1 if after is None else after, tier_delta,
                          None if res is None else res.tracker.take_changed())
        self._updates, self._results, self._num_added = [], [], 0
        return out

    def _tier_hits(self) -> dict[str, int]:
        """The manager's cumulative hit tokens by tier ({} without a host tier)."""
        if not getattr(self.engine, "num_host_blocks", 0):
            return {}
        return {str(k): int(v) for k, v in
                getattr(self.engine.kv_cache_manager, "hit_tokens_by_tier", {}).items()}

    def has_outputs(self) -> bool:
        return bool(self._updates or self._results or self._num_added)

    def publish_events(self) -> None:
        if self.kv_event_publisher is not None:
            events = self.engine.kv_cache_manager.take_events()
            if events:
                self.kv_event_publisher.publish(events)

    # -- utilities (UtilityCall.method "x" runs utility_x) -----------------------------

    def utility_reset_prefix_cache(self) -> bool:
        return bool(self.engine.kv_cache_manager.reset_prefix_cache())

    def utility_state(self) -> list:
        """[KV usage, unfinished requests, cached block ids] after checking the pool's
        invariants (tests)."""
        mgr = self.engine.kv_cache_manager
        mgr.check_invariants()
        return [float(mgr.usage), int(self.engine.scheduler.num_unfinished_requests),
                sorted(int(b) for b in mgr.cached_block_ids())]

    def utility_metrics(self) -> dict:
        """`Engine.metrics()` as a plain dict."""
        return msgspec.to_builtins(self.engine.metrics())

    def utility_record_timings(self, on: bool) -> None:
        """Start (clear) or stop recording each finished request's engine-side
        (ttft_s, num_cached_tokens) for `utility_take_timings` (benchmarks)."""
        self._timings = {} if on else None

    def utility_take_timings(self) -> dict:
        out, self._timings = self._timings or {}, ({} if self._timings is not None else None)
        return out

    def utility_ping(self) -> None:
        return None


def prepare(engine, args) -> None:
    """What runs on the built engine before the core reports ready (both modes): compile
    every step program (`Engine.warmup`, unless `--no-warmup`), so `/health` answers 200
    only when no request will wait for a compile."""
    from prefixcache.serve.cli import warmup

    warmup(engine, args)


# -- the core process --------------------------------------------------------------------


def run_engine_core(args, build, input_addr: str, output_addr: str,
                    log_level: str = "WARNING") -> None:
    """The engine-core process: builds the Engine (`build(args)`) and, when `args` asks
    for one, the KV-events publisher, prepares it, reports `Ready`, then serves commands
    until `Shutdown` or until the front end's process is gone."""
    import multiprocessing
    import signal

    import zmq

    # NOTE: Ctrl-C reaches the whole process group; the front end decides (graceful
    # shutdown), so the core ignores SIGINT. SIGTERM keeps its default: it ends the core.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=str(log_level).upper(),
                        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(input_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(output_addr)
    enc = msgspec.msgpack.Encoder()
    publisher = None
    try:
        try:
            from prefixcache.serve.cli import prepare_compilation

            prepare_compilation(args)  # (before anything compiles)
            engine = build(args)
            endpoint = getattr(args, "kv_events_endpoint", None)
            if endpoint:
                from prefixcache.serve.kv_events import KVEventPublisher

                publisher = KVEventPublisher.from_endpoint(
                    endpoint, topic=getattr(args, "kv_events_topic", "") or "",
                    replay_endpoint=getattr(args, "kv_events_replay_endpoint", None),
                    bind_host=getattr(args, "kv_events_bind_host", "127.0.0.1"))
            core = EngineCore(engine, publisher)
            prepare(engine, args)
            tok = getattr(engine, "tokenizer", None)
            push.send(enc.encode(Ready(engine_info(engine),
                                       pickle.dumps(tok) if tok is not None else b"")))
        except Exception as e:
            _log.exception("the engine core failed to start")
            push.send(enc.encode(CoreFailed(f"{type(e).__name__}: {e}")))
            raise SystemExit(1) from None
        parent = multiprocessing.parent_process()
        try:
            _core_loop(core, pull, push, enc,
                       lambda: parent is None or parent.is_alive())
        except Exception as e:
            _log.exception("the engine core failed")
            push.send(enc.encode(CoreFailed(f"{type(e).__name__}: {e}")))
            raise SystemExit(1) from None
    finally:
        if publisher is not None:
            publisher.close()
        push.close()
        pull.close()
        ctx.term()


def _core_loop(core: EngineCore, pull, push, enc, parent_alive) -> None:
    import zmq

    dec = msgspec.msgpack.Decoder(Command)
    stopping = False
    next_check = time.monotonic() + 1.0
    while True:
        if time.monotonic() > next_check:  # busy for long: is the front end still there?
            if not parent_alive():
                return
            next_check = time.monotonic() + 1.0
        if not core.busy and not stopping:
            # Idle: sleep until a command comes (waking each second to notice a front
            # end that died without saying so).
            while not pull.poll(1000):
                if not parent_alive():
                    return
        while True:
            try:
                raw = pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if core.handle(dec.decode(raw)):
                stopping = True
        if stopping:
            core.abort_all()
        stepped = core.busy
        if stepped:
            core.step()
        elif stopping:
            push.send(enc.encode(core.take_outputs(done=True)))
            core.publish_events()
            return
        if stepped or core.has_outputs():
            push.send(enc.encode(core.take_outputs()))
        core.publish_events()


def describe_exit(code: int | None) -> str:
    """'exit code 1' / 'killed by SIGKILL' of a process's exitcode."""
    if code is None:
        return "still running"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
