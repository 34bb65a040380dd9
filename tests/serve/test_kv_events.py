"""KV events on the wire (``prefixcache.serve.kv_events``), as vLLM 0.33's ZmqEventPublisher.

* Golden bytes: ``tests/data/kv_events_golden.json`` holds the payloads, the live
  ``(topic, seq, payload)`` frames and the replay frames that vLLM's own
  ``ZmqEventPublisher`` sent for fixed batches (``experiments/peers/kv_events_goldens.py``
  in the vLLM peer venv); ours must equal them byte for byte.
* vLLM's decoder reads our stream from a real manager run (only where the vLLM peer
  venv exists: a subprocess into it).
* A subscriber that rebuilds the cached blocks (device and host tier) from the decoded
  events alone ends equal to the manager's cached set after a run with evictions,
  demotions, promotions and a reset; the replay socket returns missed batches.
* Bad endpoints and bad calls raise clear errors.

Everything binds 127.0.0.1 (or inproc); every wait is bounded.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import subprocess
import time

import numpy as np
import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq (the serve extra) is not installed")
msgspec = pytest.importorskip("msgspec", reason="msgspec (the serve extra) is not installed")

from prefixcache.core import KVCacheManager, LoRARequest, Request  # noqa: E402
from prefixcache.core import events as core  # noqa: E402
from prefixcache.serve import kv_events as kv  # noqa: E402
from prefixcache.serve.kv_events import KVEventPublisher  # noqa: E402

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "data" / "kv_events_golden.json"
VLLM_PYTHON = pathlib.Path(os.environ.get(
    "PREFIXCACHE_VLLM_PYTHON",
    pathlib.Path.home() / ".cache/prefixcache-peers/vllm-venv/bin/python"))
WAIT_S = 10.0  # the longest any socket wait may take
_MASK64 = (1 << 64) - 1


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


def _value(v):
    if isinstance(v, dict) and set(v) == {"bytes"}:
        return bytes.fromhex(v["bytes"])
    if isinstance(v, list):
        return [_value(x) for x in v]
    return v


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _core_event(spec: dict):
    """A ``prefixcache.core.events`` object from the golden's JSON spec."""
    kwargs = {k: _value(v) for k, v in spec.items() if k != "type"}
    if kwargs.get("extra_keys") is not None:
        kwargs["extra_keys"] = [None if e is None else _tuples(e) for e in kwargs["extra_keys"]]
    return getattr(core, spec["type"])(**kwargs)


# ------------------------------------------------------------------ socket helpers
def _sub(ctx):
    """A SUB socket bound on loopback (our publisher connects to it) and its endpoint."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)  # keep every frame of the run
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    return sub, f"tcp://127.0.0.1:{port}"


def _replay(ctx, endpoint: str, start: int) -> list[list[bytes]]:
    """Ask the replay socket for batches from ``start``; the frames up to the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        frames = []
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if dealer.poll(100):
                msg = dealer.recv_multipart()
                frames.append(msg)
                if msg[2] == kv.END_SEQ:
                    return frames
        raise AssertionError(f"no replay end marker within {WAIT_S} s (got {len(frames)})")
    finally:
        dealer.close(linger=0)


def _collect(ctx, sub, replay_endpoint: str, num: int) -> list[list[bytes]]:
    """All ``num`` batches as live ``(topic, seq, payload)`` frames, in seq order.

    Frames the SUB missed (published before the connection and subscription were up:
    ZMQ's slow joiner) are fetched through the replay socket, as a real subscriber does.
    """
    live: dict[int, list[bytes]] = {}
    deadline = time.monotonic() + WAIT_S
    quiet = 0  # consecutive empty 100 ms polls (the publisher has flushed: 0.5 s = done)
    while len(live) < num and quiet < 5 and time.monotonic() < deadline:
        if sub.poll(100):
            msg = sub.recv_multipart()
            live[int.from_bytes(msg[1], "big")] = msg
            quiet = 0
        else:
            quiet += 1
    missing = [s for s in range(num) if s not in live]
    if missing:
        replayed = _replay(ctx, replay_endpoint, missing[0])
        assert replayed[-1] == [b"", b"", kv.END_SEQ, b""]
        for msg in replayed[:-1]:
            assert msg[0] == b""
            seq = int.from_bytes(msg[2], "big")
            if seq not in live:
                live[seq] = msg[1:]
    assert sorted(live) == list(range(num)), f"batches missing: {set(range(num)) - set(live)}"
    return [live[s] for s in range(num)]


