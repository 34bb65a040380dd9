"""Blocks keyed by caller-given keys: BlockHasher.hash_keyed_blocks, Request.adopt_block_hashes."""

from __future__ import annotations

import hashlib

import pytest

from prefixcache.core.hashing import HASH_ALGOS, BlockHasher
from prefixcache.core.kv_cache_manager import KVCacheManager
from prefixcache.core.request import Request


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_hash_keyed_blocks_chains_its_own_messages(algo):
    h = BlockHasher(algo, seed=0)
    keys = [b"a" * 10, b"b" * 10, b"a" * 10]
    got = h.hash_keyed_blocks(keys)
    assert len(got) == 3 and len(set(got)) == 3  # same key, other parent: other digest
    assert all(len(d) == h.digest_size for d in got)
    assert h.hash_keyed_blocks(keys[1:], parent=got[0]) == got[1:]
    if algo == "sha256":
        assert got[0] == hashlib.sha256(b"\0key" + h.root + keys[0]).digest()
    # Never a token block's digest (those messages start with 0x80 / 0x83).
    assert got[0] != h.hash_block(None, list(b"a" * 10))
    with pytest.raises(ValueError):
        h.hash_keyed_blocks(keys, parent=b"short")


def test_adopted_hashes_key_the_prompt_and_decode_chains_from_them():
    h = BlockHasher("sha256", seed=0)
    keys = h.hash_keyed_blocks([b"k0", b"k1"])
    req = Request("r", [0] * 8 + [5, 6, 7], hasher=h, block_size=4)
    req.adopt_block_hashes(keys)
    assert list(req.block_hashes) == keys  # the prompt's two full blocks
    req.append_output_token_ids(8)  # block 2 becomes full: hashed from its tokens
    assert list(req.block_hashes) == keys + [h.hash_block(keys[1], [5, 6, 7, 8])]
    # The manager matches prefixes by them.
    m = KVCacheManager(16, 4, hash_algo="sha256", hash_seed=0)
    a = Request("a", [0] * 9, hasher=m.hasher, block_size=4)
    a.adopt_block_hashes(m.hasher.hash_keyed_blocks([b"k0", b"k1"]))
    blocks, n = m.get_computed_blocks(a)
    assert n == 0
    assert m.allocate_slots(a, 9) is not None
    b = Request("b", [1] * 9, hasher=m.hasher, block_size=4)  # other tokens, same keys
    b.adopt_block_hashes(m.hasher.hash_keyed_blocks([b"k0", b"k1"]))
    _, n = m.get_computed_blocks(b)
    assert n == 8


def test_adopt_block_hashes_validation():
    h = BlockHasher("sha256", seed=0)
    with pytest.raises(ValueError, match="bound hasher"):
        Request("r", [1] * 8).adopt_block_hashes([])
    req = Request("r", [1] * 8, hasher=h, block_size=4)
    with pytest.raises(ValueError, match="full blocks"):
        req.adopt_block_hashes(h.hash_keyed_blocks([b"1", b"2", b"3"]))
    with pytest.raises(ValueError, match="32-byte"):
        req.adopt_block_hashes([b"x"])
    req.block_hashes
    with pytest.raises(ValueError, match="no block hashed yet"):
        req.adopt_block_hashes(h.hash_keyed_blocks([b"1"]))
