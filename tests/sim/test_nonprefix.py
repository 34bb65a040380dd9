"""The non-prefix reuse bound (prefixcache.sim.nonprefix)."""

import itertools

import pytest

from prefixcache.sim import compare, workloads
from prefixcache.sim.nonprefix import nonprefix_bound
from prefixcache.sim.replay import replay
from prefixcache.sim.trace import TraceRequest, read_trace


def _ideal_replay_hits(reqs, block_size):
    n = compare.ideal_num_blocks(reqs, block_size)
    return replay(reqs, num_blocks=n, block_size=block_size, concurrency=1)["hit_tokens"]


WORKLOADS = [
    ("multi_turn", dict(num_conversations=6, seed=1)),
    ("shared_system_prompt", dict(num_requests=20, seed=2)),
    ("few_shot", dict(num_headers=3, num_questions=20, header_len=200, seed=3)),
    ("rag", dict(num_requests=20, seed=4)),
    ("mm_salt", dict(num_requests=20, seed=5)),
]


@pytest.mark.parametrize("name,kwargs", WORKLOADS)
def test_prefix_part_equals_the_infinite_cache_replay(name, kwargs):
    reqs = workloads.generate(name, **kwargs)
    b = nonprefix_bound(reqs, 16)
    assert b["prefix_hit_tokens"] == _ideal_replay_hits(reqs, 16)
    assert b["nonprefix_hit_tokens"] >= b["prefix_hit_tokens"]
    assert b["requests"] == len(reqs)


def test_rag_reuses_chunks_out_of_position():
    # rag draws documents from a shared pool in varying order: the same document after
    # another prefix is a non-prefix hit.
    # The second document of a request starts at no block boundary in general, so the
    # token-aligned bound finds more than the block-aligned one.
    reqs = workloads.generate("rag", num_requests=40, num_documents=20, seed=0)
    b = nonprefix_bound(reqs, 16, recompute_fraction=0.0)
    tok = nonprefix_bound(reqs, 16, recompute_fraction=0.0, alignment="token")
    assert tok["nonprefix_blocks"] > b["nonprefix_blocks"] > 0
    assert b["nonprefix_hit_tokens"] == b["prefix_hit_tokens"] + 16 * b["nonprefix_blocks"]
    half = nonprefix_bound(reqs, 16, recompute_fraction=0.5)
    assert half["nonprefix_hit_tokens"] == b["prefix_hit_tokens"] + 8 * b["nonprefix_blocks"]


def _req(i, prompt, **kw):
    return TraceRequest(id=f"r{i}", prompt=prompt, output_len=1, **kw)


A, B, C, D = ([k * 10 + j for j in range(4)] for k in range(1, 5))


def test_hand_computed():
    # block size 4. r0 computes A B C. r1 = D A B C x: its prefix (D) is new, A B C recur
    # one block later: 3 non-prefix blocks (the 5th block is the capped last token's).
    # r2 = A B C D y: prefix A B C (3 blocks), D was computed by r1 at block 0: 1 block.
    reqs = [_req(0, A + B + C + [0]), _req(1, D + A + B + C + [0]), _req(2, A + B + C + D + [0])]
    b = nonprefix_bound(reqs, 4, recompute_fraction=0.25)
    assert b["prefix_hit_tokens"] == 12
    assert b["nonprefix_blocks"] == 4
    assert b["nonprefix_hit_tokens"] == 12 + 0.75 * 16


def test_equal_without_out_of_position_repeats():
    # Every repeat is a whole prefix: the bound adds nothing.
    reqs = [_req(0, A + B + [0]), _req(1, A + B + C + [0]), _req(2, A + [1, 2, 3, 4, 5])]
    b = nonprefix_bound(reqs, 4)
    assert b["nonprefix_blocks"] == 0
    assert b["nonprefix_hit_tokens"] == b["prefix_hit_tokens"] == 8 + 4


