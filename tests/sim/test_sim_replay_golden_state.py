"""State-space (Mamba) replay goldens produced by the REAL vLLM 0.33 manager
(tests/data/replay_golden_state/).

``make_goldens.py`` there ran ``experiments/peers/vllm_replay.py --kv-groups ...mamba...``
(vLLM's ``KVCacheManager`` with ``MambaSpec`` groups, ``mamba_cache_mode="align"``: its
hybrid coordinator, ``MambaManager`` and shared block pool; prompts split by its
scheduler's ``_mamba_block_aligned_split``; some runs with vLLM's
``prefix_cache_retention_interval=0``, ours ``MambaSpec(retention_interval=0)``) on the trace cuts of
``tests/data/replay_golden/`` with small pools. Our replay with the same groups,
``num_blocks = N - 1`` and ``free_order="unhashed_first"`` must give the same hits,
prefill chunks, failures, truncations and evictions request by request, and every
group's block ids one less than vLLM's -- vLLM's null block 0 being our null slot id
``num_blocks``.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from prefixcache.core.groups.mamba import MambaSpec
from prefixcache.core.kv_groups import KVCacheGroup, parse_kv_groups
from prefixcache.sim.replay import replay
from prefixcache.sim.trace import read_trace

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "replay_golden_state"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
TRACES = DATA / MANIFEST["traces"]


def _ours(vllm_ids: list[list[int]], num_blocks: int) -> list[list[int]]:
    """vLLM's per-group block ids as ours: k -> k - 1, its null block 0 -> num_blocks."""
    return [[num_blocks if b == 0 else b - 1 for b in group] for group in vllm_ids]


@pytest.mark.parametrize("run", MANIFEST["runs"], ids=lambda r: r["vllm_out"][: -len(".vllm.jsonl")])
def test_state_replay_matches_vllm(run):
    vllm = [json.loads(line) for line in (DATA / run["vllm_out"]).read_text().splitlines()]
    num_blocks = run["num_blocks_vllm"] - 1
    groups = parse_kv_groups(run["kv_groups"])
    if run.get("retention_interval") is not None:  # vLLM's prefix_cache_retention_interval
        groups = tuple(
            KVCacheGroup(MambaSpec(retention_interval=run["retention_interval"]), g.layer_names)
            if isinstance(g.spec, MambaSpec) else g for g in groups)
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
        assert mine == theirs  # hits, chunks, per-group block ids, evictions, failures
        assert list(mine) == list(theirs)  # and the same key order
    assert summary["hit_tokens"] == run["hit_tokens"]
    assert sum("prefill_chunks" in r for r in ours) == run["prefill_split"]
