"""Mooncake hash ids as block keys: the same hits, evictions and records as the token path."""

from __future__ import annotations

import itertools
import json
import os

import pytest

from prefixcache.sim import workloads as wl
from prefixcache.sim.replay import replay
from prefixcache.sim.trace import MooncakePrompt, TraceRequest, read_trace

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _both(path, n, **kw):
    """(records, summary) of the token path and of the hash-id path on the first n lines."""
    out = []
    for mode in ("expand", "lazy"):
        reqs = itertools.islice(read_trace(path, mooncake_tokens=mode), n)
        recs = []
        s = replay(
            reqs, on_record=recs.append, record_evictions=True, hash_seed=0,
            free_order="unhashed_first", concurrency=8, **kw,
        )
        s.pop("timing"), s.pop("requests_per_s"), s.pop("prompt_tokens_per_s")
        out.append((recs, s))
    return out


@pytest.mark.parametrize(
    "block_size,num_blocks,algo",
    [(512, 300, "sha256"), (512, 300, "xxhash_cbor"), (128, 1200, "sha256_cbor"), (16, 6000, "sha256")],
)
def test_hash_id_path_equals_token_path_on_a_generated_mooncake_trace(
    tmp_path, block_size, num_blocks, algo
):
    path = tmp_path / "mc.jsonl"
    wl.write_mooncake_trace(path, wl.mooncake_scale(num_requests=120, seed=3))
    (tok, s_tok), (ids, s_ids) = _both(
        path, 120, num_blocks=num_blocks, block_size=block_size, hash_algo=algo
    )
    assert s_tok["evictions"] > 0 and s_tok["hit_tokens"] > 0  # a bounded pool
    assert ids == tok and s_ids == s_tok


@pytest.mark.parametrize("name", ["conversation", "synthetic"])
@pytest.mark.parametrize("block_size,num_blocks", [(512, 400), (16, 12000)])
def test_hash_id_path_equals_token_path_on_the_real_mooncake_traces(
        name, block_size, num_blocks, local_datasets):
    from prefixcache.sim import datasets

    path = str(datasets.path_of(f"mooncake_{name}", download=False))
    (tok, s_tok), (ids, s_ids) = _both(
        path, 150, num_blocks=num_blocks, block_size=block_size, hash_algo="sha256"
    )
    assert s_tok["evictions"] > 0 and s_tok["hit_tokens"] > 0
    assert ids == tok and s_ids == s_tok


def test_other_requests_take_the_token_path(tmp_path):
    """A lazy prompt with a salt (or a block size not dividing 512) is hashed from its
    tokens: the same records as the expanded prompt."""
    lines = [
        {"timestamp": 0, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 1, "input_length": 1030, "output_length": 3, "hash_ids": [1, 2, 9]},
    ]
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    for bs, salt in ((16, "s"), (100, None)):
        got = []
        for mode in ("expand", "lazy"):
            reqs = [
                TraceRequest(r.id, r.prompt, r.output_len, cache_salt=salt)
                for r in read_trace(path, mooncake_tokens=mode)
            ]
            recs = []
            replay(reqs, num_blocks=200, block_size=bs, on_record=recs.append, hash_seed=0)
            got.append(recs)
        assert got[0] == got[1] and got[0][1]["num_computed_tokens"] > 0


def test_mooncake_prompt_is_its_expanded_tokens(tmp_path):
    lines = [{"timestamp": 0, "input_length": 1100, "output_length": 4, "hash_ids": [7, 8, 3]}]
    path = tmp_path / "mc.jsonl"
    path.write_text(json.dumps(lines[0]) + "\n")
    (exp,) = read_trace(path)
    (lazy,) = read_trace(path, mooncake_tokens="lazy")
    p = lazy.prompt
    assert isinstance(p, MooncakePrompt) and p.hash_ids == (7, 8, 3) and len(p) == 1100
    assert p == exp.prompt and lazy == exp and list(p) == exp.prompt and p.tolist() == exp.prompt
    assert p[510:515] == exp.prompt[510:515] and p[-1] == exp.prompt[-1] and p[0] == exp.prompt[0]
    assert p[1000:2000] == exp.prompt[1000:] and p[::100] == exp.prompt[::100]
    with pytest.raises(IndexError):
        p[1100]
    assert lazy.to_json() == exp.to_json()
    with pytest.raises(ValueError, match="mooncake_tokens"):
        read_trace(path, mooncake_tokens="no")
    with pytest.raises(ValueError, match="cover"):
        MooncakePrompt([1, 2], 1100)


