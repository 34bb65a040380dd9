"""Writes vllm_groups.json: vLLM 0.33's KV cache groups for hybrid layer patterns.

Run with the vLLM peer venv (CI has no vLLM; tests/model/test_model_kv_layout.py pins
`ModelConfig.kv_groups` to this file):

    ~/.cache/prefixcache-peers/vllm-venv/bin/python tests/data/kv_groups_golden/make_golden.py

Each pattern is a layer string (F: full attention, S: sliding window); each group is
[kind, layer indices] in vLLM's order (`_get_kv_cache_groups_uniform_page_size`, the
path every hybrid model with one page size takes).
"""
import json
import pathlib

import torch
import vllm
from vllm.v1.core.kv_cache_planning import _get_kv_cache_groups_uniform_page_size
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

PATTERNS = ["SSFS", "FFSS", "SFSS", "FFSSS", "FSFS", "SSSSSF" * 2, "FS", "SSSFFF", "FFFSS",
            "SFFFSSS", "FSSSSSSSS"]


def main():
    out = {"vllm_version": vllm.__version__, "groups": {}}
    for p in PATTERNS:
        kw = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
        spec = {f"layers.{i}": FullAttentionSpec(**kw) if c == "F"
                else SlidingWindowSpec(sliding_window=8, **kw) for i, c in enumerate(p)}
        out["groups"][p] = [
            ["F" if isinstance(g.kv_cache_spec, FullAttentionSpec) else "S",
             [int(n.split(".")[1]) for n in g.layer_names]]
            for g in _get_kv_cache_groups_uniform_page_size(spec)]
    path = pathlib.Path(__file__).with_name("vllm_groups.json")
    lines = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in out["groups"].items())
    path.write_text(f'{{"vllm_version": {json.dumps(out["vllm_version"])}, "groups": {{\n'
                    f"{lines}\n}}}}\n")


if __name__ == "__main__":
    main()
