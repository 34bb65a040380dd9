"""Ragged paged attention as a Pallas GPU kernel (Triton lowering), flash-decoding style.

Work decomposition: the ragged queries are cut into work items of `num_q_per_block`
rows, each inside one sequence (a sequence with q_len rows gives ceil(q_len / block)
items; a decode row is one item). The host-independent wrapper builds the item table
with a few XLA ops on the index arrays, gathers each item's query rows and block-table
row, and launches one program per (kv head, item, KV split). Each program runs an
online softmax over its split's share of the item's KV blocks (pages gathered by
index straight from the paged cache) and writes a partial output with its log-sum-exp;
the wrapper merges the splits (flash-decoding) and scatters rows back to tokens.

NOTE: the number of items is bounded statically by max_num_seqs + num_tokens // block
(sum of ceil(q_len / block) <= num_seqs + num_tokens / block); unused items exit at
once. Splitting the KV axis keeps the GPU full for decode batches that have fewer
(kv head, item) pairs than SMs.
NOTE: Triton tensors need power-of-two shapes: the q-head group is padded to a power
of two (padded heads are zero and dropped), and page_size must be a power of two.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from prefixcache_kernels.common import MASK_VALUE, pallas_limits, validate_inputs
from prefixcache_kernels.quant import dequantize

_INFO_COLS = 4  # per item: kv_len, position of row 0, valid rows, unused


@dataclasses.dataclass(frozen=True)
class GPUBlockSizes:
  """Tile sizes and launch parameters of the GPU kernel.

  Invariants: `num_q_per_block`, `num_kv_pages_per_block` powers of two;
  `num_q_per_block * padded group >= 16` is enforced by padding rows (Triton dots
  need M >= 16); `k_splits >= 1`.
  """
  # NOTE: defaults = the decode tiles with the best mean over two sweeps on an H200
  # (batch 64 x 4096, bf16, page 16; `bench_kernels --tile_sweep`, WORKSPACE_NOTES):
  # 4 tokens per item (16 rows with a group of 4: no padded decode rows beyond Triton's
  # M >= 16), 64 keys per step, 8 KV splits, 4 warps, 2 stages.
  num_q_per_block: int = 4
  num_kv_pages_per_block: int = 4
  k_splits: int = 8
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for name in ("num_q_per_block", "num_kv_pages_per_block", "k_splits", "num_warps",
                 "num_stages"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"GPUBlockSizes.{name} must be a positive int, got {value!r}")
    for name in ("num_q_per_block", "num_kv_pages_per_block"):
      value = getattr(self, name)
      if value & (value - 1):
        raise ValueError(f"GPUBlockSizes.{name} must be a power of two, got {value}")


def _part_dtype(dtype):
  """dtype of the per-split partial outputs.

  NOTE: bf16 for bf16 queries: a partial is a normalised softmax average (|o| <= max |v|),
  so bf16 adds one rounding of the same size as the final output's; it halves the bytes
  the split merge writes and reads, which a bandwidth-bound decode feels (measured on
  an H200, WORKSPACE_NOTES). f32 queries keep f32 partials. The log-sum-exps stay f32.
  """
  return jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float32


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _kernel(
    info_ref,  # i32[num_items, _INFO_COLS] (whole array)
    pages_ref,  # i32[num_items, padded_pages_per_seq] (whole array)
    q_ref,  # [rows, head_dim] block: item's rows of one kv head
    k_ref,  # [num_pages, page_size, head_dim] block: K of this kv head
    v_ref,  # [num_pages, page_size, head_dim] block: V of this kv head
    *refs,  # quantized pages: ks_ref, vs_ref (f32[num_pages] K/V scales of this kv
    # head); then o_ref [rows, head_dim] (partial output of this split, see
    # _part_dtype) and lse_ref f32[rows] (log-sum-exp of this split, -inf when it saw
    # nothing)
    quantized: bool,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group_pad: int,
    pages_per_blk: int,
    blks_per_split: int,
):
  if quantized:
    ks_ref, vs_ref, o_ref, lse_ref = refs
  else:
    o_ref, lse_ref = refs
  item, split = pl.program_id(1), pl.program_id(2)
  rows, head_dim = q_ref.shape
  page_size = k_ref.shape[1]
  kv_per_blk = pages_per_blk * page_size
  kv_len = info_ref[item, 0]
  first_pos = info_ref[item, 1]
  num_rows = info_ref[item, 2]
  f32 = jnp.float32
  # NOTE: quantized pages are dequantized to f32 (times the page's scale) as they are
  # loaded and multiplied in f32.
  cd = f32 if quantized else k_ref.dtype
  precision = lax.Precision.HIGHEST if cd == f32 else None

  row_tok = lax.broadcasted_iota(jnp.int32, (rows, kv_per_blk), 0) // group_pad
  row_pos = first_pos + row_tok
  row_ok = row_tok < num_rows
  # Visible key range of the item's rows: causal end, sliding-window start.
  key_hi = jnp.minimum(first_pos + num_rows, kv_len)
  key_lo = jnp.int32(0)
  if sliding_window is not None:
    key_lo = jnp.maximum(first_pos - sliding_window + 1, 0)
  blk_lo = jnp.maximum(key_lo // kv_per_blk, split * blks_per_split)
  blk_hi = jnp.minimum((key_hi + kv_per_blk - 1) // kv_per_blk, (split + 1) * blks_per_split)
  blk_hi = jnp.where(num_rows > 0, blk_hi, blk_lo)

  # NOTE: bf16 caches multiply in bf16 with f32 accumulation (tensor cores); f32
  # caches ask for full f32 precision (no TF32).
  q_c = (q_ref[...].astype(f32) * sm_scale).astype(cd)

  def body(blk, carry):
    acc, m, l = carry
    pages = pages_ref[item, pl.ds(blk * pages_per_blk, pages_per_blk)]
    key = blk * kv_per_blk + lax.broadcasted_iota(jnp.int32, (kv_per_blk, head_dim), 0)
    key_ok = key < kv_len
    if sliding_window is not None:
      key_ok &= key >= key_lo
    # NOTE: zero K/V of slots past kv_len or before the window: they may hold NaN or
    # inf (0 * NaN = NaN in p @ v), e.g. a released block's padding page.
    zero = jnp.zeros((), cd)
    k, v = k_ref[pages], v_ref[pages]  # [pages_per_blk, page_size, head_dim]
    if quantized:
      k = dequantize(k, ks_ref[pages][:, None, None])
      v = dequantize(v, vs_ref[pages][:, None, None])
    k = jnp.where(key_ok, k.reshape(kv_per_blk, head_dim), zero)
    v = jnp.where(key_ok, v.reshape(kv_per_blk, head_dim), zero)
    logits = lax.dot_general(q_c, k, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=f32)  # [rows, kv_per_blk]
    if soft_cap is not None:
      logits = soft_cap * jnp.tanh(logits / soft_cap)
    col = blk * kv_per_blk + lax.broadcasted_iota(jnp.int32, (rows, kv_per_blk), 1)
    mask = row_ok & (col < kv_len) & (col <= row_pos)
    if sliding_window is not None:
      mask &= col > row_pos - sliding_window
    logits = jnp.where(mask, logits, MASK_VALUE)
    m_next = jnp.maximum(m, jnp.max(logits, axis=1))
    p = jnp.where(mask, jnp.exp(logits - m_next[:, None]), 0.0)
    alpha = jnp.exp(m - m_next)
    l_next = alpha * l + jnp.sum(p, axis=1)
    pv = lax.dot_general(p.astype(cd), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=f32)
    return alpha[:, None] * acc + pv, m_next, l_next

  acc = jnp.zeros((rows, head_dim), f32)
  m = jnp.full((rows,), MASK_VALUE, f32)
  l = jnp.zeros((rows,), f32)
  acc, m, l = lax.fori_loop(blk_lo, jnp.maximum(blk_lo, blk_hi), body, (acc, m, l))
  seen = l > 0.0
  o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "block_sizes", "interpret"))
def ragged_paged_attention_gpu(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               sm_scale, sliding_window=None, soft_cap=None,
                               block_sizes: GPUBlockSizes = GPUBlockSizes(),
                               interpret: bool = False, kv_scales=None):
  """Ragged paged attention, Pallas GPU (Triton) kernel with split-K.

  Args:
    q: [num_tokens, num_q_heads, head_dim], f32 or bf16.
    kv_pages: [num_pages, page_size, 2*num_kv_heads, head_dim]; head_dim in (64, 128,
      256), page_size a power of two in [8, 128] (`common.pallas_limits`).
    kv_lens: i32[max_num_seqs].
    page_indices: i32[max_num_seqs, pages_per_seq].
    cu_q_lens: i32[max_num_seqs + 1].
    num_seqs: i32[1].
    sm_scale, sliding_window, soft_cap: static scalars (see the reference).
    block_sizes: static `GPUBlockSizes`.
    interpret: run the kernel with the Pallas interpreter (any platform).
    kv_scales: None, or the f32[num_pages, 2*num_kv_heads] scales of float8_e4m3fn /
      int8 pages (`kernels.quant`), read by index next to each page and applied as it
      is loaded (compute in f32). Compiled fp8 needs sm_89+ (`check_backend_config`).

  Returns:
    [num_tokens, num_q_heads, head_dim] in q's dtype; padding rows are 0.
  """
  validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                  sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  kv_scales=kv_scales)
  if not isinstance(block_sizes, GPUBlockSizes):
    raise ValueError(f"block_sizes must be a GPUBlockSizes, got {block_sizes!r}")
  num_tokens, num_q_heads, head_dim = q.shape
  num_pages, page_size, num_combined, _ = kv_pages.shape
  reason = pallas_limits("gpu", page_size=page_size, head_dim=head_dim)
  if reason is not None:
    raise ValueError(reason)
  num_kv_heads = num_combined // 2
  group = num_q_heads // num_kv_heads
  max_num_seqs, pages_per_seq = page_indices.shape
  if num_tokens == 0:
    return jnp.zeros_like(q)
  i32 = jnp.int32

  # Tiles: rows = q tokens per item x padded q-head group, at least 16 (Triton dot M).
  group_pad = _next_pow2(group)
  block_q = min(block_sizes.num_q_per_block, _next_pow2(num_tokens))
  block_q = max(block_q, 16 // min(group_pad, 16))
  rows = block_q * group_pad
  pages_per_blk = min(block_sizes.num_kv_pages_per_block, _next_pow2(pages_per_seq))
  pages_per_blk = max(pages_per_blk, 16 // min(page_size, 16))  # Triton dot N >= 16
  num_blks = -(-pages_per_seq // pages_per_blk)
  k_splits = min(block_sizes.k_splits, num_blks)
  blks_per_split = -(-num_blks // k_splits)
  padded_pages = k_splits * blks_per_split * pages_per_blk

  # Item table (XLA ops on the index arrays).
  n = jnp.clip(num_seqs[0], 0, max_num_seqs)
  live = jnp.arange(max_num_seqs) < n
  q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
  q_lens = jnp.maximum(q_lens, 0)
  items_per_seq = (q_lens + block_q - 1) // block_q
  item_end = jnp.cumsum(items_per_seq)
  item_start = item_end - items_per_seq
  num_items = max_num_seqs + num_tokens // block_q
  w = jnp.arange(num_items, dtype=i32)
  item_seq = jnp.minimum(jnp.searchsorted(item_end, w, side="right"), max_num_seqs - 1)
  item_blk = w - item_start[item_seq]
  item_live = w < item_end[-1]
  item_q0 = cu_q_lens[item_seq] + item_blk * block_q  # token of the item's row 0
  item_rows = jnp.where(item_live,
                        jnp.clip(q_lens[item_seq] - item_blk * block_q, 0, block_q), 0)
  item_kv_len = kv_lens[item_seq]
  item_pos0 = item_kv_len - q_lens[item_seq] + item_blk * block_q
  info = jnp.stack([item_kv_len, item_pos0, item_rows, jnp.zeros_like(w)], axis=1).astype(i32)
  pages = jnp.clip(page_indices, 0, num_pages - 1)
  pages = jnp.pad(pages, ((0, 0), (0, padded_pages - pages_per_seq)))[item_seq]

  # Queries per item: [num_kv_heads, num_items, rows, head_dim], invalid rows zeroed.
  tok = item_q0[:, None] + jnp.arange(block_q, dtype=i32)[None, :]  # [items, block_q]
  tok_ok = jnp.arange(block_q)[None, :] < item_rows[:, None]
  q_items = jnp.where(tok_ok[:, :, None, None], q[jnp.clip(tok, 0, num_tokens - 1)], 0)
  q_items = q_items.reshape(num_items, block_q, num_kv_heads, group, head_dim)
  q_items = jnp.pad(q_items, ((0, 0),) * 3 + ((0, group_pad - group), (0, 0)))
  q_items = q_items.transpose(2, 0, 1, 3, 4).reshape(num_kv_heads, num_items, rows, head_dim)

  kernel = pl.pallas_call(
      functools.partial(_kernel, sm_scale=float(sm_scale), sliding_window=sliding_window,
                        soft_cap=soft_cap, group_pad=group_pad, pages_per_blk=pages_per_blk,
                        blks_per_split=blks_per_split, quantized=kv_scales is not None),
      grid=(num_kv_heads, num_items, k_splits),
      in_specs=[
          pl.BlockSpec((num_items, _INFO_COLS), lambda h, i, s: (0, 0)),
          pl.BlockSpec((num_items, padded_pages), lambda h, i, s: (0, 0)),
          pl.BlockSpec((None, None, rows, head_dim), lambda h, i, s: (h, i, 0, 0)),
          # K of kv-head h is combined slot 2h, V is 2h+1: block size 1 (squeezed) on
          # that axis, so the block index is the slot itself.
          pl.BlockSpec((num_pages, page_size, None, head_dim), lambda h, i, s: (0, 0, 2 * h, 0)),
          pl.BlockSpec((num_pages, page_size, None, head_dim),
                       lambda h, i, s: (0, 0, 2 * h + 1, 0)),
      ] + ([
          # Scales of K (column 2h) and V (2h+1) of kv-head h, squeezed the same way.
          pl.BlockSpec((num_pages, None), lambda h, i, s: (0, 2 * h)),
          pl.BlockSpec((num_pages, None), lambda h, i, s: (0, 2 * h + 1)),
      ] if kv_scales is not None else []),
      out_specs=[
          pl.BlockSpec((None, None, None, rows, head_dim), lambda h, i, s: (s, h, i, 0, 0)),
          pl.BlockSpec((None, None, None, rows), lambda h, i, s: (s, h, i, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((k_splits, num_kv_heads, num_items, rows, head_dim),
                               _part_dtype(q.dtype)),
          jax.ShapeDtypeStruct((k_splits, num_kv_heads, num_items, rows), jnp.float32),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps,
                                           num_stages=block_sizes.num_stages),
      interpret=interpret,
      name="ragged_paged_attention_gpu",
  )
  scale_args = (kv_scales, kv_scales) if kv_scales is not None else ()
  o_parts, lse_parts = kernel(info, pages, q_items, kv_pages, kv_pages, *scale_args)

  # Flash-decoding merge of the KV splits: weights exp(lse_s - lse_max).
  lse_max = jnp.max(lse_parts, axis=0)
  safe_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
  weights = jnp.exp(lse_parts - safe_max[None])  # exp(-inf) = 0 for empty splits
  denom = jnp.sum(weights, axis=0)
  o = jnp.sum(weights[..., None] * o_parts.astype(jnp.float32), axis=0)
  o = o / jnp.where(denom == 0.0, 1.0, denom)[..., None]  # [Hkv, items, rows, D]
  o = o.reshape(num_kv_heads, num_items, block_q, group_pad, head_dim)[:, :, :, :group]

  # Back to tokens: token t of sequence s is row (t - cu[s]) % block of item
  # item_start[s] + (t - cu[s]) // block.
  t = jnp.arange(num_tokens, dtype=i32)
  t_seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], t, side="right"), max_num_seqs - 1)
  t_off = t - cu_q_lens[t_seq]
  t_item = jnp.clip(item_start[t_seq] + t_off // block_q, 0, num_items - 1)
  t_row = jnp.clip(t_off % block_q, 0, block_q - 1)
  t_live = (t < cu_q_lens[n]) & (t_seq < n)
  out = o[:, t_item, t_row]  # [Hkv, T, group, D]
  out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
  return jnp.where(t_live[:, None, None], out, 0.0).astype(q.dtype)
