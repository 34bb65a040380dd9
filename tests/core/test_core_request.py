"""Request: copies, validation (state unchanged on error), incremental block hashes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.core.hashing import BlockHasher, block_extra_keys
from prefixcache.core.request import LoRARequest, MultiModalFeature, Request


class CountingHasher(BlockHasher):
    """Records (start_block, number of blocks hashed) of every hash_token_blocks call,
    and counts single blocks hashed by the decode fast path (hash_plain_block)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []
        self.plain = 0

    def hash_plain_block(self, parent, block, tag):
        self.plain += 1
        return super().hash_plain_block(parent, block, tag)

    def hash_token_blocks(self, token_ids, block_size, **kw):
        out = super().hash_token_blocks(token_ids, block_size, **kw)
        self.calls.append((kw.get("start_block", 0), len(out)))
        return out


def test_prompt_is_copied_and_views_are_read_only():
    prompt = [5, 6, 7, 8, 9]
    req = Request("r", prompt)
    prompt.append(10)
    prompt[0] = 99
    assert req.prompt_token_ids == [5, 6, 7, 8, 9]
    assert req.num_prompt_tokens == req.num_tokens == 5
    view = req.all_token_ids
    with pytest.raises(TypeError):
        view[0] = 1  # no item assignment on the view
    req.prompt_token_ids.append(1)  # a copy: changes nothing
    assert req.num_tokens == 5
    req.append_output_token_ids(11)
    req.append_output_token_ids([12, np.int64(13)])
    assert view == [5, 6, 7, 8, 9, 11, 12, 13]  # the view follows appends
    assert req.output_token_ids == [11, 12, 13] and type(req.all_token_ids[-1]) is int
    assert req.num_tokens == 8 and req.num_prompt_tokens == 5
    assert req.all_token_ids[5:] == [11, 12, 13]


def test_numpy_prompt_and_properties():
    lora = LoRARequest("a", "/a")
    mm = [MultiModalFeature("B", 6, 2), MultiModalFeature("A", 1, 3)]
    req = Request(7, np.arange(10, dtype=np.int32), mm_features=mm, lora=lora, cache_salt="s")
    assert req.request_id == 7
    assert req.prompt_token_ids == list(range(10))
    assert [f.identifier for f in req.mm_features] == ["A", "B"]  # sorted by offset
    assert req.lora is lora and req.cache_salt == "s"
    assert req.hasher is None and req.block_size is None


def test_num_computed_tokens_is_the_schedulers_plain_attribute():
    # vLLM's: starts at 0, the scheduler sets it; the manager checks it when it acts
    # on it (test_core_manager.py::test_bad_num_computed_tokens_changes_nothing).
    req = Request("r", [1, 2, 3])
    assert req.num_computed_tokens == 0
    req.num_computed_tokens = 3
    assert req.num_computed_tokens == 3 and "num_computed_tokens=3" in repr(req)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt_token_ids=[]), "empty prompt"),
        (dict(prompt_token_ids=[1, -2]), "negative"),
        (dict(prompt_token_ids=[1, 2.0]), "not an int"),
        (dict(prompt_token_ids=[1, "2"]), "not an int"),
        (dict(prompt_token_ids=[1, 2**64]), "below 2\\*\\*64"),
        (dict(prompt_token_ids=np.array([1, -2])), "negative"),
        (dict(prompt_token_ids=np.array([1.0])), "dtype"),
        (dict(prompt_token_ids="abc"), "sequence"),
        (dict(mm_features=[MultiModalFeature("a", 8, 3)]), r"\[8, 11\) beyond the 10-token"),
        (
            dict(mm_features=[MultiModalFeature("a", 0, 4), MultiModalFeature("b", 3, 2)]),
            "overlap",
        ),
        (dict(mm_features=[("a", 0, 2)]), "MultiModalFeature"),
        (dict(lora=("a", "/a")), "LoRARequest"),
        (dict(cache_salt=5), "cache_salt"),
        (dict(hasher=BlockHasher("sha256")), "together"),
        (dict(hasher=BlockHasher("sha256"), block_size=0), "block_size"),
        (dict(hasher="sha256", block_size=4), "BlockHasher"),
        (dict(request_id=["unhashable"]), "hashable"),
    ],
)
def test_request_validation(kwargs, match):
    args = dict(request_id="r", prompt_token_ids=list(range(10)))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Request(args.pop("request_id"), args.pop("prompt_token_ids"), **args)


@pytest.mark.parametrize(
    "args, match",
    [
        (("a", -1, 2), "offset"),
        (("a", 0, 0), "length"),
        (("a", 0, -3), "length"),
        (("", 0, 1), "identifier"),
        (("a", 1.5, 1), "offset"),
    ],
)
def test_multimodal_feature_validation(args, match):
    with pytest.raises(ValueError, match=match):
        MultiModalFeature(*args)


def test_lora_validation_and_frozen():
    with pytest.raises(ValueError, match="name"):
        LoRARequest("", "/p")
    with pytest.raises(ValueError, match="path"):
        LoRARequest("a", None)
    lora = LoRARequest("a", "/p")
    with pytest.raises(AttributeError):
        lora.name = "b"