def test_extra_keys_isolate_chunks():
    # The same chunk under another tenant's salt or another adapter is not reusable.
    reqs = [_req(0, A + B + [0], cache_salt="t1"), _req(1, C + A + B + [0], cache_salt="t2"),
            _req(2, D + A + B + [0], lora=("x", "/x")), _req(3, C + A + B + [0], cache_salt="t1")]
    b = nonprefix_bound(reqs, 4, recompute_fraction=0.0)
    assert b["nonprefix_blocks"] == 2  # only r3 (tenant t1) reuses A B from r0


def test_mooncake_hash_ids_equal_tokens(local_datasets):
    path = local_datasets / "mooncake_conversation" / "conversation_trace.jsonl"
    lazy = list(itertools.islice(read_trace(str(path), format="mooncake", mooncake_tokens="lazy"), 200))
    eager = list(itertools.islice(read_trace(str(path), format="mooncake"), 200))
    a, b = nonprefix_bound(lazy, 512), nonprefix_bound(eager, 512)
    assert a == b
    assert a["prefix_hit_tokens"] == _ideal_replay_hits(lazy, 512)


@pytest.mark.parametrize("kw,exc", [(dict(block_size=0), ValueError),
                                    (dict(block_size=4, recompute_fraction=1.5), ValueError),
                                    (dict(block_size=4, recompute_fraction="0.1"), TypeError),
                                    (dict(block_size=4, alignment="byte"), ValueError)])
def test_bad_arguments(kw, exc):
    with pytest.raises(exc, match=next(iter(k for k in kw if k != "block_size"), "block_size")):
        nonprefix_bound([], **kw)


def test_token_alignment_finds_shifted_chunks():
    # r1 repeats r0's tokens shifted by 2: no block boundary lines up, only "token" finds it.
    base = list(range(100, 124))
    reqs = [_req(0, base + [0]), _req(1, [7, 8] + base + [0])]
    assert nonprefix_bound(reqs, 4)["nonprefix_blocks"] == 0
    t = nonprefix_bound(reqs, 4, alignment="token", recompute_fraction=0.0)
    assert t["nonprefix_blocks"] == 5  # blocks 1..5 of r1 (its block 0 holds 7, 8)
    assert t["prefix_hit_tokens"] == 0


@pytest.mark.parametrize("name,kwargs", WORKLOADS[:3])
def test_token_alignment_bounds_block_alignment(name, kwargs):
    reqs = workloads.generate(name, **kwargs)
    blk, tok = nonprefix_bound(reqs, 16), nonprefix_bound(reqs, 16, alignment="token")
    assert tok["prefix_hit_tokens"] == blk["prefix_hit_tokens"]
    assert tok["nonprefix_blocks"] >= blk["nonprefix_blocks"]


def test_compare_policies_ideal_row_carries_the_bound(tmp_path):
    from configs import compare_policies as cfg_mod
    from experiments import compare_policies

    c = cfg_mod.get_config("quick")
    c.workload.kwargs.num_requests = 30
    c.capacities, c.policies, c.indexes, c.belady_bound = "256", "lru", "hash", False
    c.workers, c.workdir, c.nonprefix_alignment = 1, str(tmp_path), "token"
    out = compare_policies.run(c)
    rows = [r for r in map(__import__("json").loads, open(out["rows"])) if "record" in r]
    ideal = next(r for r in rows if r["record"] == "ideal")
    reqs = workloads.generate("rag", **c.workload.kwargs.to_dict())
    want = nonprefix_bound(reqs, 16, alignment="token")
    assert ideal["nonprefix_hit_tokens"] == want["nonprefix_hit_tokens"]
    assert ideal["nonprefix_hit_rate_tokens"] >= ideal["hit_rate_tokens"] * 0.99
    c.nonprefix_recompute_fraction = 2.0
    with pytest.raises(ValueError, match="recompute_fraction"):
        compare_policies.run(c)
