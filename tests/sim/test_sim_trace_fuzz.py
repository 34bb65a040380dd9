"""Fuzzing the trace readers (issue 13, item 5): random bytes and random JSON lines give
requests or a TraceError / ValueError naming ``path:line`` -- never another exception."""

from __future__ import annotations

import gzip
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.sim.replay import replay
from prefixcache.sim.trace import TraceError, TraceRequest, read_trace

FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
LINE = re.compile(r":(\d+): ")

json_scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=5))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=4),
    max_leaves=12)
FIELDS = ("id", "prompt", "output_len", "cache_salt", "lora", "mm", "timestamp",
          "input_length", "output_length", "hash_ids")
# Objects shaped like requests (known keys, values of any type) reach the field checks.
request_like = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=len(FIELDS))
good_line = st.builds(
    lambda i, p, n: {"id": f"r{i}", "prompt": p, "output_len": n},
    st.integers(0, 10**6), st.lists(st.integers(0, 2**31), min_size=1, max_size=20),
    st.integers(0, 5))


def read_all(path, fmt):
    """The requests, or the error's line number (the error must carry one)."""
    try:
        reqs = list(read_trace(path, format=fmt))
    except TraceError as e:
        m = LINE.search(str(e))
        assert m and str(path) in str(e), f"no path:line in {e!r}"
        return int(m.group(1))
    for r in reqs:
        assert isinstance(r, TraceRequest) and r.prompt and r.output_len >= 0
        assert all(type(t) is int and t >= 0 for t in r.prompt)
    return reqs


@FUZZ
@given(data=st.binary(max_size=300), fmt=st.sampled_from(["auto", "jsonl", "mooncake"]),
       gz=st.booleans())
def test_random_bytes(tmp_path, data, fmt, gz):
    path = tmp_path / ("t.jsonl.gz" if gz else "t.jsonl")
    path.write_bytes(data)
    read_all(path, fmt)


@FUZZ
@given(lines=st.lists(st.one_of(json_values, request_like, good_line), min_size=1,
                      max_size=6),
       fmt=st.sampled_from(["auto", "jsonl", "mooncake"]))
def test_random_json_lines(tmp_path, lines, fmt):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = read_all(path, fmt)
    if isinstance(got, int):
        assert 1 <= got <= len(lines)


def test_corrupt_line_in_a_long_trace_names_it(tmp_path):
    """A corrupt line deep in a long trace: the stream yields every request before it,
    then a TraceError naming that line; a replay over it raises (no partial summary)."""
    good = [{"id": f"r{i}", "prompt": [1 + i % 7] * 40, "output_len": 3} for i in range(500)]
    text = [json.dumps(x) for x in good]
    text.insert(321, '{"id": "bad", "prompt": [1, 2,')  # truncated line 322
    path = tmp_path / "long.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(text) + "\n")
    seen = []
    with pytest.raises(TraceError, match=r"long\.jsonl\.gz:322: malformed JSON"):
        for r in read_trace(path):
            seen.append(r.id)
    assert seen == [f"r{i}" for i in range(321)]
    with pytest.raises(TraceError, match=":322: "):
        replay(read_trace(path), num_blocks=64, block_size=16, concurrency=4)


@pytest.mark.parametrize("line,match", [
    (b'{"id": "a", "prompt": [1, \xff], "output_len": 1}', "not UTF-8"),
    (b"[" * 100000, "malformed JSON"),
    (b'{"id": "a", "prompt": [1' + b"1" * 5000 + b'], "output_len": 1}', "malformed JSON"),
    (b'{"id": "a", "prompt": [true, 2], "output_len": 1}', "non-integer token id"),
    (b'{"id": "a", "prompt": [18446744073709551616], "output_len": 1}', "beyond 2\\*\\*63"),
    (b'{"id": "a", "prompt": [1], "output_len": 1, "timestamp": NaN}', "finite"),
    (b'{"id": "a", "prompt": [1], "output_len": 1, "mm": [["", 0, 1]]}', "mm\\[0\\]"),
    (b'{"id": "a", "prompt": [1], "output_len": 1, "lora": ["", "p"]}', "lora"),
    (b'{"input_length": 3, "output_length": 1, "hash_ids": [1], "timestamp": Infinity}',
     "finite"),
])
def test_each_hole_is_a_trace_error(tmp_path, line, match):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"id": "ok", "prompt": [1], "output_len": 1}\n' + line + b"\n")
    with pytest.raises(TraceError, match=f":2: .*{match}"):
        list(read_trace(path))


def test_corrupt_gzip_stream_is_a_trace_error(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    good = gzip.compress(b'{"id": "ok", "prompt": [1], "output_len": 1}\n' * 50)
    path.write_bytes(good[: len(good) // 2])  # truncated stream
    with pytest.raises(TraceError, match="unreadable"):
        list(read_trace(path))


@pytest.mark.parametrize("kw,match", [
    (dict(output_len=2.5), "output_len must be an int"),
    (dict(output_len="3"), "output_len must be an int"),
    (dict(output_len=-1), "output_len must be an int >= 0"),
    (dict(prompt={1, 2}), "prompt must be an ordered sequence"),
    (dict(id=""), "id must be a non-empty str"),
    (dict(timestamp=float("nan")), "timestamp must be a finite number"),
])
def test_trace_request_checks_its_fields(kw, match):
    """A hand-built request with a float output_len used to fail inside the replay,
    after its admission."""
    args = dict(id="a", prompt=[1, 2], output_len=2, **{})
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        TraceRequest(**args)
