"""prefixcache.sim.compare: grid names, the replay adapter, the ideal capacity, rows."""

import inspect

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

    assert compare.policy_names() == eviction.policy_names() and "lru" in compare.policy_names()
    try:
        from prefixcache.core.indexes import INDEXES
    except ModuleNotFoundError:
        assert compare.index_names() == ("hash", "radix")
    else:
        assert compare.index_names() == tuple(INDEXES)


def _new_replay(calls):
    """A replay with the merged signature that records its arguments (and runs lru)."""

    def fn(requests, *, num_blocks, block_size, hash_algo="sha256", hash_seed=None,
           free_order="append", concurrency=1, max_model_len=None, on_record=None,
           record_evictions=False, progress=False, eviction="lru", eviction_options=None,
           index="hash", model=None):
        calls.append(dict(requests=requests, eviction=eviction, index=index, model=model,
                          num_blocks=num_blocks))
        reqs = list(requests() if callable(requests) else requests)
        return {**replay(reqs, num_blocks=num_blocks, block_size=block_size),
                "peak_cached_blocks": 7, "stranded_blocks": 0}

    return fn


def test_replay_cell_passes_policy_index_and_model_to_a_replay_that_takes_them():
    reqs = wl.shared_system_prompt(num_requests=4, system_len=40, unique_len=(4, 8),
                                   output_len=(2, 3))
    calls = []
    fn = _new_replay(calls)
    for policy in ("lfu", "belady"):
        s = compare.replay_cell(lambda: iter(reqs), policy=policy, index="radix",
                                num_blocks=64, block_size=B, model="tiny", replay_fn=fn)
        assert s["requests"] == 4
    assert [(c["eviction"], c["index"], c["model"], c["num_blocks"]) for c in calls] == [
        ("lfu", "radix", "tiny", 64), ("belady", "radix", "tiny", 64)]
    # belady reads the trace twice: it gets the callable, the others one iterator.
    assert not callable(calls[0]["requests"]) and callable(calls[1]["requests"])


def test_this_replay_runs_lru_on_the_hash_chain_only():
    params = inspect.signature(replay).parameters
    reqs = wl.shared_system_prompt(num_requests=3, system_len=40, unique_len=(4, 8),
                                   output_len=(2, 3))
    s = compare.replay_cell(lambda: iter(reqs), policy="lru", index="hash", num_blocks=64,
                            block_size=B, model="tiny")
    assert s["hit_tokens"] == 2 * 32
    assert {"eviction", "index", "model"} <= set(params)  # every replay takes them
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
    s = replay(reqs, num_blocks=64, block_size=B)
    row = compare.cell_row({**s, "peak_cached_blocks": 10, "mean_cached_blocks": 4.5},
                           policy="lru", index="hash", num_blocks=64, block_size=B,
                           concurrency=1, model="tiny")
    kv = 2 * 2 * 2 * 64 * 4  # tiny: 2 layers x (K, V) x 2 kv heads x 64 dims x f32
    assert row["peak_cached_bytes"] == 10 * B * kv and row["mean_cached_bytes"] == 4.5 * B * kv
    assert (row["policy"], row["index"], row["num_blocks"], row["capacity_tokens"]) == (
        "lru", "hash", 64, 64 * B)
    assert row["hit_tokens"] == s["hit_tokens"] and row["loop_s"] == s["timing"]["loop_s"]
    bare = compare.cell_row(s, policy="lru", index="hash", num_blocks=64, block_size=B,
                            concurrency=1)
    # What the replay does not report stays None (never a made-up number).
    for field in ("stranded_blocks", "peak_cached_blocks", "peak_cached_bytes"):
        assert bare[field] == s.get(field)
    given = compare.cell_row({**s, "peak_cached_bytes": 123}, policy="lru", index="hash",
                             num_blocks=64, block_size=B, concurrency=1, model="tiny")
    assert given["peak_cached_bytes"] == 123
