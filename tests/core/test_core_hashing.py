"""BlockHasher: vLLM 0.33 digest parity (pinned vectors), seed rules, encoders byte for byte.

The pinned digests were computed once with the real vLLM 0.33 (its own ``Request`` and
``get_request_block_hasher``, PYTHONHASHSEED=1234) by ``experiments/hash_parity_vllm.py``;
the cases below are copied from that script.
"""

import os
import pickle
import struct
import sys

import cbor2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.core import hash_writers, hashing
from prefixcache.core.hashing import (
    CACHE_SALT_LABEL,
    HASH_ALGOS,
    LORA_LABEL,
    MM_LABEL,
    BlockHasher,
    block_extra_keys,
    canonical_extra_keys,
)
from experiments.hash_parity_vllm import BOUNDARY_TOKENS, CASES
from prefixcache.core.request import LoRARequest, MultiModalFeature, Request


def _tune(mp, name, value):
    """Set a writer's tuning knob where it is read: the dispatcher
    (`BlockHasher.hash_token_blocks`, in hashing) and the writers (hash_writers) hold
    their own names of the same constant."""
    for module in (hashing, hash_writers):
        if hasattr(module, name):
            mp.setattr(module, name, value)


SEED = 1234
# Digests computed by vLLM 0.33's own code on BOUNDARY_TOKENS / CASES (defined once, in
# experiments/hash_parity_vllm.py, which recomputes these under the peer venv).
VLLM_VECTORS = {
    "sha256": {
        "root": "8a7c43e934778270f0241e4efb933334518a7ad06e0070742b3f802652a2e249",
        "boundaries_bs4": [
            "6a761ddbc2fe78e3d14a7fe904a4651ffa559d23dd4a7eef99b925ac8d0f68cb",
            "e4451cb884a4fe9cdc840a690348a49f94922e6b16ea7d4e874174e34df70ef1",
            "658f21ce16f1be6783ca03370ac3316aab3ef4a94c39d118dbf3f20619a37f27",
            "8efcae264fb4865cecae33f3d663ab9a7f33b5293457b0c1034c0c6ee6950946",
        ],
        "extras_bs4": [
            "d103709eb8fbef31b9c188de5e0c82ac52fd15b233340ca090a450a8bb499292",
            "6bc7f0dc4ab46aeae560028cfe250e50d91135f5365433f60f2d106e57ce84a2",
            "8ab376fcf7345fc2a6409e317e6760ce1538703c93197781f6725dfa7fb5f7fd",
            "ac84f15c6a40fd8506a9b9d91bec27be641eb430e7ae3faf859b1d6f79ff5fba",
            "26722f8d6dd0e29b6a3c9d4a773c984b15a628ffedff95af4ba78ed38c88290a",
            "dddc42d11f8b1b75ef85d0c9b40fc7986815509172b3aee439de905579f4fe43",
            "5a9741dfa79c936ca4ed694e07cd54a477287d2a5517a275d92bc1ebd8243cfd",
        ],
        "salt_only_bs16": [
            "f60c7057da6b250628af83dc9446296cac18e4047f250684cb85240058f11a43",
            "9d80dea32e19da498a082e88e6b8f4e6c1e7277d2d173b3a874f2e830029673f",
            "a3fcb121fc390125c183c627d904e282feebdae51bd45d7ed815ccccb72a6178",
        ],
    },
    "sha256_cbor": {
        "root": "dfa66c9da4dad0601316e0b63a2909b4068e72830385ddbd16e0c980c76c9e12",
        "boundaries_bs4": [
            "06eb62563b893d596a659b5db73b388791b6be3d2b200de985a2019176f5e90a",
            "99fbc33848d654ca868b4e41e6f18fbb4386942ffe77011c51350252bfc7cb31",
            "83083c8a3344a6ed41c642310dd9842b0f274bb8421096f3f15d9389b2809d4b",
            "385d0a4f1ba389f1b2f901e7c8cb5ae47efaec9bf4cd36ea995db236233e6ec0",
        ],
        "extras_bs4": [
            "c9e8b6e6e0e195694aecdce99bd98259048e361e5a1e1fc2984d4b0037a0c132",
            "4f39ea5f25d19c59152f3324516850fdd70677c9212db7ea2abcedae38e4d4a3",
            "c976ba9cc063aa945471f9c15a421c15a65287831275b6429b8cb07e5317ae1a",
            "1581639bf882d7ddae1dbd0389828853d5d0e87547f78864f1b37355051c9d25",
            "9015a271f1faf07d9853aa3e6d2d613af9fa360631d178329f158ce2453619e4",
            "9040be52b8e15610ed8197b367794349b7defa029528c93a1e8ce63a4cfe1e75",
            "3d3c065ad1532fbf12c71768caef7ad72938195755c4f0c1f1a49992eb25e93d",
        ],
        "salt_only_bs16": [
            "f3ee5c8248d97ac855af18a16c648c981e4dac4aa1de29df23fee5a3c0b79c5d",
            "66d2966dae98cac6a036e4bb9a523f5c46bb3f0293a9a14917b6c7d333e4add7",
            "f8a0e9bbeea98d1a5801a1119b8a92c2f76498265ae3d22284f4d2b65d15606f",
        ],
    },
    "xxhash": {
        "root": "28974bb42b4a0d52e9eea234e8dbe4dc",
        "boundaries_bs4": [
            "65879b9ea8e96d254e42bdf687594f40",
            "9681da79fc9c02e25d5334af89f270e6",
            "0a060247bb4f2eda07d99bad06fb4730",
            "17d991e0b6c018e8e95c08fcc3428c61",
        ],
        "extras_bs4": [
            "03f61f1f7c8e27ee6c4dc8133b57ccb8",
            "ded7bf8e617c7e359e21d4d3a94bc0db",
            "e3295b59a66d1cce4975cb1a17a6411f",
            "218a1aa1868a735f39f4b7a610ac9c1a",
            "00bb73b1033414427f9a3d72e4d07b9e",
            "bcbd0c4251f3144a85d38e5117a188d9",
            "a0bc4c02c09f942e2aa992c1d583c39e",
        ],
        "salt_only_bs16": [
            "bf21c9f77817feed872daf9479c69b92",
            "170d34e566b51e067d91ab42b2db99a7",
            "d14b41bbc4e08df43aace34ee94a91d9",
        ],
    },
    "xxhash_cbor": {
        "root": "0fd12ee6a63390842c413be31a6766db",
        "boundaries_bs4": [
            "72cc66dc9383ca5c33063784a6916a7f",
            "2bb537421264997ca1006cb182d5437d",
            "a547a0697ad29caf2dbfa7e4743c056d",
            "832607921a19852e1ad8d4f2a9ded653",
        ],
        "extras_bs4": [
            "8116fda4d33ef4e89b72fdf0d7733db7",
            "fd7a0d38c2f4601f4cd6d4034c5b9aee",
            "db89b2349308e7b53bbe292262bc43b8",
            "ab830db3230cec31e95753c0c4839985",
            "15562d87ea4a9265a60925901f5d30d9",
            "af0e75817f204ab044637edda6c03c7b",
            "7b39d81cfdc072f88b08b4f97dc96903",
        ],
        "salt_only_bs16": [
            "32e6ddf3eca8bd2b1b60fe3eeba3136e",
            "870dc1139e1e7fe73ca11b9b7ccf23d1",
            "de8191caaab0815ea723e4636c2de868",
        ],
    },
}
DEFAULT_ROOTS = {
    "sha256": "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
    "sha256_cbor": "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
}


