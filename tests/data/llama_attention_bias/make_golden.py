"""Writes a tiny LlamaForCausalLM checkpoint with attention_bias=True (q/k/v AND o_proj
biases, as transformers builds it) and its transformers logits, for
`tests/model/test_model_attention_bias.py`.

Run with a Python that has CPU torch and transformers (not the project's venv):
  ~/.cache/prefixcache-peers/hf-venv/bin/python tests/data/llama_attention_bias/make_golden.py
(made with torch 2.13.0+cpu, transformers 5.24.0).
"""
import json
import os

import numpy as np
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENS = [3, 17, 42, 5, 60, 9, 33, 1, 28, 50, 11, 7, 2, 45, 19, 63, 30, 8, 14, 22]


def main():
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(
      vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=128,
      rms_norm_eps=1e-5, rope_theta=10000.0, attention_bias=True, mlp_bias=False,
      tie_word_embeddings=False, torch_dtype="float32")
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      # transformers initialises biases to 0: give every parameter visible values.
      p.copy_(torch.randn_like(p) * (0.3 if name.endswith("bias") else 0.2))
    logits = model(torch.tensor([TOKENS])).logits[0].numpy().astype(np.float32)
  assert model.model.layers[0].self_attn.o_proj.bias is not None
  model.save_pretrained(HERE, safe_serialization=True)
  np.save(os.path.join(HERE, "logits.npy"), logits)
  with open(os.path.join(HERE, "tokens.json"), "w") as f:
    json.dump({"tokens": TOKENS, "torch": torch.__version__,
               "transformers": transformers.__version__}, f)


if __name__ == "__main__":
  main()