@pytest.mark.parametrize("eviction", ["lru", "belady"])
def test_lazy_prompts_under_the_radix_index_take_the_token_path(tmp_path, eviction):
    """The radix tree keys blocks by their tokens, so hash-id prompts (whose tokens are
    zeros) must be materialised for it: records equal the expanded-token replay's, and
    the hits are not inflated (zeros would match every block)."""
    path = tmp_path / "mc.jsonl"
    wl.write_mooncake_trace(path, wl.mooncake_scale(num_requests=120, seed=3))

    def run(mode, index):
        reqs = list(read_trace(path, mooncake_tokens=mode))
        recs = []
        s = replay(reqs, on_record=recs.append, record_evictions=True, hash_seed=0,
                   free_order="unhashed_first", concurrency=8, num_blocks=300,
                   block_size=512, index=index, eviction=eviction)
        for k in ("timing", "requests_per_s", "prompt_tokens_per_s"):
            s.pop(k)
        return recs, s

    tok, s_tok = run("expand", "radix")
    ids, s_ids = run("lazy", "radix")
    assert s_tok["evictions"] > 0 and s_tok["hit_tokens"] > 0
    assert ids == tok and s_ids == s_tok
    _, s_hash = run("lazy", "hash")
    assert s_tok["hit_tokens"] <= s_hash["hit_tokens"] * 1.05  # same order as the chain's


def _bailian_and_claude_code_files(tmp_path, n=90, seed=5):
    """A Bailian file (16-token ids) and a Claude Code file (64-token ids, two sessions,
    local scope) whose prompts share prefixes of ids, as multi-turn chats do."""
    import random

    rng = random.Random(seed)
    roots = [[rng.randrange(1 << 40) for _ in range(rng.randrange(2, 12))] for _ in range(6)]
    bl, sessions = [], {"a": [], "b": []}
    for i in range(n):
        ids = rng.choice(roots) + [rng.randrange(1 << 40) for _ in range(rng.randrange(1, 6))]
        n_in = 16 * (len(ids) - 1) + rng.randrange(1, 17)
        bl.append({"chat_id": i, "parent_chat_id": -1, "timestamp": float(i),
                   "input_length": n_in, "output_length": rng.randrange(1, 20),
                   "type": "text", "turn": 1, "hash_ids": ids})
        cc_ids = ids[: max(1, len(ids) // 2)]
        sessions["ab"[i % 2]].append({"t": float(i), "in": 64 * (len(cc_ids) - 1)
                                      + rng.randrange(1, 65), "out": rng.randrange(1, 40),
                                      "hash_ids": cc_ids, "model": "m"})
    b = tmp_path / "bl.jsonl"
    b.write_text("".join(json.dumps(x) + "\n" for x in bl))
    c = tmp_path / "cc.jsonl"
    c.write_text("".join(json.dumps({"id": k, "block_size": 64, "hash_id_scope": "local",
                                     "requests": v}) + "\n" for k, v in sessions.items()))
    return b, c


@pytest.mark.parametrize("fmt,block_size,num_blocks", [
    ("bailian", 16, 160), ("bailian", 8, 320), ("claude_code", 64, 40), ("claude_code", 16, 160)])
def test_hash_id_path_equals_token_path_on_bailian_and_claude_code(
        tmp_path, fmt, block_size, num_blocks):
    from prefixcache.sim.trace import HashIdPrompt

    b, c = _bailian_and_claude_code_files(tmp_path)
    path = b if fmt == "bailian" else c
    lazy = list(read_trace(path, format=fmt, mooncake_tokens="lazy"))
    expanded = list(read_trace(path, format=fmt))
    assert all(type(r.prompt) is HashIdPrompt for r in lazy)
    assert {r.prompt.block_tokens for r in lazy} == {16 if fmt == "bailian" else 64}
    assert [r.prompt for r in lazy[:5]] == [r.prompt for r in expanded[:5]]  # same tokens
    for policy in ("lru", "belady"):
        out = []
        for reqs in (expanded, lazy):
            recs = []
            s = replay(reqs, num_blocks=num_blocks, block_size=block_size, hash_seed=0,
                       concurrency=4, eviction=policy, on_record=recs.append,
                       record_evictions=True, miss_reasons=True)
            s.pop("timing"), s.pop("requests_per_s"), s.pop("prompt_tokens_per_s")
            out.append((recs, s))
        (tok, s_tok), (ids, s_ids) = out
        assert s_tok["evictions"] > 0 and s_tok["hit_tokens"] > 0, policy
        assert ids == tok and s_ids == s_tok, policy


def test_hash_id_prompt_of_any_block_size():
    from prefixcache.sim.trace import HashIdPrompt, mooncake_tokens

    p = HashIdPrompt([5, 6, 7], 40, block_tokens=16)
    assert len(p) == 40 and p.tolist() == mooncake_tokens([5, 6, 7], block_tokens=16)[:40].tolist()
    assert p[17] == p.tolist()[17] and p[10:20] == p.tolist()[10:20]
    assert HashIdPrompt([5], 16, block_tokens=16) != HashIdPrompt([5], 16, block_tokens=64)
    with pytest.raises(ValueError, match="do not cover 40 tokens in 16-token blocks"):
        HashIdPrompt([5, 6], 40, block_tokens=16)
    with pytest.raises(ValueError, match="block_tokens"):
        HashIdPrompt([5], 4, block_tokens=0)