# ------------------------------------------------------------------ golden bytes
def test_payloads_equal_vllm_encoder_bytes(golden):
    assert golden["provenance"]["vllm"] == "0.33.0"
    for spec, want in zip(golden["batches"], golden["payloads_hex"], strict=True):
        events = [_core_event(e) for e in spec["events"]]
        got = kv.encode_batch(events, ts=spec["ts"],
                              data_parallel_rank=spec["data_parallel_rank"])
        assert got.hex() == want
        # our decoder reads vLLM's bytes back into the same values vLLM's decoder gives
        ours = msgspec.to_builtins(kv.decode_batch(bytes.fromhex(want)))
        assert json.loads(json.dumps(ours)) == golden["decoded"][
            golden["payloads_hex"].index(want)]
    # the events are tagged maps (vLLM 0.33's KVCacheEvent is not array_like), the
    # batch a 3-element array
    first = msgspec.msgpack.decode(bytes.fromhex(golden["payloads_hex"][0]))
    assert len(first) == 3 and first[1][0]["type"] == "BlockStored"


def test_publisher_frames_and_replay_equal_vllm_publisher(golden):
    ctx = zmq.Context.instance()
    sub, endpoint = _sub(ctx)
    pub = KVEventPublisher.from_endpoint(endpoint, topic=golden["topic"],
                                         replay_endpoint="tcp://127.0.0.1:0")
    try:
        assert pub.endpoint == endpoint  # connected, as vLLM does for a non-wildcard address
        assert pub.replay_endpoint.startswith("tcp://127.0.0.1:")
        for spec in golden["batches"]:
            pub.publish([_core_event(e) for e in spec["events"]], ts=spec["ts"],
                        data_parallel_rank=spec["data_parallel_rank"])
        assert pub.flush(WAIT_S)
        live = _collect(ctx, sub, pub.replay_endpoint, len(golden["batches"]))
        assert [[f.hex() for f in m] for m in live] == golden["live_frames_hex"]
        replayed = _replay(ctx, pub.replay_endpoint, golden["replay_start"])
        assert [[f.hex() for f in m] for m in replayed] == golden["replay_frames_hex"]
    finally:
        pub.close()
        sub.close(linger=0)


# ------------------------------------------------------------ a run with evictions
def _drive(publish, *, num_requests: int = 90, seed: int = 0):
    """Requests sharing a few prefixes through a small device pool with a host tier.

    One "step" = admit the next request (finishing the oldest when 4 run or when it
    does not fit) and decode one token for each running request; ``publish(events)``
    after every step. A reset (everything freed first) at the midpoint. Returns the
    manager, with some requests still running.
    """
    rng = np.random.default_rng(seed)
    m = KVCacheManager(20, 4, enable_events=True, num_host_blocks=8)
    prefixes = [list(rng.integers(1, 500, size=int(n))) for n in (8, 12, 16, 9, 20)]
    lora = LoRARequest("sql", "/loras/sql", int_id=1)
    running: collections.deque = collections.deque()
    for i in range(num_requests):
        if i == num_requests // 2:
            while running:
                m.free(running.popleft())
            assert m.reset_prefix_cache()
            publish(m.take_events())
        prompt = [int(t) for t in prefixes[int(rng.integers(len(prefixes)))]]
        prompt += [int(t) for t in rng.integers(1, 500, size=int(rng.integers(1, 9)))]
        req = Request(f"r{i}", prompt, lora=lora if i % 7 == 3 else None,
                      cache_salt="s" if i % 11 == 5 else None)
        if len(running) == 4:
            m.free(running.popleft())
        while True:
            blocks, hit = m.get_computed_blocks(req)
            if m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None:
                break
            if not running:
                req = None  # does not fit even alone (cannot happen at these sizes)
                break
            m.free(running.popleft())
        if req is not None:
            req.num_computed_tokens = req.num_tokens
            req.append_output_token_ids(int(rng.integers(1, 500)))
            running.append(req)
        for r in list(running):
            if m.allocate_slots(r, 1) is None:
                running.remove(r)
                m.free(r)
                continue
            r.num_computed_tokens += 1
            r.append_output_token_ids(int(rng.integers(1, 500)))
        publish(m.take_events())
    m.check_invariants()
    return m


def _rebuild(payloads: list[bytes]):
    """Cached blocks per medium as counts per hash, from the decoded events alone."""
    held = {kv.MEDIUM_GPU: collections.Counter(), kv.MEDIUM_CPU: collections.Counter()}
    for payload in payloads:
        batch = kv.decode_batch(payload)
        assert batch.data_parallel_rank == 0
        for ev in batch.events:
            if isinstance(ev, kv.BlockStored):
                held[ev.medium].update(ev.block_hashes)
            elif isinstance(ev, kv.BlockRemoved):
                cnt = held[ev.medium]
                for h in ev.block_hashes:
                    assert cnt[h] > 0, f"removed {h:#x} ({ev.medium}) that was never stored"
                    cnt[h] -= 1
                    if not cnt[h]:
                        del cnt[h]
            else:
                assert isinstance(ev, kv.AllBlocksCleared)
                for cnt in held.values():
                    cnt.clear()
    return held


