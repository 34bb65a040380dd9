"""Retention hints through the serving path without a server: the ``retention`` extra
body field (OpenAI-style 400 naming it), the engine-core message, and
``Engine.add_request(..., retention=...)`` reaching the core Request."""

from __future__ import annotations

import msgspec
import pytest

from prefixcache.core.request import RetentionHints
from prefixcache.engine import Engine, SamplingParams
from prefixcache.model import ModelConfig
from prefixcache.serve.engine_core import NewRequest
from prefixcache.serve.engine_loop import EngineCall, EngineFrontEnd
from prefixcache.serve.protocol import APIError, ServerContext, parse_request

CTX = ServerContext(served_model_name="tiny", lora_modules={}, tokenizer=None,
                    max_model_len=256, vocab_size=512)


def _body(**extra):
    return {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 2, **extra}


def test_retention_field_parsed_into_hints():
    gen = parse_request("completion", _body(retention={
        "priority": 3, "ttl_s": 30, "keep_range": [0, 64], "session_end": True}), CTX)
    assert gen.retention == RetentionHints(priority=3, ttl_s=30.0, keep_range=(0, 64),
                                           session_end=True)
    assert parse_request("completion", _body(), CTX).retention is None


@pytest.mark.parametrize("value,match", [
    ([1, 2], "'retention' must be an object"),
    ({"ttl": 5}, "unknown field"),
    ({"ttl_s": -1}, "ttl_s must be a finite number > 0"),
    ({"priority": "high"}, "priority must be an int"),
    ({"priority": 2 ** 63}, r"\[-2\*\*63, 2\*\*63\)"),
    ({"keep_range": [4, 2]}, "keep_range must satisfy"),
    ({"session_end": "yes"}, "session_end must be True or False"),
])
def test_bad_retention_is_a_400_naming_the_field(value, match):
    with pytest.raises(APIError, match=match) as e:
        parse_request("completion", _body(retention=value), CTX)
    assert e.value.status == 400 and e.value.param == "retention"


def test_engine_core_message_carries_the_hints():
    hints = RetentionHints(priority=1, ttl_steps=50, session_end=True)
    call = EngineCall("r-0", [1, 2, 3], SamplingParams(max_tokens=1), retention=hints)
    loop = EngineFrontEnd.__new__(EngineFrontEnd)  # (only the message encoding is used)
    loop._encode_params = True
    msg = loop._new_request(call)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=NewRequest)
    assert RetentionHints.from_dict(back.retention) == hints
    plain = loop._new_request(EngineCall("r-1", [1, 2], SamplingParams(max_tokens=1)))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(plain), type=NewRequest).retention is None


def test_engine_add_request_forwards_the_hints():
    eng = Engine(ModelConfig.tiny(), num_blocks=16, block_size=16, max_model_len=128,
                 eviction="hinted")
    hints = {"priority": 2, "ttl_steps": 10}
    rid = eng.add_request([3, 4, 5], SamplingParams(max_tokens=1), retention=hints)
    (state,) = [s for s in eng.scheduler.waiting if s.request_id == rid]
    assert state.request.retention == RetentionHints(priority=2, ttl_steps=10)
    with pytest.raises(ValueError, match="retention must be"):
        eng.add_request([3, 4, 5], SamplingParams(max_tokens=1), retention=7)
    assert len(eng.scheduler.waiting) == 1  # the refused call changed nothing
