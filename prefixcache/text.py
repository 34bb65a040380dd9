"""Text in, text out: tokenizer, chat template and incremental detokenizer (host only).

    from prefixcache.text import Tokenizer

    tok = Tokenizer.from_pretrained("SmolLM2-135M-Instruct.Q4_1.gguf")  # or an HF directory
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    detok = tok.detokenizer(ids, stop=("\\n\\n",))
    for token_id in generated:            # streaming: one text delta per push
        print(detok.push([token_id]), end="")
    print(detok.flush())

The tokenizer is a `tokenizers.Tokenizer` (Hugging Face's Rust library, what transformers'
fast tokenizers run on), built from an HF directory's `tokenizer.json` or, for a GGUF file,
from its metadata the way transformers' GGUF converter does
(`transformers/integrations/gguf/gguf_tokenizer_mapping.py`). The chat template renders in a
sandboxed jinja2 environment set up as transformers' `apply_chat_template` sets it up. The
detokenizer is vLLM's incremental detokenization (prefix/read offsets).

Optional dependencies (`pip install 'prefixcache[text]'`): tokenizers, jinja2, gguf. Nothing
here imports jax.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Mapping, Sequence

from prefixcache._gguf import plain_array_reader

_EXTRA_HINT = "pip install 'prefixcache[text]'"

# GGUF token types (llama.cpp's llama_token_type / gguf.TokenType).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens decoded as context for the
# first output token (so a leading space or a merge with the prompt's tail decodes right).
_PROMPT_CONTEXT_TOKENS = 5

# End-of-generation token texts llama.cpp recognises in a vocabulary besides eos
# (llama-vocab.cpp, "special_eog_ids"): a turn ends on them even where eos is another token.
_EOG_TOKEN_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>")

# Pre-tokenizer split regexes by GGUF `tokenizer.ggml.pre`, as transformers' GGUF converter
# (GGUF_PRE_TOKENIZER_SPLITS) and llama.cpp (llama-vocab.cpp) use them. None: the GPT-2
# regex of the ByteLevel pre-tokenizer itself.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_PRE_SPLITS = {
    "default": None, "gpt2": None, "gpt-2": None,
    # NOTE: llama.cpp splits every digit off first for these (the vocabularies were trained
    # with individual digits); transformers uses the plain GPT-2 regex. Their vocabularies
    # have no multi-digit tokens, so both give the same ids (tests/data golden).
    "smollm": "digits", "starcoder": "digits", "refact": "digits",
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
}


# GGUF architectures whose SentencePiece ("llama") vocabulary `from_gguf` builds.
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

# Gemma 3's chat template (google/gemma-3-*-it tokenizer_config.json), for gemma3 GGUF
# files that carry none (the base models' files): a system message becomes the first user
# turn's prefix, the assistant's role is "model", turns end with <end_of_turn>.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n")


def _require(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"prefixcache.text needs the {module.split('.')[0]!r} package: "
                          f"{_EXTRA_HINT}") from e


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json write it."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


class Tokenizer:
    """A text tokenizer with its special tokens and chat template.

    Build one with `from_pretrained(path)` (an HF directory or a .gguf file). Token ids are
    those of the model's vocabulary (`vocab_size` = the embedding rows the file declares,
    added tokens included).

    Attributes:
      vocab_size: the number of token ids (added tokens included).
      bos_token_id, eos_token_id: None when the tokenizer declares none.
      stop_token_ids: eos plus the end-of-turn tokens the generation config or the GGUF file
        declares (e.g. `<|im_end|>` for ChatML), what an engine stops on by default.
      chat_template: the jinja2 template, or None.
      name_or_path: where it came from.
    """

    def __init__(self, backend, *, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, stop_token_ids: Sequence[int] = (),
                 chat_template: str | None = None, special_tokens: Mapping[str, str] | None = None,
                 name_or_path: str = "<tokenizer>"):
        """Wraps a built `tokenizers.Tokenizer` (use the from_* constructors instead).

        Args:
          backend: a `tokenizers.Tokenizer` (its post-processor adds BOS/EOS, if any).
          bos_token_id, eos_token_id: ids of the BOS/EOS tokens, or None.
          stop_token_ids: extra stop ids (eos is always among `stop_token_ids`).
          chat_template: the jinja2 chat template, or None.
          special_tokens: "bos_token", "eos_token", "unk_token", "pad_token" -> their text,
            passed to the chat template as variables.
          name_or_path: for messages.

        Raises:
          ValueError: a token id outside the vocabulary.
        """
        self._backend = backend
        self.name_or_path = str(name_or_path)
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        for name, v in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if v is not None and not 0 <= int(v) < self.vocab_size:
                raise ValueError(f"{self.name_or_path}: {name}={v} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        self.bos_token_id = None if bos_token_id is None else int(bos_token_id)
        self.eos_token_id = None if eos_token_id is None else int(eos_token_id)
        stops = [] if self.eos_token_id is None else [self.eos_token_id]
        for t in stop_token_ids:
            t = int(t)
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"{self.name_or_path}: stop token id {t} is outside the "
                                 f"vocabulary [0, {self.vocab_size})")
            if t not in stops:
                stops.append(t)
        self.stop_token_ids: tuple[int, ...] = tuple(stops)
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"{self.name_or_path}: chat_template must be a string, got "
                             f"{type(chat_template).__name__}")
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in dict(special_tokens or {}).items()
                               if v is not None}
        if self.bos_token_id is not None:
            self.special_tokens.setdefault("bos_token", backend.id_to_token(self.bos_token_id))
        if self.eos_token_id is not None:
            self.special_tokens.setdefault("eos_token", backend.id_to_token(self.eos_token_id))

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token_id}, eos={self.eos_token_id}, "
                f"stop={self.stop_token_ids})")

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer`."""
        return self._backend

    # -- construction -----------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path) -> "Tokenizer":
        """From an HF directory (with tokenizer.json) or a .gguf file.

        Raises:
          FileNotFoundError: nothing at `path`.
          ValueError: neither a directory with tokenizer.json nor a GGUF file.
        """
        p = os.fspath(path)
        if os.path.isdir(p):
            return cls.from_hf_dir(p)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                magic = f.read(4)
            if magic == b"GGUF":
                return cls.from_gguf(p)
            raise ValueError(f"{p}: not a GGUF file (magic {magic!r}, expected b'GGUF') and "
                             "not a directory; give an HF model directory (tokenizer.json) "
                             "or a .gguf file")
        raise FileNotFoundError(f"no tokenizer at {p}: no such file or directory")

    @classmethod
    def from_hf_dir(cls, path) -> "Tokenizer":
        """From an HF directory: tokenizer.json, plus tokenizer_config.json (chat template,
        special tokens), generation_config.json (eos ids) and special_tokens_map.json when
        present; a `chat_template.jinja` file overrides the config's template.

        Raises:
          FileNotFoundError: the directory or its tokenizer.json is missing.
          ValueError: a file that cannot be parsed.
        """
        tokenizers = _require("tokenizers")
        d = os.fspath(path)
        if not os.path.isdir(d):
            raise FileNotFoundError(f"no such tokenizer directory: {d}")
        tj = os.path.join(d, "tokenizer.json")
        if not os.path.isfile(tj):
            raise FileNotFoundError(f"{d} has no tokenizer.json (only fast-tokenizer "
                                    "directories are supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(tj)
        except Exception as e:  # tokenizers raises its own Exception type
            raise ValueError(f"cannot parse {tj}: {e}") from None

        def optional(name):
            f = os.path.join(d, name)
            return _read_json(f) if os.path.isfile(f) else {}

        config = optional("tokenizer_config.json")
        special_map = optional("special_tokens_map.json")
        gen = optional("generation_config.json")
        special = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            v = _token_content(config.get(key))
            if v is None:
                v = _token_content(special_map.get(key))
            if v is not None:
                special[key] = v

        def token_id(name):
            text = special.get(name)
            return None if text is None else backend.token_to_id(text)

        bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
        gen_eos = gen.get("eos_token_id")
        gen_eos = [] if gen_eos is None else ([gen_eos] if isinstance(gen_eos, int)
                                              else list(gen_eos))
        if eos_id is None and gen_eos:
            eos_id = gen_eos[0]
        if bos_id is None and isinstance(gen.get("bos_token_id"), int):
            bos_id = gen["bos_token_id"]
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
            named = {t.get("name"): t.get("template") for t in template
                     if isinstance(t, Mapping)}
            template = named.get("default", next(iter(named.values()), None))
        jinja_file = os.path.join(d, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        stops = list(gen_eos) + _template_eog_ids(backend, template)
        return cls(backend, bos_token_id=bos_id, eos_token_id=eos_id, stop_token_ids=stops,
                   chat_template=template, special_tokens=special, name_or_path=d)

    @classmethod
    def from_gguf(cls, path, *, reader=None) -> "Tokenizer":
        """From a GGUF file's tokenizer metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).

        Supports `tokenizer.ggml.model` "gpt2" (byte-level BPE; pre-tokenizer by
        `tokenizer.ggml.pre`: gpt2/default, smollm/starcoder, llama-bpe/llama3, qwen2 and
        their aliases) as transformers' GGUF converter builds it: BPE over the vocabulary
        and merges, ByteLevel pre-tokenizer and decoder, CONTROL tokens added as special
        tokens and USER_DEFINED ones as plain added tokens.

        Args:
          path: the .gguf file.
          reader: a `gguf.GGUFReader` of `path` already open (e.g. the weights loader's):
            parsing the metadata of a 49k-token vocabulary takes seconds, so share it.

        Raises:
          FileNotFoundError: no such file.
          ValueError: not a GGUF file, no tokenizer in it, or a tokenizer model or
            pre-tokenizer this does not build (named).
        """
        gguf = _require("gguf")
        tokenizers = _require("tokenizers")
        p = os.fspath(path)
        if not os.path.isfile(p):
            raise FileNotFoundError(f"no such GGUF file: {p}")
        if reader is not None and not isinstance(reader, gguf.GGUFReader):
            raise ValueError(f"reader must be a gguf.GGUFReader, got {type(reader).__name__}")
        try:
            reader = plain_array_reader(gguf)(p, "r") if reader is None else reader
        except Exception as e:  # the reader raises ValueError/struct errors on bad files
            raise ValueError(f"cannot read GGUF file {p}: {type(e).__name__}: {e}") from None
        fields = reader.fields

        def get(key, default=None):
            f = fields.get(key)
            return default if f is None else f.contents()

        model = get("tokenizer.ggml.model")
        if model is None:
            raise ValueError(f"{p}: the GGUF file has no tokenizer (no tokenizer.ggml.model)")
        if model == "llama":
            return cls._from_gguf_sentencepiece(p, get)
        if model != "gpt2":
            raise ValueError(f"{p}: tokenizer.ggml.model={model!r} is not supported (only "
                             "'gpt2', byte-level BPE, and Gemma's 'llama', SentencePiece)")
        pre = get("tokenizer.ggml.pre", "default")
        if pre not in _GGUF_PRE_SPLITS:
            raise ValueError(f"{p}: tokenizer.ggml.pre={pre!r} is not supported; known: "
                             f"{sorted(_GGUF_PRE_SPLITS)}")
        tokens = get("tokenizer.ggml.tokens")
        merges = get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise ValueError(f"{p}: tokenizer.ggml.tokens / tokenizer.ggml.merges missing")
        types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise ValueError(f"{p}: {len(types)} token types for {len(tokens)} tokens")

        # NOTE: as transformers' byte_level_tokenizer: a token spelled outside the
        # byte-level alphabet (an added token such as "<think>" with raw characters is
        # fine; real text would be "Ġ..."-spelled) is respelled through the byte alphabet.
        alphabet = _byte_alphabet()
        spelled = [t if set(t) <= alphabet.keys() else "".join(_byte_spell(t)) for t in tokens]
        vocab = {}
        for i, t in enumerate(spelled):
            vocab.setdefault(t, i)
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise ValueError(f"{p}: malformed merge {m!r} (expected 'left right')")
            pairs.append((a, b))
        models, pre_tokenizers, decoders, processors = (
            tokenizers.models, tokenizers.pre_tokenizers, tokenizers.decoders,
            tokenizers.processors)
        backend = tokenizers.Tokenizer(models.BPE(
            vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
            end_of_word_suffix="", fuse_unk=False))
        split = _GGUF_PRE_SPLITS[pre]
        add_prefix_space = bool(get("tokenizer.ggml.add_space_prefix", False))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
        elif split == "digits":
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)])
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)])
        backend.decoder = decoders.ByteLevel()
        control = [tokenizers.AddedToken(t, normalized=False, special=True)
                   for t, ty in zip(tokens, types)
                   if ty == _TOKEN_TYPE_CONTROL and set(t) <= alphabet.keys()]
        user = [tokenizers.AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_USER_DEFINED]
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens(user)
        return cls._from_gguf_backend(p, get, backend, tokens, types)

    @classmethod
    def _from_gguf_sentencepiece(cls, p: str, get) -> "Tokenizer":
        """A SentencePiece ("llama") GGUF vocabulary of a Gemma model, as transformers'
        GGUF converter builds it (`gemma_tokenizer` + `GemmaTokenizer`): space-only tokens
        respelled with U+2581, BPE merges recovered from the vocabulary ranked by file
        order (Gemma's scores do not follow its merge order), byte fallback, spaces
        normalised to U+2581, CONTROL tokens special, USER_DEFINED ones plain added
        tokens. A gemma3 file without `tokenizer.chat_template` gets Gemma 3's own
        (`GEMMA3_CHAT_TEMPLATE`)."""
        tokenizers = _require("tokenizers")
        arch = get("general.architecture")
        if arch not in _GEMMA_ARCHITECTURES:
            raise ValueError(f"{p}: tokenizer.ggml.model='llama' (SentencePiece) is supported "
                             f"for {sorted(_GEMMA_ARCHITECTURES)} files only, not "
                             f"general.architecture={arch!r}")
        tokens = get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError(f"{p}: tokenizer.ggml.tokens missing")
        types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise ValueError(f"{p}: {len(types)} token types for {len(tokens)} tokens")
        spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}
        unk_id = get("tokenizer.ggml.unknown_token_id")
        unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(
            tokens) else "<unk>"
        backend = tokenizers.Tokenizer(tokenizers.models.BPE(
            vocab=vocab, merges=_merges_from_vocab(vocab, {t: -i for i, t in
                                                          enumerate(spelled)}),
            fuse_unk=True, unk_token=unk, dropout=None, byte_fallback=True))
        backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(
            pattern=" ", behavior="merged_with_previous", invert=False)
        backend.decoder = tokenizers.decoders.Sequence([
            tokenizers.decoders.Replace("\u2581", " "), tokenizers.decoders.ByteFallback(),
            tokenizers.decoders.Fuse()])
        backend.normalizer = tokenizers.normalizers.Replace(" ", "\u2581")
        control = [tokenizers.AddedToken(t, normalized=False, special=True)
                   for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_CONTROL]
        if control:
            backend.add_special_tokens(control)
        known = backend.get_vocab(with_added_tokens=True)
        user = [tokenizers.AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_USER_DEFINED and t in known]
        if user:
            backend.add_tokens(user)
        template = get("tokenizer.chat_template")
        if template is None and arch == "gemma3":
            template = GEMMA3_CHAT_TEMPLATE
        return cls._from_gguf_backend(p, get, backend, tokens, types, chat_template=template)

    @classmethod
    def _from_gguf_backend(cls, p: str, get, backend, tokens, types, *,
                           chat_template: str | None = None) -> "Tokenizer":
        """The GGUF file's special token ids, BOS/EOS post-processor and end-of-turn ids
        around a built backend."""
        tokenizers = _require("tokenizers")
        processors = tokenizers.processors
        if chat_template is None:
            chat_template = get("tokenizer.chat_template")

        def token_id(key):
            v = get(key)
            if v is None:
                return None
            v = int(v)
            if not 0 <= v < len(tokens):
                raise ValueError(f"{p}: {key}={v} is outside the vocabulary of "
                                 f"{len(tokens)} tokens")
            return v

        bos_id = token_id("tokenizer.ggml.bos_token_id")
        eos_id = token_id("tokenizer.ggml.eos_token_id")
        unk_id = token_id("tokenizer.ggml.unknown_token_id")
        pad_id = token_id("tokenizer.ggml.padding_token_id")
        add_bos = bool(get("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(get("tokenizer.ggml.add_eos_token", False))
        if (add_bos and bos_id is not None) or (add_eos and eos_id is not None):
            single = ((["$A:0"] if not add_bos or bos_id is None else [tokens[bos_id], "$A:0"])
                      + ([tokens[eos_id]] if add_eos and eos_id is not None else []))
            pair = single + [s.replace("$A", "$B") for s in single if s.startswith("$A")]
            special = [(tokens[i], i) for i in {bos_id if add_bos else None,
                                                eos_id if add_eos else None} - {None}]
            backend.post_processor = processors.TemplateProcessing(
                single=single, pair=pair, special_tokens=special)
        else:
            backend.post_processor = processors.ByteLevel(trim_offsets=False)
        # End of generation, as llama.cpp decides it: eos, eot/eom ids, and the vocabulary's
        # control tokens spelled as a known end-of-turn token.
        stops = [i for i in (token_id("tokenizer.ggml.eot_token_id"),
                             token_id("tokenizer.ggml.eom_token_id")) if i is not None]
        stops += [i for i, (t, ty) in enumerate(zip(tokens, types))
                  if t in _EOG_TOKEN_TEXTS and ty in (_TOKEN_TYPE_CONTROL,
                                                      _TOKEN_TYPE_USER_DEFINED)]
        special_text = {name: tokens[i] for name, i in (
            ("bos_token", bos_id), ("eos_token", eos_id), ("unk_token", unk_id),
            ("pad_token", pad_id)) if i is not None}
        return cls(backend, bos_token_id=bos_id, eos_token_id=eos_id,
                   stop_token_ids=stops, chat_template=chat_template,
                   special_tokens=special_text, name_or_path=p)

    # -- text <-> ids -----------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (special tokens written in it are matched whole).

        Args:
          add_special_tokens: add BOS/EOS as the tokenizer's post-processor does (for
            most chat models: nothing; Llama-style: BOS).

        Raises:
          ValueError: `text` is not a str.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return list(self._backend.encode(text, add_special_tokens=bool(add_special_tokens)).ids)

    def _check_ids(self, token_ids) -> list[int]:
        if isinstance(token_ids, (str, bytes)):
            raise ValueError(f"token ids must be a sequence of ints, got {type(token_ids).__name__}")
        try:
            ids = list(token_ids)
        except TypeError:
            raise ValueError(f"token ids must be a sequence of ints, got "
                             f"{type(token_ids).__name__}") from None
        out = []
        n = self.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise ValueError(f"token id at position {i} is not an int: {t!r}")
            t = int(t)
            if not 0 <= t < n:
                raise ValueError(f"token id {t} at position {i} is outside the vocabulary "
                                 f"[0, {n})")
            out.append(t)
        return out

    def decode(self, token_ids, *, skip_special_tokens: bool = True) -> str:
        """The text of `token_ids` (invalid UTF-8 becomes U+FFFD, as in transformers).

        Raises:
          ValueError: not a sequence of ints, or an id outside the vocabulary.
        """
        ids = self._check_ids(token_ids)
        return self._backend.decode(ids, skip_special_tokens=bool(skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # -- chat -------------------------------------------------------------------------

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True,
                            tokenize: bool = False, tools=None, chat_template: str | None = None,
                            **template_kwargs) -> str | list[int]:
        """Renders a conversation with the chat template, as transformers does.

        Args:
          messages: a list of {"role": str, "content": str | list | None, ...} mappings.
          add_generation_prompt: end with the assistant turn's header.
          tokenize: return token ids (the rendered text encoded without adding special
            tokens, as transformers) instead of the text.
          tools: tool schemas passed to the template as `tools`.
          chat_template: render this template instead of the tokenizer's.
          template_kwargs: extra template variables (e.g. `documents`, `enable_thinking`).

        Raises:
          ValueError: no chat template; malformed messages (the bad index named); the
            template raised (`raise_exception`) or failed to render.
        """
        jinja2 = _require("jinja2")
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError(f"tokenizer {self.name_or_path!r} has no chat template: pass "
                             "chat_template=..., or give token ids / plain text instead")
        messages = _check_messages(messages)
        compiled = _compile_template(template)
        variables = {**self.special_tokens, **template_kwargs}
        try:
            text = compiled.render(messages=messages, tools=tools,
                                   add_generation_prompt=bool(add_generation_prompt),
                                   **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template of {self.name_or_path!r} failed: {e}") from None
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    def detokenizer(self, prompt_token_ids=(), *, skip_special_tokens: bool = True,
                    stop: Sequence[str] = (), include_stop_str_in_output: bool = False
                    ) -> "IncrementalDetokenizer":
        """A streaming detokenizer for one request's output (see IncrementalDetokenizer)."""
        return IncrementalDetokenizer(self, prompt_token_ids,
                                      skip_special_tokens=skip_special_tokens, stop=stop,
                                      include_stop_str_in_output=include_stop_str_in_output)

    @classmethod
    def tiny(cls) -> "Tokenizer":
        """The tokenizer of the `tiny` model preset (`ModelConfig.tiny()`), built in code.

        A byte-level BPE over exactly the tiny model's 512 ids (256 bytes, 253 merges
        learned deterministically from a built-in text, `<|endoftext|>`, `<|im_start|>`,
        `<|im_end|>`) with a ChatML chat template; see `prefixcache._tiny_tokenizer`.
        It declares no eos: the tiny model's weights are random and end no turn, so
        generation ends at `max_tokens` or a stop string, and token-id requests run as
        they do without a tokenizer.
        """
        from prefixcache._tiny_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, build_backend

        return cls(build_backend(), chat_template=CHAT_TEMPLATE,
                   special_tokens={"unk_token": SPECIAL_TOKENS[0],
                                   "pad_token": SPECIAL_TOKENS[0]},
                   name_or_path="tiny")


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: character -> byte (bytes_to_unicode, inverted)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _byte_spell(text: str) -> list[str]:
    inv = {b: c for c, b in _byte_alphabet().items()}
    return [inv[b] for b in text.encode("utf-8")]


def _merges_from_vocab(vocab: Mapping[str, int], scores: Mapping[str, float]
                       ) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary, best first, as transformers'
    `generate_merges(vocab, vocab_scores)` orders them: every split of a token into two
    tokens, ranked by the token's score (higher first), then the shorter left piece."""
    merges = []
    for merge, score in scores.items():
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge))
                 if merge[:i] in vocab and merge[i:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _template_eog_ids(backend, template: str | None) -> list[int]:
    """Ids of known end-of-turn tokens that the chat template writes (a ChatML template
    ends every turn with `<|im_end|>`): the model ends its turn with them too."""
    if not template:
        return []
    out = []
    for text in _EOG_TOKEN_TEXTS:
        if text in template and (i := backend.token_to_id(text)) is not None:
            out.append(i)
    return out


def _check_messages(messages) -> list[dict]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} mappings, got "
                         f"{type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"message {i} must be a mapping with 'role' and 'content', got "
                             f"{type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {i} has no 'role' string (got {role!r})")
        if "content" not in m and "tool_calls" not in m:
            raise ValueError(f"message {i} (role {role!r}) has no 'content'")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"message {i} (role {role!r}): content must be a str, a list "
                             f"of parts or None, got {type(content).__name__}")
        out.append(dict(m))
    return out


