"""Trace reader/writer: our JSONL, Mooncake expansion, validation errors with line numbers."""

from __future__ import annotations

import json
import zlib

import pytest

from prefixcache.sim.trace import (
    TraceError,
    TraceRequest,
    mooncake_block_tokens,
    output_token,
    output_tokens,
    read_trace,
    write_trace,
)


PINNED_7 = [28980, 18373, 23860, 31731]
PINNED_0 = [1, 22299, 22517, 23542]


def _write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_output_token_formula():
    assert output_token("mt-c000-t0", 0) == 1 + zlib.crc32(b"mt-c000-t0:0") % 1000
    assert output_tokens("x", 5) == [output_token("x", k) for k in range(5)]
    assert all(1 <= output_token("r", k) <= 1000 for k in range(200))


def test_roundtrip(tmp_path):
    reqs = [
        TraceRequest("a", [1, 2, 3], 4),
        TraceRequest(
            "b", [0, 0, 0, 5], 1, cache_salt="s", lora=("l", "/p"), mm=(("img", 0, 3),),
            timestamp=1.5,
        ),
    ]
    p = tmp_path / "t.jsonl"
    assert write_trace(p, reqs) == 2
    assert list(read_trace(p)) == reqs
    first = json.loads(p.read_text().splitlines()[0])
    assert first == {
        "id": "a", "prompt": [1, 2, 3], "output_len": 4, "cache_salt": None,
        "lora": None, "mm": [],
    }
    assert [f.name for f in tmp_path.iterdir()] == ["t.jsonl"]  # no temp files left


def test_mm_is_sorted_by_offset(tmp_path):
    p = _write_lines(
        tmp_path / "t.jsonl",
        ['{"id": "a", "prompt": [0,0,0,0,0,0], "output_len": 1, "mm": [["j", 4, 2], ["i", 0, 3]]}'],
    )
    (r,) = read_trace(p)
    assert r.mm == (("i", 0, 3), ("j", 4, 2))


@pytest.mark.parametrize(
    "line, match",
    [
        ('{"id": "a", "prompt": [1, 2], "output_len": 1', r":2: malformed JSON"),
        ('[1, 2]', r":2: expected a JSON object"),
        ('{"prompt": [1, 2], "output_len": 1}', r":2: missing field 'id'"),
        ('{"id": "a", "output_len": 1}', r":2: missing field 'prompt'"),
        ('{"id": "a", "prompt": [1]}', r":2: missing field 'output_len'"),
        ('{"id": "a", "prompt": [], "output_len": 1}', r":2: field 'prompt'"),
        ('{"id": "a", "prompt": [1, -5], "output_len": 1}', r":2: field 'prompt' .*negative"),
        ('{"id": "a", "prompt": [1, 2.5], "output_len": 1}', r":2: field 'prompt' .*non-integer"),
        ('{"id": "a", "prompt": [1], "output_len": -1}', r":2: field 'output_len'"),
        ('{"id": "a", "prompt": [1], "output_len": 1, "lora": ["x"]}', r":2: field 'lora'"),
        ('{"id": "a", "prompt": [1], "output_len": 1, "cache_salt": 3}', r":2: field 'cache_salt'"),
        ('{"id": "a", "prompt": [0, 0], "output_len": 1, "mm": [["i", 1, 2]]}', r":2: field 'mm\[0\]' range \[1, 3\) is outside"),
        ('{"id": "a", "prompt": [0, 0], "output_len": 1, "mm": [["i", -1, 1]]}', r":2: field 'mm\[0\]'"),
        ('{"id": "a", "prompt": [0, 0, 0], "output_len": 1, "mm": [["i", 0, 2], ["j", 1, 2]]}', r":2: field 'mm': .*overlap"),
        ('{"input_length": 600, "output_length": 1, "hash_ids": [1]}', r":2: field 'hash_ids' has 1 ids"),
        ('{"input_length": -1, "output_length": 1, "hash_ids": []}', r":2: field 'input_length'"),
        ('{"input_length": 10, "output_length": -2, "hash_ids": [1]}', r":2: field 'output_length'"),
        ('{"input_length": 10, "hash_ids": [1]}', r":2: missing field 'output_length'"),
    ],
)
def test_errors_name_line_and_field(tmp_path, line, match):
    good = '{"id": "ok", "prompt": [1, 2], "output_len": 1}'
    p = _write_lines(tmp_path / "bad.jsonl", [good, line, good])
    it = read_trace(p)
    assert next(it).id == "ok"  # streaming: the first line is served before the error
    with pytest.raises(TraceError, match=match):
        next(it)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="format"):
        read_trace(tmp_path / "x", format="csv")
    with pytest.raises(FileNotFoundError):
        list(read_trace(tmp_path / "missing.jsonl"))


def test_mooncake_expansion(tmp_path):
    p = _write_lines(
        tmp_path / "mc.jsonl",
        [
            '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [7, 8]}',
            "",
            '{"timestamp": 2500, "input_length": 512, "output_length": 0, "hash_ids": [7]}',
        ],
    )
    a, b = read_trace(p)
    assert (a.id, b.id) == ("mc-1", "mc-3")  # line numbers
    assert (a.timestamp, b.timestamp) == (0.0, 2.5)  # ms -> s
    assert len(a.prompt) == 1000 and len(b.prompt) == 512
    assert a.output_len == 5 and b.output_len == 0
    blk7 = mooncake_block_tokens(7).tolist()
    assert a.prompt[:512] == blk7 == b.prompt  # equal ids, equal blocks
    assert a.prompt[512:] == mooncake_block_tokens(8).tolist()[:488]  # truncated last block
    assert blk7 != mooncake_block_tokens(8).tolist()
    assert all(1 <= t < 32000 for t in blk7)
    assert list(read_trace(p, format="mooncake")) == [a, b]
    ours = _write_lines(tmp_path / "m2.jsonl", ['{"id": "x", "prompt": [1], "output_len": 1}'])
    with pytest.raises(TraceError, match="missing field 'input_length'"):
        list(read_trace(ours, format="mooncake"))


def test_mooncake_tokens_are_pinned():
    # Pure 64-bit integer arithmetic (splitmix64): the same on every platform/process.
    assert mooncake_block_tokens(7)[:4].tolist() == PINNED_7
    assert mooncake_block_tokens(0)[:4].tolist() == PINNED_0


def test_mooncake_tokens_equal_the_blocks_one_by_one():
    import numpy as np

    from prefixcache.sim.trace import mooncake_tokens

    ids = [0, 7, 7, 3, 2**40 + 5, 2**64 - 1, 123456789]
    for vocab in (32000, 2):
        want = np.concatenate([mooncake_block_tokens(h, vocab_size=vocab) for h in ids])
        got = mooncake_tokens(ids, vocab_size=vocab)
        assert got.dtype == np.int64 and got.tolist() == want.tolist()
    assert mooncake_tokens([], block_tokens=4).shape == (0,)
    # The pinned values of the per-block function still hold through the vectorised one.
    assert mooncake_tokens([7, 0])[:4].tolist() == mooncake_block_tokens(7)[:4].tolist()
