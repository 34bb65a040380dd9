"""The generated agentic workload and the AgentX / TraceLab readers (small files in each
published format, tests/data/agent_traces)."""

import json
import pathlib

import pytest

from prefixcache.core.request import RetentionHints
from prefixcache.sim import agentic, datasets, trace_formats, workloads
from prefixcache.sim.trace import TraceError, read_trace
from prefixcache.sim.replay import replay

DATA = pathlib.Path(__file__).parents[1] / "data" / "agent_traces"
SMALL = dict(num_sessions=3, mean_steps=12, system_tokens=500, tool_tokens=1000,
             compact_at=12_000, summary_tokens=1_000, subagent_prob=0.3,
             subagent_mean_steps=3)


def test_agentx_fixture_flattens_subagents_in_time_order():
    reqs = list(read_trace(DATA / "agentx_small.jsonl", format="agentx", mooncake_tokens="lazy"))
    assert [r.id for r in reqs] == [
        "ax-sess-a-0", "ax-sess-b-0", "ax-sess-b-1", "ax-sess-a-agent_001-0",
        "ax-sess-a-agent_001-1", "ax-sess-a-1"]
    assert [r.timestamp for r in reqs] == [0.0, 1.0, 2.5, 3.0, 5.0, 8.0]
    by = {r.id: r for r in reqs}
    main0, sub0, main1 = by["ax-sess-a-0"], by["ax-sess-a-agent_001-0"], by["ax-sess-a-1"]
    # a sub-agent shares its parent's namespace: ids 0, 1 are the parent's blocks
    assert sub0.prompt.hash_ids[:2] == main0.prompt.hash_ids[:2]
    assert sub0.prompt.hash_ids[2] not in main0.prompt.hash_ids
    assert main1.prompt.hash_ids[:3] == main0.prompt.hash_ids[:3]
    # "local" ids of two sessions are different content
    assert by["ax-sess-b-0"].prompt.hash_ids[0] != main0.prompt.hash_ids[0]
    assert [len(r.prompt) for r in reqs] == [200, 128, 129, 150, 260, 300]
    assert all(r.retention is None for r in reqs)
    # the expanded prompts are the lazy ones' tokens
    expanded = list(read_trace(DATA / "agentx_small.jsonl", format="agentx"))
    assert [r.prompt for r in expanded] == [list(r.prompt) for r in reqs]


def test_agentx_hints_follow_the_session_structure():
    reqs = {r.id: r for r in trace_formats.read_agentx(DATA / "agentx_small.jsonl",
                                                        lazy=True, hints=True, ttl_s=60)}
    assert reqs["ax-sess-a-0"].retention == RetentionHints(priority=1, ttl_s=60)
    assert reqs["ax-sess-a-agent_001-0"].retention == RetentionHints(priority=0, ttl_s=60)
    # the sub-agent's last call ends it; the shared system prompt + tools are kept
    assert reqs["ax-sess-a-agent_001-1"].retention == RetentionHints(
        priority=0, ttl_s=60, keep_range=(0, 128), session_end=True)
    assert reqs["ax-sess-a-1"].retention.session_end
    # no system/tool token counts: the whole session's blocks end with it
    assert reqs["ax-sess-b-1"].retention == RetentionHints(priority=1, ttl_s=60,
                                                           session_end=True)


@pytest.mark.parametrize("mutate,match", [
    (lambda s: s["requests"][1].update(type="agent"), "'type' must be 'n', 's' or 'subagent'"),
    (lambda s: s["requests"][1].pop("agent_id"), "missing field 'agent_id'"),
    (lambda s: s["requests"][1]["requests"][0].update(hash_ids=[0]), "'hash_ids' has 1 ids"),
    (lambda s: s["requests"][0].pop("t"), "missing field 't'"),
    (lambda s: s.update(hash_id_scope="tree"), "'hash_id_scope'"),
    (lambda s: s.update(tool_tokens=-1), "'tool_tokens'"),
])
def test_agentx_errors_name_the_line_and_field(tmp_path, mutate, match):
    lines = (DATA / "agentx_small.jsonl").read_text().splitlines()
    s = json.loads(lines[0])
    mutate(s)
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(s) + "\n" + lines[1] + "\n")
    with pytest.raises(TraceError, match=match) as e:
        list(read_trace(p, format="agentx"))
    assert f"{p}:1" in str(e.value)


def test_agentx_reads_one_json_session_per_file(tmp_path):
    s = json.loads((DATA / "agentx_small.jsonl").read_text().splitlines()[1])
    p = tmp_path / "sess-b.json"
    p.write_text(json.dumps(s, indent=2))
    assert [r.id for r in read_trace(p, format="agentx")] == ["ax-sess-b-0", "ax-sess-b-1"]