@functools.lru_cache(maxsize=16)
def _compile_template(template: str):
    """The template compiled as transformers compiles it (`_compile_jinja_template`):
    immutable sandbox, trim_blocks + lstrip_blocks, loop controls, `tojson` without ASCII
    escaping, `raise_exception`, `strftime_now`, and the `{% generation %}` block."""
    jinja2 = _require("jinja2")
    from jinja2 import ext, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationBlock(ext.Extension):
        # transformers' AssistantTracker: `{% generation %}...{% endgeneration %}` marks
        # assistant text for masks; rendering just keeps the body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body
                                   ).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not parse: {e}") from None


class IncrementalDetokenizer:
    """Streams one request's output text, token by token, as vLLM detokenizes.

    `push(ids)` returns the new text; `flush()` what is still held back at the end. Held
    back: an incomplete UTF-8 character (the text so far ends in U+FFFD) and, with stop
    strings and `include_stop_str_in_output=False`, the longest tail that is a prefix of a
    stop string. When a stop string appears, `stopped` is set, `stop_reason` is the string,
    and the text ends before it (or after it, with `include_stop_str_in_output`); later
    pushes are refused.

    Invariants:
      - `text` == the concatenation of everything push() and flush() returned;
      - after flush() (without a stop), `text == tokenizer.decode(output ids)`: the
        prompt's last tokens are decoded as context only (for byte-level BPE the context
        changes nothing);
      - `prefix_offset <= read_offset <= len(all ids)`; the ids in
        [prefix_offset, read_offset) decode to complete characters.

    Attributes:
      text: all output text returned so far.
      token_ids: the output token ids pushed so far.
      stopped, stop_reason: whether and on which stop string it stopped.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids=(), *,
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False):
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        self._tok = tokenizer
        self._ids = tokenizer._check_ids(prompt_token_ids)
        self._num_prompt = len(self._ids)
        self._skip = bool(skip_special_tokens)
        self._stop = stop
        self._include_stop = bool(include_stop_str_in_output)
        self.prefix_offset = max(len(self._ids) - _PROMPT_CONTEXT_TOKENS, 0)
        self.read_offset = len(self._ids)
        self._decoded = ""      # output text decoded so far (complete characters)
        self._search_from = 0   # no stop string can start before this offset of _decoded
        self.text = ""
        self.stopped = False
        self.stop_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self._ids[self._num_prompt:]

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tok._backend.decode(self._ids[start:end],
                                         skip_special_tokens=self._skip)

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds output tokens; returns the new text (possibly "").

        Raises:
          ValueError: ids not ints in the vocabulary, or the detokenizer already stopped.
        """
        if self.stopped:
            raise ValueError(f"the detokenizer stopped on {self.stop_reason!r}; no more "
                             "tokens can be pushed")
        ids = self._tok._check_ids(token_ids)
        if not ids:
            return ""
        self._ids.extend(ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        # NOTE: vLLM's rule: emit only when the new text is longer and does not end in
        # U+FFFD (a multi-byte character still incomplete); the window then moves on.
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._decoded += new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Returns whatever is held back (incomplete characters decode as U+FFFD)."""
        if not self.stopped and self.read_offset < len(self._ids):
            prefix_text = self._decode(self.prefix_offset, self.read_offset)
            self._decoded += self._decode(self.prefix_offset)[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        decoded = self._decoded
        if self._stop and not self.stopped:
            best = None
            for s in self._stop:
                i = decoded.find(s, self._search_from)
                if i >= 0 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                i, s = best
                self.stopped, self.stop_reason = True, s
                self._decoded = decoded = decoded[:i + len(s) if self._include_stop else i]
            else:
                # The longest tail that may still grow into a stop string.
                hold = 0
                for k in range(min(len(decoded) - self._search_from,
                                   max(map(len, self._stop)) - 1), 0, -1):
                    tail = decoded[-k:]
                    if any(s.startswith(tail) for s in self._stop):
                        hold = k
                        break
                self._search_from = len(decoded) - hold
        if self.stopped or final or not self._stop or self._include_stop:
            end = len(decoded)
        else:
            end = self._search_from
        delta = decoded[len(self.text):end] if end > len(self.text) else ""
        self.text += delta
        return delta
