"""The serving loop: one thread owns the Engine; HTTP handlers talk to it via queues.

The Engine is not thread-safe, so every engine call happens on the engine thread:
handlers put commands (add, abort, call) on a `queue.SimpleQueue`; the thread runs
them between steps, steps while requests are waiting or running, and hands each
request's new tokens back to the handler's asyncio queue once per step (one
`loop.call_soon_threadsafe` per step and event loop, carrying every request's delta).

Events a handler's queue receives, each `(tag, kind, ...)` with the tag given at submit:
  * `(tag, "tokens", ids)`: the tokens one step added;
  * `(tag, "final", ids, RequestOutput)`: the last new tokens and the finished output
    (finish_reason "length" / "stop" / "abort" / "error");
  * `(tag, "error", message)`: `add_request` refused it (a ValueError: nothing added).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable

from prefixcache.serve.protocol import APIError

_log = logging.getLogger(__name__)
_STOP = object()


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


@dataclasses.dataclass(eq=False)
class _Active:
    call: EngineCall
    loop: Any
    queue: Any
    arrival: float
    sent: int = 0
    last_token_time: float | None = None


def _deliver(items) -> None:
    for q, item in items:
        q.put_nowait(item)


class ServingEngine:
    """Runs an Engine on its own thread for many concurrent asyncio clients.

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
        if max_waiting is not None and (not isinstance(max_waiting, int) or max_waiting < 0):
            raise ValueError(f"max_waiting must be None or an int >= 0, got {max_waiting!r}")
        if kv_event_publisher is not None and not engine.kv_cache_manager.enable_events:
            raise ValueError("kv_event_publisher needs an engine whose KV cache manager "
                             "queues events (Engine(..., manager_kwargs={'enable_events': "
                             "True}))")
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.kv_event_publisher = kv_event_publisher
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._num_waiting = 0
        self._num_running = 0
        self._accepting = True
        self._active: dict[str, _Active] = {}
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        sched = engine.scheduler.stats()
        self._preemptions_seen = sched["num_preemptions"]
        self._host_hits_seen = int(getattr(engine.kv_cache_manager, "host_hit_tokens", 0))

    # -- any thread -------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def start(self) -> "ServingEngine":
        if self._thread is not None:
            raise RuntimeError("ServingEngine already started")
        self._thread = threading.Thread(target=self._run, name="prefixcache-engine",
                                        daemon=True)
        self._thread.start()
        return self

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
            engine thread died.
        """
        arrival = time.perf_counter()
        with self._lock:
            if not self._accepting or not self.alive:
                raise APIError(503, "the server is shutting down" if self.failure is None
                               else f"the engine failed: {self.failure!r}",
                               code="unavailable")
            if self.max_waiting is not None:
                free = max(self.engine.scheduler.max_num_seqs - self._num_running, 0)
                queued = max(self._pending_adds + self._num_waiting + len(calls) - free, 0)
                if queued > self.max_waiting:
                    raise APIError(
                        503, f"too many requests waiting ({self._pending_adds + self._num_waiting}"
                             f" queued, bound --max-waiting={self.max_waiting}); retry later",
                        code="queue_full", headers={"Retry-After": "1"})
            self._pending_adds += len(calls)
        self._cmds.put(("add", [_Active(c, loop, q, arrival) for c in calls]))

    def abort(self, request_ids) -> None:
        """Aborts these requests if still unfinished (their events stop)."""
        ids = list(request_ids)
        if ids:
            self._cmds.put(("abort", ids))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Runs `fn(engine)` on the engine thread between steps; its result or exception
        in the returned Future (inspection, `reset_prefix_cache`, tests)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            fut.set_exception(RuntimeError("the engine thread is not running"))
            return fut
        self._cmds.put(("call", fn, fut))
        return fut

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops accepting, aborts every unfinished request (their handlers get a final
        "abort" event), and joins the engine thread."""
        self.stop_accepting()
        if self._thread is None:
            return
        self._cmds.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():  # pragma: no cover - a step that never returns
            _log.error("the engine thread did not stop within %s s", timeout)

    # -- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        eng = self.engine
        stopping = False
        try:
            while True:
                busy = eng.has_unfinished_requests()
                cmds = []
                if not busy and not stopping:
                    cmds.append(self._cmds.get())  # idle: sleep until a command comes
                while True:
                    try:
                        cmds.append(self._cmds.get_nowait())
                    except queue.Empty:
                        break
                added = 0
                for cmd in cmds:
                    if cmd is _STOP:
                        stopping = True
                        continue
                    added += self._handle(cmd)
                if stopping:
                    for rid in list(self._active):
                        self._abort(rid)
                self._publish_state(added)
                if eng.has_unfinished_requests():
                    self._step()
                    self._publish_state(0)
                elif stopping:
                    self._flush_deliveries({})
                    break
                self._publish_events()
        except BaseException as e:  # pragma: no cover - an engine bug: fail every client
            _log.exception("the engine thread failed")
            self.failure = e
            out = collections.defaultdict(list)
            for a in self._active.values():
                out[a.loop].append((a.queue, (a.call.tag, "error",
                                              f"the engine failed: {type(e).__name__}: {e}")))
            self._active.clear()
            self._flush_deliveries(out)

    def _handle(self, cmd) -> int:
        eng = self.engine
        kind = cmd[0]
        if kind == "add":
            out = collections.defaultdict(list)
            for a in cmd[1]:
                c = a.call
                try:
                    eng.add_request(c.prompt, c.params, request_id=c.request_id,
                                    cache_salt=c.cache_salt, lora_request=c.lora,
                                    priority=c.priority)
                except ValueError as e:
                    out[a.loop].append((a.queue, (c.tag, "error", str(e))))
                    continue
                self._active[c.request_id] = a
            self._flush_deliveries(out)
            return len(cmd[1])
        if kind == "abort":
            for rid in cmd[1]:
                self._abort(rid)
            return 0
        if kind == "call":
            _, fn, fut = cmd
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(eng))
                except BaseException as e:  # handed to the caller
                    fut.set_exception(e)
            return 0
        raise AssertionError(f"unknown command {kind!r}")  # pragma: no cover

    def _abort(self, rid: str) -> None:
        if rid in self.engine.scheduler.requests:
            self.engine.abort_request(rid)

    def _publish_state(self, added: int) -> None:
        st = self.engine.scheduler.stats()
        with self._lock:
            self._pending_adds -= added
            self._num_waiting = st["num_waiting"]
            self._num_running = st["num_running"]
        m = self.metrics
        if m is not None:
            m.running.set(st["num_running"])
            m.waiting.set(st["num_waiting"] + self._pending_adds)
            m.usage.set(self.engine.kv_cache_manager.usage)
            m.set_programs(self.engine.num_programs_built,
                           self.engine.num_compiles_after_warmup)

    def _publish_events(self) -> None:
        if self.kv_event_publisher is not None:
            events = self.engine.kv_cache_manager.take_events()
            if events:
                self.kv_event_publisher.publish(events)

    def _step(self) -> None:
        eng = self.engine
        outs = eng.step()
        now = time.perf_counter()
        m = self.metrics
        finished = {o.request_id: o for o in outs} if outs else {}
        out = collections.defaultdict(list)
        for rid, a in list(self._active.items()):
            o = finished.pop(rid, None)
            if o is None:
                new = eng.output_token_ids(rid, a.sent)
                if not new:
                    continue
                item = (a.call.tag, "tokens", new)
            else:
                del self._active[rid]
                new = o.token_ids[a.sent:]
                item = (a.call.tag, "final", new, o)
                if m is not None:
                    m.e2e.observe(now - a.arrival)
                    m.success(o.finish_reason).inc()
                    m.prompt_tokens.inc(len(o.prompt_token_ids))
                    m.generation_tokens.inc(len(o.token_ids))
                    if o.metrics.miss_reasons:
                        m.add_misses(o.metrics.miss_reasons)
            if new:
                a.sent += len(new)
                if m is not None:
                    if a.last_token_time is None:
                        m.ttft.observe(now - a.arrival)
                    else:
                        m.itl.observe(now - a.last_token_time)
                a.last_token_time = now
            out[a.loop].append((a.queue, item))
        if m is not None:
            for o in finished.values():  # aborted after their client left
                m.success(o.finish_reason).inc()
                if o.metrics.miss_reasons:
                    m.add_misses(o.metrics.miss_reasons)
            self._step_metrics()
        self._flush_deliveries(out)

    def _step_metrics(self) -> None:
        eng, m = self.engine, self.metrics
        mgr = eng.kv_cache_manager
        stats = mgr.make_prefix_cache_stats()
        if stats is not None:
            m.queries.inc(stats.queries)
            m.hits.inc(stats.hits)
        host = int(getattr(mgr, "host_hit_tokens", 0))
        if host > self._host_hits_seen:
            m.host_hits.inc(host - self._host_hits_seen)
        self._host_hits_seen = host
        pre = eng.scheduler.stats()["num_preemptions"]
        if pre > self._preemptions_seen:
            m.preemptions.inc(pre - self._preemptions_seen)
        self._preemptions_seen = pre
        m.usage.set(mgr.usage)

    @staticmethod
    def _flush_deliveries(out) -> None:
        for loop, items in out.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the client's event loop is closed: nobody listens
                pass