def test_tracelab_fixture_rebuilds_prefixes_from_the_split():
    reqs = list(read_trace(DATA / "tracelab_small.jsonl", format="tracelab",
                           mooncake_tokens="lazy"))
    assert [r.id for r in reqs] == ["tl-s1-0", "tl-s2-0", "tl-s1-1", "tl-s1-2"]
    assert [r.timestamp for r in reqs] == [0.0, 1.5, 4.0, 1200.0]
    s1 = [r for r in reqs if r.id.startswith("tl-s1")]
    ids = [r.prompt.hash_ids for r in s1]
    assert [len(r.prompt) for r in s1] == [200, 300, 350]
    # round 1 reuses 240 prefix tokens: 3 full 64-token blocks, the first 3 of round 0's
    # context (prompt 200 + output 40: the output rewrote round 0's partial 4th block)
    assert ids[1][:3] == ids[0][:3] and ids[1][3] != ids[0][3]
    # round 2: the provider reported no cached prefix: all new content
    assert not set(ids[2]) & (set(ids[0]) | set(ids[1]))
    # sessions never share
    assert not set(reqs[1].prompt.hash_ids) & set(ids[0])


def test_tracelab_errors_name_the_line_and_field(tmp_path):
    p = tmp_path / "bad.jsonl"
    row = json.loads((DATA / "tracelab_small.jsonl").read_text().splitlines()[0])
    row["prefix_tokens"] = row["input_tokens_total"] + 1
    p.write_text(json.dumps(row) + "\n")
    with pytest.raises(TraceError, match=rf"{p}:1: field 'prefix_tokens'"):
        list(read_trace(p, format="tracelab"))
    row["prefix_tokens"] = 0
    row["timing_events"][0]["timestamp"] = "yesterday"
    p.write_text(json.dumps(row) + "\n")
    with pytest.raises(TraceError, match="not ISO-8601"):
        list(read_trace(p, format="tracelab"))


def test_registry_entries_and_block_sizes():
    for name in ("agentx", "agentx_256k", "tracelab"):
        d = datasets.get(name)
        assert d.block_size == 64
        assert d.trace_format in ("agentx", "tracelab")
    assert datasets.get("tracelab").sha256.startswith("9d265eae")
    with pytest.raises(datasets.DatasetError, match="block_size=64"):
        datasets.check_block_size("tracelab", 16)


def test_generator_deterministic_and_calibrated():
    a = agentic.agentic_sessions(**SMALL, seed=1)
    assert a == agentic.agentic_sessions(**SMALL, seed=1)
    assert a != agentic.agentic_sessions(**SMALL, seed=2)
    assert any(r["type"] == "subagent" for s in a for r in s["requests"])
    # the defaults: AgentX's published theoretical hit rates at 64-token blocks bracket
    # ours (85.8% v0.2 .. 96.8%), mean input within 25% of AgentX's 85k-token mean ISL
    full = agentic.agentic_sessions()
    rate = agentic.theoretical_hit_rate(full)
    assert 0.858 <= rate <= 0.968, rate
    ins = [r["in"] for s in full for r in s["requests"] if r["type"] != "subagent"]
    assert 0.75 * 85_201 <= sum(ins) / len(ins) <= 1.25 * 85_201


@pytest.mark.parametrize("fmt", ["agentx", "tracelab"])
def test_written_formats_read_back(tmp_path, fmt):
    sessions = agentic.agentic_sessions(**SMALL)
    p = tmp_path / f"t.{fmt}.jsonl"
    (agentic.write_agentx if fmt == "agentx" else agentic.write_tracelab)(p, sessions)
    got = list(read_trace(p, format=fmt, mooncake_tokens="lazy"))
    n_calls = sum(len(r["requests"]) if r["type"] == "subagent" else 1
                  for s in sessions for r in s["requests"])
    assert len(got) == n_calls
    gen = workloads.generate("agentic", format=fmt, **SMALL)
    assert sorted(len(r.prompt) for r in gen) == sorted(len(r.prompt) for r in got)


def test_agentx_keeps_the_subagent_sharing_tracelab_cannot_express():
    hits = {}
    for fmt in ("agentx", "tracelab"):
        reqs = workloads.generate("agentic", format=fmt, **SMALL)
        s = replay(reqs, num_blocks=1 << 16, block_size=64)
        hits[fmt] = s["hit_tokens"]
        assert s["prompt_tokens"] == sum(len(r.prompt) for r in reqs)
    assert hits["agentx"] > hits["tracelab"] > 0


def test_claude_code_reader_hints_and_nested_subagents(tmp_path):
    line = json.loads((DATA / "agentx_small.jsonl").read_text().splitlines()[1])
    p = tmp_path / "cc.jsonl"
    p.write_text(json.dumps(line) + "\n")
    plain = list(trace_formats.read_claude_code(p))
    hinted = list(trace_formats.read_claude_code(p, hints=True, ttl_s=30))
    assert [r.retention for r in plain] == [None, None]
    assert [r.prompt for r in hinted] == [r.prompt for r in plain]
    assert hinted[0].retention == RetentionHints(priority=1, ttl_s=30)
    assert hinted[1].retention == RetentionHints(priority=1, ttl_s=30, session_end=True)
    nested = tmp_path / "nested.jsonl"
    nested.write_text((DATA / "agentx_small.jsonl").read_text().splitlines()[0] + "\n")
    with pytest.raises(TraceError, match="format='agentx'"):
        list(read_trace(nested, format="claude_code"))
