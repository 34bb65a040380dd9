"""`Tokenizer.tiny()`: the tiny model preset's built-in tokenizer."""

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from prefixcache.model import ModelConfig  # noqa: E402
from prefixcache.text import Tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.tiny()


def test_covers_exactly_the_tiny_models_ids(tok):
    assert tok.vocab_size == ModelConfig.tiny().vocab_size == 512
    # Every id the model can sample decodes (no id outside the vocabulary).
    assert isinstance(tok.decode(list(range(512)), skip_special_tokens=False), str)
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] \
        == [509, 510, 511]
    assert (tok.eos_token_id, tok.bos_token_id, tok.stop_token_ids) == (None, None, ())


def test_ids_are_fixed(tok):
    # Golden ids: the merges are learned in code (ties broken by the pair), so these
    # never change with the machine or the tokenizers version. Bytes keep their value.
    assert tok.encode("Hello, world! The capital of France is Paris.") == [
        72, 101, 300, 44, 366, 33, 32, 283, 485, 270, 32, 70, 297, 99, 101, 317, 505, 46]
    assert tok.encode("\x00\xff") == [0, 195, 191]  # (U+00FF is two UTF-8 bytes)
    assert Tokenizer.tiny().encode("prefix caching") == tok.encode("prefix caching")


@pytest.mark.parametrize("text", ["", "plain ascii", "日本語 😀 café\n\ttabs  ",
                                  "<|im_start|>user\nhi<|im_end|>"])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n")
    ids = tok.apply_chat_template(msgs, tokenize=True)
    assert ids[0] == 510 and ids.count(511) == 2
    assert tok.decode(ids) == "system\nBe brief.\nuser\nHi\nassistant\n"
