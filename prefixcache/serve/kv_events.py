"""The KV cache manager's events on the wire, exactly as vLLM 0.33's ``ZmqEventPublisher``.

KV-aware routers (llm-d's precise prefix-cache scorer, NVIDIA Dynamo's KV router) and
vLLM's own example subscriber read this stream unchanged::

    pub = KVEventPublisher.from_endpoint("tcp://*:5557", replay_endpoint="tcp://*:5558")
    pub.publish(manager.take_events())      # once per engine step, from the engine thread
    pub.close()

Wire format (``vllm/distributed/kv_events.py`` of vLLM 0.33, read from its wheel; the
structs below repeat its field order, options and defaults):

* one ZMQ multipart message per non-empty step: ``(topic, seq, payload)`` with ``topic``
  the UTF-8 topic (``b""`` by default), ``seq`` an 8-byte big-endian counter from 0, and
  ``payload`` the msgspec msgpack encoding of ``KVEventBatch(ts, events,
  data_parallel_rank)``. The batch is ``array_like`` (a 3-element array); the events are
  *tagged maps* (``{"type": "BlockStored", "block_hashes": ..., ...}``: in 0.33
  ``KVCacheEvent`` has ``tag=True, omit_defaults=True`` but not ``array_like``), the
  fields with a default left out while they hold it.
* block hashes are vLLM's external hashes as the manager already publishes them
  (``prefixcache.core.events``): the digest's low 64 bits as an unsigned int (msgpack
  uint64), or the raw digest bytes with ``KVCacheManager(int_event_hashes=False)``;
  ``medium`` is ``"GPU"`` or ``"CPU"`` (the host tier).
* replay (``replay_endpoint``, always bound, a ROUTER socket): a client (DEALER, or REQ)
  sends ``(b"", start_seq)`` (8 bytes big-endian); the publisher answers, for every
  buffered batch with ``seq >= start_seq`` in order, ``(b"", topic, seq, payload)``
  and then the end marker ``(b"", b"", (-1).to_bytes(8, "big", signed=True), b"")``.
  The buffer keeps the last ``buffer_steps`` batches.

Endpoints follow vLLM's convention: one with a wildcard (``tcp://*:5557``), ``::``, or
an ``ipc://`` / ``inproc://`` address is bound; any other is connected to (the
subscriber binds). Sockets come from ``zmq.Context.instance()`` as in vLLM, so an
``inproc://`` subscriber in the same process can connect.

Threading: as vLLM, one daemon thread owns the sockets after start-up; it sends the
queued batches, keeps the replay buffer and answers replay requests (polled between
batches, at least every 0.1 s). ``publish`` only checks, converts and encodes the step's
events (so bad input raises in the caller) and queues the bytes.

Differences from vLLM's class, all outside the bytes on the wire: the publisher is
built from an endpoint string (``from_endpoint``) rather than a ``KVEventsConfig``;
``publish`` takes the manager's event list (an empty list publishes nothing, as vLLM's
scheduler skips empty steps) and stamps ``ts`` itself; the port is not offset by the
data-parallel rank (one engine per process here; pass another endpoint per rank);
``close`` lets the sockets linger 1 s for frames still in flight (vLLM closes with
linger 0); ``tcp://*:0`` binds an OS-chosen port (vLLM binds the node's IP), reported
by ``endpoint``; and a wildcard host binds loopback (``bind_host``, 127.0.0.1) unless
told otherwise (``bind_host="*"``: every interface, vLLM's behaviour), so that the
cache's contents are not published to the network by default.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from typing import Any

import msgspec
import zmq

from prefixcache.core import events as core_events

logger = logging.getLogger(__name__)

ExternalBlockHash = bytes | int  # vLLM's ``vllm.v1.core.kv_cache_utils.ExternalBlockHash``

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
MEDIUM_GPU = core_events.MEDIUM_GPU
MEDIUM_CPU = core_events.MEDIUM_CPU
_MAX_PORT = 65535


# --------------------------------------------------------------------- wire structs
# NOTE: copied field for field from vLLM 0.33 (class names are the tags: keep them).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the wire events (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_WIRE_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)


def to_wire(event) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """The wire struct of one ``prefixcache.core.events`` event (wire structs pass through).

    Raises:
        TypeError: anything else.
    """
    t = type(event)
    if t is core_events.BlockStored:
        e = event
        return BlockStored(
            e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id,
            e.medium, e.lora_name, e.extra_keys, e.group_idx, e.kv_cache_spec_kind,
            e.kv_cache_spec_sliding_window, e.locality, e.ownership, e.session_id,
            e.lookahead_token_ids)
    if t is core_events.BlockRemoved:
        e = event
        return BlockRemoved(e.block_hashes, e.medium, e.group_idx, e.locality, e.ownership)
    if t is core_events.AllBlocksCleared:
        return AllBlocksCleared()
    if t in _WIRE_TYPES:
        return event
    raise TypeError(
        f"not a KV cache event: {event!r} (expected prefixcache.core.events.BlockStored, "
        "BlockRemoved or AllBlocksCleared)")


def encode_batch(events: list, *, ts: float, data_parallel_rank: int = 0) -> bytes:
    """The msgpack payload vLLM 0.33 sends for ``events`` (core or wire events)."""
    wire = [to_wire(e) for e in events]
    return msgspec.msgpack.encode(KVEventBatch(ts, wire, data_parallel_rank))


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload back into wire structs (what a subscriber does)."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


# ----------------------------------------------------------------------- endpoints
def check_endpoint(endpoint: Any, what: str = "KV events endpoint") -> str:
    """``endpoint`` if it is a ZMQ address this publisher can use, else ``ValueError``.

    Accepted: ``tcp://HOST:PORT`` (HOST ``*``, a name, an IPv4 or IPv6 address; PORT
    0..65535, or ``*`` for an OS-chosen port when bound), ``ipc://PATH``,
    ``inproc://NAME``.
    """
    hint = ("expected tcp://HOST:PORT (tcp://*:PORT binds), ipc://PATH or inproc://NAME")
    if not isinstance(endpoint, str):
        raise ValueError(f"{what} must be a string, got {endpoint!r}; {hint}")
    scheme, sep, rest = endpoint.partition("://")
    bad = (not sep or not rest or any(c.isspace() for c in endpoint))
    if not bad and scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        bad = (not colon or not host or "/" in host
               or not (port == "*" or (port.isdigit() and int(port) <= _MAX_PORT)))
    elif not bad and scheme not in ("ipc", "inproc"):
        bad = True
    if bad:
        raise ValueError(f"malformed {what} {endpoint!r}: {hint}")
    return endpoint


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard, ``::`` and ipc/inproc endpoints; connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def with_bind_host(endpoint: str, bind_host: str) -> str:
    """``endpoint`` with a wildcard TCP host (``tcp://*:PORT``) replaced by
    ``bind_host`` (``"*"`` keeps it: every interface); any other endpoint unchanged."""
    if endpoint.startswith("tcp://*:") and bind_host != "*":
        host = f"[{bind_host}]" if ":" in bind_host and not bind_host.startswith("[") \
            else bind_host
        return f"tcp://{host}:{endpoint[len('tcp://*:'):]}"
    return endpoint


def _check_count(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


# ----------------------------------------------------------------------- publisher
class KVEventPublisher:
    """PUB socket + replay ROUTER socket + replay buffer (vLLM's ``ZmqEventPublisher``).

    Build it with ``from_endpoint``. Invariants: ``seq`` numbers are consecutive from 0
    in publish order; the replay buffer holds the last ``buffer_steps`` batches sent, in
    ``seq`` order; after ``close`` nothing more is published.

    Attributes:
        endpoint: the PUB address (when bound: the address actually bound, e.g. the
            port chosen for ``tcp://127.0.0.1:0``).
        replay_endpoint: the bound replay address, or ``None``.
        topic: the topic string.
        buffer_steps: batches kept for replay.
    """

    SHUTDOWN_TIMEOUT = 1.0  # seconds close() waits for queued batches, as vLLM
    LINGER_MS = 1000  # how long closed sockets keep trying to deliver frames in flight
    _POLL_S = 0.1  # the thread's wait for the next batch between replay polls (vLLM's)

    def __init__(self, pub: zmq.Socket, replay: zmq.Socket | None, *, endpoint: str,
                 replay_endpoint: str | None, topic: str, buffer_steps: int,
                 max_queue_size: int, bound: bool):
        self._pub = pub
        self._bound = bound
        self._replay = replay
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.buffer_steps = buffer_steps
        self._topic_bytes = topic.encode("utf-8")
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=buffer_steps)
        self._seq = itertools.count()
        self._closed = False
        self._lock = threading.Lock()  # publish/close from several threads
        self._sent_cond = threading.Condition()
        self._num_queued = 0
        self._num_sent = 0
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="kv-events-publisher")
        self._thread.start()

    @classmethod
    def from_endpoint(cls, endpoint: str, *, topic: str = "",
                      replay_endpoint: str | None = None, buffer_steps: int = 10_000,
                      hwm: int = 100_000, max_queue_size: int = 100_000,
                      bind_host: str = "127.0.0.1") -> KVEventPublisher:
        """Open the sockets and start the publisher thread.

        Args:
            endpoint: PUB address; ``tcp://*:PORT`` binds (on ``bind_host``),
                ``tcp://HOST:PORT`` connects.
            topic: the first frame of every message (UTF-8).
            replay_endpoint: ROUTER address (always bound) answering replay requests;
                ``None``: no replay socket.
            buffer_steps: batches kept for replay (> 0).
            hwm: the PUB socket's send high-water mark, in messages (> 0).
            max_queue_size: batches ``publish`` may queue ahead of the thread (> 0;
                ``publish`` blocks beyond it, as vLLM's queue).
            bind_host: the interface a wildcard TCP endpoint (``tcp://*:PORT``, PUB
                or replay) binds: loopback by default; ``"*"`` for every interface
                (vLLM's behaviour), or an address.

        Raises:
            ValueError: a malformed endpoint (named), a bad count, or an address
                that cannot be bound or connected (zmq's reason); nothing stays open.
        """
        check_endpoint(endpoint)
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint, "KV events replay endpoint")
        if not isinstance(topic, str):
            raise ValueError(f"topic must be a string, got {topic!r}")
        buffer_steps = _check_count("buffer_steps", buffer_steps)
        hwm = _check_count("hwm", hwm)
        max_queue_size = _check_count("max_queue_size", max_queue_size)
        if (not isinstance(bind_host, str) or not bind_host
                or any(c.isspace() or c == "/" for c in bind_host)):
            raise ValueError(f"bind_host must be '*' or an interface address, got "
                             f"{bind_host!r}")
        bind_pub = is_bind_endpoint(endpoint)  # (decided on the endpoint as given)
        endpoint = with_bind_host(endpoint, bind_host)
        if replay_endpoint is not None:
            replay_endpoint = with_bind_host(replay_endpoint, bind_host)
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        replay = None
        pub_bound = replay_bound = None
        try:
            pub.set_hwm(hwm)
            if bind_pub:
                endpoint = pub_bound = _bind(pub, endpoint, "KV events endpoint")
            else:
                try:
                    pub.connect(endpoint)
                except zmq.ZMQError as e:
                    raise ValueError(f"cannot connect to KV events endpoint {endpoint!r}: "
                                     f"{e}") from e
            if replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                # NOTE: as vLLM: room for a full replay plus its end marker.
                replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                replay_endpoint = replay_bound = _bind(replay, replay_endpoint,
                                                       "KV events replay endpoint")
        except BaseException:
            _release(pub, pub_bound, 0)
            if replay is not None:
                _release(replay, replay_bound, 0)
            raise
        return cls(pub, replay, endpoint=endpoint, replay_endpoint=replay_endpoint,
                   topic=topic, buffer_steps=buffer_steps, max_queue_size=max_queue_size,
                   bound=pub_bound is not None)

    # ------------------------------------------------------------------ public
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_published(self) -> int:
        """Batches accepted by ``publish`` so far (the next batch's ``seq``)."""
        return self._num_queued

    def publish(self, events: list, *, data_parallel_rank: int = 0,
                ts: float | None = None) -> None:
        """Publish one engine step's events as one ``KVEventBatch``.

        Args:
            events: the manager's ``take_events()`` list (``prefixcache.core.events``
                objects, or this module's wire structs); ``[]`` publishes nothing.
            data_parallel_rank: the batch's ``data_parallel_rank`` (an int >= 0).
            ts: the batch's timestamp (seconds since the epoch); ``None``: now.

        Raises:
            RuntimeError: the publisher is closed.
            TypeError: ``events`` is not a list of KV cache events (nothing queued).
            ValueError: a bad rank or timestamp, or an event msgpack cannot hold
                (e.g. a hash int beyond 64 bits); nothing queued.
        """
        if self._closed:
            raise RuntimeError("KVEventPublisher is closed: publish() after close()")
        if type(events) is not list:
            raise TypeError(f"events must be a list (the manager's take_events()), "
                            f"got {type(events).__name__}")
        if (not isinstance(data_parallel_rank, int) or isinstance(data_parallel_rank, bool)
                or data_parallel_rank < 0):
            raise ValueError(f"data_parallel_rank must be an int >= 0, got "
                             f"{data_parallel_rank!r}")
        if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
            raise ValueError(f"ts must be a number of seconds or None, got {ts!r}")
        if not events:
            return
        try:
            payload = encode_batch(events, ts=time.time() if ts is None else float(ts),
                                   data_parallel_rank=data_parallel_rank)
        except (OverflowError, msgspec.EncodeError) as e:
            raise ValueError(f"cannot encode the KV events batch: {e}") from e
        with self._lock:
            if self._closed:
                raise RuntimeError("KVEventPublisher is closed: publish() after close()")
            self._queue.put(payload)
            self._num_queued += 1

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every published batch has been handed to the PUB socket.

        Returns:
            ``True`` if they all were within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._sent_cond:
            while self._num_sent < self._num_queued:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._sent_cond.wait(left)
        return True

    def close(self) -> None:
        """Send what is queued (up to ``SHUTDOWN_TIMEOUT``), stop the thread, close the
        sockets. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout=2 * self.SHUTDOWN_TIMEOUT)
        if self._thread.is_alive():
            logger.warning("KV events publisher thread still running after %.1f s; "
                           "%d batches not sent", 2 * self.SHUTDOWN_TIMEOUT,
                           self._queue.qsize())
            return  # NOTE: a daemon thread still using the sockets: leave them to it
        _release(self._pub, self.endpoint if self._bound else None, self.LINGER_MS)
        if self._replay is not None:
            _release(self._replay, self.replay_endpoint, 0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"KVEventPublisher(endpoint={self.endpoint!r}, replay_endpoint="
                f"{self.replay_endpoint!r}, topic={self.topic!r}, published="
                f"{self._num_queued}, closed={self._closed})")

    # ----------------------------------------------------------------- thread
    def _run(self) -> None:
        pub, replay, q = self._pub, self._replay, self._queue
        topic = self._topic_bytes
        while True:
            if replay is not None and replay.poll(0):
                try:
                    self._service_replay()
                except Exception:  # NOTE: as vLLM: a bad replay request never stops events
                    logger.exception("KV events: error answering a replay request")
            try:
                payload = q.get(timeout=self._POLL_S)
            except queue.Empty:
                continue
            if payload is None:
                break
            seq = next(self._seq)
            try:
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            except Exception:
                logger.exception("KV events: error sending batch %d", seq)
            self._buffer.append((seq, payload))
            with self._sent_cond:
                self._num_sent += 1
                self._sent_cond.notify_all()

    def _service_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: invalid replay request %r", frames)
            return
        client_id, _, start = frames
        start_seq = int.from_bytes(start, "big")
        send = self._replay.send_multipart
        topic = self._topic_bytes
        for seq, payload in self._buffer:
            if seq >= start_seq:
                send((client_id, b"", topic, seq.to_bytes(8, "big"), payload))
        send((client_id, b"", b"", END_SEQ, b""))


def _bind(sock: zmq.Socket, endpoint: str, what: str) -> str:
    """Bind ``sock``; the address actually bound (e.g. the port chosen for port 0)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise ValueError(f"cannot bind {what} {endpoint!r}: {e}") from e
    if endpoint.startswith("tcp://"):
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return endpoint


def _release(sock: zmq.Socket, bound: str | None, linger_ms: int) -> None:
    """Close ``sock``, unbinding ``bound`` first: a close is asynchronous in ZMQ, so
    without it the same address could not be bound again right away (a restart)."""
    if bound is not None:
        try:
            sock.unbind(bound)
        except zmq.ZMQError:
            pass  # NOTE: closing releases it anyway, only later
    sock.close(linger=linger_ms)
