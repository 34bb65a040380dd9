"""Replay goldens produced by the REAL vLLM 0.33 manager (tests/data/replay_golden/).

``make_goldens.py`` there cut a few dozen requests from each of the four peer traces and
ran ``experiments/peers/vllm_replay.py`` on them with small pools (evictions, early
finishes, failed admissions, truncated decodes). vLLM reserves block 0 as its null
block, so with ``num_blocks = N - 1`` and ``free_order="unhashed_first"`` our replay must
give the same hits, failures and truncations request by request, and block ids one
less than vLLM's. CI has no vLLM: these files are the oracle.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from prefixcache.sim.replay import replay
from prefixcache.sim.trace import read_trace

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "replay_golden"
MANIFEST = json.loads((DATA / "manifest.json").read_text())


@pytest.mark.parametrize("run", MANIFEST["runs"], ids=lambda r: r["vllm_out"][: -len(".vllm.jsonl")])
def test_replay_matches_vllm(run):
    vllm = [json.loads(line) for line in (DATA / run["vllm_out"]).read_text().splitlines()]
    ours = []
    summary = replay(
        read_trace(DATA / run["trace"]),
        num_blocks=run["num_blocks_vllm"] - 1,
        block_size=MANIFEST["block_size"],
        hash_algo=run["hash_algo"],
        hash_seed=0,
        free_order="unhashed_first",
        concurrency=run["concurrency"],
        on_record=ours.append,
        record_evictions=True,
    )
    assert len(ours) == len(vllm) == run["requests"]
    for mine, theirs in zip(ours, vllm):
        theirs = dict(theirs)
        theirs["block_ids"] = [b - 1 for b in theirs["block_ids"]]
        assert mine == theirs  # hits, block ids, evictions so far, failures, truncation
        assert list(mine) == list(theirs)  # and the same key order
    assert summary["hit_tokens"] == run["hit_tokens"]
    assert summary["failed"] == run["failed_admissions"]
    assert summary["decode_truncated"] == run["decode_truncated"]
    assert summary["early_finishes"] == run["early_finishes"]
    assert summary["evictions"] == run["evictions"]
    assert summary["blocks_cached"] == run["blocks_stored"]


def test_goldens_cover_the_interesting_cases():
    runs = MANIFEST["runs"]
    assert {r["trace"].split(".")[0] for r in runs} == {
        "shared_system_prompt", "multi_turn", "few_shot", "mm_salt",
    }
    assert any(r["failed_admissions"] for r in runs)
    assert any(r["decode_truncated"] for r in runs)
    assert any(r["early_finishes"] for r in runs)
    assert all(r["evictions"] for r in runs)
    assert {r["hash_algo"] for r in runs} == {"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"}
