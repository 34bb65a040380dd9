"""Helpers of the server tests: a tiny test tokenizer and uvicorn on 127.0.0.1.

`TinyTokenizer` implements the interface of `prefixcache.text.Tokenizer` (encode,
decode, apply_chat_template, stop ids, an incremental detokenizer with stop strings)
over a byte-level BPE trained here on a few strings (vocab <= 512, the tiny model's);
a test fixture, not library code.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("httpx")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "hello world, how are you today? I am fine, thank you.",
    "system user assistant: answer the question briefly and well.",
    "prefix caching reuses the KV cache of a shared prompt prefix.",
]


class _Detokenizer:
    def __init__(self, tok, prompt_token_ids=(), skip_special_tokens=True, stop=(),
                 include_stop_str_in_output=False):
        self._tok = tok
        self._skip = skip_special_tokens
        self._stop = tuple(stop)
        self._incl = include_stop_str_in_output
        self._ids: list[int] = []
        self._emitted = 0
        self.text = ""
        self.stopped = False
        self.stop_reason = None

    def _decoded(self) -> str:
        return self._tok.decode(self._ids, skip_special_tokens=self._skip)

    def push(self, token_ids) -> str:
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        full = self._decoded()
        for s in self._stop:
            i = full.find(s)
            if i >= 0:
                self.stopped, self.stop_reason = True, s
                full = full[:i + len(s)] if self._incl else full[:i]
                return self._emit(full)
        while full.endswith("\ufffd"):
            full = full[:-1]  # a UTF-8 character still incomplete
        hold = max((len(s) for s in self._stop), default=1) - 1
        return self._emit(full[:max(len(full) - hold, self._emitted)])

    def _emit(self, upto: str) -> str:
        delta = upto[self._emitted:]
        self._emitted = len(upto)
        self.text = upto
        return delta

    def flush(self) -> str:
        if self.stopped:
            return ""
        return self._emit(self._decoded())


class TinyTokenizer:
    """The `prefixcache.text.Tokenizer` interface over a BPE trained on `_CORPUS`."""

    def __init__(self):
        import jinja2
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        t = Tokenizer(models.BPE())
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = decoders.ByteLevel()
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        t.train_from_iterator(_CORPUS * 4, trainers.BpeTrainer(
            vocab_size=480, special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        self._t = t
        self.vocab_size = t.get_vocab_size()
        self.eos_token_id = t.token_to_id("<|im_end|>")
        self.bos_token_id = None
        self.stop_token_ids = (self.eos_token_id, t.token_to_id("<|endoftext|>"))
        self._template = jinja2.Environment().from_string(CHATML)

    def encode(self, text, add_special_tokens=True):
        return self._t.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens=True):
        return self._t.decode([i for i in ids if i < self.vocab_size],
                              skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False,
                            tools=None, **kw):
        text = self._template.render(messages=messages,
                                     add_generation_prompt=add_generation_prompt, **kw)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def detokenizer(self, prompt_token_ids=(), skip_special_tokens=True, stop=(),
                    include_stop_str_in_output=False):
        return _Detokenizer(self, prompt_token_ids, skip_special_tokens, stop,
                            include_stop_str_in_output)


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, app):
        import uvicorn

        self.app = app
        self.serving = app.state.serving
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    lifespan="off"))
        self.serving.start()
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def on_engine(self, fn, timeout=60):
        """fn(engine) run on the engine thread (the engine is not thread-safe)."""
        return self.serving.call(fn).result(timeout)

    def engine_state(self):
        """(check_invariants passed, KV usage, unfinished requests, cached blocks)."""
        def probe(e):
            e.kv_cache_manager.check_invariants()
            return (e.kv_cache_manager.usage, e.scheduler.num_unfinished_requests,
                    sorted(e.kv_cache_manager.cached_block_ids()))
        return self.on_engine(probe)

    def wait_idle(self, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            state = self.engine_state()
            if state[1] == 0 and state[0] == 0.0:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: {state}")
            time.sleep(0.05)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.serving.shutdown()


def build_small_engine(args):
    """`cli.build_engine` for the tiny model with one bucket per step dimension (one
    program to compile): the engine-core process's `build` in tests (picklable)."""
    from prefixcache.engine import Engine
    from prefixcache.model import ModelConfig

    kw = {"manager_kwargs": {"enable_events": True}} if args.kv_events_endpoint else {}
    return Engine(ModelConfig.tiny(), num_blocks=args.num_blocks,
                  block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_model_len, seed=args.seed,
                  token_buckets=(args.max_num_batched_tokens,),
                  seq_buckets=(args.max_num_seqs,),
                  page_buckets=(args.max_model_len // args.block_size,), **kw)


def build_refused(args):
    """A `build` that refuses its arguments, as `cli.build_engine` does a bad model."""
    raise ValueError(f"no model {args.model!r} here")
