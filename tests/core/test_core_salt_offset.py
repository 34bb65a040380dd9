"""cache_salt_offset: a salt that protects a request from a given prompt position on.

The default (offset 0) must keep vLLM's digests bit for bit; with an offset the salt
enters the key of the block holding that token (the spec's extra keys, as vLLM writes
them for block 0) and every later block chains from it, so a public prefix before it is
shared across salts and nothing from it on is.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.core import KVCacheManager
from prefixcache.core.hashing import HASH_ALGOS, BlockHasher, block_extra_keys
from prefixcache.core.request import LoRARequest, MultiModalFeature, Request


def spec_chain(hasher, tokens, bs, *, lora=None, mm=(), salt=None, salt_block=0):
    """The reference: hash_block over block_extra_keys, salt on block `salt_block`."""
    out, parent = [], None
    for b in range(len(tokens) // bs):
        keys = block_extra_keys(b * bs, (b + 1) * bs, lora=lora, mm_features=mm,
                                cache_salt=salt, is_first_block=b == salt_block)
        parent = hasher.hash_block(parent, tokens[b * bs:(b + 1) * bs], keys)
        out.append(parent)
    return out


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_offset_zero_is_vllm_first_block_salt(algo):
    hasher = BlockHasher(algo, seed=0)
    tokens = list(range(1, 70))
    a = Request("a", tokens, cache_salt="t1", hasher=hasher, block_size=8)
    b = Request("b", tokens, cache_salt="t1", cache_salt_offset=0, hasher=hasher,
                block_size=8)
    assert list(a.block_hashes) == list(b.block_hashes) == spec_chain(
        hasher, tokens, 8, salt="t1", salt_block=0)
    assert b.cache_salt_offset == 0


@settings(max_examples=40, deadline=None)
@given(
    algo=st.sampled_from(HASH_ALGOS),
    bs=st.sampled_from([1, 4, 16]),
    data=st.data(),
)
def test_incremental_hashes_equal_the_spec_with_the_salt_on_its_block(algo, bs, data):
    n = data.draw(st.integers(2, 90), label="prompt_len")
    tokens = data.draw(st.lists(st.integers(0, 70000), min_size=n, max_size=n), label="tokens")
    offset = data.draw(st.integers(0, n - 1), label="offset")
    lora = data.draw(st.sampled_from([None, LoRARequest("ad", "/p")]), label="lora")
    mm = ()
    if data.draw(st.booleans(), label="mm") and n >= 3:
        lo = data.draw(st.integers(0, n - 2), label="mm_lo")
        length = data.draw(st.integers(1, n - lo), label="mm_len")
        mm = (MultiModalFeature("img", lo, length),)  # may cross the salted block
    outputs = data.draw(st.lists(st.integers(0, 600), max_size=3 * bs + 2), label="outputs")
    hasher = BlockHasher(algo, seed=1)
    req = Request("r", tokens, mm_features=mm, lora=lora, cache_salt="tenant",
                  cache_salt_offset=offset, hasher=hasher, block_size=bs)
    seen = list(req.block_hashes)
    for t in outputs:  # decode: one token at a time, hashes read after each
        req.append_output_token_ids(t)
        seen = list(req.block_hashes)
    want = spec_chain(hasher, tokens + outputs, bs, lora=lora, mm=mm, salt="tenant",
                      salt_block=offset // bs)
    assert seen == want
    # Blocks before the salted one are the unsalted request's; from it on none is.
    plain = spec_chain(hasher, tokens + outputs, bs, lora=lora, mm=mm)
    k = offset // bs
    assert seen[:k] == plain[:k]
    assert not set(seen[k:]) & set(plain)


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("lora", [None, LoRARequest("ad", "/p")])
def test_salted_block_completed_by_decode(algo, lora):
    """The prompt ends inside the salted block: decode fills it (not a plain block)."""
    hasher = BlockHasher(algo, seed=2)
    tokens = list(range(300, 320))  # 20 tokens, block size 8: block 2 holds 16..23
    req = Request("r", tokens, lora=lora, cache_salt="t", cache_salt_offset=17,
                  hasher=hasher, block_size=8)
    assert len(req.block_hashes) == 2
    outs = list(range(7, 20))
    for t in outs:
        req.append_output_token_ids(t)
        req.block_hashes  # noqa: B018 (hash as a decode loop would)
    assert list(req.block_hashes) == spec_chain(hasher, tokens + outs, 8, lora=lora,
                                                salt="t", salt_block=2)


def test_public_prefix_shared_private_part_not():
    """Two tenants, one 32-token public prompt, then each tenant's text (same tokens)."""
    bs = 8
    mgr = KVCacheManager(64, bs, hash_algo="sha256_cbor")
    public = list(range(100, 132))
    private = list(range(500, 540))

    def run(rid, salt, offset):
        req = Request(rid, public + private, cache_salt=salt, cache_salt_offset=offset)
        blocks, hit = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
        req.num_computed_tokens = req.num_tokens
        mgr.free(req)
        mgr.check_invariants()
        return hit

    assert run("a1", "A", 32) == 0
    assert run("b1", "B", 32) == 32  # the public prompt only (4 blocks)
    assert run("a2", "A", 32) == 64  # tenant A's own 8 full blocks (72 tokens: 9th partial)
    # vLLM's first-block salt: nothing is shared across tenants, the public prompt neither.
    assert run("c1", "C", 0) == 0
    assert run("d1", "D", 0) == 0
    assert run("c2", "C", 0) == 64
    # An offset inside a block salts that whole block: the public part hits up to it.
    assert run("e1", "E", 36) == 32


@pytest.mark.parametrize("kwargs, match", [
    (dict(cache_salt_offset=4), "needs a non-empty cache_salt"),
    (dict(cache_salt="", cache_salt_offset=4), "needs a non-empty cache_salt"),
    (dict(cache_salt="s", cache_salt_offset=10), "not inside the 10-token prompt"),
    (dict(cache_salt="s", cache_salt_offset=-1), "cache_salt_offset must be >= 0"),
    (dict(cache_salt="s", cache_salt_offset=1.5), "cache_salt_offset must be an int"),
    (dict(cache_salt="s", cache_salt_offset=True), "cache_salt_offset must be an int"),
])
def test_offset_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Request("r", list(range(10)), **kwargs)
