"""Benchmark cases and timers for the paged-attention kernels (used by
`experiments/bench_kernels.py`; importable from a notebook).

Each case is a batch of (q_len, kv_len) sequences. It is timed twice, side by side in
the same process: the paged path (`paged_attention` over a shuffled page table) and
dense attention over contiguous per-sequence K/V of the same lengths, batched per
group of equal shapes. Roofline figures count the KV bytes a kernel must read at least
once and the attention FLOPs of the visible (causal) scores.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from prefixcache_kernels.api import paged_attention, resolve_backend
from prefixcache_kernels.pallas_gpu import GPUBlockSizes
from prefixcache_kernels.pallas_tpu import TPUBlockSizes


@dataclasses.dataclass(frozen=True)
class BenchCase:
  """A named batch: `seqs` lists (q_len, kv_len), decodes first."""
  name: str
  seqs: tuple
  num_kv_heads: int = 2
  num_q_heads: int = 8
  head_dim: int = 128
  page_size: int = 16

  def __post_init__(self):
    for q_len, kv_len in self.seqs:
      if not 0 < q_len <= kv_len:
        raise ValueError(f"case {self.name}: need 0 < q_len <= kv_len, got {(q_len, kv_len)}")
    if self.num_q_heads % self.num_kv_heads:
      raise ValueError(f"case {self.name}: q heads not a multiple of kv heads")


def standard_cases(sizes: str) -> list[BenchCase]:
  """The issue's cases ("full") or a scaled-down set for a quick run ("small")."""
  if sizes == "full":
    return [
        BenchCase("decode_32x2048", tuple([(1, 2048)] * 32)),
        BenchCase("prefill_2048_cached_1920", ((128, 2048),)),
        BenchCase("mixed_24x1024_decode+512_over_512", tuple([(1, 1024)] * 24) + ((512, 1024),)),
    ]
  if sizes == "small":
    return [
        BenchCase("decode_8x512", tuple([(1, 512)] * 8)),
        BenchCase("prefill_512_cached_448", ((64, 512),)),
        BenchCase("mixed_6x256_decode+128_over_128", tuple([(1, 256)] * 6) + ((128, 256),)),
    ]
  raise ValueError(f"unknown sizes {sizes!r}; expected 'full' or 'small'")


def roofline(case: BenchCase, dtype) -> dict:
  """Minimum KV bytes read and attention FLOPs (QK^T and PV over visible keys)."""
  itemsize = jnp.dtype(dtype).itemsize
  kv_bytes = sum(kv for _, kv in case.seqs) * 2 * case.num_kv_heads * case.head_dim * itemsize
  visible = sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in case.seqs)
  flops = 4 * visible * case.num_q_heads * case.head_dim
  return {"kv_bytes": int(kv_bytes), "flops": int(flops)}


