"""A tiny byte-level BPE tokenizer saved as an HF directory, for tests (no weights needed).

`build_tiny_tokenizer_dir(path)` trains tokenizers' BPE on a few strings (vocabulary <= 512,
the tiny model's `ModelConfig.tiny().vocab_size`) and writes tokenizer.json,
tokenizer_config.json (with a ChatML chat template that uses raise_exception, loop controls
and tojson) and generation_config.json. tests/data/tiny_chat_tokenizer/ is its output (the
transformers goldens in tests/data/tiny_chat_template_golden.json were made from it).
"""

from __future__ import annotations

import json
import os

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools: ' + tools | tojson + '<|im_end|>\\n' }}"
    "{% elif messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are tiny.<|im_end|>\\n' }}{% endif %}\n"
    "{% for message in messages %}\n"
    "  {% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}\n"
    "  {% if message['role'] == 'system' and tools %}{% continue %}{% endif %}\n"
    "  {{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

TRAINING_TEXT = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. What is the capital of France? Paris.",
    "def f(x):\n    return x * 2\n",
    "Numbers 0123456789 and punctuation: .,;:!?()[]{}<>",
    "日本語 中文 한국어 😀 café naïve",
] * 4


def build_tiny_tokenizer_dir(path, *, vocab_size: int = 400) -> str:
    """Writes the tiny tokenizer's HF directory at `path`; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
              "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
              "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
              "model_max_length": 512, "clean_up_tokenization_spaces": False}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 0]}, f)
    return str(path)
