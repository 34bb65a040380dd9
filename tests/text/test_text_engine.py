"""Text in the engine: str prompts, chat(), RequestOutput.text, the tokenizer's stop ids and
stop strings, on the tiny model with the tiny tokenizer (no weights needed)."""

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from prefixcache.engine import Engine, SamplingParams  # noqa: E402
from prefixcache.model import ModelConfig  # noqa: E402
from prefixcache.text import Tokenizer  # noqa: E402
from tiny_tokenizer import build_tiny_tokenizer_dir  # noqa: E402

# One shape bucket each: few compiled programs.
COMMON = dict(num_blocks=64, block_size=16, seed=0, max_num_seqs=4,
              max_num_batched_tokens=128, max_model_len=256, token_buckets=(128,),
              seq_buckets=(4,), page_buckets=(16,))
MSGS = [{"role": "system", "content": "You are tiny."},
        {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_pretrained(build_tiny_tokenizer_dir(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def engines(tok):
    """(with tokenizer, without) over one model and its compiled programs."""
    cfg = ModelConfig.tiny()
    plain = Engine(cfg, **COMMON)
    text = Engine(cfg, tokenizer=tok, share_programs_with=plain, **COMMON)
    return text, plain


def test_str_prompt_and_text(engines, tok):
    text, plain = engines
    # The plain engine, given the tokenizer's stop ids (2, 0) by hand, is the reference.
    params = SamplingParams(max_tokens=12)
    [o] = text.generate("Hello, world!", params)
    [ref] = plain.generate([tok.encode("Hello, world!")],
                           SamplingParams(max_tokens=12, stop_token_ids=tok.stop_token_ids))
    assert o.prompt_token_ids == tok.encode("Hello, world!")
    assert o.token_ids == ref.token_ids and o.finish_reason == ref.finish_reason
    assert o.text == tok.decode([t for t in o.token_ids if t < tok.vocab_size])
    assert ref.text is None
    # Token-id prompts still work with a tokenizer; text comes with them.
    [o2] = text.generate([o.prompt_token_ids], params)
    assert o2.token_ids == o.token_ids and o2.text == o.text


def test_default_stop_on_tokenizer_stop_ids(engines, tok):
    text, plain = engines
    prompt = tok.encode("The quick brown fox")
    [free] = plain.generate([prompt], SamplingParams(max_tokens=24))
    # Stop on the 4th generated token through the tokenizer's stop ids: an engine whose
    # tokenizer declares it stops there, one without does not.
    stop_id = next(t for t in free.token_ids[3:] if t < tok.vocab_size)
    first = free.token_ids.index(stop_id)
    tok2 = Tokenizer(tok.backend, bos_token_id=tok.bos_token_id, eos_token_id=stop_id,
                     chat_template=tok.chat_template)
    assert tok2.stop_token_ids == (stop_id,)
    eng = Engine(ModelConfig.tiny(), tokenizer=tok2, share_programs_with=plain, **COMMON)
    [o] = eng.generate([prompt], SamplingParams(max_tokens=24))
    assert o.token_ids == free.token_ids[:first + 1] and o.finish_reason == "stop"


def test_stop_strings(engines, tok):
    text, _ = engines
    [free] = text.generate("def f(x):", SamplingParams(max_tokens=40, stop_token_ids=()))
    full = free.text
    assert len(full) >= 6, full
    stop = full[3:5]
    i = full.find(stop)
    for include in (False, True):
        [o] = text.generate("def f(x):", SamplingParams(
            max_tokens=40, stop=(stop,), include_stop_str_in_output=include))
        assert o.finish_reason == "stop"
        assert o.text == (full[:i + len(stop)] if include else full[:i])
        # The tokens up to the one that completed the stop string.
        assert o.token_ids == free.token_ids[:len(o.token_ids)]
        assert len(o.token_ids) < len(free.token_ids) or free.finish_reason == "stop"
    # A stop string never seen: the same output as without.
    [o] = text.generate("def f(x):", SamplingParams(max_tokens=40, stop=("\x00never",)))
    assert o.token_ids == free.token_ids and o.text == full


def test_chat(engines, tok):
    text, _ = engines
    outs = text.chat([MSGS, MSGS[1:]], SamplingParams(max_tokens=6))
    assert [o.prompt_token_ids for o in outs] == [
        tok.apply_chat_template(MSGS, tokenize=True),
        tok.apply_chat_template(MSGS[1:], tokenize=True)]
    # One conversation alone; the second prompt shares the first's rendered prefix.
    [one] = text.chat(MSGS, SamplingParams(max_tokens=6))
    assert one.token_ids == outs[0].token_ids and one.text == outs[0].text
    assert one.metrics.num_cached_tokens > 0


def test_errors_leave_engine_unchanged(engines):
    text, plain = engines
    with pytest.raises(ValueError, match="no tokenizer, so prompts must be token ids"):
        plain.generate(["hello"])
    with pytest.raises(ValueError, match="stop strings .* need an engine with a tokenizer"):
        plain.generate([[1, 2]], SamplingParams(stop=("x",)))
    with pytest.raises(ValueError, match="chat\\(\\) needs an engine with a tokenizer"):
        plain.chat(MSGS)
    with pytest.raises(ValueError, match="conversation 1: message 0 has no 'role'"):
        text.chat([MSGS, [{"content": "x"}]])
    with pytest.raises(ValueError, match="prompt is empty"):
        text.generate([""])
    with pytest.raises(ValueError, match="stop must be non-empty strings"):
        SamplingParams(stop=("",))
    assert not text.has_unfinished_requests()
    with pytest.raises(ValueError, match="tokenizer has 400 tokens but the model's .* 64"):
        Engine(ModelConfig.tiny(vocab_size=64), tokenizer=text.tokenizer, **COMMON)
    with pytest.raises(ValueError, match="tokenizer must be a prefixcache.text.Tokenizer"):
        Engine(ModelConfig.tiny(), tokenizer="gpt2", **COMMON)

