"""The server's side of the engine: HTTP handlers talk to an `EngineCore` through this.

Two ways to run the core, one interface for the handlers (`submit`, `abort`,
`utility`, `alive`, `failure`, `info`, `tokenizer`, `num_waiting`, `shutdown`):

* `EngineCoreClient` (the default of `prefixcache serve`): the core runs in its own
  process (multiprocessing spawn) and exchanges msgspec-encoded messages with this one
  over ZMQ (`prefixcache.serve.engine_core`), vLLM's AsyncLLM / EngineCore split. A
  reader thread here decodes each step's outputs and hands them to the handlers' event
  loops. If the core process dies, every unfinished request gets a "failed" event at
  once, new requests get a 503, and `alive` turns False (`/health` answers 503).
* `ServingEngine` (`serve --engine-in-process`, and `build_app(engine)`): the same core
  on a thread of this process (one GIL with the HTTP event loop): for debugging, for
  tests that inspect the engine (`call(fn)`), and where a second process is unwelcome.

Events a handler's asyncio queue receives, each `(tag, kind, ...)` with the tag given at
submit:
  * `(tag, "tokens", ids)`: the tokens one step added;
  * `(tag, "final", ids, RequestUpdate)`: the last new tokens and how the request ended
    (`.finish_reason` "length" / "stop" / "abort" / "error", `.error`,
    `.num_cached_tokens`, `.miss_reasons`; `prefixcache.serve.engine_core.RequestUpdate`);
  * `(tag, "error", message)`: `add_request` refused it (a ValueError: nothing added);
  * `(tag, "failed", message)`: the engine core failed or died (a server error).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import pickle
import queue
import shutil
import tempfile
import threading
import time
from typing import Any, Callable

from prefixcache.serve.engine_core import (AbortRequests, AddRequests, CoreFailed,
                                           EngineCore, NewRequest, Ready, Shutdown,
                                           StepOutputs, UtilityCall, describe_exit,
                                           engine_info, params_to_list)
from prefixcache.serve.protocol import APIError

_log = logging.getLogger(__name__)


class EngineCoreError(RuntimeError):
    """The engine core failed to start, failed, or died."""


@dataclasses.dataclass(eq=False)
class EngineCall:
    """One request for the engine: `Engine.add_request(prompt, params, **kwargs)`."""

    request_id: str
    prompt: list[int]
    params: Any
    tag: Any = None
    cache_salt: str | None = None
    priority: int = 0
    lora: Any = None
    retention: Any = None  # RetentionHints or None


@dataclasses.dataclass(eq=False)
class _Active:
    call: EngineCall
    loop: Any
    queue: Any
    arrival: float
    last_token_time: float | None = None


def _deliver(items) -> None:
    for q, item in items:
        q.put_nowait(item)


def _flush(out) -> None:
    for loop, items in out.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the client's event loop is closed: nobody listens
            pass


class EngineFrontEnd:
    """The handlers' side, shared by both modes: admission (the waiting bound),
    per-request routing of the core's outputs to asyncio queues, the Prometheus
    metrics, utility-call futures, failing everything when the core is gone.

    Attributes:
      info: the engine's `max_model_len`, `vocab_size`, `enable_lora`, `max_num_seqs`.
      tokenizer: the engine's tokenizer (None: token ids only).
      metrics: a `ServerMetrics` updated from each output batch (None: none).
      failure: why the core is gone (None while it runs).
      residency: a `ResidencyTracker` holding the engine's block residency histograms
        as its output batches carry them (`Engine(residency=RATE)`; None: off).
    """

    _encode_params = False  # process mode: SamplingParams / LoRARequest as plain lists

    def _init_front(self, info: dict, tokenizer, max_waiting: int | None, metrics) -> None:
        if max_waiting is not None and (not isinstance(max_waiting, int) or max_waiting < 0):
            raise ValueError(f"max_waiting must be None or an int >= 0, got {max_waiting!r}")
        self.info = dict(info)
        self.tokenizer = tokenizer
        self.residency = None  # the engine's residency histograms, as the outputs carry them
        if info.get("residency") is not None:
            from prefixcache.core.residency import ResidencyTracker  # noqa: PLC0415

            self.residency = ResidencyTracker(info["residency"])
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.failure: BaseException | None = None
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._num_waiting = 0
        self._num_running = 0
        self._accepting = True
        self._active: dict[str, _Active] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()

    # -- to be provided by the mode -----------------------------------------------------

    def _send(self, cmd) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _running(self) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- the handlers' interface ----------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.failure is None and self._running()

    def num_waiting(self) -> int:
        """Requests queued: not yet added, or waiting in the engine."""
        with self._lock:
            return self._pending_adds + self._num_waiting

    def num_running(self) -> int:
        with self._lock:
            return self._num_running

    def submit(self, calls: list[EngineCall], loop, q) -> None:
        """Queues `calls` (all or none); their events go to asyncio queue `q` of `loop`.

        Raises:
          APIError: 503 when the waiting queue is full, the server shuts down, or the
            engine core is gone.
        """
        arrival = time.perf_counter()
        with self._lock:
            if self.failure is not None or not self._running():
                raise APIError(503, "the engine is not running" + (
                    "" if self.failure is None else f": {self.failure}"), code="unavailable")
            if not self._accepting:
                raise APIError(503, "the server is shutting down", code="unavailable")
            if self.max_waiting is not None:
                free = max(self.info["max_num_seqs"] - self._num_running, 0)
                queued = max(self._pending_adds + self._num_waiting + len(calls) - free, 0)
                if queued > self.max_waiting:
                    raise APIError(
                        503, f"too many requests waiting ({self._pending_adds + self._num_waiting}"
                             f" queued, bound --max-waiting={self.max_waiting}); retry later",
                        code="queue_full", headers={"Retry-After": "1"})
            self._pending_adds += len(calls)
            for c in calls:
                self._active[c.request_id] = _Active(c, loop, q, arrival)
        self._send(AddRequests([self._new_request(c) for c in calls]))

    def _new_request(self, c: EngineCall) -> NewRequest:
        params, lora, retention = c.params, c.lora, c.retention
        if self._encode_params:
            params = params_to_list(params)
            if lora is not None:
                lora = (lora.name, lora.path, lora.int_id)
            if retention is not None and not isinstance(retention, dict):
                retention = retention.to_dict()
        return NewRequest(c.request_id, list(c.prompt), params, c.cache_salt, c.priority,
                          lora, retention)

    def abort(self, request_ids) -> None:
        """Aborts these requests if still unfinished (their final comes as "abort")."""
        ids = list(request_ids)
        if ids and self.alive:
            self._send(AbortRequests(ids))

    def utility(self, method: str, *args) -> concurrent.futures.Future:
        """Runs `EngineCore.utility_<method>(*args)` in the core between steps; its
        result (or an `EngineCoreError` with the core's message) in the Future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.failure is not None or not self._running():
                fut.set_exception(EngineCoreError("the engine is not running" + (
                    "" if self.failure is None else f": {self.failure}")))
                return fut
            cid = next(self._call_ids)
            self._calls[cid] = fut
        self._send(UtilityCall(cid, method, list(args)))
        return fut

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    # -- outputs ----------------------------------------------------------------------------

    def _process(self, out: StepOutputs) -> None:
        """Routes one output batch to the handlers and the metrics (any thread)."""
        now = time.perf_counter()
        m = self.metrics
        deliveries = collections.defaultdict(list)
        results = []
        with self._lock:
            self._pending_adds -= out.num_added
            self._num_running, self._num_waiting = out.num_running, out.num_waiting
            waiting = self._num_waiting + self._pending_adds
            for u in out.updates:
                rid = u.request_id
                if u.rejected:
                    a = self._active.pop(rid, None)
                    if a is not None:
                        deliveries[a.loop].append((a.queue, (a.call.tag, "error", u.error)))
                    continue
                final = u.finish_reason is not None
                a = self._active.pop(rid, None) if final else self._active.get(rid)
                if final and m is not None:
                    m.success(u.finish_reason).inc()
                    if u.miss_reasons:
                        m.add_misses(u.miss_reasons)
                if a is None:
                    continue
                new = u.new_token_ids
                if final:
                    item = (a.call.tag, "final", new, u)
                    if m is not None:
                        m.e2e.observe(now - a.arrival)
                        m.prompt_tokens.inc(u.num_prompt_tokens)
                        m.generation_tokens.inc(u.num_output_tokens)
                else:
                    item = (a.call.tag, "tokens", new)
                if new:
                    if m is not None:
                        if a.last_token_time is None:
                            m.ttft.observe(now - a.arrival)
                        else:
                            m.itl.observe(now - a.last_token_time)
                    a.last_token_time = now
                deliveries[a.loop].append((a.queue, item))
            for r in out.results:
                fut = self._calls.pop(r.call_id, None)
                if fut is not None:
                    results.append((fut, r))
        if m is not None:
            m.running.set(out.num_running)
            m.waiting.set(waiting)
            m.usage.set(out.kv_usage)
            m.set_programs(out.programs,
                           None if out.compiles_after_warmup < 0 else out.compiles_after_warmup)
            if out.queries:
                m.queries.inc(out.queries)
            if out.hits:
                m.hits.inc(out.hits)
            if out.host_hits:
                m.host_hits.inc(out.host_hits)
            if out.hits_by_tier:
                m.add_tier_hits(out.hits_by_tier)
            if out.preemptions:
                m.preemptions.inc(out.preemptions)
        if out.residency and self.residency is not None:
            self.residency.apply_changed(out.residency)
        _flush(deliveries)
        for fut, r in results:
            if r.error is None:
                fut.set_result(r.value)
            else:
                fut.set_exception(EngineCoreError(r.error))

    def _fail(self, exc: BaseException) -> None:
        """The core is gone: every unfinished request gets a "failed" event, every
        pending utility call the exception; new requests get a 503."""
        with self._lock:
            if self.failure is None:
                self.failure = exc
            active, self._active = self._active, {}
            calls, self._calls = self._calls, {}
            self._pending_adds = 0
        msg = f"the engine failed: {exc}"
        deliveries = collections.defaultdict(list)
        for a in active.values():
            deliveries[a.loop].append((a.queue, (a.call.tag, "failed", msg)))
        _flush(deliveries)
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(EngineCoreError(msg))


class _InprocCall:
    __slots__ = ("fn", "fut")

    def __init__(self, fn, fut):
        self.fn, self.fut = fn, fut


class ServingEngine(EngineFrontEnd):
    """The engine core on a thread of this process (`serve --engine-in-process`).

    Args:
      engine: a `prefixcache.engine.Engine` (used from the engine thread only, once
        `start()` is called).
      max_waiting: the most requests queued beyond the running batch's free slots
        (None: unbounded); past it `submit` raises a 503 `APIError` with Retry-After.
      metrics: a `ServerMetrics` updated after each step (None: none).
      kv_event_publisher: an object with `.publish(events, data_parallel_rank=0)`; the
        manager's `take_events()` go to it after each step (the engine's manager must
        have been built with `enable_events=True`).
    """

    def __init__(self, engine, *, max_waiting: int | None = None, metrics=None,
                 kv_event_publisher=None):
        self.core = EngineCore(engine, kv_event_publisher)
        self._init_front(engine_info(engine), getattr(engine, "tokenizer", None),
                         max_waiting, metrics)
        self.engine = engine
        self.kv_event_publisher = kv_event_publisher
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _send(self, cmd) -> None:
        self._cmds.put(cmd)

    def start(self) -> "ServingEngine":
        if self._thread is not None:
            raise RuntimeError("ServingEngine already started")
        self._thread = threading.Thread(target=self._run, name="prefixcache-engine",
                                        daemon=True)
        self._thread.start()
        return self

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Runs `fn(engine)` on the engine thread between steps; its result or exception
        in the returned Future (inspection, tests)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            fut.set_exception(RuntimeError("the engine thread is not running"))
            return fut
        self._cmds.put(_InprocCall(fn, fut))
        return fut

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops accepting, aborts every unfinished request (their handlers get a final
        "abort" event), and joins the engine thread."""
        self.stop_accepting()
        if self._thread is None:
            return
        self._cmds.put(Shutdown())
        self._thread.join(timeout)
        if self._thread.is_alive():  # pragma: no cover - a step that never returns
            _log.error("the engine thread did not stop within %s s", timeout)

    def _run(self) -> None:
        core = self.core
        stopping = False
        try:
            while True:
                cmds = []
                if not core.busy and not stopping:
                    cmds.append(self._cmds.get())  # idle: sleep until a command comes
                while True:
                    try:
                        cmds.append(self._cmds.get_nowait())
                    except queue.Empty:
                        break
                for cmd in cmds:
                    if isinstance(cmd, _InprocCall):
                        if cmd.fut.set_running_or_notify_cancel():
                            try:
                                cmd.fut.set_result(cmd.fn(self.engine))
                            except BaseException as e:  # handed to the caller
                                cmd.fut.set_exception(e)
                    elif core.handle(cmd):
                        stopping = True
                if stopping:
                    core.abort_all()
                stepped = core.busy
                if stepped:
                    core.step()
                elif stopping:
                    self._process(core.take_outputs(done=True))
                    core.publish_events()
                    break
                if stepped or core.has_outputs():
                    self._process(core.take_outputs())
                core.publish_events()
        except BaseException as e:  # pragma: no cover - an engine bug: fail every client
            _log.exception("the engine thread failed")
            self._fail(EngineCoreError(f"{type(e).__name__}: {e}"))


class EngineCoreClient(EngineFrontEnd):
    """The engine core in its own process; this object is its HTTP-side client.

    Starting it spawns the process, which builds the Engine with `build(args)`, the
    KV-events publisher when `args.kv_events_endpoint` is set, runs
    `engine_core.prepare`, and reports ready; the constructor returns then.

    Args:
      args: the `prefixcache serve` flags (an argparse Namespace; picklable).
      build: a picklable `build(args) -> Engine` (default: `cli.build_engine`).
      max_waiting, metrics: as `ServingEngine`'s.
      log_level: the core process's logging level.

    Raises:
      EngineCoreError: the engine could not be built (the core's message), or the
        process died while starting.
    """

    _encode_params = True

    def __init__(self, args, *, build: Callable | None = None,
                 max_waiting: int | None = None, metrics=None, log_level: str = "warning"):
        import multiprocessing

        import msgspec
        import zmq

        if build is None:
            from prefixcache.serve.cli import build_engine as build
        self._dir = tempfile.mkdtemp(prefix="prefixcache-core-")
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.LINGER, 0)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        in_addr = f"ipc://{os.path.join(self._dir, 'in')}"
        out_addr = f"ipc://{os.path.join(self._dir, 'out')}"
        self._in.bind(in_addr)
        self._out.bind(out_addr)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(StepOutputs | Ready | CoreFailed)
        self._send_lock = threading.Lock()
        self._closing = False
        self._done = threading.Event()
        self._reader: threading.Thread | None = None
        from prefixcache.serve.engine_core import run_engine_core

        mp = multiprocessing.get_context("spawn")
        self.process = mp.Process(target=run_engine_core, name="prefixcache-engine-core",
                                  args=(args, build, in_addr, out_addr, log_level),
                                  daemon=True)
        self.process.start()
        try:
            ready = self._wait_ready()
        except BaseException:
            self._close_process(0.0)
            self._close_sockets()
            raise
        tok = pickle.loads(ready.tokenizer) if ready.tokenizer else None
        self._init_front(ready.info, tok, max_waiting, metrics)
        self._reader = threading.Thread(target=self._read, name="prefixcache-core-reader",
                                        daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def _wait_ready(self) -> Ready:
        import zmq

        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._out in events:
                msg = self._dec.decode(self._out.recv())
                if isinstance(msg, Ready):
                    return msg
                if isinstance(msg, CoreFailed):
                    raise EngineCoreError(msg.message)
                raise EngineCoreError(f"unexpected first message {type(msg).__name__}")
            if not self.process.is_alive():
                raise EngineCoreError(f"the engine core process exited while starting "
                                      f"({describe_exit(self.process.exitcode)})")

    def _running(self) -> bool:
        return self.process.is_alive() and not self._done.is_set()

    def _send(self, cmd) -> None:
        import zmq

        data = self._enc.encode(cmd)
        with self._send_lock:
            if self._closing:
                return
            try:
                self._in.send(data, copy=False)
            except zmq.ZMQError as e:  # pragma: no cover - sockets closed under us
                _log.warning("could not send to the engine core: %s", e)

    def start(self) -> "EngineCoreClient":
        """Already running (the constructor started it); for `ServingEngine` parity."""
        return self

    def _read(self) -> None:
        """The reader thread: decodes output batches until the core is done or gone."""
        import zmq

        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        dead = False
        try:
            while not self._closing:
                events = dict(poller.poll(200))
                if self._out in events:
                    while True:  # everything already here, then look at the process
                        try:
                            raw = self._out.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        msg = self._dec.decode(raw)
                        if isinstance(msg, StepOutputs):
                            self._process(msg)
                            if msg.done:
                                self._done.set()
                        elif isinstance(msg, CoreFailed):
                            self._fail(EngineCoreError(msg.message))
                if self._done.is_set():
                    return
                if not dead and self.process.sentinel in events:
                    dead = True  # one more turn: drain what it sent before it died
                    continue
                if dead:
                    self.process.join(1.0)
                    self._fail(EngineCoreError(
                        f"the engine core process died ({describe_exit(self.process.exitcode)})"))
                    return
        except BaseException as e:  # pragma: no cover - a bug here: fail every client
            _log.exception("the engine-core reader failed")
            self._fail(EngineCoreError(f"{type(e).__name__}: {e}"))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops accepting, asks the core to abort every unfinished request (their
        handlers get a final "abort" event) and exit; waits for it (then kills it)."""
        self.stop_accepting()
        if self.process.is_alive() and self.failure is None:
            self._send(Shutdown())
            self._done.wait(timeout)
        self._close_process(5.0)
        with self._send_lock:
            self._closing = True
        if self._reader is not None:
            self._reader.join(5.0)
        if self.failure is None and not self._done.is_set():
            self._fail(EngineCoreError("the engine core was stopped"))
        self._close_sockets()

    def _close_process(self, timeout: float) -> None:
        p = self.process
        p.join(timeout)
        if p.is_alive():
            p.terminate()
            p.join(5.0)
        if p.is_alive():  # pragma: no cover - SIGTERM ignored
            p.kill()
            p.join(5.0)

    def _close_sockets(self) -> None:
        self._in.close(0)
        self._out.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
