"""The tiny model's tokenizer (`prefixcache.text.Tokenizer.tiny()`), built in code.

A byte-level BPE over exactly `ModelConfig.tiny().vocab_size` = 512 ids, so every id the
tiny model samples has text:

    0 .. 255    the 256 bytes (id = byte value; GPT-2's byte-level alphabet spells them)
    256 .. 508  253 merges learned here from `_CORPUS` (greedy BPE, below)
    509 .. 511  <|endoftext|>, <|im_start|>, <|im_end|> (special)

The merges are learned by a few lines of plain Python, not by a library's trainer: most
frequent adjacent pair first, ties broken by the pair itself, over the words GPT-2's
byte-level pre-tokenizer splits the corpus into. So the ids are the same on every
machine and every version of `tokenizers` (cached prefixes and traces stay comparable),
and nothing is downloaded or read from disk.
"""

from __future__ import annotations

import collections

NUM_IDS = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NUM_MERGES = NUM_IDS - 256 - len(SPECIAL_TOKENS)

# ChatML (content parts of type "text" are joined, as the OpenAI API's).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_CORPUS = """\
You are a helpful assistant. Answer the question briefly and well.
The user asks: what is the capital of France? The assistant answers: Paris.
Prefix caching reuses the KV cache of a shared prompt prefix, so a request that
starts with the same system prompt as an earlier one skips most of its prefill.
The quick brown fox jumps over the lazy dog. Hello, world! How are you today?
I am fine, thank you. Please summarize the following document in three sentences.
def main():
    for i in range(10):
        print(i, "hello")
    return 0
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; punctuation: . , ; : ! ? ( ) [ ] { } " '
The time to first token and the throughput of a server are what a client measures.
This is a test of the tiny model, which has random weights and says nothing useful.
"""


def learn_merges(text: str, num_merges: int) -> list[tuple[str, str]]:
    """The first `num_merges` BPE merges of `text` (byte-level alphabet spellings).

    Raises:
      ValueError: the text has fewer mergeable pairs than `num_merges`.
    """
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = collections.Counter(w for w, _ in pre.pre_tokenize_str(text))
    seqs = {tuple(w): c for w, c in words.items()}
    merges = []
    while len(merges) < num_merges:
        pairs: collections.Counter = collections.Counter()
        for seq, c in seqs.items():
            for pair in zip(seq, seq[1:]):
                pairs[pair] += c
        if not pairs:
            raise ValueError(f"the corpus has only {len(merges)} merges, "
                             f"{num_merges} wanted")
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        joined = best[0] + best[1]
        new = {}
        for seq, c in seqs.items():
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            new[tuple(out)] = new.get(tuple(out), 0) + c
        seqs = new
    return merges


def build_backend():
    """The `tokenizers.Tokenizer` of the tiny model (see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from prefixcache.text import _byte_alphabet

    by_byte = {b: ch for ch, b in _byte_alphabet().items()}
    vocab = {by_byte[b]: b for b in range(256)}
    merges = learn_merges(_CORPUS, NUM_MERGES)
    for a, b in merges:
        vocab[a + b] = len(vocab)
    assert len(vocab) == 256 + NUM_MERGES, "a merge repeated a token"
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                     use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in SPECIAL_TOKENS])
    assert backend.get_vocab_size(with_added_tokens=True) == NUM_IDS
    return backend
