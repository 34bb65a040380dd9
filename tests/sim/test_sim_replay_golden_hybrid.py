"""Hybrid replay goldens produced by the REAL vLLM 0.33 manager
(tests/data/replay_golden_hybrid/).

``make_goldens.py`` there ran ``experiments/peers/vllm_replay.py --kv-groups ...`` (vLLM's
``KVCacheManager`` with full-attention and ``SlidingWindowSpec`` groups: its hybrid
coordinator, sliding-window manager and shared block pool) on the trace cuts of
``tests/data/replay_golden/`` with small pools. Our replay with the same groups,
``num_blocks = N - 1`` and ``free_order="unhashed_first"`` must give the same hits,
failures, truncations and evictions request by request, and every group's block ids one
less than vLLM's -- vLLM's null block 0 being our null slot id ``num_blocks``.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from prefixcache.core.kv_groups import parse_kv_groups
from prefixcache.sim.replay import replay
from prefixcache.sim.trace import read_trace

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "replay_golden_hybrid"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
TRACES = DATA / MANIFEST["traces"]


def _ours(vllm_ids: list[list[int]], num_blocks: int) -> list[list[int]]:
    """vLLM's per-group block ids as ours: k -> k - 1, its null block 0 -> num_blocks."""
    return [[num_blocks if b == 0 else b - 1 for b in group] for group in vllm_ids]


@pytest.mark.parametrize("run", MANIFEST["runs"], ids=lambda r: r["vllm_out"][: -len(".vllm.jsonl")])
def test_hybrid_replay_matches_vllm(run):
    vllm = [json.loads(line) for line in (DATA / run["vllm_out"]).read_text().splitlines()]
    num_blocks = run["num_blocks_vllm"] - 1
    groups = parse_kv_groups(run["kv_groups"])
    ours = []
    summary = replay(
        read_trace(TRACES / run["trace"]),
        num_blocks=num_blocks,
        block_size=MANIFEST["block_size"],
        hash_algo=run["hash_algo"],
        hash_seed=0,
        free_order="unhashed_first",
        concurrency=run["concurrency"],
        on_record=ours.append,
        record_evictions=True,
        kv_cache_groups=groups,
    )
    assert len(ours) == len(vllm) == run["requests"]
    for mine, theirs in zip(ours, vllm):
        theirs = dict(theirs)
        if not theirs.get("failed"):
            assert len(theirs["block_ids"]) == len(groups)
            theirs["block_ids"] = _ours(theirs["block_ids"], num_blocks)
        assert mine == theirs  # hits, per-group block ids, evictions so far, failures
        assert list(mine) == list(theirs)  # and the same key order
    assert summary["hit_tokens"] == run["hit_tokens"]
    assert summary["failed"] == run["failed_admissions"]
    assert summary["decode_truncated"] == run["decode_truncated"]
    assert summary["early_finishes"] == run["early_finishes"]
    assert summary["evictions"] == run["evictions"]
    assert summary["blocks_cached"] == run["blocks_stored"]


def test_hybrid_goldens_cover_the_interesting_cases():
    runs = MANIFEST["runs"]
    layouts = {r["kv_groups"] for r in runs}
    assert "full,sw32" in layouts and "full,sw64" in layouts
    assert any(len(g.split(",")) == 3 and g.count("sw") == 2 for g in layouts)  # loop > 1 pass
    assert any("full" not in g for g in layouts)  # sliding-window only (unitary)
    residues = {int(p[2:]) % MANIFEST["block_size"] for g in layouts for p in g.split(",")
                if p.startswith("sw")}
    assert residues - {0, 1}  # a window that is not a multiple of the block
    assert 1 in residues  # ceil((W - 1) / block) != ceil(W / block)
    assert any(r["failed_admissions"] for r in runs)
    assert any(r["decode_truncated"] for r in runs)
    assert any(r["early_finishes"] for r in runs)
    assert all(r["evictions"] and r["hit_tokens"] for r in runs)
    assert {r["trace"].split(".")[0] for r in runs} == {
        "shared_system_prompt", "multi_turn", "few_shot", "mm_salt",
    }
    # The null slots are exercised: some admitted request's sliding table starts null.
    seen_null = False
    for r in runs:
        if "sw" not in r["kv_groups"]:
            continue
        for line in (DATA / r["vllm_out"]).read_text().splitlines():
            rec = json.loads(line)
            if not rec.get("failed") and any(g and g[0] == 0 for g in rec["block_ids"]):
                seen_null = True
                break
    assert seen_null
