"""The replay's reuse per tenant (cache salt) and per adapter (LoRA name)."""

import dataclasses

from prefixcache.sim import workloads as wl
from prefixcache.sim.replay import replay
from prefixcache.sim.trace import TraceRequest


def _per_request(reqs, **kw):
    recs = []
    s = replay(reqs, on_record=recs.append, **kw)
    return s, {r["id"]: r for r in recs}


def test_breakdown_sums_and_matches_per_request_records():
    reqs = wl.mm_salt(num_requests=60, prefix_len=10, image_len=32, num_images=3,
                      num_salts=3, num_loras=2, suffix_len=(8, 40), output_len=(1, 4), seed=1)
    # Every 4th request without a salt, every 5th without an adapter: the "" groups.
    reqs = [dataclasses.replace(r, cache_salt=None if i % 4 == 0 else r.cache_salt,
                                lora=None if i % 5 == 0 else r.lora)
            for i, r in enumerate(reqs)]
    assert len({r.cache_salt for r in reqs}) == 4 and len({r.lora for r in reqs}) == 3
    s, recs = _per_request(reqs, num_blocks=64, block_size=8, concurrency=2)
    for field, key in (("per_tenant", lambda r: r.cache_salt or ""),
                       ("per_adapter", lambda r: r.lora[0] if r.lora else "")):
        groups = s[field]
        assert sum(g["requests"] for g in groups.values()) == s["requests"]
        assert sum(g["prompt_tokens"] for g in groups.values()) == s["prompt_tokens"]
        assert sum(g["hit_tokens"] for g in groups.values()) == s["hit_tokens"]
        expect: dict = {}
        for r in reqs:
            e = expect.setdefault(key(r), [0, 0, 0])
            e[0] += 1
            e[1] += len(r.prompt)
            e[2] += recs[r.id]["num_computed_tokens"]
        assert {k: [g["requests"], g["prompt_tokens"], g["hit_tokens"]]
                for k, g in groups.items()} == expect, field
        for g in groups.values():
            assert g["hit_rate_tokens"] == (g["hit_tokens"] / g["prompt_tokens"])


def test_an_untagged_trace_has_one_group_equal_to_the_totals():
    reqs = [TraceRequest(id=f"r{i}", prompt=[1, 2, 3, 4, 5, 6, 7, 8, i], output_len=2)
            for i in range(5)]
    s = replay(reqs, num_blocks=16, block_size=4)
    total = {"requests": 5, "prompt_tokens": 45, "hit_tokens": s["hit_tokens"],
             "hit_rate_tokens": s["hit_rate_tokens"]}
    assert s["hit_tokens"] == 4 * 8
    assert s["per_tenant"] == {"": total} and s["per_adapter"] == {"": total}


def test_salted_tenants_do_not_share_and_are_reported_apart():
    shared = list(range(100, 116))
    reqs = [TraceRequest(id=f"{t}{i}", prompt=shared + [i], output_len=1, cache_salt=t)
            for t in ("a", "b") for i in range(3)]
    s = replay(reqs, num_blocks=32, block_size=4)
    # Each tenant computes the shared 16 tokens once and reuses them twice (no cross hits).
    assert s["per_tenant"]["a"]["hit_tokens"] == s["per_tenant"]["b"]["hit_tokens"] == 32
    assert "" not in s["per_tenant"] and s["per_adapter"] == {"": {
        "requests": 6, "prompt_tokens": 102, "hit_tokens": 64, "hit_rate_tokens": 64 / 102}}
