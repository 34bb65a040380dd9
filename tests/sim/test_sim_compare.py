"""prefixcache.sim.compare: grid names, the replay adapter, the ideal capacity, rows."""


import pytest

from prefixcache.sim import compare
from prefixcache.sim import workloads as wl
from prefixcache.sim.replay import replay

B = 16


def test_parse_names_validates_and_keeps_order():
    known = ("lru", "fifo", "lfu")
    assert compare.parse_names(" lfu,lru ,lfu", known=known, what="policy") == ("lfu", "lru")
    assert compare.parse_names("all", known=known, what="policy") == known
    assert compare.parse_names(["fifo"], known=known, what="policy") == ("fifo",)
    with pytest.raises(ValueError, match=r"unknown policy 'lruu'.*\('lru', 'fifo', 'lfu'\)"):
        compare.parse_names("lru,lruu", known=known, what="policy")
    with pytest.raises(ValueError, match="no policy given"):
        compare.parse_names(" , ", known=known, what="policy")


def test_parse_capacities():
    assert compare.parse_capacities("3000, 1000,3000") == (1000, 3000)
    assert compare.parse_capacities([8, 4]) == (4, 8)
    for bad in ("", "10,x", "0", "-5", "1e3", "2.5"):
        with pytest.raises(ValueError, match="capacities"):
            compare.parse_capacities(bad)


def test_names_come_from_the_registries():
    from prefixcache.core import eviction

    from prefixcache.core.indexes import INDEXES

    assert compare.policy_names() == eviction.policy_names() and "lru" in compare.policy_names()
    assert compare.index_names() == tuple(INDEXES) and "radix" in compare.index_names()


def test_replay_cell_passes_policy_index_and_model_to_the_replay():
    reqs = wl.shared_system_prompt(num_requests=4, system_len=40, unique_len=(4, 8),
                                   output_len=(2, 3))
    reads = []

    def make_requests():
        reads.append(1)
        return iter(reqs)

    for policy in ("lfu", "belady"):
        reads.clear()
        s = compare.replay_cell(make_requests, policy=policy, index="radix",
                                num_blocks=64, block_size=B, model="tiny")
        assert (s["requests"], s["eviction"], s["index"], s["model"]) == (
            4, policy, "radix", "tiny")
        assert s["peak_cached_bytes"] > 0
        # belady reads the trace twice (it gets the callable), the others once.
        assert len(reads) == (2 if policy == "belady" else 1)


def test_replay_cell_hits_and_refusals():
    reqs = wl.shared_system_prompt(num_requests=3, system_len=40, unique_len=(4, 8),
                                   output_len=(2, 3))
    s = compare.replay_cell(lambda: iter(reqs), policy="lru", index="hash", num_blocks=64,
                            block_size=B, model="tiny")
    assert s["hit_tokens"] == 2 * 32
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        compare.check_replay_supports("mru", "hash")
    with pytest.raises(ValueError, match="unknown index 'btree'"):
        compare.check_replay_supports("lru", "btree")
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'"):
        compare.check_replay_supports("lru", "hash", model="gpt5")


def _oracle_hits(reqs, block_size):
    """Infinite cache from prompt blocks alone: the longest run of prefixes seen before,
    capped at num_tokens - 1 tokens (the last token is always computed)."""
    seen, hits = set(), []
    for r in reqs:
        n = 0
        while (n + 1) * block_size <= len(r.prompt) - 1 and tuple(
                r.prompt[:(n + 1) * block_size]) in seen:
            n += 1
        hits.append(n * block_size)
        for k in range(len(r.prompt) // block_size):
            seen.add(tuple(r.prompt[:(k + 1) * block_size]))
    return hits


@pytest.mark.parametrize("concurrency", [1, 4])
def test_ideal_capacity_never_evicts_and_matches_the_oracle(concurrency):
    reqs = wl.rag(num_requests=40, num_documents=8, doc_len=(20, 60), system_len=40,
                  output_len=(2, 40), seed=3)
    n = compare.ideal_num_blocks(reqs, B)
    assert n == sum(-(-(len(r.prompt) + r.output_len) // B) for r in reqs)
    recs = []
    s = replay(reqs, num_blocks=n, block_size=B, concurrency=concurrency,
               free_order="unhashed_first", on_record=recs.append)
    assert s["evictions"] == 0 and s["failed"] == 0
    assert [r["num_computed_tokens"] for r in recs] == _oracle_hits(reqs, B)
    # A smaller cache evicts and hits less.
    small = replay(reqs, num_blocks=n // 8, block_size=B, concurrency=concurrency)
    assert small["evictions"] > 0 and small["hit_tokens"] < s["hit_tokens"]


def test_cell_row_fields_and_bytes():
    reqs = wl.shared_system_prompt(num_requests=3, system_len=40, unique_len=(4, 8),
                                   output_len=(2, 3))
    s = replay(reqs, num_blocks=64, block_size=B, model="tiny")
    row = compare.cell_row(s, policy="lru", index="hash", num_blocks=64, block_size=B,
                           concurrency=1, model="tiny")
    kv = 2 * 2 * 2 * 64 * 4  # tiny: 2 layers x (K, V) x 2 kv heads x 64 dims x f32
    assert row["peak_cached_bytes"] == s["peak_cached_blocks"] * B * kv
    assert row["mean_cached_bytes"] == s["mean_cached_blocks"] * B * kv
    assert (row["policy"], row["index"], row["num_blocks"], row["capacity_tokens"]) == (
        "lru", "hash", 64, 64 * B)
    assert row["hit_tokens"] == s["hit_tokens"] and row["loop_s"] == s["timing"]["loop_s"]
    # Without a model the replay reports no bytes: None (never a made-up number).
    bare = compare.cell_row(replay(reqs, num_blocks=64, block_size=B), policy="lru",
                            index="hash", num_blocks=64, block_size=B, concurrency=1)
    assert bare["peak_cached_bytes"] is None and bare["stranded_blocks"] == 0
    with pytest.raises(KeyError, match="stranded_blocks"):  # a summary missing a field
        compare.cell_row({k: v for k, v in s.items() if k != "stranded_blocks"},
                         policy="lru", index="hash", num_blocks=64, block_size=B,
                         concurrency=1)