def build_paged_inputs(case: BenchCase, dtype, seed: int = 0):
  """Random q and a paged cache with a shuffled page table.

  Returns:
    (args, dense, dense_rows) where args = (q, kv_pages, kv_lens, page_indices, cu_q_lens,
    num_seqs)
    and dense = list of (q [B, Q, Hq, D], k [B, Hkv, L, D], v [B, Hkv, L, D]) per group
    of sequences with equal (q_len, kv_len), holding the same values, and dense_rows the
    token rows of `q` each group's flattened [B*Q] queries correspond to.
  """
  rng = np.random.default_rng(seed)
  ps, hkv, d = case.page_size, case.num_kv_heads, case.head_dim
  num_seqs = len(case.seqs)
  pages_per_seq = max(-(-kv // ps) for _, kv in case.seqs)
  num_alloc = sum(-(-kv // ps) for _, kv in case.seqs)
  num_pages = num_alloc + 1  # + padding page
  perm = rng.permutation(num_alloc).astype(np.int32)
  page_indices = np.full((num_seqs, pages_per_seq), num_pages - 1, np.int32)
  kv_pages = np.zeros((num_pages, ps, 2 * hkv, d), np.float32)
  groups: dict = {}
  rows: dict = {}  # token rows of each group's members, in member order
  used = 0
  qs = []
  for s, (q_len, kv_len) in enumerate(case.seqs):
    n = -(-kv_len // ps)
    pages = perm[used:used + n]
    used += n
    page_indices[s, :n] = pages
    kv = rng.standard_normal((n * ps, hkv, 2, d), dtype=np.float32)
    kv[kv_len:] = 0.0
    kv_pages[pages] = kv.reshape(n, ps, 2 * hkv, d)
    q = rng.standard_normal((q_len, case.num_q_heads, d), dtype=np.float32)
    qs.append(q)
    rows.setdefault((q_len, kv_len), []).append(np.arange(q_len) + sum(len(x) for x in qs[:-1]))
    groups.setdefault((q_len, kv_len), []).append(
        (q, kv[:kv_len, :, 0].transpose(1, 0, 2), kv[:kv_len, :, 1].transpose(1, 0, 2)))
  kv_lens = np.array([kv for _, kv in case.seqs], np.int32)
  cu_q_lens = np.concatenate([[0], np.cumsum([q for q, _ in case.seqs])]).astype(np.int32)
  args = (jnp.asarray(np.concatenate(qs), dtype), jnp.asarray(kv_pages, dtype),
          jnp.asarray(kv_lens), jnp.asarray(page_indices), jnp.asarray(cu_q_lens),
          jnp.asarray([num_seqs], jnp.int32))
  dense = [tuple(jnp.asarray(np.stack(x), dtype) for x in zip(*members))
           for members in groups.values()]
  dense_rows = [np.concatenate(r) for r in rows.values()]
  return args, dense, dense_rows


def _dense_group(q, k, v, *, sm_scale):
  """Causal attention with prefix offset over contiguous K/V.

  Args:
    q: [B, Q, Hq, D]; k, v: [B, Hkv, L, D] (query row i at position L - Q + i).

  Returns:
    [B, Q, Hq, D] in q's dtype.
  """
  b, nq, hq, d = q.shape
  hkv, nl = k.shape[1], k.shape[2]
  out_dtype = q.dtype
  if jax.default_backend() == "cpu":
    # XLA:CPU has no bf16 x bf16 -> f32 dot; the reference upcasts the same way.
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  qg = q.reshape(b, nq, hkv, hq // hkv, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, Q, D]
  logits = jnp.einsum("bhgqd,bhld->bhgql", qg, k,
                      preferred_element_type=jnp.float32) * sm_scale
  pos = nl - nq + jnp.arange(nq)
  mask = jnp.arange(nl)[None, :] <= pos[:, None]
  logits = jnp.where(mask, logits, -jnp.inf)
  p = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bhgql,bhld->bqhgd", p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.reshape(b, nq, hq, d).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def dense_attention(groups, *, sm_scale):
  """Dense baseline: one batched attention per group of equal shapes."""
  return [_dense_group(q, k, v, sm_scale=sm_scale) for q, k, v in groups]


def time_fn(fn, *args, iters: int) -> float:
  """Median wall seconds of `fn(*args)` after one warm-up (compile) call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def run_case(case: BenchCase, *, dtype, backend: str, iters: int,
             interpret: bool = False) -> dict:
  """Times the paged path and the dense baseline side by side; returns a record."""
  args, dense, dense_rows = build_paged_inputs(case, dtype)
  sm_scale = 1.0 / float(np.sqrt(case.head_dim))
  paged = jax.jit(functools.partial(paged_attention, sm_scale=sm_scale, backend=backend,
                                    interpret=interpret))
  dense_fn = functools.partial(dense_attention, sm_scale=sm_scale)
  # Interleave to share any machine noise between the two.
  t_paged, t_dense = [], []
  for _ in range(3):
    t_paged.append(time_fn(paged, *args, iters=max(1, iters // 3)))
    t_dense.append(time_fn(dense_fn, dense, iters=max(1, iters // 3)))
  t_paged, t_dense = min(t_paged), min(t_dense)
  # The two paths must agree, or the timing compares different work.
  out = np.asarray(paged(*args).astype(jnp.float32))
  err = max(float(np.max(np.abs(out[r] - np.asarray(d.astype(jnp.float32)).reshape(
      len(r), *out.shape[1:])))) for r, d in zip(dense_rows, dense_fn(dense)))
  rl = roofline(case, dtype)
  return {
      "case": case.name, "backend": backend, "interpret": interpret,
      "dtype": jnp.dtype(dtype).name, "num_seqs": len(case.seqs), "num_tokens": sum(q for q, _ in case.seqs),
      "max_abs_diff_vs_dense": err, "paged_s": t_paged, "dense_s": t_dense, "paged_over_dense": t_paged / t_dense,
      **rl,
      "paged_kv_gbps": rl["kv_bytes"] / t_paged / 1e9,
      "paged_gflops": rl["flops"] / t_paged / 1e9,
  }


def time_device(fn, *args, iters: int, inner: int = 10) -> float:
  """Steady-state device seconds per call of `fn(*args)`.

  The minimum over `iters` rounds of `inner` back-to-back calls with one sync at the end
  (dispatch overlaps the previous call's execution, so per-call launch cost is hidden),
  after one warm-up (compile) call. For bandwidth figures, where a single call's wall
  time carries the dispatch and the sync and the median carries the noise of a shared
  machine.
  """
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(iters):
    t0 = time.perf_counter()
    out = None
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - t0) / inner)
  return best


def device_copy_bandwidth(num_bytes: int, *, iters: int, inner: int = 10) -> float:
  """Bytes/s of a jitted device copy (read + write counted) of a `num_bytes` buffer,
  timed as `time_device` does."""
  x = jnp.zeros((num_bytes // 4,), jnp.float32)
  copy = jax.jit(lambda a: a + 1.0)
  t = time_device(copy, x, iters=iters, inner=inner)
  return 2 * x.size * 4 / t


JAX_GPU_PEER = "jax.experimental.pallas.ops.gpu.paged_attention"


def decode_bandwidth_sweep(*, backend: str, batch: int, context: int, dtype, iters: int,
                           tiles, num_kv_heads: int = 8, num_q_heads: int = 32,
                           head_dim: int = 128, page_size: int = 16,
                           interpret: bool = False, jax_gpu_peer: bool = False,
                           inner: int = 10) -> list[dict]:
  """Achieved KV-read bandwidth of a decode batch against the device copy bandwidth,
  for each of `tiles` (block sizes, None = the kernel's defaults).

  The inputs are built once; the copy bandwidth is measured before and after the
  kernels (the faster counts); every tile's output is checked against the output of the
  first tile that ran (they compute the same attention), so a fast but wrong tile
  cannot win. A tile the device cannot run
  (a `JaxRuntimeError`: too much shared memory, say) gets a record with `error` set and
  no timing; the sweep goes on. With `jax_gpu_peer`, jax's own
  decode kernel (`jax.experimental.pallas.ops.gpu.paged_attention`, its default tiles)
  is timed last on the same data (K and V split into its layout, q pre-scaled, both
  outside the timing) and added as a final record whose backend names it.
  """
  case = BenchCase(f"decode_bw_{batch}x{context}", tuple([(1, context)] * batch),
                   num_kv_heads=num_kv_heads, num_q_heads=num_q_heads, head_dim=head_dim,
                   page_size=page_size)
  args, _, _ = build_paged_inputs(case, dtype)
  sm_scale = 1.0 / float(np.sqrt(head_dim))
  kv_bytes = roofline(case, dtype)["kv_bytes"]
  # The copy is timed before and after the kernels; the faster of the two is the ceiling.
  copy_before = device_copy_bandwidth(kv_bytes, iters=iters, inner=inner)
  first = None
  timed = []  # (backend, block_sizes, seconds or None, diff or None, error or None)

  def attempt(name, block_sizes, fn, fn_args):
    # A tile the device cannot run (shared memory, registers) is recorded, not fatal.
    nonlocal first
    try:
      t = time_device(fn, *fn_args, iters=iters, inner=inner)
      out = np.asarray(fn(*fn_args).astype(jnp.float32))
    except jax.errors.JaxRuntimeError as e:
      timed.append((name, block_sizes, None, None, f"{type(e).__name__}: {e}"[:300]))
      return
    if first is None:
      first = out
    timed.append((name, block_sizes, t, float(np.max(np.abs(out - first))), None))

  for block_sizes in tiles:
    attempt(backend, block_sizes,
            jax.jit(functools.partial(paged_attention, sm_scale=sm_scale, backend=backend,
                                      interpret=interpret, block_sizes=block_sizes)), args)
  if jax_gpu_peer:
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_gpu_paged
    q, kv_pages, kv_lens, page_indices = args[:4]
    k_pages = kv_pages[:, :, 0::2].transpose(2, 0, 1, 3)
    v_pages = kv_pages[:, :, 1::2].transpose(2, 0, 1, 3)
    q_scaled = (q.astype(jnp.float32) * sm_scale).astype(q.dtype)
    attempt(JAX_GPU_PEER, None,
            jax.jit(functools.partial(jax_gpu_paged.paged_attention, interpret=interpret)),
            (q_scaled, k_pages, v_pages, page_indices, kv_lens))
  copy_bw = max(copy_before, device_copy_bandwidth(kv_bytes, iters=iters, inner=inner))
  return [{"case": case.name, "backend": name, "dtype": jnp.dtype(dtype).name,
           "interpret": interpret,
           "block_sizes": None if bs is None else dataclasses.asdict(bs),
           "paged_s": t, "kv_bytes": int(kv_bytes),
           "achieved_gbps": None if t is None else kv_bytes / t / 1e9,
           "copy_gbps": copy_bw / 1e9,
           "fraction_of_copy_bw": None if t is None else kv_bytes / t / copy_bw,
           "max_abs_diff_vs_first_tile": diff, "error": err,
           "timing": f"time_device: min of {iters} rounds x {inner} back-to-back calls"}
          for name, bs, t, diff, err in timed]


def tile_candidates(backend: str, interpret: bool = False) -> list:
  """Block sizes a decode tile sweep tries for the backend `backend` resolves to.

  The kernel's defaults come first (None); the reference has no tiles (just [None]).
  """
  name = resolve_backend(backend, interpret)
  if name == "pallas_gpu":
    grid = [  # (q per block, KV pages per block, KV splits, warps, stages)
        (4, 4, 8, 4, 1), (4, 4, 8, 2, 1), (4, 2, 8, 4, 1), (4, 2, 8, 1, 1),
        (4, 1, 8, 2, 1), (4, 2, 4, 2, 1), (4, 2, 16, 2, 1), (4, 2, 8, 2, 2),
        (4, 8, 8, 4, 1), (4, 2, 8, 2, 1), (4, 2, 16, 4, 1), (16, 8, 8, 4, 2)]
    cands = [GPUBlockSizes(num_q_per_block=q, num_kv_pages_per_block=p, k_splits=k,
                           num_warps=w, num_stages=st) for q, p, k, w, st in grid]
    return [None] + [t for t in cands if t != GPUBlockSizes()]
  if name == "pallas_tpu":
    grid = [(8, 8, 1), (8, 16, 1), (8, 32, 1), (16, 16, 1), (8, 16, 2), (8, 16, 8)]
    cands = [TPUBlockSizes(num_q_per_block=q, num_kv_pages_per_block=p,
                           num_kv_heads_per_block=h) for q, p, h in grid]
    return [None] + [t for t in cands if t != TPUBlockSizes()]
  return [None]