def test_append_validation_leaves_state_unchanged():
    req = Request("r", [1, 2, 3], hasher=BlockHasher("sha256", seed=0), block_size=2)
    before = list(req.block_hashes)
    for bad in ([4, -5], [4, 1.5], -1, "x", [4, None], 2**64, [2**65]):
        with pytest.raises(ValueError):
            req.append_output_token_ids(bad)
        assert req.num_tokens == 3 and list(req.block_hashes) == before


def test_bind_hasher_rules():
    req = Request("r", list(range(9)))
    with pytest.raises(ValueError, match="no hasher"):
        _ = req.block_hashes
    h = BlockHasher("sha256", seed=0)
    req.bind_hasher(h, 4)
    req.bind_hasher(BlockHasher("sha256", seed=0), 4)  # equal hasher: no-op
    assert req.hasher is h and len(req.block_hashes) == 2
    with pytest.raises(ValueError, match="cannot rebind"):
        req.bind_hasher(h, 8)
    with pytest.raises(ValueError, match="cannot rebind"):
        req.bind_hasher(BlockHasher("sha256_cbor", seed=0), 4)
    with pytest.raises(ValueError, match="cannot rebind"):
        req.bind_hasher(BlockHasher("sha256", seed=1), 4)
    assert req.hasher is h and req.block_size == 4
    with pytest.raises(ValueError, match="block_size"):
        Request("s", [1]).bind_hasher(h, -1)


@pytest.mark.parametrize("algo", ["sha256", "xxhash_cbor"])
def test_decode_hashes_only_new_blocks(algo):
    h = CountingHasher(algo, seed=0)
    req = Request("r", list(range(37)), lora=LoRARequest("l", "/l"), cache_salt="s",
                  mm_features=[MultiModalFeature("img", 3, 34)], hasher=h, block_size=8)
    assert len(req.block_hashes) == 4 and h.calls == [(0, 4)]
    for step in range(40):
        req.append_output_token_ids(1000 + step)
        _ = req.block_hashes
    # Every new full block was hashed exactly once, never an earlier one: block 4 (it
    # overlaps the image) by hash_token_blocks, blocks 5-8 by the decode fast path.
    assert [c for c in h.calls if c[1]] == [(0, 4), (4, 1)] and h.plain == 4
    assert len(req.block_hashes) == 77 // 8
    all_ids = list(req.all_token_ids)
    assert list(req.block_hashes) == h.hash_token_blocks(
        all_ids, 8, lora=req.lora, mm_features=req.mm_features, cache_salt="s"
    )


