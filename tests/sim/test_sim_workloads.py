"""Workload generators: determinism, parity with make_traces.py, and hand-computed
hits when their traces go through the replay (the replay loop itself is tested in
tests/sim by its owner; here the workloads are)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from prefixcache.sim import workloads as wl
from prefixcache.sim.replay import replay
from prefixcache.sim.trace import TraceRequest, read_trace, write_trace

# The peers' generator (the vLLM harness's own, in this repository).
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAKE_TRACES = os.path.join(_REPO, "experiments", "peers", "make_traces.py")
B = 16  # block size of these tests


def _replay(reqs, num_blocks=100_000, **kw):
    recs = []
    summary = replay(reqs, num_blocks=num_blocks, block_size=kw.pop("block_size", B),
                     on_record=recs.append, **kw)
    return summary, recs


def _small():
    return {
        "shared_system_prompt": dict(num_requests=20, system_len=100),
        "multi_turn": dict(num_conversations=4, num_turns=3),
        "few_shot": dict(num_headers=3, num_questions=5, header_len=70),
        "mm_salt": dict(num_requests=40),
        "rag": dict(num_requests=30, num_documents=10, doc_len=(20, 60)),
        "tenant_prefixes": dict(num_requests=30, num_tenants=4, prefix_len=64,
                                question_len=(8, 20)),
        "agentic": dict(num_sessions=2, mean_steps=6, system_tokens=300, tool_tokens=600,
                        compact_at=8000, summary_tokens=500),
    }


@pytest.mark.parametrize("name", sorted(wl.WORKLOADS))
def test_deterministic_and_seed_sensitive(name):
    kw = _small()[name]
    a = wl.generate(name, seed=3, **kw)
    b = wl.generate(name, seed=3, **kw)
    c = wl.generate(name, seed=4, **kw)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert all(isinstance(r, TraceRequest) for r in a)
    assert len({r.id for r in a}) == len(a)


def test_round_trip_through_trace_files(tmp_path):
    reqs = wl.mm_salt(num_requests=10) + wl.multi_turn(num_conversations=2, num_turns=2)
    write_trace(tmp_path / "t.jsonl", reqs)
    assert list(read_trace(tmp_path / "t.jsonl")) == reqs


def test_same_requests_as_peers_make_traces(tmp_path):
    subprocess.run([sys.executable, MAKE_TRACES, "--out-dir", str(tmp_path), "--seed", "5",
                    "--traces", "multi_turn,mm_salt"], check=True, capture_output=True)
    for name in ("multi_turn", "mm_salt"):
        peer = list(read_trace(tmp_path / f"{name}.jsonl"))
        ours = wl.generate(name, seed=5)
        assert len(ours) == len(peer)
        for o, p in zip(ours, peer):
            assert (o.id, o.prompt, o.output_len, o.cache_salt, o.lora, o.mm) == (
                p.id, p.prompt, p.output_len, p.cache_salt, p.lora, p.mm)


def test_shared_system_prompt_hits_the_full_block_part():
    reqs = wl.shared_system_prompt(num_requests=20, system_len=100, seed=1)
    summary, recs = _replay(reqs)
    # 100 // 16 = 6 full blocks of system prompt = 96 tokens, for all but the first.
    assert [r["num_computed_tokens"] for r in recs] == [0] + [96] * 19
    assert summary["hit_tokens"] == 19 * 96 and summary["failed"] == 0


def test_few_shot_every_header_misses_once():
    reqs = wl.few_shot(num_headers=3, num_questions=5, header_len=70, seed=2)
    _, recs = _replay(reqs)
    seen = set()
    for r, rec in zip(reqs, recs):
        header = r.id.split("-")[1]
        assert rec["num_computed_tokens"] == (64 if header in seen else 0), r.id
        seen.add(header)


def test_multi_turn_hits_previous_prompt_and_output():
    reqs = wl.multi_turn(num_conversations=4, num_turns=3, seed=3)
    assert [r.timestamp for r in reqs] == sorted(r.timestamp for r in reqs)
    by_id = {r.id: r for r in reqs}
    _, recs = _replay(reqs, concurrency=2)
    for rec in recs:
        conv, turn = rec["id"].rsplit("-t", 1)
        turn = int(turn)
        if turn == 0:
            expected = 0
        else:
            prev = by_id[f"{conv}-t{turn - 1}"]
            # The previous turn computed KV for its prompt + all outputs but the
            # last sampled token; its full blocks are what this turn reuses.
            expected = (len(prev.prompt) + prev.output_len - 1) // B * B
        assert rec["num_computed_tokens"] == expected, rec["id"]


@pytest.mark.parametrize("salts,loras", [(4, 2), (0, 0), (3, 0)])
def test_mm_salt_lora_isolate(salts, loras):
    reqs = wl.mm_salt(num_requests=60, num_salts=salts, num_loras=loras, seed=4)
    _, recs = _replay(reqs)
    seen = set()
    for r, rec in zip(reqs, recs):
        key = (r.mm[0][0], r.cache_salt, r.lora)
        # Block 0 already overlaps the image (offset 10): every block is keyed by
        # image, salt and adapter. Shared part: 10 text + 576 placeholders = 586
        # tokens -> 36 full blocks = 576 tokens.
        assert rec["num_computed_tokens"] == (576 if key in seen else 0), r.id
        seen.add(key)


def _ideal_hits(reqs, block_size):
    """Oracle: an infinite cache of full prompt blocks keyed by the whole prefix."""
    seen, hits = set(), []
    for r in reqs:
        n = 0
        for k in range((len(r.prompt) - 1) // block_size):
            if tuple(r.prompt[: (k + 1) * block_size]) not in seen:
                break
            n += 1
        hits.append(n * block_size)
        for k in range(len(r.prompt) // block_size):
            seen.add(tuple(r.prompt[: (k + 1) * block_size]))
    return hits


def test_rag_hits_match_an_infinite_cache_oracle():
    reqs = wl.rag(num_requests=40, num_documents=8, doc_len=(20, 60), system_len=40, seed=5)
    _, recs = _replay(reqs)
    hits = [r["num_computed_tokens"] for r in recs]
    assert hits == _ideal_hits(reqs, B)
    assert all(h >= 32 for h in hits[1:])  # the system prompt's 2 full blocks
    assert sum(h > 32 for h in hits) > 5  # popular leading documents are reused


def test_too_small_pool_evicts_and_reports_failures():
    reqs = wl.shared_system_prompt(num_requests=30, system_len=100, unique_len=(64, 200), seed=6)
    # A pool of 20 blocks (320 tokens) holds one request at a time: hits survive
    # only while the system prompt blocks are not evicted.
    summary, recs = _replay(reqs, num_blocks=20, concurrency=4)
    assert summary["evictions"] > 0
    assert summary["failed"] == 0
    # A pool smaller than any prompt: every request fails, and it is reported.
    summary, recs = _replay(reqs, num_blocks=5)
    assert summary["failed"] == 30 and all(r.get("failed") for r in recs)
    assert summary["hit_tokens"] == 0


def test_mooncake_three_request_trace_gives_expected_hit_blocks(tmp_path):
    lines = [
        {"timestamp": 0, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 10, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 20, "input_length": 1500, "output_length": 4, "hash_ids": [1, 4, 5]},
    ]
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    reqs = list(read_trace(path))
    assert [len(r.prompt) for r in reqs] == [1100, 1024, 1500]
    assert [r.timestamp for r in reqs] == [0.0, 0.01, 0.02]
    # Block size 512 = Mooncake's: request 2 shares ids [1, 2] but at least one token
    # is computed, so it hits 1 block; request 3 shares id 1 -> 1 block.
    _, recs = _replay(reqs, block_size=512, num_blocks=64)
    assert [r["num_computed_tokens"] for r in recs] == [0, 512, 512]
    # Block size 16: request 2 hits (1024 - 1) // 16 = 63 blocks; request 3 the 32
    # blocks of id 1.
    _, recs = _replay(reqs, block_size=16, num_blocks=1000)
    assert [r["num_computed_tokens"] for r in recs] == [0, 1008, 512]


def test_mooncake_scale_stream_is_valid_and_deterministic(tmp_path):
    gen = wl.mooncake_scale(num_requests=300, seed=2)
    lines = list(gen)
    assert lines == list(wl.mooncake_scale(num_requests=300, seed=2))
    for x in lines:
        assert len(x["hash_ids"]) == -(-x["input_length"] // 512)
    ts = [x["timestamp"] for x in lines]
    assert ts == sorted(ts)
    # Sessions continue: some request extends an earlier one's full blocks.
    firsts = {tuple(x["hash_ids"][:2]) for x in lines}
    assert len(firsts) < len(lines)
    stats = wl.write_mooncake_trace(tmp_path / "mc.jsonl", lines)
    assert stats["requests"] == 300
    reqs = list(read_trace(tmp_path / "mc.jsonl"))
    assert [len(r.prompt) for r in reqs] == [x["input_length"] for x in lines]
    mean = np.mean([x["input_length"] for x in lines])
    assert 6000 < mean < 20000


def test_bad_generator_arguments():
    with pytest.raises(ValueError, match="num_requests"):
        wl.shared_system_prompt(num_requests=0)
    with pytest.raises(ValueError, match="unique_len"):
        wl.shared_system_prompt(unique_len=(10, 5))
    with pytest.raises(ValueError, match="unknown workload"):
        wl.generate("nope")
    with pytest.raises(ValueError, match="docs_per_request"):
        wl.rag(num_documents=2, docs_per_request=3)
    with pytest.raises(ValueError, match="arrival rate"):
        wl.poisson_arrivals(3, 0.0)


def test_tenant_prefixes_share_each_tenants_prefix_only():
    reqs = wl.generate("tenant_prefixes", num_requests=60, num_tenants=5, prefix_len=48,
                       question_len=(16, 16), output_len=(4, 4), arrival_rate=10.0)
    prefixes = {tuple(r.prompt[:48]) for r in reqs}
    assert len(prefixes) == 5
    assert all(len(r.prompt) == 64 for r in reqs)
    ts = [r.timestamp for r in reqs]
    assert ts == sorted(ts) and ts[0] > 0
    summary, _ = _replay(reqs)
    # Every request after its tenant's first hits the 48-token (3-block) prefix.
    assert summary["hit_tokens"] == (60 - 5) * 48
