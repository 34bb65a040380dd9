"""Test helpers for the kernels tests: a paged-cache case builder and a float64 oracle.

The oracle is written independently of `prefixcache_kernels/`: it never reads pages, only the
contiguous per-sequence K/V the builder scattered into them, and does plain dense
attention in float64.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import jax.numpy as jnp


@dataclasses.dataclass
class Case:
  """One ragged paged-attention call plus the contiguous data it was built from.

  Invariants: every slot not holding a live token (unused pages, the tail of a
  sequence's last page, the padding page) is NaN, and so is every padding query token.
  """
  q: np.ndarray            # [T, Hq, D]
  kv_pages: np.ndarray     # [num_pages, page_size, 2*Hkv, D]
  kv_lens: np.ndarray      # i32[S]
  page_indices: np.ndarray  # i32[S, P]
  cu_q_lens: np.ndarray    # i32[S+1]
  num_seqs: np.ndarray     # i32[1]
  seqs: list               # [(q_len, kv_len)] of the live rows
  k_seq: list              # per live sequence f64[kv_len, Hkv, D] (as stored, rounded)
  v_seq: list

  def args(self):
    return (jnp.asarray(self.q), jnp.asarray(self.kv_pages), jnp.asarray(self.kv_lens),
            jnp.asarray(self.page_indices), jnp.asarray(self.cu_q_lens),
            jnp.asarray(self.num_seqs))

  @property
  def num_live_tokens(self) -> int:
    return int(self.cu_q_lens[len(self.seqs)])


def make_case(seed, seqs, *, num_kv_heads=1, group=1, head_dim=64, page_size=8,
              dtype=np.float32, max_num_seqs=None, pages_per_seq=None, num_tokens=None,
              extra_pages=2, garbage_padding_rows=True):
  """Builds a NaN-poisoned paged cache for the given live sequences.

  Args:
    seed: numpy RNG seed.
    seqs: list of (q_len, kv_len) with q_len <= kv_len.
    dtype: np.float32 or jnp.bfloat16 for q and kv_pages.
    max_num_seqs, pages_per_seq, num_tokens: padded table sizes (default: tight + 1).
    extra_pages: unused pages (NaN) scattered among the live ones.
    garbage_padding_rows: give padding rows nonzero kv_lens pointing at NaN pages.
  """
  rng = np.random.default_rng(seed)
  num_q_heads = num_kv_heads * group
  need_pages = [-(-kv // page_size) for _, kv in seqs]
  if pages_per_seq is None:
    pages_per_seq = max([1] + need_pages) + 1
  if max_num_seqs is None:
    max_num_seqs = len(seqs) + 1
  total_q = sum(q for q, _ in seqs)
  if num_tokens is None:
    num_tokens = total_q + 3
  assert num_tokens >= total_q and max_num_seqs >= len(seqs)
  num_alloc = sum(need_pages) + extra_pages
  num_pages = num_alloc + 1  # + the padding page, last
  pad_page = num_pages - 1
  perm = rng.permutation(num_alloc)  # random physical page order
  kv_pages = np.full((num_pages, page_size, 2 * num_kv_heads, head_dim), np.nan, np.float32)
  page_indices = np.full((max_num_seqs, pages_per_seq), pad_page, np.int32)
  kv_lens = np.zeros(max_num_seqs, np.int32)
  cu_q_lens = np.zeros(max_num_seqs + 1, np.int32)
  q = np.full((num_tokens, num_q_heads, head_dim), np.nan, np.float32)
  k_seq, v_seq = [], []
  next_page = 0
  for s, (q_len, kv_len) in enumerate(seqs):
    assert 0 <= q_len <= kv_len
    pages = perm[next_page:next_page + need_pages[s]]
    next_page += need_pages[s]
    page_indices[s, :len(pages)] = pages
    kv_lens[s] = kv_len
    cu_q_lens[s + 1] = cu_q_lens[s] + q_len
    k = rng.standard_normal((kv_len, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((kv_len, num_kv_heads, head_dim)).astype(np.float32)
    k = np.asarray(jnp.asarray(k, dtype).astype(jnp.float32))  # round as stored
    v = np.asarray(jnp.asarray(v, dtype).astype(jnp.float32))
    for t in range(kv_len):
      page, off = pages[t // page_size], t % page_size
      kv_pages[page, off, 0::2] = k[t]
      kv_pages[page, off, 1::2] = v[t]
    k_seq.append(k.astype(np.float64))
    v_seq.append(v.astype(np.float64))
    q[cu_q_lens[s]:cu_q_lens[s + 1]] = rng.standard_normal((q_len, num_q_heads, head_dim))
  cu_q_lens[len(seqs) + 1:] = cu_q_lens[len(seqs)]
  if garbage_padding_rows and max_num_seqs > len(seqs):
    # Padding rows: lengths that would read NaN pages if a kernel looked at them.
    kv_lens[len(seqs):] = page_size + 1
  q = np.array(jnp.asarray(q, dtype))  # writable copies
  kv_pages = np.array(jnp.asarray(kv_pages, dtype))
  return Case(q=q, kv_pages=kv_pages, kv_lens=kv_lens, page_indices=page_indices,
              cu_q_lens=cu_q_lens, num_seqs=np.array([len(seqs)], np.int32), seqs=list(seqs),
              k_seq=k_seq, v_seq=v_seq)


def oracle(case, *, sm_scale, sliding_window=None, soft_cap=None):
  """Float64 dense attention per live sequence; padding rows stay 0.

  Returns:
    f64[T, Hq, D].
  """
  q = np.asarray(jnp.asarray(case.q).astype(jnp.float32), np.float64)
  out = np.zeros_like(q)
  num_q_heads = q.shape[1]
  for s, (q_len, kv_len) in enumerate(case.seqs):
    k, v = case.k_seq[s], case.v_seq[s]  # [kv_len, Hkv, D]
    group = num_q_heads // k.shape[1]
    k = np.repeat(k, group, axis=1)  # [kv_len, Hq, D]
    v = np.repeat(v, group, axis=1)
    start = int(case.cu_q_lens[s])
    for i in range(q_len):
      pos = kv_len - q_len + i
      logits = np.einsum("hd,lhd->hl", q[start + i], k) * sm_scale
      if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
      lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
      visible = np.zeros(kv_len, bool)
      visible[lo:pos + 1] = True
      logits = np.where(visible[None], logits, -np.inf)
      w = np.exp(logits - logits.max(axis=-1, keepdims=True))
      w /= w.sum(axis=-1, keepdims=True)
      out[start + i] = np.einsum("hl,lhd->hd", w, v)
  return out


def tolerance(dtype):
  """(rtol, atol) matched to the input dtype."""
  if jnp.dtype(dtype) == jnp.bfloat16:
    return 2e-2, 2e-2
  return 1e-5, 1e-5