def spec_chain(algo, seed, tokens, bs, *, lora=None, mm=(), salt=None):
    """The spec, block by block, on a fresh hasher (no memo shared with the test's)."""
    h = BlockHasher(algo, seed=seed)
    parent, out = None, []
    for b in range(len(tokens) // bs):
        extra = block_extra_keys(b * bs, (b + 1) * bs, lora=lora, mm_features=mm,
                                 cache_salt=salt)
        parent = h.hash_block(parent, tokens[b * bs : (b + 1) * bs], extra)
        out.append(parent)
    return out


@settings(max_examples=60, deadline=None)
@given(
    algo=st.sampled_from(["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]),
    block_size=st.integers(1, 9),
    prompt=st.lists(st.integers(0, 2**33), min_size=1, max_size=40),
    chunks=st.lists(st.integers(0, 2**40) | st.lists(st.integers(0, 70000), max_size=7),
                    max_size=30),
    salt=st.none() | st.just("") | st.just("salt"),
    lora=st.none() | st.just(LoRARequest("l", "/l")),
    mm=st.none() | st.tuples(st.integers(0, 39), st.integers(1, 40)),
    peek=st.booleans(),
)
def test_incremental_equals_whole_sequence(algo, block_size, prompt, chunks, salt, lora,
                                           mm, peek):
    feats = []
    if mm is not None and mm[0] + mm[1] <= len(prompt):
        feats = [MultiModalFeature("img", *mm)]
    h = BlockHasher(algo, seed=5)
    req = Request("r", prompt, cache_salt=salt, lora=lora, mm_features=feats, hasher=h,
                  block_size=block_size)
    for chunk in chunks:
        if peek:
            _ = req.block_hashes
        req.append_output_token_ids(chunk)
    everything = prompt + [t for c in chunks for t in ([c] if isinstance(c, int) else c)]
    assert list(req.all_token_ids) == everything
    want = spec_chain(algo, 5, everything, block_size, lora=lora, mm=feats, salt=salt)
    assert list(req.block_hashes) == want
    assert h.hash_token_blocks(
        everything, block_size, cache_salt=salt, lora=lora, mm_features=feats
    ) == want


class PlainCountingHasher(BlockHasher):
    """Counts decode fast-path blocks and blocks the generic writers hash."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plain = 0
        self.written = 0

    def hash_plain_block(self, parent, block, tag):
        self.plain += 1
        return super().hash_plain_block(parent, block, tag)

    # Every CBOR block the writers hash goes through _cbor_chain (hash_token_blocks
    # calls it directly after the memo, _hash_blocks otherwise); pickle blocks through
    # _hash_blocks.
    def _hash_blocks(self, packed, num_blocks, *args, **kwargs):
        if not self._is_cbor:
            self.written += num_blocks
        return super()._hash_blocks(packed, num_blocks, *args, **kwargs)

    def _cbor_chain(self, packed, num_blocks, *args, **kwargs):
        self.written += num_blocks
        return super()._cbor_chain(packed, num_blocks, *args, **kwargs)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_decode_fast_path_takes_plain_blocks_only_and_shares_the_memo(algo):
    bs = 4
    h = PlainCountingHasher(algo, seed=0)
    # Salt on block 0; the image covers tokens [5, 10): blocks 1 and 2 carry its key,
    # block 2 fills during decode and must not take the fast path.
    req = Request("r", list(range(1, 11)), cache_salt="s",
                  mm_features=[MultiModalFeature("img", 5, 5)], hasher=h, block_size=bs)
    assert len(req.block_hashes) == 2 and (h.plain, h.written) == (0, 2)
    for step in range(10):
        req.append_output_token_ids(100 + step)
        _ = req.block_hashes
    # Blocks 2 (image) through the generic path, 3 and 4 through the fast path.
    assert (h.plain, h.written) == (2, 3)
    tokens = list(req.all_token_ids)
    mm = req.mm_features
    assert list(req.block_hashes) == spec_chain(algo, 0, tokens, bs, mm=mm, salt="s")
    # The prompt path finds the decode blocks in the memo: nothing is rewritten.
    again = h.hash_token_blocks(tokens, bs, mm_features=mm, cache_salt="s")
    assert again == list(req.block_hashes) and h.written == 3
    # Without extra keys every decode block takes the fast path (spec digests).
    plain_req = Request("p", tokens[:12], hasher=h, block_size=bs)
    h.written = 0
    assert len(plain_req.block_hashes) == 3 and h.written == 3
    for t in tokens[12:]:
        plain_req.append_output_token_ids(t)
        _ = plain_req.block_hashes
    assert h.plain == 4 and list(plain_req.block_hashes) == spec_chain(algo, 0, tokens, bs)
    assert h.hash_plain_block(h.root, plain_req._tokens[:4], h.plain_block_tag(4)) == (
        plain_req.block_hashes[0])


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_decode_fast_path_with_lora(algo):
    bs = 4
    lora = LoRARequest("adapter", "adapter")  # equal name and path: no pickle aliasing
    h = PlainCountingHasher(algo, seed=0)
    req = Request("r", list(range(1, 7)), lora=lora, cache_salt="s", hasher=h, block_size=bs)
    for step in range(11):
        req.append_output_token_ids(100 + step)
        _ = req.block_hashes
    assert (h.plain, h.written) == (3, 1)  # block 0 (salt) by the writers, 1-3 plain
    tokens = list(req.all_token_ids)
    assert list(req.block_hashes) == spec_chain(algo, 0, tokens, bs, lora=lora, salt="s")
    again = h.hash_token_blocks(tokens, bs, lora=lora, cache_salt="s")
    assert again == list(req.block_hashes) and h.written == 1  # all from the memo


def test_plain_block_tag_validation():
    h = BlockHasher("sha256", seed=0)
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="block_size"):
            h.plain_block_tag(bad)


def test_num_preemptions_settable_and_validated():
    req = Request("r", [1, 2, 3])
    assert req.num_preemptions == 0
    req.num_preemptions += 1
    req.num_preemptions = np.int64(3)
    assert req.num_preemptions == 3 and type(req.num_preemptions) is int
    for bad in (-1, 1.0, "1", None, True):
        with pytest.raises(ValueError, match="num_preemptions"):
            req.num_preemptions = bad
    assert req.num_preemptions == 3


def test_token_containers_enter_by_value():
    import array

    for raw in (b"\x01\x02", bytearray([1, 2, 255]), memoryview(b"\x01")):
        with pytest.raises(TypeError, match="ordered sequence of int ids"):
            Request("r", raw)  # bytes-like is text, never one id per byte (issue 25)
    assert list(Request("r", (np.int64(4), True, 2**64 - 1)).all_token_ids) == [4, 1, 2**64 - 1]
    assert list(Request("r", array.array("q", [5, 6])).all_token_ids) == [5, 6]
    assert list(Request("r", iter([7, 8])).all_token_ids) == [7, 8]
    req = Request("r", [1])
    req.append_output_token_ids([9])
    for bad, match in ((array.array("d", [1.0]), "not an int"),
                       (array.array("q", [3, -1]), r"\[1\] = -1 is a negative"),
                       ([2**64], "not below 2"), ((1, "2"), r"\[1\] = '2'")):
        with pytest.raises(ValueError, match=match):
            req.append_output_token_ids(bad)
    assert list(req.all_token_ids) == [1, 9]