def _manager_cached(m):
    device = collections.Counter(
        int.from_bytes(b.block_hash, "big") & _MASK64
        for b in m.block_pool.blocks if b.block_hash is not None)
    tier = m.host_tier
    host = collections.Counter(
        int.from_bytes(h, "big") & _MASK64 for h in [*tier.hash_to_slot, *tier._pinned])
    return device, host


def test_subscriber_rebuilds_the_cached_blocks_and_replays_missed_batches():
    ctx = zmq.Context.instance()
    sub, endpoint = _sub(ctx)
    pub = KVEventPublisher.from_endpoint(endpoint, topic="kv",
                                         replay_endpoint="tcp://127.0.0.1:0")
    kinds = collections.Counter()

    def publish(events):
        kinds.update((type(e).__name__, getattr(e, "medium", None)) for e in events)
        pub.publish(events)

    try:
        m = _drive(publish)
        assert pub.flush(WAIT_S)
        n = pub.num_published
        frames = _collect(ctx, sub, pub.replay_endpoint, n)
        assert all(f[0] == b"kv" for f in frames)
        # the run exercised every kind: device stores/evictions, demotions to the
        # host, host removals (evictions or promotions), the reset
        assert m.num_evictions > 0 and m.host_blocks_stored > 0
        for kind in [("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "CPU"),
                     ("BlockRemoved", "CPU"), ("AllBlocksCleared", None)]:
            assert kinds[kind] > 0, kind
        held = _rebuild([f[2] for f in frames])
        device, host = _manager_cached(m)
        assert sum(device.values()) == m.num_cached_blocks > 0
        assert held[kv.MEDIUM_GPU] == device
        assert held[kv.MEDIUM_CPU] == host and sum(host.values()) == m.num_host_cached_blocks > 0

        # A late subscriber asks for everything: the buffer (10_000 steps) still has
        # every batch, in order, then the end marker.
        replayed = _replay(ctx, pub.replay_endpoint, 0)
        assert replayed[-1] == [b"", b"", kv.END_SEQ, b""]
        assert [msg[1:] for msg in replayed[:-1]] == frames
    finally:
        pub.close()
        sub.close(linger=0)


def test_replay_buffer_keeps_the_last_steps_in_order():
    ctx = zmq.Context.instance()
    # NOTE: no subscriber at all; inproc binds (vLLM's rule) and stays in-process.
    pub = KVEventPublisher.from_endpoint("inproc://kv-events-replay-test",
                                         replay_endpoint="tcp://127.0.0.1:0", buffer_steps=5)
    try:
        for i in range(8):
            pub.publish([core.AllBlocksCleared()], ts=float(i))
        assert pub.flush(WAIT_S) and pub.num_published == 8

        def seqs_and_ts(start):
            msgs = _replay(ctx, pub.replay_endpoint, start)
            assert msgs[-1] == [b"", b"", kv.END_SEQ, b""]
            return [(int.from_bytes(m[2], "big"), kv.decode_batch(m[3]).ts)
                    for m in msgs[:-1]]

        assert seqs_and_ts(0) == [(s, float(s)) for s in range(3, 8)]  # the last 5 kept
        assert seqs_and_ts(6) == [(6, 6.0), (7, 7.0)]
        assert seqs_and_ts(100) == []
        # a malformed request (no delimiter frame) is ignored; the socket keeps serving
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send(b"junk")
        dealer.close(linger=0)
        assert seqs_and_ts(7) == [(7, 7.0)]
    finally:
        pub.close()


# -------------------------------------------------------------------- vLLM decodes
_VLLM_DECODE = r"""
import json, sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
dec = msgspec.msgpack.Decoder(type=KVEventBatch)
out = []
for line in sys.stdin:
    topic, seq, payload = (bytes.fromhex(x) for x in json.loads(line))
    b = dec.decode(payload)
    assert type(b) is KVEventBatch
    assert all(type(e) in (BlockStored, BlockRemoved, AllBlocksCleared) for e in b.events)
    out.append([topic.decode(), int.from_bytes(seq, "big"), msgspec.to_builtins(b)])
json.dump(out, sys.stdout)
"""


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=(
    f"the vLLM peer venv is not installed ({VLLM_PYTHON}; "
    "bash experiments/peers/setup_vllm_env.sh, or set PREFIXCACHE_VLLM_PYTHON)"))
