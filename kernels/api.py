"""`paged_attention`: one entry point over the reference and Pallas backends."""
from __future__ import annotations

import jax

from kernels.common import validate_inputs
from kernels.reference import ragged_paged_attention_reference

BACKENDS = ("auto", "reference")


def _resolve_backend(backend: str, interpret: bool) -> str:
  if backend not in BACKENDS:
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
  if backend == "auto":
    return "reference"
  return backend


def paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                    sm_scale, sliding_window=None, soft_cap=None, backend="auto",
                    interpret=False):
  """Ragged paged attention (see `ragged_paged_attention_reference` for semantics).

  Args:
    q: [num_tokens, num_q_heads, head_dim], f32 or bf16.
    kv_pages: [num_pages, page_size, 2*num_kv_heads, head_dim], f32 or bf16.
    kv_lens: i32[max_num_seqs].
    page_indices: i32[max_num_seqs, pages_per_seq].
    cu_q_lens: i32[max_num_seqs + 1].
    num_seqs: i32[1].
    sm_scale, sliding_window, soft_cap: static scalars.
    backend: "auto" | "reference".
    interpret: run a Pallas backend in interpret mode (any platform).

  Returns:
    [num_tokens, num_q_heads, head_dim] in q's dtype.

  Raises:
    ValueError: unknown/unavailable backend, or bad shapes/dtypes.
  """
  name = _resolve_backend(backend, interpret)
  validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                  sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
  del name
  return ragged_paged_attention_reference(
      q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
      sliding_window=sliding_window, soft_cap=soft_cap)
