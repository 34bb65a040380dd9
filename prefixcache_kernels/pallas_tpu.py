"""Ragged paged attention as a Pallas TPU kernel.

One program per (kv-head block, query block). A query block is `num_q_per_block`
consecutive rows of the flat token axis and may span several sequences; the program
walks the sequences that own rows in it and, for each, the KV blocks those rows can
see (causal + sliding window limits), with an online softmax kept in VMEM scratch.

Page indices, kv_lens, cu_q_lens and num_seqs are scalar-prefetched into SMEM. K/V
pages stay in HBM (`memory_space=ANY`); each KV block (`num_kv_pages_per_block`
pages, the program's kv heads only) is copied into one half of a VMEM double buffer
with async copies while the other half is being used, so the copy of block n+1
overlaps the compute of block n (also across sequence boundaries within a program).

NOTE: programs share no state (no cross-program prefetch), so both grid axes are
"parallel" and megacore may split them.
NOTE: no ref reshapes inside the kernel (TPU interpret mode and Mosaic both take
value reshapes of leading dims): K and V of kv-head j are loaded as
`kv_buf[slot, :, :, 2j, :]` and merged [pages, page_size] -> [tokens] as values.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from prefixcache_kernels.common import MASK_VALUE, pallas_limits, validate_inputs
from prefixcache_kernels.quant import dequantize

_LANES = 128  # m/l scratch is lane-replicated: Mosaic has no unaligned lane slicing


@dataclasses.dataclass(frozen=True)
class TPUBlockSizes:
  """Tile sizes of the TPU kernel.

  Invariants: all positive; `num_q_per_block` a multiple of 8 (f32 sublanes). The
  wrapper clamps blocks to the problem (a query block to the padded token count, a KV
  block to pages_per_seq, the kv-head block to a divisor of num_kv_heads).
  """
  num_q_per_block: int = 32
  num_kv_pages_per_block: int = 8
  num_kv_heads_per_block: int = 1

  def __post_init__(self):
    for name in ("num_q_per_block", "num_kv_pages_per_block", "num_kv_heads_per_block"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"TPUBlockSizes.{name} must be a positive int, got {value!r}")
    if self.num_q_per_block % 8:
      raise ValueError(
          f"TPUBlockSizes.num_q_per_block must be a multiple of 8, got {self.num_q_per_block}")


def _kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref,  # i32[max_num_seqs]
    page_indices_ref,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens_ref,  # i32[max_num_seqs + 1]
    num_seqs_ref,  # i32[1]
    # Inputs.
    q_ref,  # [num_q_per_blk, num_q_heads_per_blk, head_dim] (VMEM block)
    kv_pages_hbm_ref,  # [num_pages, page_size, 2*num_kv_heads, head_dim] (HBM)
    *refs,
    # Quantized pages only: scales_hbm_ref f32[num_pages, 2*num_kv_heads] (HBM), input.
    # Output: o_ref [num_q_per_blk, num_q_heads_per_blk, head_dim].
    # Scratch:
    #   kv_bufs [2, pages_per_blk, page_size, 2*num_kv_heads_per_blk, head_dim]
    #   sems: DMA semaphores [2], one per buffer half
    #   m_ref, l_ref: f32[num_kv_heads_per_blk, num_q_per_blk * group, _LANES]
    #   acc_ref: f32[num_kv_heads_per_blk, num_q_per_blk * group, head_dim]
    #   quantized pages only: scale_bufs f32[2, pages_per_blk, 2*num_kv_heads_per_blk]
    #     (SMEM), the scales of the pages in kv_bufs, copied with them.
    quantized: bool,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group: int,
):
  if quantized:
    scales_hbm_ref, o_ref, kv_bufs, sems, m_ref, l_ref, acc_ref, scale_bufs = refs
  else:
    o_ref, kv_bufs, sems, m_ref, l_ref, acc_ref = refs
  num_q_per_blk, _, head_dim = q_ref.shape
  _, pages_per_blk, page_size, num_combined_blk, _ = kv_bufs.shape
  num_kv_heads_blk = num_combined_blk // 2
  num_pages = kv_pages_hbm_ref.shape[0]
  max_num_seqs, pages_per_seq = page_indices_ref.shape
  kv_per_blk = pages_per_blk * page_size
  rows = num_q_per_blk * group
  heads_blk, q_blk = pl.program_id(0), pl.program_id(1)
  q_lo = q_blk * num_q_per_blk
  q_hi = q_lo + num_q_per_blk
  num_seqs = jnp.minimum(num_seqs_ref[0], max_num_seqs)
  kv_src = kv_pages_hbm_ref.at[:, :, pl.ds(heads_blk * num_combined_blk, num_combined_blk), :]
  if quantized:
    scales_src = scales_hbm_ref.at[:, pl.ds(heads_blk * num_combined_blk, num_combined_blk)]

  m_ref[...] = jnp.full_like(m_ref, MASK_VALUE)
  l_ref[...] = jnp.zeros_like(l_ref)
  acc_ref[...] = jnp.zeros_like(acc_ref)

  def seq_span(s):
    """KV block range [blk_lo, blk_hi) the rows of sequence s in this block can see."""
    q_start, q_end = cu_q_lens_ref[s], cu_q_lens_ref[s + 1]
    kv_len = jnp.minimum(kv_lens_ref[s], pages_per_seq * page_size)
    first_pos = kv_len - (q_end - q_start)  # position of the sequence's first q row
    r_lo, r_hi = jnp.maximum(q_start, q_lo), jnp.minimum(q_end, q_hi)
    key_hi = jnp.minimum(first_pos + (r_hi - q_start), kv_len)  # last visible + 1
    key_lo = 0
    if sliding_window is not None:
      key_lo = jnp.maximum(first_pos + (r_lo - q_start) - sliding_window + 1, 0)
    empty = (r_lo >= r_hi) | (key_hi <= key_lo)
    blk_lo = key_lo // kv_per_blk
    blk_hi = jnp.where(empty, blk_lo, (key_hi + kv_per_blk - 1) // kv_per_blk)
    return blk_lo, blk_hi

  def in_block(s):
    return (s < num_seqs) & (cu_q_lens_ref[jnp.minimum(s, max_num_seqs)] < q_hi)

  def next_work(s):
    """First sequence >= s with KV to read for this block (or one past the last)."""
    def cond(s):
      blk_lo, blk_hi = seq_span(jnp.minimum(s, max_num_seqs - 1))
      return in_block(s) & (blk_lo >= blk_hi)
    s = lax.while_loop(cond, lambda s: s + 1, s)
    blk_lo, _ = seq_span(jnp.minimum(s, max_num_seqs - 1))
    return s, blk_lo

  def copies(s, blk, slot):
    """The async copies of KV block `blk` of sequence s into buffer half `slot`."""
    num_used = (kv_lens_ref[s] + page_size - 1) // page_size
    last = jnp.clip(jnp.minimum(num_used, pages_per_seq) - 1, 0, pages_per_seq - 1)
    out = []
    for i in range(pages_per_blk):
      # Pages past the sequence's end re-read its last page (masked below).
      p = jnp.minimum(blk * pages_per_blk + i, last)
      page = jnp.clip(page_indices_ref[s, p], 0, num_pages - 1)
      out.append(pltpu.make_async_copy(kv_src.at[page], kv_bufs.at[slot, i], sems.at[slot]))
      if quantized:
        out.append(pltpu.make_async_copy(scales_src.at[page], scale_bufs.at[slot, i],
                                         sems.at[slot]))
    return out

  def compute(s, blk, slot):
    q_start, q_end = cu_q_lens_ref[s], cu_q_lens_ref[s + 1]
    kv_len = kv_lens_ref[s]
    first_pos = kv_len - (q_end - q_start)
    # Row r of the [rows, ...] tiles is token q_lo + r // group, q head r % group.
    tok = q_lo + lax.broadcasted_iota(jnp.int32, (rows, kv_per_blk), 0) // group
    key = blk * kv_per_blk + lax.broadcasted_iota(jnp.int32, (rows, kv_per_blk), 1)
    pos = first_pos + tok - q_start
    mask = (tok >= q_start) & (tok < q_end) & (key < kv_len) & (key <= pos)
    if sliding_window is not None:
      mask &= key > pos - sliding_window
    key_ok = blk * kv_per_blk + lax.broadcasted_iota(jnp.int32, (kv_per_blk, head_dim), 0)
    if sliding_window is not None:  # keys before the window of s's first row here
      r_lo = jnp.maximum(q_start, q_lo)
      key_ok = (key_ok < kv_len) & (key_ok > first_pos + (r_lo - q_start) - sliding_window)
    else:
      key_ok = key_ok < kv_len
    # NOTE: the MXU multiplies in the cache dtype (bf16 caches: bf16 x bf16 -> f32);
    # f32 caches ask for full f32 precision.
    # Quantized pages are dequantized to f32 (times their page's scale) as they are
    # read from the buffer and multiplied in f32.
    cd = jnp.float32 if quantized else kv_bufs.dtype
    precision = lax.Precision.HIGHEST if cd == jnp.float32 else None
    zero = jnp.zeros((), cd)
    for j in range(num_kv_heads_blk):
      # NOTE: zero K/V of slots past kv_len or before the window: they may hold NaN
      # or inf (0 * NaN = NaN in p @ v), e.g. a released block's padding page.
      if quantized:
        # NOTE: one page at a time (its scale is an SMEM scalar), merged as values.
        k = jnp.concatenate([dequantize(kv_bufs[slot, i, :, 2 * j, :], scale_bufs[slot, i, 2 * j])
                             for i in range(pages_per_blk)], axis=0)
        v = jnp.concatenate([dequantize(kv_bufs[slot, i, :, 2 * j + 1, :],
                                        scale_bufs[slot, i, 2 * j + 1])
                             for i in range(pages_per_blk)], axis=0)
      else:
        k = kv_bufs[slot, :, :, 2 * j, :].reshape(kv_per_blk, head_dim)
        v = kv_bufs[slot, :, :, 2 * j + 1, :].reshape(kv_per_blk, head_dim)
      k = jnp.where(key_ok, k, zero)
      v = jnp.where(key_ok, v, zero)
      q = q_ref[:, j * group:(j + 1) * group, :].astype(jnp.float32)
      q = (q.reshape(rows, head_dim) * sm_scale).astype(cd)
      logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)  # [rows, kv_per_blk]
      if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
      logits = jnp.where(mask, logits, MASK_VALUE)
      m_prev = m_ref[j]  # [rows, _LANES], lanes equal
      l_prev = l_ref[j]
      m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
      # Masked weights are 0 even while a row has seen nothing (m == MASK_VALUE).
      p = jnp.where(mask, jnp.exp(logits - m_next[:, :1]), 0.0)
      alpha = jnp.exp(m_prev - m_next)
      l_ref[j] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
      m_ref[j] = m_next
      pv = lax.dot_general(p.astype(cd), v, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)  # [rows, head_dim]
      acc_ref[j] = alpha[:, :1] * acc_ref[j] + pv

  s0, blk0 = next_work(jnp.int32(0))

  @pl.when(in_block(s0))
  def _():
    for c in copies(s0, blk0, 0):
      c.start()

  def body(carry):
    s, blk, slot = carry
    _, blk_hi = seq_span(s)
    same_seq = blk + 1 < blk_hi
    s_alt, blk_alt = next_work(s + 1)
    s_next = jnp.where(same_seq, s, s_alt)
    blk_next = jnp.where(same_seq, blk + 1, blk_alt)

    @pl.when(in_block(s_next))
    def _():
      for c in copies(s_next, blk_next, 1 - slot):  # prefetch into the other half
        c.start()

    for c in copies(s, blk, slot):
      c.wait()
    compute(s, blk, slot)
    return s_next, blk_next, 1 - slot

  lax.while_loop(lambda c: in_block(c[0]), body, (s0, blk0, jnp.int32(0)))

  for j in range(num_kv_heads_blk):
    l = l_ref[j][:, :1]
    out = acc_ref[j] / jnp.where(l == 0.0, 1.0, l)  # rows that saw no key -> 0
    o_ref[:, j * group:(j + 1) * group, :] = out.reshape(
        num_q_per_blk, group, head_dim).astype(o_ref.dtype)


def _largest_divisor_at_most(n: int, cap: int) -> int:
  return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "block_sizes", "interpret"))
def ragged_paged_attention_tpu(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               sm_scale, sliding_window=None, soft_cap=None,
                               block_sizes: TPUBlockSizes = TPUBlockSizes(),
                               interpret: bool = False, kv_scales=None):
  """Ragged paged attention, Pallas TPU kernel (same contract as the reference).

  Args:
    q: [num_tokens, num_q_heads, head_dim], f32 or bf16.
    kv_pages: [num_pages, page_size, 2*num_kv_heads, head_dim]; head_dim in (64, 128,
      256), page_size in [8, 128] (`common.pallas_limits`).
    kv_lens: i32[max_num_seqs].
    page_indices: i32[max_num_seqs, pages_per_seq].
    cu_q_lens: i32[max_num_seqs + 1].
    num_seqs: i32[1].
    sm_scale, sliding_window, soft_cap: static scalars (see the reference).
    block_sizes: static `TPUBlockSizes`.
    interpret: run in TPU interpret mode (any platform); also happens under
      `pltpu.force_tpu_interpret_mode()`.
    kv_scales: None, or the f32[num_pages, 2*num_kv_heads] scales of float8_e4m3fn /
      int8 pages (`kernels.quant`): each page's scales are copied into SMEM with the
      page and applied as it is read (compute in f32).

  Returns:
    [num_tokens, num_q_heads, head_dim] in q's dtype; padding rows are 0.
  """
  validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                  sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  kv_scales=kv_scales)
  if not isinstance(block_sizes, TPUBlockSizes):
    raise ValueError(f"block_sizes must be a TPUBlockSizes, got {block_sizes!r}")
  num_tokens, num_q_heads, head_dim = q.shape
  _, page_size, num_combined, _ = kv_pages.shape
  reason = pallas_limits("tpu", page_size=page_size, head_dim=head_dim)
  if reason is not None:
    raise ValueError(reason)
  num_kv_heads = num_combined // 2
  group = num_q_heads // num_kv_heads
  _, pages_per_seq = page_indices.shape
  if num_tokens == 0:
    return jnp.zeros_like(q)
  num_q_per_blk = min(block_sizes.num_q_per_block, -(-num_tokens // 8) * 8)
  pages_per_blk = min(block_sizes.num_kv_pages_per_block, pages_per_seq)
  heads_blk = _largest_divisor_at_most(num_kv_heads, block_sizes.num_kv_heads_per_block)
  num_q_blks = -(-num_tokens // num_q_per_blk)
  padded = num_q_blks * num_q_per_blk
  q_in = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0))) if padded > num_tokens else q
  q_spec = pl.BlockSpec((num_q_per_blk, heads_blk * group, head_dim),
                        lambda h, i, *_: (i, h, 0))
  rows = num_q_per_blk * group
  scratch = [
      pltpu.VMEM((2,  # double buffering
                  pages_per_blk, page_size, 2 * heads_blk, head_dim), kv_pages.dtype),
      pltpu.SemaphoreType.DMA((2,)),  # one per buffer half
      pltpu.VMEM((heads_blk, rows, _LANES), jnp.float32),  # m
      pltpu.VMEM((heads_blk, rows, _LANES), jnp.float32),  # l
      pltpu.VMEM((heads_blk, rows, head_dim), jnp.float32),  # acc
  ]
  quantized = kv_scales is not None
  in_specs = [q_spec, pl.BlockSpec(memory_space=pl.ANY)]
  if quantized:
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    scratch.append(pltpu.SMEM((2, pages_per_blk, 2 * heads_blk), jnp.float32))
  kernel = pl.pallas_call(
      functools.partial(_kernel, sm_scale=float(sm_scale), sliding_window=sliding_window,
                        soft_cap=soft_cap, group=group, quantized=quantized),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4,
          in_specs=in_specs,
          out_specs=q_spec,
          grid=(num_kv_heads // heads_blk, num_q_blks),
          scratch_shapes=scratch),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      out_shape=jax.ShapeDtypeStruct(q_in.shape, q.dtype),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="ragged_paged_attention_tpu",
  )
  out = kernel(kv_lens, page_indices, cu_q_lens, num_seqs, q_in, kv_pages,
               *((kv_scales,) if quantized else ()))
  return out[:num_tokens]