@pytest.fixture(params=["vectorised", "per_block"])
def path(request, monkeypatch):
    """Run a test through each writer: the numpy one (from the first block on) and the
    per-block one (however many blocks)."""
    threshold = 1 if request.param == "vectorised" else 10**9
    _tune(monkeypatch, "_MIN_VECTOR_BLOCKS_CBOR", threshold)
    _tune(monkeypatch, "_MIN_VECTOR_BLOCKS_PICKLE", threshold)
    # CBOR blocks of ids < 65536 take the per-block writer up to this many blocks.
    _tune(monkeypatch, "_MAX_STREAM_BLOCKS_CBOR", 0 if threshold == 1 else 10**9)
    # pickle: the stream writer from these block sizes / new blocks on (never: vectorised).
    _tune(monkeypatch, "_MIN_STREAM_BS_PICKLE", 10**9 if threshold == 1 else 64)
    _tune(monkeypatch, "_MIN_STREAM_BLOCKS_PICKLE", 10**9 if threshold == 1 else 64)
    return request.param


def _case_kwargs(case):
    return dict(
        lora=case.get("lora"),
        mm_features=case.get("mm", ()),
        cache_salt=case.get("cache_salt"),
    )


def _chain_reference(hasher, tokens, block_size, **kw):
    """The spec, block by block: hash_block over block_extra_keys."""
    parent, out = None, []
    for b in range(len(tokens) // block_size):
        start, end = b * block_size, (b + 1) * block_size
        extra = block_extra_keys(start, end, **kw)
        parent = hasher.hash_block(parent, tokens[start:end], extra)
        out.append(parent)
    return out


# -- parity with vLLM -----------------------------------------------------------------


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_pinned_vllm_vectors(algo, path):
    want = VLLM_VECTORS[algo]
    hasher = BlockHasher(algo, seed=SEED)
    assert hasher.root.hex() == want["root"]
    for name, case in CASES.items():
        tokens = case["tokens"] + case.get("output", [])
        kw = _case_kwargs(case)
        got = hasher.hash_token_blocks(tokens, case["block_size"], **kw)
        assert [h.hex() for h in got] == want[name], name
        # The spec path (generic serializers, block by block) gives the same bytes.
        assert _chain_reference(hasher, tokens, case["block_size"], **kw) == got, name


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_pinned_vectors_through_request_incremental(algo, path):
    """Request hashing incrementally (one output token at a time) equals vLLM's."""
    hasher = BlockHasher(algo, seed=str(SEED))
    for name, case in CASES.items():
        req = Request(
            name,
            case["tokens"],
            lora=LoRARequest(*case["lora"]) if case.get("lora") else None,
            mm_features=[MultiModalFeature(*m) for m in case.get("mm", [])],
            cache_salt=case.get("cache_salt"),
            hasher=hasher,
            block_size=case["block_size"],
        )
        _ = req.block_hashes
        for t in case.get("output", []):
            req.append_output_token_ids(t)
            _ = req.block_hashes
        assert [h.hex() for h in req.block_hashes] == VLLM_VECTORS[algo][name], name


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_seed_from_pythonhashseed(algo, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", str(SEED))
    hasher = BlockHasher(algo)
    assert hasher.seed == "1234"
    assert hasher.root.hex() == VLLM_VECTORS[algo]["root"]
    # An explicit seed wins over the environment, and is used as str(seed).
    assert BlockHasher(algo, seed=99).root == BlockHasher(algo, seed="99").root
    assert BlockHasher(algo, seed=99).root != hasher.root


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_default_root_sha256_is_fixed(algo, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    a, b = BlockHasher(algo), BlockHasher(algo)
    assert a.seed == hashing.DEFAULT_NONE_HASH_SEED == "vllm-none-hash"
    assert a.root.hex() == DEFAULT_ROOTS[algo]
    assert a == b and hash(a) == hash(b)


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_default_root_xxhash_is_random(algo, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    a, b = BlockHasher(algo), BlockHasher(algo)
    assert a.root != b.root and a != b
    assert len(a.root) == 16 and len(a.seed) == 64  # 32 random bytes, hex
    assert a.hash_block(None, [1, 2, 3]) != b.hash_block(None, [1, 2, 3])


def test_root_is_hash_of_serialized_seed():
    h = BlockHasher("sha256", seed="abc")
    import hashlib

    assert h.root == hashlib.sha256(pickle.dumps("abc", pickle.HIGHEST_PROTOCOL)).digest()
    h = BlockHasher("sha256_cbor", seed="abc")
    assert h.root == hashlib.sha256(cbor2.dumps("abc", canonical=True)).digest()


def test_config_errors(monkeypatch):
    with pytest.raises(ValueError, match="sha256, sha256_cbor, xxhash, xxhash_cbor"):
        BlockHasher("md5")
    _tune(monkeypatch, "_xxhash", None)
    with pytest.raises(ImportError, match="xxhash"):
        BlockHasher("xxhash_cbor")
    BlockHasher("sha256")  # unaffected


# -- semantics that decide the bytes --------------------------------------------------


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_canonicalisation_values_only(algo):
    h = BlockHasher(algo, seed=0)
    parent = h.hash_block(None, [1, 2])
    # Labels that are not the interned constants, lists, numpy ints: same digest.
    mm = "".join(["m", "m"])
    assert mm is not MM_LABEL
    ident = "img-" + "x" * 5
    canonical = h.hash_block(
        parent, (1, 2, 3, 4), ((MM_LABEL, ident, 0), (MM_LABEL, ident, 2))
    )
    assert h.hash_block(
        bytearray(parent),
        [np.int64(1), np.int32(2), 3, np.uint16(4)],
        [[mm, ident, np.int64(0)], [mm, ident, 2]],
    ) == canonical
    # None / b"" parent = root; empty extra keys = None.
    assert h.hash_block(None, [5]) == h.hash_block(b"", [5]) == h.hash_block(h.root, [5])
    assert h.hash_block(None, [5], ()) == h.hash_block(None, [5], None)


def test_pickle_memo_backreference_of_labels():
    """Two "mm" keys in one block: the second label is a memo back-reference."""
    key = canonical_extra_keys([("".join(["m", "m"]), "img-1", 0), ("m" + "m", "img-2", 3)])
    assert key[0][0] is key[1][0] is MM_LABEL
    data = pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)
    assert data.count(b"\x8c\x02mm") == 1  # SHORT_BINUNICODE "mm" written once
    # Non-label strings never alias: the same identifier object twice is written twice.
    ident = "img-same"
    key = canonical_extra_keys([(MM_LABEL, ident, 0), (MM_LABEL, ident, 3)])
    assert key[0][1] is not key[1][1]
    assert pickle.dumps(key, protocol=5).count(b"img-same") == 2


def test_block_extra_keys_rules():
    lora = LoRARequest("lora-a", "/p/a")
    mm = [MultiModalFeature("A", 2, 5), MultiModalFeature("B", 7, 6)]
    # Block [4, 8): A started 2 tokens before the block, B starts at 3 in it.
    assert block_extra_keys(4, 8, lora=lora, mm_features=mm, cache_salt="s") == (
        (LORA_LABEL, "lora-a", "/p/a"),
        (MM_LABEL, "A", -2),
        (MM_LABEL, "B", 3),
    )
    # Salt on the first block only, after the mm keys; empty salt adds nothing.
    assert block_extra_keys(0, 4, mm_features=mm, cache_salt="s") == (
        (MM_LABEL, "A", 2),
        (CACHE_SALT_LABEL, "s"),
    )
    assert block_extra_keys(0, 2, mm_features=mm, cache_salt="") is None
    assert block_extra_keys(13, 17, mm_features=mm) is None  # B ends at 13 (exclusive)
    assert block_extra_keys(12, 16, mm_features=mm) == ((MM_LABEL, "B", -5),)
    assert block_extra_keys(4, 8, cache_salt="s", is_first_block=True) == (
        (CACHE_SALT_LABEL, "s"),
    )


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_salt_only_in_first_block_and_reaches_later_blocks_via_parent(algo):
    h = BlockHasher(algo, seed=0)
    toks = list(range(12))
    plain = h.hash_token_blocks(toks, 4)
    salted = h.hash_token_blocks(toks, 4, cache_salt="t")
    assert all(a != b for a, b in zip(plain, salted))
    # Blocks 1, 2 carry no salt key themselves: recomputed from the salted parent.
    assert h.hash_block(salted[0], toks[4:8]) == salted[1]
    assert h.hash_token_blocks(toks, 4, cache_salt="") == plain


# -- encoders, byte for byte ----------------------------------------------------------

WIDTH_EDGES = [0, 1, 23, 24, 25, 255, 256, 65535, 65536, 2**31 - 1, 2**31,
               2**32 - 1, 2**32, 2**39 - 1, 2**39, 2**47, 2**55, 2**63 - 1, 2**63, 2**64 - 1]
SMALL_EDGES = [v for v in WIDTH_EDGES if v < 2**32]
# Mostly ids the vectorised writer handles (< 2**32), edges weighted up.
edge_or_random = st.one_of(
    st.sampled_from(SMALL_EDGES), st.integers(0, 2**17), st.integers(0, 2**32 - 1)
)


def _messages(hasher, tokens, block_size, **kw):
    """(digests, messages the hasher digested) of one hash_token_blocks call."""
    inner = hasher._digest
    cap = _Capture(hasher)
    try:
        got = hasher.hash_token_blocks(tokens, block_size, **kw)
    finally:
        hasher._digest = inner
    return got, cap.messages


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 5, 16])
def test_width_edges_byte_for_byte(algo, block_size, path):
    """Token ids at every encoding width boundary, through the vectorised writer."""
    tokens = (SMALL_EDGES * (1 + 6 * block_size // len(SMALL_EDGES)))[: 7 * block_size - 1]
    hasher = BlockHasher(algo, seed=11)
    for kw in (
        {},
        dict(lora=("l", "/l"), cache_salt="s", mm_features=[("i", 1, 2 * block_size)]),
    ):
        got, messages = _messages(hasher, tokens, block_size, **kw)
        assert len(got) == len(messages) == 6
        parent = hasher.root
        for b, msg in enumerate(messages):
            key = (
                parent,
                tuple(tokens[b * block_size : (b + 1) * block_size]),
                block_extra_keys(b * block_size, (b + 1) * block_size, **kw),
            )
            assert msg == hasher.serialize(key), (b, msg)
            parent = got[b]


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("with_high", [True, False])
def test_u16_blocks_byte_for_byte(algo, with_high, path):
    """Blocks whose ids all lie in [256, 65536) (CBOR's per-block writer cuts them from
    one byte stream), next to blocks that leave that range by one id at either end;
    with and without ids >= 65536 elsewhere in the call (the writer's big-int check)."""
    bs = 4
    blocks = [
        [256, 300, 65535, 1000],  # all u16: from the stream
        [256, 257, 258, 255],  # one id below: cbor2
        [65535, 65536, 300, 400],  # one id above: cbor2
        [40000, 256, 65535, 31999],  # from the stream again
        [0, 23, 24, 65535],  # ids < 256 spliced into the stream's items
        [300, 400, 7, 255],
        [0, 0, 0, 0],  # a run of ids < 24 (placeholders): the low bytes
        [300, 0, 23, 1],  # a run of ids < 24 after an u16 id
        [5, 6, 300, 7],  # runs of ids < 24 around an u16 id
        [24, 0, 255, 300],  # a run of ids < 256 with some >= 24
        [1, 2, 3, 255],
        [70000, 2**32 - 1, 2**32, 2**40],
        [2**64 - 1, 256, 256, 256],
        [1 << 16, 1 << 24, 1 << 48, 511],
    ]
    if not with_high:
        blocks = [b for b in blocks if max(b) < 65536]
    tokens = [t for b in blocks for t in b]
    hasher = BlockHasher(algo, seed=12)
    for kw in ({}, dict(lora=("l", "/l"), cache_salt="s", mm_features=[("i", 2, 5)])):
        got, messages = _messages(hasher, tokens, bs, **kw)
        assert len(messages) == len(blocks)
        parent = hasher.root
        for b, msg in enumerate(messages):
            key = (parent, tuple(blocks[b]), block_extra_keys(b * bs, (b + 1) * bs, **kw))
            assert msg == hasher.serialize(key), (b, msg)
            parent = got[b]
        assert got == _chain_reference(hasher, tokens, bs, **kw)
        hasher.clear_caches()


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxhash_cbor"])
@pytest.mark.parametrize("high_at", [None, 5, 38])
def test_cbor_per_block_writer_over_4096_ids(algo, high_at):
    """More ids than the writer's precomputed high-byte mask covers (block size 128,
    40 blocks = 5120 ids, below the vectorised crossover): the mask is built for the
    call; one block with an id >= 65536 (or none) and one with an id < 256."""
    bs, nb = 128, 40
    rng = np.random.default_rng(3)
    tokens = rng.integers(256, 65536, size=bs * nb).tolist()
    tokens[2 * bs + 7] = 17
    if high_at is not None:
        tokens[high_at * bs + 100] = 70000  # byte 1 nonzero: only the high-byte mask sees it
    hasher = BlockHasher(algo, seed=5)
    assert hasher.hash_token_blocks(tokens, bs) == _chain_reference(hasher, tokens, bs)


def test_lookup_tables_equal_arithmetic_and_serializers():
    """The import-time token tables: same rows as the arithmetic writer, and the bytes
    cbor2 / pickle write, at every width boundary below the table size."""
    ids = np.arange(1 << hash_writers._TABLE_BITS, dtype=np.uint32)
    for table_rows, table_lens, arith in (
        (hash_writers._CBOR_ROW, hash_writers._CBOR_ROW_LEN, hash_writers._cbor_token_rows),
        (hash_writers._PICKLE_ROW, hash_writers._PICKLE_ROW_LEN, hash_writers._pickle_token_rows),
    ):
        rows, lens = arith(ids)
        np.testing.assert_array_equal(table_rows, rows)
        np.testing.assert_array_equal(table_lens, lens)
        assert not table_rows.flags.writeable
    assert [cbor2.dumps(v, canonical=True) for v in range(256)] == list(hash_writers._CBOR_SMALL_ITEM)
    for v in [0, 1, 23, 24, 255, 256, 65535, 65536, (1 << hash_writers._TABLE_BITS) - 1]:
        row = hash_writers._CBOR_ROW[v].tobytes()
        assert row[: hash_writers._CBOR_ROW_LEN[v]] == cbor2.dumps(v, canonical=True)
        assert row[hash_writers._CBOR_ROW_LEN[v]:] == bytes(8 - hash_writers._CBOR_ROW_LEN[v])
        row = hash_writers._PICKLE_ROW[v].tobytes()
        assert row[: hash_writers._PICKLE_ROW_LEN[v]] == _pickled_int(v)


def _pickled_int(v):
    data = pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
    return data[11:-1] if data[2:3] == b"\x95" else data[2:-1]  # strip PROTO/FRAME/STOP


class _Capture:
    """Records every message a hasher digests (to compare serialized bytes directly)."""

    def __init__(self, hasher):
        self.messages = []
        inner = hasher._digest

        def digest(data):
            self.messages.append(bytes(data))
            return inner(data)

        hasher._digest = digest


mm_strategy = st.lists(
    st.tuples(st.sampled_from(["img-a", "img-b", "x"]), st.integers(0, 60), st.integers(1, 12)),
    max_size=3,
)


@settings(max_examples=80, deadline=None)
@given(
    algo=st.sampled_from(HASH_ALGOS),
    block_size=st.integers(1, 20),
    tokens=st.lists(edge_or_random, min_size=0, max_size=70),
    huge=st.none() | st.tuples(st.integers(0, 69), st.sampled_from(WIDTH_EDGES)),
    lora=st.none() | st.just(("lora-a", "/adapters/lora-a")),
    salt=st.none() | st.sampled_from(["", "s", "salt-1"]),
    mm=mm_strategy,
    start_block=st.integers(0, 3),
    vector_from=st.sampled_from([1, 3, 10**9]),
    stream_to=st.sampled_from([0, 4, 10**9]),
    pickle_stream_bs=st.sampled_from([1, 10**9]),
    numpy_stream_from=st.sampled_from([1, 10**9]),
)
def test_specialised_encoder_bytes_equal_generic_serializers(
    algo, block_size, tokens, huge, lora, salt, mm, start_block, vector_from, stream_to,
    pickle_stream_bs, numpy_stream_from,
):
    """Every message the fast path digests equals pickle.dumps / cbor2.dumps(canonical)
    of the canonical key tuple (vLLM's bytes)."""
    if huge is not None and huge[0] < len(tokens):
        tokens[huge[0]] = huge[1]  # sometimes an id only the generic path writes
    # From how many blocks on the numpy writer takes over (hypothesis cannot use
    # function-scoped fixtures).
    # CBOR: up to stream_to blocks of ids < 65536 stay with the per-block writer.
    # pickle: from pickle_stream_bs tokens per block on, the stream writer (_pickle_chain).
    # Both writers' streams: numpy-built from numpy_stream_from ids on, else strided.
    knobs = dict(_MIN_VECTOR_BLOCKS_CBOR=vector_from, _MIN_VECTOR_BLOCKS_PICKLE=vector_from,
                 _MAX_STREAM_BLOCKS_CBOR=stream_to, _MIN_STREAM_BS_PICKLE=pickle_stream_bs,
                 _MIN_STREAM_BLOCKS_PICKLE=pickle_stream_bs,
                 _NUMPY_STREAM_MIN_IDS=numpy_stream_from)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in knobs.items():
            _tune(mp, name, value)
        _check_messages(algo, block_size, tokens, lora, salt, mm, start_block)


def _check_messages(algo, block_size, tokens, lora, salt, mm, start_block):
    # Non-overlapping items in offset order (the Request guarantees this).
    items, end = [], 0
    for ident, off, length in sorted(mm, key=lambda m: m[1]):
        if off >= end:
            items.append((ident, off, length))
            end = off + length
    hasher = BlockHasher(algo, seed=7)
    kw = dict(lora=lora, mm_features=items, cache_salt=salt)
    ref = _chain_reference(hasher, tokens, block_size, **kw)
    cap = _Capture(hasher)
    parent = ref[start_block - 1] if 0 < start_block <= len(ref) else None
    if start_block > len(ref):
        start_block = len(ref)
        parent = ref[-1] if ref else None
    got = hasher.hash_token_blocks(
        tokens, block_size, parent=parent, start_block=start_block, **kw
    )
    assert got == ref[start_block:]
    assert len(cap.messages) == len(got)
    for i, msg in enumerate(cap.messages):
        b = start_block + i
        start, end_ = b * block_size, (b + 1) * block_size
        key = (
            ref[b - 1] if b else hasher.root,
            tuple(tokens[start:end_]),
            block_extra_keys(start, end_, **kw),
        )
        assert msg == hasher.serialize(key), (b, msg)


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_large_blocks_foreign_parents_and_huge_ids_fall_back_exactly(algo, path):
    h = BlockHasher(algo, seed=1)
    # > 64 KiB pickle frame: pickle splits frames; we hand those to pickle itself.
    big = [70000 + i for i in range(2 * 14000)]
    assert h.hash_token_blocks(big, 14000) == _chain_reference(h, big, 14000)
    # Parents of other lengths (SHORT_BINBYTES / BINBYTES, other CBOR heads).
    for parent in (b"\x01" * 5, b"\x02" * 300):
        assert h.hash_token_blocks([1, 2, 3, 4], 2, parent=parent, start_block=0)[0] == (
            h.hash_block(parent, [1, 2])
        )
    # Ids >= 2**63 (pickle LONG1 with 9 bytes) and >= 2**64 (CBOR bignum).
    huge = [2**63, 2**64 - 1, 2**64, 2**70, 5, 6]
    assert h.hash_token_blocks(huge, 2) == _chain_reference(h, huge, 2)
    arr = np.array([1, 2, 3, 4, 5], dtype=np.int32)
    assert h.hash_token_blocks(arr, 2) == h.hash_token_blocks([1, 2, 3, 4, 5], 2)


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_incremental_equals_whole_sequence(algo, path):
    h = BlockHasher(algo, seed=3)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 200000, size=203).tolist()
    kw = dict(lora=("l", "/l"), mm_features=[("i", 30, 50)], cache_salt="c")
    whole = h.hash_token_blocks(toks, 16, **kw)
    pieces = []
    for b in range(len(toks) // 16):
        pieces += h.hash_token_blocks(
            toks[: (b + 1) * 16 + 3], 16, parent=pieces[-1] if pieces else None,
            start_block=b, **kw
        )
    assert pieces == whole and len(whole) == 12


@pytest.mark.parametrize(
    "tokens, match",
    [
        ([1, -1, 2, 3], "negative"),
        ([1, 2.5, 3, 4], "int"),
        ([1, "2", 3, 4], "int"),
        ([1, None, 3, 4], "int"),
        (np.array([1, -3, 4, 5]), "negative"),
        (np.array([1.0, 2.0, 3.0, 4.0]), "integer array"),
        ([1, 2, 3, 4, -1], "negative"),  # in the partial tail too
    ],
)
def test_bad_token_ids(tokens, match):
    h = BlockHasher("sha256_cbor", seed=0)
    with pytest.raises(ValueError, match=match):
        h.hash_token_blocks(tokens, 2)
    if not isinstance(tokens, np.ndarray):
        with pytest.raises(ValueError, match=match):
            h.hash_block(None, tokens)


def test_bad_arguments():
    h = BlockHasher("sha256", seed=0)
    for bs in (0, -4, 2.0, True):
        with pytest.raises(ValueError, match="block_size"):
            h.hash_token_blocks([1, 2], bs)
    for sb in (-1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="start_block"):
            h.hash_token_blocks([1, 2], 1, start_block=sb)
    for parent in ("abc", 5, [1]):
        with pytest.raises(ValueError, match="parent"):
            h.hash_token_blocks([1, 2], 1, parent=parent)
    # numpy ints are ints; an empty or bytearray parent is the root / its bytes.
    want = h.hash_token_blocks([1, 2, 3], 1)
    assert h.hash_token_blocks([1, 2, 3], np.int64(1), start_block=np.int32(0)) == want
    assert h.hash_token_blocks([1, 2, 3], 1, parent=b"") == want
    assert h.hash_token_blocks([1, 2, 3], 1, parent=bytearray(h.root)) == want
    assert h.hash_token_blocks([1, 2, 3], 1, start_block=1, parent=memoryview(want[0])) == want[1:]
    with pytest.raises(ValueError, match="parent"):
        h.hash_block("abc", [1])
    with pytest.raises(ValueError, match="extra"):
        h.hash_block(None, [1], "lora")
    with pytest.raises(ValueError, match="not supported"):
        h.hash_block(None, [1], ((LORA_LABEL, object()),))


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_memo_skips_seen_blocks_and_keeps_digests(algo, path, monkeypatch):
    h = BlockHasher(algo, seed=5)
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, 100_000, size=64).tolist()
    a = prefix + rng.integers(0, 100_000, size=40).tolist()
    b = prefix + rng.integers(0, 100_000, size=40).tolist()
    kw = dict(lora=("l", "/l"), mm_features=[("img", 20, 30)], cache_salt="s")
    want_a = _chain_reference(h, a, 16, **kw)
    want_b = _chain_reference(h, b, 16, **kw)
    got, msgs = _messages(h, a, 16, **kw)
    assert got == want_a and len(msgs) == 6  # cold: every block serialized and hashed
    got, msgs = _messages(h, a, 16, **kw)
    assert got == want_a and msgs == []  # all six from the memo
    got, msgs = _messages(h, b, 16, **kw)
    assert got == want_b and len(msgs) == 2  # the shared 4 blocks hit, 2 new ones
    # Other extra keys never hit: another salt changes every block's chain.
    got, msgs = _messages(h, a, 16, lora=("l", "/l"), mm_features=[("img", 20, 30)],
                          cache_salt="t")
    assert len(msgs) == 6 and got == _chain_reference(
        h, a, 16, lora=("l", "/l"), mm_features=[("img", 20, 30)], cache_salt="t"
    )
    got, msgs = _messages(h, a, 16, lora=("l", "/other"), mm_features=[("img", 20, 30)],
                          cache_salt="s")
    assert len(msgs) == 6 and got[0] != want_a[0]
    # Bounded; clear_caches forgets.
    _tune(monkeypatch, "_MEMO_SIZE", 8)
    for k in range(5):
        h.hash_token_blocks(rng.integers(0, 1000, size=48).tolist(), 16)
        assert len(h._memo) <= 8
    h.clear_caches()
    got, msgs = _messages(h, a, 16, **kw)
    assert got == want_a and len(msgs) == 6


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("diverge", [3, 9, 10, 16])
def test_memo_hits_then_misses_inside_multimodal_items(algo, diverge, path):
    """A request that leaves a memoised prefix in the middle of its images: the blocks
    after the divergence still carry the right image keys (the plan of the request is
    reused from the first missing block on)."""
    h = BlockHasher(algo, seed=4)
    rng = np.random.default_rng(3)
    bs = 4
    a = rng.integers(0, 100_000, size=30 * bs).tolist()
    c = a[: diverge * bs] + rng.integers(0, 100_000, size=(30 - diverge) * bs).tolist()
    kw = dict(lora=("l", "/l"), cache_salt="s",
              mm_features=[("img", 5, 20), ("img2", 30, 31), ("img", 70, 8)])
    want_c = _chain_reference(h, c, bs, **kw)
    assert h.hash_token_blocks(a, bs, **kw) == _chain_reference(h, a, bs, **kw)
    got, msgs = _messages(h, c, bs, **kw)
    assert got == want_c and len(msgs) == 30 - diverge
    # And from a later start, with the prefix known.
    h.clear_caches()
    h.hash_token_blocks(c[: 14 * bs], bs, **kw)
    got, msgs = _messages(h, c, bs, **kw)
    assert got == want_c and len(msgs) == 16


@pytest.mark.parametrize("algo", ["sha256", "xxhash_cbor"])
def test_token_container_types_agree(algo, path):
    import array

    h = BlockHasher(algo, seed=2)
    ids = [3, 70000, 5, 300, 0, 2**31 + 7, 9, 10, 11, 12, 13]
    want = _chain_reference(h, ids, 2)
    for container in (
        tuple(ids),
        array.array("Q", ids),
        array.array("q", ids),
        np.array(ids, dtype=np.uint64),
        np.array(ids, dtype=np.int64),
        [np.int64(t) for t in ids],
    ):
        h.clear_caches()
        assert h.hash_token_blocks(container, 2) == want, type(container)
    small = [1, 2, 3, 4, 5]
    for container in (array.array("I", small), array.array("h", small), np.array(small, np.int16)):
        assert h.hash_token_blocks(container, 2) == _chain_reference(h, small, 2)
    with pytest.raises(ValueError, match="negative"):
        h.hash_token_blocks(array.array("i", [1, 2, -3, 4]), 2)
    with pytest.raises(ValueError, match="integers"):
        h.hash_token_blocks(array.array("d", [1.0, 2.0]), 2)


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("extras", [False, True])
def test_memo_groups_of_blocks(algo, extras, path):
    """Runs of known blocks come back whole from the memo, with the spec's digests,
    whatever mix of group and block entries the memo holds."""
    h = BlockHasher(algo, seed=3)
    rng = np.random.default_rng(2)
    bs = 4
    a = rng.integers(0, 100_000, size=40 * bs + 3).tolist()  # 40 blocks: 5 groups
    b = a[: 20 * bs] + rng.integers(0, 100_000, size=20 * bs).tolist()
    kw = dict(lora=("l", "/l"), mm_features=[("img", 30, 45)], cache_salt="s") if extras else {}
    want_a, want_b = _chain_reference(h, a, bs, **kw), _chain_reference(h, b, bs, **kw)
    got, msgs = _messages(h, a, bs, **kw)
    assert got == want_a and len(msgs) == 40
    got, msgs = _messages(h, a, bs, **kw)
    assert got == want_a and msgs == []
    # The group entries alone (white box: block entries are 2-tuples) give all 40.
    saved = dict(h._memo)
    for key in [k for k in h._memo if len(k) == 2]:
        del h._memo[key]
    got, msgs = _messages(h, a, bs, **kw)
    assert got == want_a and msgs == []
    h._memo.update(saved)
    # b shares 20 blocks: two groups, then four single blocks, then 20 new ones.
    got, msgs = _messages(h, b, bs, **kw)
    assert got == want_b and len(msgs) == 20
    got, msgs = _messages(h, b, bs, **kw)
    assert got == want_b and msgs == []
    # From the middle (groups aligned to another start): block entries, then its own.
    for _ in range(2):
        got, msgs = _messages(h, a, bs, parent=want_a[9], start_block=10, **kw)
        assert got == want_a[10:] and msgs == []
    # Another block size over the same bytes never hits.
    got, msgs = _messages(h, a, 2 * bs, **kw)
    assert got == _chain_reference(h, a, 2 * bs, **kw) and len(msgs) == 20
    # Blocks known only one by one (the decode path) are found and then grouped.
    h.clear_caches()
    req = Request("r", a[:bs], hasher=h, block_size=bs, **(dict(
        lora=LoRARequest("l", "/l"), mm_features=[MultiModalFeature("img", 1, 2)],
        cache_salt="s") if extras else {}))
    for t in a[bs:]:
        req.append_output_token_ids(t)
        _ = req.block_hashes
    kw_r = dict(kw, mm_features=[("img", 1, 2)]) if extras else kw
    want_r = _chain_reference(h, a, bs, **kw_r)
    assert list(req.block_hashes) == want_r
    for _ in range(2):
        got, msgs = _messages(h, a, bs, **kw_r)
        assert got == want_r and msgs == []


@pytest.mark.parametrize("n", [1, 2, 4096, 5000])
def test_low_u16s_cuts_every_id_to_its_low_16_bits(n):
    ids = [65535, 0, 256, 255] * max(n, 2)
    ids[-1] = 2**64 - 1
    for k in range(2, 8):
        ids[k] = (1 << (8 * k)) + 0x1234
    packed = struct.pack(f"={len(ids)}Q", *ids)
    low = hash_writers._low_u16s(packed, packed[hash_writers._BYTE0 :: 8], packed[hash_writers._BYTE1 :: 8])
    assert low == struct.pack(f"={len(ids)}Q", *(v & 0xFFFF for v in ids))


_TAIL_STRS = ["a", "img-0", "é" * 30, "x" * 300, "画像-🙂"]


@settings(max_examples=150, deadline=None)
@given(
    lora=st.none() | st.tuples(st.sampled_from(_TAIL_STRS), st.sampled_from(_TAIL_STRS)),
    mm=st.lists(
        st.tuples(
            st.sampled_from(_TAIL_STRS),
            st.sampled_from([0, 1, 23, 24, 255, 256, 65535, 65536, 2**32, -1, -24, -25,
                             -256, -257, -65537, -(2**32) - 1])
            | st.integers(-(2**40), 2**40),
        ),
        max_size=3,
    ).map(tuple),
    salt=st.none() | st.sampled_from(["", "s", "salt-1", "ü" * 40]),
)
def test_tail_equals_cbor2_canonical(lora, mm, salt):
    """The cached CBOR suffix of extra keys is cbor2's canonical encoding (string
    lengths and int widths at every head boundary, negative offsets, non-ASCII)."""
    hasher = BlockHasher("xxhash_cbor", seed=0)
    extra = hashing._extras_from_parts(lora, mm, salt)
    want = b"\xf6" if extra is None else cbor2.dumps(extra, canonical=True)
    assert hasher._tail(lora, mm, salt)[0] == want
    assert hasher._tail(lora, mm, salt)[0] == want  # cached copy


def test_str_subclass_parts_hash_as_their_values():
    """Extra-key parts given as str subclasses hash as the plain strings (the spec)."""
    hasher = BlockHasher("sha256_cbor", seed=0)

    class S(str):
        pass

    tokens = list(range(300, 340))
    kw = dict(lora=(S("lora-x"), "/p"), mm_features=[("img-q", 3, 20)], cache_salt=S("s"))
    assert hasher.hash_token_blocks(tokens, 8, **kw) == _chain_reference(hasher, tokens, 8, **kw)


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_plan_extras_are_the_blocks_extra_keys(algo):
    """A plan's extra keys are block_extra_keys of each block it covers."""
    bs = 4
    hasher = BlockHasher(algo, seed=0)
    lora, mm, salt = ("l", "/l"), [("i", 5, 9)], "s"
    plan = hasher._tail_plan(bs, 0, lora, mm, salt)
    for b in range(6):
        want = block_extra_keys(b * bs, (b + 1) * bs, lora=lora, mm_features=mm,
                                cache_salt=salt, is_first_block=b == 0)
        assert plan.extras[plan.id_of.get(b, 0)] == want, b


class _GenericPlans(BlockHasher):
    """Plans from the generic builder only."""

    def _one_item_plan(self, *args):
        return None


@settings(max_examples=200, deadline=None)
@given(
    algo=st.sampled_from(HASH_ALGOS),
    bs=st.integers(1, 20) | st.sampled_from([256, 300, 70000]),
    lora=st.none() | st.sampled_from([("lora-a", "/adapters/lora-a"), ("a", "b"), ("i", "/p")]),
    ident=st.sampled_from(["img-0", "i", "é" * 30, "x" * 300]),
    offset=st.sampled_from([0, 1, 15, 16, 255, 256, 257, 65535, 65536, 65537, 2**31 - 5, 2**31 + 3])
    | st.integers(0, 400),
    length=st.sampled_from([1, 2, 16, 17, 300]) | st.integers(1, 64),
    salt=st.none() | st.sampled_from(["s", "salt-1"]),
    start_block=st.integers(0, 3),
)
def test_one_item_plan_equals_the_generic_builder(
    algo, bs, lora, ident, offset, length, salt, start_block
):
    """The one-item plan (suffixes from a template around the item's relative offset)
    is the generic builder's, suffix for suffix, extra key for extra key, block for
    block -- at the int width boundaries of both encodings and for items beyond
    2**31 (the generic builder writes those)."""
    lo = start_block * bs
    if offset + length <= lo:
        offset = lo  # the item must reach past start_block (as _tail_plan filters)
    salt = salt if start_block == 0 else None
    feats = ((ident, offset, length),)
    hasher = BlockHasher(algo, seed=0)
    # Another salt and a longer item first: item suffixes are cached (the first plan's
    # shared with this one; the second's, starting at the same block, not).
    other = "other-salt" if start_block == 0 else None
    hasher._make_tail_plan(lora, feats, other, start_block, bs)
    hasher._make_tail_plan(lora, ((ident, offset, length + bs),), salt, start_block, bs)
    fast = hasher._make_tail_plan(lora, feats, salt, start_block, bs)
    generic = _GenericPlans(algo, seed=0)._make_tail_plan(lora, feats, salt, start_block, bs)
    if generic is hash_writers._UNSPLICEABLE:
        assert fast is generic
        return
    n = max(generic.id_of, default=0) + 2
    if n < 100_000:  # the suffix of every block, in order
        assert fast.tails_for(n) == [
            generic.suffixes[generic.id_of.get(i, 0)] for i in range(n)
        ]
    blocks = set(fast.id_of) | set(generic.id_of) | {0, max(generic.id_of, default=0) + 1}
    assert set(fast.id_of) == set(generic.id_of)
    for i in sorted(blocks):
        assert fast.suffixes[fast.id_of.get(i, 0)] == generic.suffixes[generic.id_of.get(i, 0)]
        got = fast.extras[fast.id_of.get(i, 0)]
        want = generic.extras[generic.id_of.get(i, 0)]
        assert got == want, i
        key = (bytes(32), (1, 2), got)
        if not algo.endswith("_cbor"):  # same objects aliased the same way: same pickle
            assert pickle.dumps(key, protocol=5) == pickle.dumps(
                (key[0], key[1], want), protocol=5
            )
    assert (fast.head, fast.hole, fast.close_len) == (generic.head, generic.hole, generic.close_len)


def test_int_encodings_at_every_width_boundary():
    """The one-item plan's int encodings are cbor2's canonical items and pickle's
    opcodes (the latter cut from pickling the int alone)."""
    for v in [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, -1, -24, -25, -256, -257,
              -65536, -65537, -(2**31)]:
        assert hash_writers._cbor_int(v) == cbor2.dumps(v, canonical=True), v
        assert hash_writers._pickle_int(v) == _pickled_int(v), v


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxhash_cbor"])
@pytest.mark.parametrize("high_at", [None, 77])
def test_cbor_crossover_between_the_writers_at_default_knobs(algo, high_at):
    """100 new blocks (between the vectorised crossover and _MAX_STREAM_BLOCKS_CBOR):
    all ids < 65536 -> the per-block writer (reusing the crossover's high-byte check),
    one id >= 65536 -> the vectorised one; both equal the spec."""
    bs, nb = 4, 100
    assert hash_writers._MIN_VECTOR_BLOCKS_CBOR <= nb <= hash_writers._MAX_STREAM_BLOCKS_CBOR
    rng = np.random.default_rng(7)
    tokens = rng.integers(256, 65536, size=bs * nb).tolist()
    tokens[5] = tokens[6] = 0
    tokens[41] = 200
    if high_at is not None:
        tokens[high_at * bs + 1] = 70000
    hasher = BlockHasher(algo, seed=3)
    assert hasher.hash_token_blocks(tokens, bs) == _chain_reference(hasher, tokens, bs)


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("bs", [64, 512])
@pytest.mark.parametrize("shape", ["plain", "small_ids", "high_id", "lora", "mm_salt"])
@pytest.mark.parametrize("numpy_from", [None, 10**9])
def test_stream_writers_at_large_blocks(algo, bs, shape, numpy_from, monkeypatch):
    """Block sizes from _MIN_STREAM_BS_PICKLE on: pickle keys written from the ids'
    bytes (`_pickle_chain`; BININT1 runs spliced in; an id >= 65536 falls back), CBOR's
    by `_cbor_chain`, their streams built with numpy (from _NUMPY_STREAM_MIN_IDS ids:
    the 512-token case) or strided slicing, equal the spec, every message byte for
    byte, cold and through the memo."""
    assert bs >= hash_writers._MIN_STREAM_BS_PICKLE
    assert 5 * 64 + 7 < hash_writers._NUMPY_STREAM_MIN_IDS <= 5 * 512  # 64: strided, 512: numpy
    if numpy_from is not None:
        _tune(monkeypatch, "_NUMPY_STREAM_MIN_IDS", numpy_from)
    rng = np.random.default_rng(bs)
    n = 5 * bs + 7
    tokens = rng.integers(256, 40000, size=n).tolist()
    kw = {}
    if shape == "small_ids":
        tokens[3] = 0
        tokens[bs - 1] = 255
        tokens[bs + 10 : bs + 40] = [0] * 30  # a run (placeholders)
        tokens[2 * bs - 5 : 2 * bs + 5] = range(100, 110)  # a run across a boundary
        tokens[4 * bs : 5 * bs] = [7] * bs  # a whole block
    elif shape == "high_id":
        tokens[2 * bs + 1] = 70000
    elif shape == "lora":
        kw = dict(lora=("lora-a", "/adapters/lora-a"))
    elif shape == "mm_salt":
        kw = dict(mm_features=[("img-a", bs - 3, bs + 9)], cache_salt="salt-1")
    ref = _chain_reference(BlockHasher(algo, seed=3), tokens, bs, **kw)
    hasher = BlockHasher(algo, seed=3)
    cap = _Capture(hasher)
    assert hasher.hash_token_blocks(tokens, bs, **kw) == ref
    hasher2 = BlockHasher(algo, seed=3)
    parent = None
    for b, msg in enumerate(cap.messages):
        start = b * bs
        key = hasher2.block_key(
            parent, tokens[start : start + bs], block_extra_keys(start, start + bs, **kw)
        )
        assert msg == hasher2.serialize(key), b
        parent = ref[b]
    assert len(cap.messages) == len(ref)
    assert hasher.hash_token_blocks(tokens, bs, **kw) == ref  # from the memo
