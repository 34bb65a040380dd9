"""Qwen-Bailian and Claude Code trace readers (issue 26 item 4), on small files written
in those formats: expansion of hash ids at each format's block size, the session rules
(local hash-id scope, arrival merge), a replay that hits exactly where ids repeat, and
a clear error per malformed field."""

from __future__ import annotations

import json

import pytest

from prefixcache.sim.replay import replay
from prefixcache.sim.trace import TraceError, mooncake_tokens, read_trace
from prefixcache.sim.trace_formats import BLOCK_TOKENS, read_bailian, read_claude_code


def _write(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


BAILIAN = [
    {"chat_id": 159, "parent_chat_id": -1, "timestamp": 61.114, "input_length": 40,
     "output_length": 3, "type": "text", "turn": 1, "hash_ids": [1089, 1090, 1091]},
    {"chat_id": 160, "parent_chat_id": 159, "timestamp": 62.5, "input_length": 50,
     "output_length": 2, "type": "text", "turn": 2, "hash_ids": [1089, 1090, 7, 8]},
]


def test_bailian_expands_16_token_blocks(tmp_path):
    path = _write(tmp_path / "qwen_traceA_blksz_16.jsonl", BAILIAN)
    reqs = list(read_trace(path, format="bailian"))
    assert [r.id for r in reqs] == ["bl-159", "bl-160"]
    assert [len(r.prompt) for r in reqs] == [40, 50]
    assert [r.timestamp for r in reqs] == [61.114, 62.5]
    assert reqs[0].prompt == mooncake_tokens([1089, 1090, 1091], block_tokens=16)[:40].tolist()
    assert reqs[0].prompt[:32] == reqs[1].prompt[:32] != reqs[0].prompt[32:40]
    # Replayed at the format's block size, the second request hits the two shared ids.
    recs = []
    replay(read_trace(path, format="bailian"), num_blocks=64,
           block_size=BLOCK_TOKENS["bailian"], on_record=recs.append)
    assert [r["num_computed_tokens"] for r in recs] == [0, 32]


@pytest.mark.parametrize("field,value,match", [
    ("hash_ids", [1, 2], "has 2 ids but input_length=40 needs ceil\\(40/16\\) = 3"),
    ("timestamp", -1.0, "'timestamp' must be a finite number of seconds >= 0"),
    ("type", "video", "'type' must be one of"),
    ("input_length", 0, "'input_length' must be a positive int"),
    ("turn", 0, "'turn' must be an int >= 1"),
    ("chat_id", "x", "'chat_id' must be an int"),
])
def test_bailian_malformed_fields(tmp_path, field, value, match):
    bad = dict(BAILIAN[0], **{field: value})
    path = _write(tmp_path / "t.jsonl", [bad])
    with pytest.raises(TraceError, match=match):
        list(read_bailian(path))
    path = _write(tmp_path / "t.jsonl", [BAILIAN[0], BAILIAN[0]])
    with pytest.raises(TraceError, match=":2: duplicate chat_id 159"):
        list(read_bailian(path))


def _session(sid, reqs, scope="local"):
    return {"id": sid, "models": ["claude-opus-4-7"], "block_size": 64,
            "hash_id_scope": scope, "requests": reqs}


CC = [
    _session("s1", [{"t": 0.0, "model": "m", "in": 130, "out": 4, "hash_ids": [0, 1, 2]},
                    {"t": 5.0, "model": "m", "in": 200, "out": 4, "hash_ids": [0, 1, 3, 4]}]),
    _session("s2", [{"t": 1.0, "model": "m", "in": 128, "out": 2, "hash_ids": [0, 1]}]),
]


def test_claude_code_sessions_local_scope_and_arrival_order(tmp_path):
    path = _write(tmp_path / "cc.jsonl", CC)
    reqs = list(read_trace(path, format="claude_code"))
    assert [(r.id, r.timestamp) for r in reqs] == [("cc-s1-0", 0.0), ("cc-s2-0", 1.0),
                                                  ("cc-s1-1", 5.0)]
    s1a, s2a, s1b = reqs
    assert s1a.prompt[:128] == s1b.prompt[:128]  # same session, same ids: same tokens
    assert s1a.prompt[:64] != s2a.prompt[:64]  # id 0 of another session: other content
    recs = []
    replay(iter(reqs), num_blocks=64, block_size=64, on_record=recs.append)
    assert [r["num_computed_tokens"] for r in recs] == [0, 0, 128]
    # A session interval shifts whole sessions; global ids are shared across sessions.
    reqs = list(read_claude_code(path, session_interval=10.0))
    assert [(r.id, r.timestamp) for r in reqs] == [("cc-s1-0", 0.0), ("cc-s1-1", 5.0),
                                                  ("cc-s2-0", 11.0)]
    glob = _write(tmp_path / "g.jsonl", [_session(s["id"], s["requests"], "global") for s in CC])
    a, b, _ = list(read_claude_code(glob))
    assert a.prompt[:128] == b.prompt[:128]


@pytest.mark.parametrize("change,match", [
    ({"t": -1.0}, "'t' must be a finite number of seconds >= 0"),
    ({"hash_ids": [0]}, "has 1 ids but in=130 needs ceil\\(130/64\\) = 3"),
    ({"out": -2}, "'out' must be an int >= 0"),
    ({"in": True}, "'in' must be a positive int"),
])
def test_claude_code_malformed_fields(tmp_path, change, match):
    bad = _session("s", [dict(CC[0]["requests"][0], **change)])
    with pytest.raises(TraceError, match=f"cc.jsonl:1: requests\\[0\\]: .*{match}"):
        list(read_claude_code(_write(tmp_path / "cc.jsonl", [bad])))
    back = _session("s", [dict(CC[0]["requests"][1]), dict(CC[0]["requests"][0])])
    with pytest.raises(TraceError, match="goes back in time"):
        list(read_claude_code(_write(tmp_path / "cc.jsonl", [back])))
    with pytest.raises(TraceError, match="'hash_id_scope' must be 'local' or 'global'"):
        list(read_claude_code(_write(tmp_path / "cc.jsonl", [_session("s", [], "team")])))
    with pytest.raises(TraceError, match="duplicate session id 's'"):
        list(read_claude_code(_write(tmp_path / "cc.jsonl", [_session("s", []),
                                                            _session("s", [])])))
    with pytest.raises(ValueError, match="session_interval"):
        read_claude_code(tmp_path / "cc.jsonl", session_interval=float("inf"))
