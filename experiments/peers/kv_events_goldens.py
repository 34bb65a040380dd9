#!/usr/bin/env python3
"""Golden KV event frames from vLLM 0.33's own ``ZmqEventPublisher`` (peer venv only).

Builds a fixed set of batches with vLLM's event classes (``vllm.distributed.kv_events``),
publishes them through vLLM's real ``ZmqEventPublisher`` on loopback (PUB bound to
``tcp://127.0.0.1:PORT``, replay ROUTER beside it), records every frame a SUB client
receives and every frame a replay client receives (start seq 1, then the end
marker), and writes them with the batches' spec to ``tests/data/kv_events_golden.json``.
``tests/serve/test_kv_events.py`` rebuilds the same batches from the spec as
``prefixcache.core.events`` objects, publishes them with ``KVEventPublisher`` and
compares the frames byte for byte.

    VLLM_PY=$(bash experiments/peers/setup_vllm_env.sh | tail -1)
    $VLLM_PY -I experiments/peers/kv_events_goldens.py --out tests/data/kv_events_golden.json

(``-I``: only the peer venv's packages, none of the checkout's, on ``sys.path``.) Spec encoding (JSON):
a bytes value is ``{"bytes": HEX}``; tuples are lists (msgpack writes both as arrays).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

# The batches: every field of every event type at least once, int hashes on both
# sides of 2**63 (msgpack int64 / uint64), raw-digest bytes hashes, LoRA and extra
# keys, GPU and CPU media, a reset, two data-parallel ranks.
_H = [0x0123456789ABCDEF, 0xFEDCBA9876543210, 2**63, 2**63 - 1, 7, 0, 2**64 - 1]
SPEC = [
    {"ts": 1767225600.125, "data_parallel_rank": 0, "events": [
        {"type": "BlockStored", "block_hashes": [_H[0], _H[1]], "parent_block_hash": None,
         "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "block_size": 4, "lora_id": None,
         "medium": "GPU", "lora_name": None, "group_idx": 0,
         "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockStored", "block_hashes": [_H[2]], "parent_block_hash": _H[1],
         "token_ids": [9, 10, 11, 12], "block_size": 4, "lora_id": 3, "medium": "GPU",
         "lora_name": "sql-lora", "extra_keys": [["sql-lora", ["img-0", 2], "salt!"]],
         "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
    ]},
    {"ts": 1767225600.25, "data_parallel_rank": 0, "events": [
        {"type": "BlockRemoved", "block_hashes": [_H[0]], "medium": "GPU", "group_idx": 0},
        {"type": "BlockStored", "block_hashes": [_H[0]], "parent_block_hash": None,
         "token_ids": [], "block_size": 4, "lora_id": None, "medium": "CPU",
         "lora_name": None, "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [_H[3]], "medium": "CPU", "group_idx": 0},
        {"type": "BlockStored", "block_hashes": [_H[4], _H[5]], "parent_block_hash": _H[6],
         "token_ids": list(range(100, 108)), "block_size": 4, "lora_id": None,
         "medium": "GPU", "lora_name": None, "extra_keys": [None, ["salt?"]],
         "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
    ]},
    {"ts": 1767225601.0, "data_parallel_rank": 0, "events": [
        {"type": "BlockStored",
         "block_hashes": [{"bytes": "ab" * 32}, {"bytes": "00ff" * 16}],
         "parent_block_hash": {"bytes": "11" * 32}, "token_ids": [5, 6, 7, 8, 9, 10],
         "block_size": 3, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [{"bytes": "ab" * 32}], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]},
    {"ts": 1767225602.5, "data_parallel_rank": 1, "events": [
        {"type": "BlockStored", "block_hashes": [42], "parent_block_hash": 41,
         "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": None,
         "lora_name": None, "extra_keys": None, "group_idx": 1,
         "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 32,
         "locality": "LOCAL", "ownership": "tier-2", "session_id": "sess-9",
         "lookahead_token_ids": [[3, 4]]},
        {"type": "BlockRemoved", "block_hashes": [42], "medium": None, "group_idx": 1,
         "locality": "REMOTE", "ownership": "tier-2"},
        {"type": "AllBlocksCleared"},
    ]},
]
TOPIC = "kv@golden"
REPLAY_START = 1


def _value(v):
    if isinstance(v, dict) and set(v) == {"bytes"}:
        return bytes.fromhex(v["bytes"])
    if isinstance(v, list):
        return [_value(x) for x in v]
    return v


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _vllm_event(spec, kv):
    kwargs = {k: _value(v) for k, v in spec.items() if k != "type"}
    if kwargs.get("extra_keys") is not None:
        kwargs["extra_keys"] = [None if e is None else _tuples(e) for e in kwargs["extra_keys"]]
    return getattr(kv, spec["type"])(**kwargs)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _capture(kv, zmq, batches):
    """Publish ``batches`` through vLLM's ZmqEventPublisher; (live, replay) frames or None."""
    ctx = zmq.Context.instance()
    pub_ep = f"tcp://127.0.0.1:{_free_port()}"
    replay_ep = f"tcp://127.0.0.1:{_free_port()}"
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(pub_ep)  # NOTE: a non-wildcard endpoint: vLLM's PUB connects to us
    publisher = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=pub_ep,
                                     replay_endpoint=replay_ep, topic=TOPIC)
    dealer = ctx.socket(zmq.DEALER)
    try:
        # Slow joiner: frames published before the PUB has our subscription are
        # dropped (and probes would take seq numbers), so wait for the connection.
        time.sleep(2.0)
        for b in batches:
            publisher.publish(b)
        live = []
        deadline = time.monotonic() + 10
        while len(live) < len(batches) and time.monotonic() < deadline:
            if sub.poll(200):
                live.append(sub.recv_multipart())
        if len(live) != len(batches):
            return None
        dealer.connect(replay_ep)
        dealer.send_multipart((b"", REPLAY_START.to_bytes(8, "big")))
        replayed = []
        while time.monotonic() < deadline:
            if dealer.poll(200):
                frames = dealer.recv_multipart()
                replayed.append(frames)
                if frames[2] == kv.ZmqEventPublisher.END_SEQ:
                    return live, replayed
        return None
    finally:
        publisher.shutdown()
        sub.close(linger=0)
        dealer.close(linger=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import msgspec
    import vllm
    import zmq
    from vllm.distributed import kv_events as kv

    batches = [kv.KVEventBatch(ts=b["ts"], events=[_vllm_event(e, kv) for e in b["events"]],
                               data_parallel_rank=b["data_parallel_rank"]) for b in SPEC]
    payloads = [msgspec.msgpack.Encoder().encode(b) for b in batches]

    for attempt in range(3):  # NOTE: a loaded machine may miss the slow-joiner wait
        got = _capture(kv, zmq, batches)
        if got is not None:
            break
        print(f"attempt {attempt + 1}: frames missing, retrying", file=sys.stderr)
    else:
        return 1
    live, replayed = got
    for frame, want in zip(live, payloads):
        assert frame[2] == want, "the publisher's payload differs from the encoder's"

    out = {
        "provenance": {
            "vllm": vllm.__version__, "msgspec": msgspec.__version__, "pyzmq": zmq.__version__,
            "python": platform.python_version(), "script": "experiments/peers/kv_events_goldens.py",
        },
        "topic": TOPIC,
        "replay_start": REPLAY_START,
        "batches": SPEC,
        "payloads_hex": [p.hex() for p in payloads],
        "live_frames_hex": [[f.hex() for f in m] for m in live],
        "replay_frames_hex": [[f.hex() for f in m] for m in replayed],
        # what vLLM's decoder gives back for each payload (bytes as base64)
        "decoded": [msgspec.to_builtins(msgspec.msgpack.decode(p, type=kv.KVEventBatch))
                    for p in payloads],
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(live)} live frames, {len(replayed)} replay frames")
    return 0


if __name__ == "__main__":
    sys.exit(main())
