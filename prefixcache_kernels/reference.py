"""Plain-jnp ragged paged attention: the oracle the Pallas kernels are checked against,
and the CPU path of `kernels.paged_attention`.

Semantics (docs/DESIGN.md, "The index-array contract"): query row i of sequence s sits at
absolute position `kv_lens[s] - q_len[s] + i` and attends causally to the first
`kv_lens[s]` tokens of its block table (within `sliding_window` tokens, itself
included, when set). Logits are `sm_scale * q.k`, soft-capped as
`soft_cap * tanh(logits / soft_cap)` before masking, softmax in float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from prefixcache_kernels.common import validate_inputs
from prefixcache_kernels.quant import dequantize

# NOTE: query-block sizes the per-sequence loop chooses between, per sequence the one
# with the least cost ceil(q_len / b) * b + _PASS_COST_ROWS * ceil(q_len / b): padded
# rows plus a charge per pass over the sequence's KV (ties to the larger block). Decode
# rows take the 1-row branch, so a decode batch costs one matrix-vector product per
# sequence rather than a padded block; a 128-token chunk runs as 2 x 64 rows.
_Q_BLOCK_BUCKETS = (1, 16, 64, 256)
_PASS_COST_ROWS = 8


def _attend_block(q_blk, k, v, key_ok, pos, *, sm_scale, sliding_window, soft_cap):
  """Attention of one block of query rows against one sequence's gathered KV.

  Args:
    q_blk: f32[num_kv_heads, group, block, head_dim], group = q heads per kv head.
    k: f32[num_kv_heads, kv_cap, head_dim].
    v: f32[num_kv_heads, kv_cap, head_dim].
    key_ok: bool[kv_cap], key index < kv_len (and not before the sequence's window);
      K and V are zero where it is False.
    pos: i32[block], absolute position of each query row.

  Returns:
    f32[num_kv_heads, group, block, head_dim]; rows with no visible key are 0.
  """
  # NOTE: HIGHEST keeps the products in true f32 on every platform (XLA:GPU would
  # otherwise use TF32, ~1e-3 relative error, on Ampere and newer).
  logits = jnp.einsum("hgqd,hld->hgql", q_blk, k, precision=lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32) * sm_scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  key_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
  mask = key_ok[None, :] & (key_pos[None, :] <= pos[:, None])  # [block, kv_cap]
  if sliding_window is not None:
    mask &= key_pos[None, :] > pos[:, None] - sliding_window
  logits = jnp.where(mask, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)  # fully masked row: avoid inf - inf
  p = jnp.exp(logits - m)  # masked -> exp(-inf) = 0
  denom = jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("hgql,hld->hgqd", p, v, precision=lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
  return out / jnp.where(denom == 0.0, 1.0, denom)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_reference(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                                     num_seqs, *, sm_scale, sliding_window=None,
                                     soft_cap=None, kv_scales=None):
  """Ragged paged attention in plain jnp (jittable, traced `num_seqs`).

  Args:
    q: [num_tokens, num_q_heads, head_dim], f32 or bf16; tokens of sequence s are rows
      `cu_q_lens[s]:cu_q_lens[s+1]`; rows past `cu_q_lens[num_seqs]` are padding.
    kv_pages: [num_pages, page_size, 2*num_kv_heads, head_dim], f32 or bf16; K of kv-head
      h at slot 2h, V at 2h+1.
    kv_lens: i32[max_num_seqs], KV tokens each sequence attends to (this step's included).
    page_indices: i32[max_num_seqs, pages_per_seq], page id of each block of a sequence.
    cu_q_lens: i32[max_num_seqs + 1], cumulative query lengths.
    num_seqs: i32[1], live rows of the tables.
    sm_scale: static float multiplying q.k.
    sliding_window: static int or None; a row at position p sees keys in
      (p - sliding_window, p].
    soft_cap: static float or None.
    kv_scales: None, or for float8_e4m3fn / int8 pages their f32[num_pages,
      2*num_kv_heads] scales (`kernels.quant`): each page is dequantized (times its
      scale) to f32 as it is loaded.

  Returns:
    [num_tokens, num_q_heads, head_dim] in q's dtype; padding rows are 0.
  """
  validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                  sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  kv_scales=kv_scales)
  num_tokens, num_q_heads, head_dim = q.shape
  _, page_size, num_combined, _ = kv_pages.shape
  num_kv_heads = num_combined // 2
  group = num_q_heads // num_kv_heads
  max_num_seqs, pages_per_seq = page_indices.shape
  kv_cap = pages_per_seq * page_size
  out = jnp.zeros_like(q)
  if num_tokens == 0:
    return out
  buckets = tuple(sorted({min(b, num_tokens) for b in _Q_BLOCK_BUCKETS}))
  attend = functools.partial(_attend_block, sm_scale=float(sm_scale),
                             sliding_window=sliding_window, soft_cap=soft_cap)
  n = jnp.clip(num_seqs[0], 0, max_num_seqs)

  def seq_body(s, out):
    q_start, q_end = cu_q_lens[s], cu_q_lens[s + 1]
    q_len = q_end - q_start
    kv_len = kv_lens[s]
    # [pages_per_seq, page_size, 2*num_kv_heads, head_dim] -> per-head contiguous K, V.
    kv = jnp.take(kv_pages, page_indices[s], axis=0, mode="clip")
    if kv_scales is not None:
      scales = jnp.take(kv_scales, page_indices[s], axis=0, mode="clip")  # [P, 2K]
      kv = dequantize(kv, scales[:, None, :, None])
    kv = kv.reshape(kv_cap, num_kv_heads, 2, head_dim)
    key_pos = jnp.arange(kv_cap, dtype=jnp.int32)
    key_ok = key_pos < kv_len
    if sliding_window is not None:  # before the window of the sequence's first row
      key_ok &= key_pos > kv_len - q_len - sliding_window
    # NOTE: zero K/V of the keys no row of the sequence sees (past kv_len, before the
    # window) so NaN / inf there cannot reach live rows: 0 * NaN would survive the
    # masked softmax weights in `p @ v`. Released out-of-window blocks point at the
    # padding page or at blocks other requests reuse; unused slots hold anything.
    kv = jnp.where(key_ok[:, None, None, None], kv.astype(jnp.float32), 0.0)
    k = kv[:, :, 0].transpose(1, 0, 2)  # [num_kv_heads, kv_cap, head_dim]
    v = kv[:, :, 1].transpose(1, 0, 2)

    def make_branch(block):
      def run(out):
        def chunk_body(c, out):
          start = q_start + c * block
          start_c = jnp.clip(start, 0, num_tokens - block)  # keep the slice in bounds
          q_blk = lax.dynamic_slice_in_dim(q, start_c, block, axis=0)
          q_blk = q_blk.astype(jnp.float32).reshape(block, num_kv_heads, group, head_dim)
          tok = start_c + jnp.arange(block, dtype=jnp.int32)
          row_ok = (tok >= start) & (tok < q_end)
          pos = kv_len - q_len + (tok - q_start)
          o = attend(q_blk.transpose(1, 2, 0, 3), k, v, key_ok, pos)
          o = o.transpose(2, 0, 1, 3).reshape(block, num_q_heads, head_dim)
          old = lax.dynamic_slice_in_dim(out, start_c, block, axis=0)
          new = jnp.where(row_ok[:, None, None], o.astype(out.dtype), old)
          return lax.dynamic_update_slice_in_dim(out, new, start_c, axis=0)

        num_chunks = (q_len + block - 1) // block
        return lax.fori_loop(0, num_chunks, chunk_body, out)
      return run

    sizes = jnp.asarray(buckets, jnp.int32)
    passes = (q_len + sizes - 1) // sizes
    cost = passes * sizes + _PASS_COST_ROWS * passes
    order = jnp.arange(len(buckets) - 1, -1, -1, dtype=jnp.int32)  # prefer larger blocks
    branch = jnp.argmin(cost * len(buckets) + order)
    return lax.switch(branch, [make_branch(b) for b in buckets], out)

  return lax.fori_loop(0, n, seq_body, out)
