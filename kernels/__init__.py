"""Paged-attention kernels (pure JAX; never imports prefixcache).

Public API:
- `paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
  sliding_window=None, soft_cap=None, backend="auto", interpret=False)`
- `ragged_paged_attention_reference(...)`: the same minus backend/interpret.
- `write_kv(kv_pages, k, v, slot_mapping) -> kv_pages`.
"""
from kernels.api import BACKENDS, paged_attention
from kernels.reference import ragged_paged_attention_reference
from kernels.write_kv import write_kv

__all__ = ["BACKENDS", "paged_attention", "ragged_paged_attention_reference", "write_kv"]