def test_vllm_decoder_reads_our_stream():
    ctx = zmq.Context.instance()
    sub, endpoint = _sub(ctx)
    pub = KVEventPublisher.from_endpoint(endpoint, topic="kv@ours",
                                         replay_endpoint="tcp://127.0.0.1:0")
    sent: list[list] = []

    def publish(events):
        if events:
            sent.append(events)
        pub.publish(events)

    try:
        _drive(publish, num_requests=30, seed=1)
        assert pub.flush(WAIT_S)
        frames = _collect(ctx, sub, pub.replay_endpoint, pub.num_published)
    finally:
        pub.close()
        sub.close(linger=0)
    stdin = "".join(json.dumps([f.hex() for f in m]) + "\n" for m in frames)
    # NOTE: -I keeps this checkout (its `kernels` package) off the child's sys.path.
    proc = subprocess.run([str(VLLM_PYTHON), "-I", "-c", _VLLM_DECODE], input=stdin,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    decoded = json.loads(proc.stdout)
    assert [(t, s) for t, s, _ in decoded] == [("kv@ours", i) for i in range(len(sent))]
    for (_, _, (ts, events, rank)), ours in zip(decoded, sent, strict=True):
        assert rank == 0 and isinstance(ts, float)
        assert len(events) == len(ours)
        for got, want in zip(events, ours):
            # (int hashes here: JSON-safe; tuples become lists as in msgpack)
            fields = json.loads(json.dumps(dataclasses.asdict(want)))
            assert got.pop("type") == type(want).__name__
            # omit_defaults: a field vLLM left out holds its default (None)
            assert got == {k: v for k, v in fields.items() if k in got}
            assert all(v is None for k, v in fields.items() if k not in got)


# -------------------------------------------------------------------- bad input
@pytest.mark.parametrize("endpoint", [
    "", "5557", "tcp://", "tcp://*", "tcp://*:", "tcp://*:port", "tcp://*:70000",
    "tcp://:5557", "udp://*:5557", "tcp://* :5557", "ipc://", "inproc://", None, 5557,
])
def test_malformed_endpoint_is_named(endpoint):
    with pytest.raises(ValueError, match="endpoint") as e:
        KVEventPublisher.from_endpoint(endpoint)
    assert repr(endpoint) in str(e.value)
    if endpoint is None:
        return  # replay_endpoint=None: no replay socket
    with pytest.raises(ValueError, match="replay endpoint") as e:
        KVEventPublisher.from_endpoint("inproc://kv-events-bad", replay_endpoint=endpoint)
    assert repr(endpoint) in str(e.value)


def test_bad_arguments_and_unusable_addresses():
    for kwargs in ({"buffer_steps": 0}, {"hwm": -1}, {"max_queue_size": True}, {"topic": b"x"}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            KVEventPublisher.from_endpoint("inproc://kv-events-bad-args", **kwargs)
    first = KVEventPublisher.from_endpoint("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    try:
        # the replay address is taken: a clear error, and the PUB opened first is closed
        # again (the same inproc name can be bound afterwards)
        with pytest.raises(ValueError, match="cannot bind KV events replay endpoint"):
            KVEventPublisher.from_endpoint("inproc://kv-events-reuse",
                                           replay_endpoint=first.replay_endpoint)
        KVEventPublisher.from_endpoint("inproc://kv-events-reuse").close()
    finally:
        first.close()


def test_bad_publish_calls_change_nothing_and_close_is_final():
    pub = KVEventPublisher.from_endpoint("inproc://kv-events-bad-calls")
    pub.publish([])  # an empty step publishes nothing (as vLLM's scheduler)
    assert pub.num_published == 0
    stored = core.BlockStored([1], None, [1, 2], 2, None, "GPU", None)
    with pytest.raises(TypeError, match="must be a list"):
        pub.publish((stored,))
    with pytest.raises(TypeError, match="not a KV cache event"):
        pub.publish([stored, "BlockStored"])
    with pytest.raises(ValueError, match="data_parallel_rank"):
        pub.publish([stored], data_parallel_rank=-1)
    with pytest.raises(ValueError, match="ts"):
        pub.publish([stored], ts="now")
    with pytest.raises(ValueError, match="cannot encode"):
        pub.publish([core.BlockRemoved([1 << 64], "GPU")])  # beyond msgpack's uint64
    assert pub.num_published == 0
    pub.publish([stored])
    assert pub.flush(WAIT_S) and pub.num_published == 1
    pub.close()
    pub.close()  # idempotent
    assert pub.closed
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish([stored])
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish([])
