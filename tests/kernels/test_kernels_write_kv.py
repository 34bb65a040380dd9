"""write_kv and input validation of paged_attention."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import prefixcache_kernels as kernels
from kernel_cases import make_case, oracle, tolerance


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_write_then_attend_equals_attention_over_concatenated_sequence(dtype):
  # Two sequences: 10 cached + 5 new tokens, 3 cached + 1 new; 2 padding tokens.
  seqs = [(5, 15), (1, 4)]
  case = make_case(0, seqs, num_kv_heads=2, group=2, dtype=dtype, num_tokens=8)
  page_size = case.kv_pages.shape[1]
  pad_page = case.kv_pages.shape[0] - 1
  slots, k_new, v_new = [], [], []
  for s, (q_len, kv_len) in enumerate(seqs):
    for t in range(kv_len - q_len, kv_len):
      page, off = case.page_indices[s, t // page_size], t % page_size
      case.kv_pages[page, off] = np.nan  # the step's tokens are not in the cache yet
      slots.append(page * page_size + off)
      k_new.append(case.k_seq[s][t])
      v_new.append(case.v_seq[s][t])
  num_pad = case.q.shape[0] - len(slots)
  slots += [pad_page * page_size + i for i in range(num_pad)]
  k_new += [np.full_like(k_new[0], np.nan)] * num_pad  # padding tokens carry NaN
  v_new += [np.full_like(v_new[0], np.nan)] * num_pad
  write = jax.jit(kernels.write_kv, donate_argnums=0)
  kv_pages = write(jnp.asarray(case.kv_pages), jnp.asarray(np.stack(k_new), dtype),
                   jnp.asarray(np.stack(v_new), dtype), jnp.asarray(slots, jnp.int32))
  assert kv_pages.shape == case.kv_pages.shape and kv_pages.dtype == case.kv_pages.dtype
  args = list(case.args())
  args[1] = kv_pages
  out = kernels.paged_attention(*args, sm_scale=0.125, backend="reference")
  out = np.asarray(out.astype(jnp.float32), np.float64)
  ref = oracle(case, sm_scale=0.125)
  rtol, atol = tolerance(dtype)
  np.testing.assert_allclose(out[:6], ref[:6], rtol=rtol, atol=atol)
  np.testing.assert_array_equal(out[6:], 0.0)
  # Only the step's slots and the padding page changed.
  before = np.asarray(jnp.asarray(case.kv_pages).astype(jnp.float32))
  after = np.asarray(kv_pages.astype(jnp.float32))
  changed = ~((before == after) | (np.isnan(before) & np.isnan(after)))
  changed_slots = set(np.flatnonzero(changed.reshape(-1, *changed.shape[2:]).any(axis=(1, 2))))
  assert changed_slots <= set(slots)
  # The fused call (jitted, pages donated) is the two calls above, bit for bit.
  fused = jax.jit(functools.partial(kernels.write_kv_and_attend, sm_scale=0.125,
                                    num_blocks=pad_page, backend="reference"),
                  donate_argnums=3)
  args = list(case.args())
  out_f, kv_f = fused(args[0], jnp.asarray(np.stack(k_new), dtype),
                      jnp.asarray(np.stack(v_new), dtype), jnp.asarray(case.kv_pages),
                      jnp.asarray(slots, jnp.int32), *args[2:])
  np.testing.assert_array_equal(np.asarray(kv_f.astype(jnp.float32)), after)
  np.testing.assert_array_equal(np.asarray(out_f.astype(jnp.float32), np.float64), out)


@pytest.mark.parametrize("head_dim, page_size", [(16, 4), (24, 1), (8, 3)])
def test_reference_takes_any_head_dim_and_page_size(head_dim, page_size):
  """Only the Pallas kernels have tiling limits; the reference runs any shape."""
  case = make_case(1, [(3, 7), (1, 5)], num_kv_heads=2, group=2, head_dim=head_dim,
                   page_size=page_size)
  out = kernels.paged_attention(*case.args(), sm_scale=0.125, backend="reference")
  n = case.num_live_tokens
  rtol, atol = tolerance(np.float32)
  np.testing.assert_allclose(np.asarray(out, np.float64)[:n],
                             oracle(case, sm_scale=0.125)[:n], rtol=rtol, atol=atol)


def test_write_kv_layout_k_even_v_odd():
  kv_pages = jnp.zeros((3, 8, 4, 64), jnp.float32)  # 2 kv heads
  k = jnp.arange(2 * 64, dtype=jnp.float32).reshape(1, 2, 64)
  v = -k - 1
  out = np.asarray(kernels.write_kv(kv_pages, k, v, jnp.array([8 + 5], jnp.int32)))
  np.testing.assert_array_equal(out[1, 5, 0], k[0, 0])
  np.testing.assert_array_equal(out[1, 5, 1], v[0, 0])
  np.testing.assert_array_equal(out[1, 5, 2], k[0, 1])
  np.testing.assert_array_equal(out[1, 5, 3], v[0, 1])
  assert np.count_nonzero(out) == 4 * 64 - 1  # k[0,0,0] == 0


def test_write_kv_bad_inputs():
  kv_pages = jnp.zeros((3, 8, 4, 64), jnp.float32)
  k = jnp.zeros((2, 2, 64), jnp.float32)
  slots = jnp.zeros((2,), jnp.int32)
  with pytest.raises(ValueError, match="k shape"):
    kernels.write_kv(kv_pages, jnp.zeros((2, 3, 64)), k, slots)
  with pytest.raises(ValueError, match="v shape"):
    kernels.write_kv(kv_pages, k, jnp.zeros((2, 2, 32)), slots)
  with pytest.raises(ValueError, match="slot_mapping shape"):
    kernels.write_kv(kv_pages, k, k, jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match="slot_mapping dtype"):
    kernels.write_kv(kv_pages, k, k, jnp.zeros((2,), jnp.int64 if jax.config.x64_enabled
                                              else jnp.float32))
  with pytest.raises(ValueError, match="kv_pages must be"):
    kernels.write_kv(kv_pages[0], k, k, slots)


def _good_args():
  case = make_case(0, [(2, 9)], num_kv_heads=2, group=2)
  return list(case.args())


@pytest.mark.parametrize("mutate, match", [
    (lambda a: a.__setitem__(0, a[0][:, :3]), "not a multiple of num_kv_heads"),
    (lambda a: a.__setitem__(0, jnp.zeros((a[0].shape[0], 4, 128), jnp.float32)),
     "head_dim mismatch"),
    (lambda a: a.__setitem__(0, a[0].astype(jnp.int32)), "q dtype"),
    (lambda a: a.__setitem__(0, a[0].astype(jnp.bfloat16)), "bfloat16 with kv_pages"),
    (lambda a: a.__setitem__(1, a[1].astype(jnp.float16)), "kv_pages dtype"),
    (lambda a: a.__setitem__(1, a[1][:, :, :3]), "2\\*num_kv_heads"),
    (lambda a: a.__setitem__(2, a[2].astype(jnp.float32)), "kv_lens dtype"),
    (lambda a: a.__setitem__(3, a[3].astype(jnp.float32)), "page_indices dtype"),
    (lambda a: a.__setitem__(4, a[4][:-1]), "cu_q_lens shape"),
    (lambda a: a.__setitem__(2, a[2][:-1]), "kv_lens shape"),
    (lambda a: a.__setitem__(5, jnp.array([1, 1], jnp.int32)), "num_seqs shape"),
    (lambda a: a.__setitem__(5, 1), "num_seqs must be an array"),
])
def test_paged_attention_bad_inputs(mutate, match):
  args = _good_args()
  mutate(args)
  with pytest.raises(ValueError, match=match):
    kernels.paged_attention(*args, sm_scale=0.125, backend="reference")


def test_bad_static_args_and_backend():
  args = _good_args()
  with pytest.raises(ValueError, match="sliding_window"):
    kernels.paged_attention(*args, sm_scale=0.125, sliding_window=0)
  with pytest.raises(ValueError, match="soft_cap"):
    kernels.paged_attention(*args, sm_scale=0.125, soft_cap=-1.0)
  with pytest.raises(ValueError, match="'cuda'"):
    kernels.paged_attention(*args, sm_scale=0.125, backend="cuda")


def test_negative_and_out_of_range_slots_write_nothing():
  """issue 13: jax normalises a negative index numpy-style before mode="drop", so slot
  -1 used to land on the last slot and -9 (page size 8) on the page before it -- a
  live page. Every slot outside [0, num_pages * page_size) must write nothing."""
  kv = jnp.zeros((3, 8, 2, 64))
  k = jnp.ones((5, 1, 64))
  v = 2 * jnp.ones((5, 1, 64))
  slots = jnp.array([-1, -9, -24, 24, 3], jnp.int32)  # only slot 3 is in range
  out = np.asarray(kernels.write_kv(kv, k, v, slots))
  touched = np.argwhere(out.any(axis=(2, 3)))
  np.testing.assert_array_equal(touched, [[0, 3]])
  np.testing.assert_array_equal(out[0, 3, 0], 1.0)
  np.testing.assert_array_equal(out[0, 3, 1], 2.0)



@pytest.mark.parametrize("slot", [-1, -9, 24, 0, 11, 23])
def test_one_token_write(slot):
  """One token (a batch-1 decode step: its own code path) writes its slot, and a slot
  outside [0, 24) writes nothing."""
  kv = jnp.arange(3 * 8 * 2 * 4, dtype=jnp.float32).reshape(3, 8, 2, 4)
  k, v = jnp.full((1, 1, 4), -1.0), jnp.full((1, 1, 4), -2.0)
  out = np.asarray(jax.jit(kernels.write_kv)(kv, k, v, jnp.array([slot], jnp.int32)))
  want = np.asarray(kv).copy()
  if 0 <= slot < 24:
    want[slot // 8, slot % 8] = [[-1.0] * 4, [-2.0] * 4]
  np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_one_token_write_updates_in_place(kv_dtype):
  """The compiled one-token write (KV donated) never copies the KV pages: XLA turns a
  one-row scatter into a dynamic-update-slice it duplicates into each consumer, each
  duplicate behind a copy of the whole cache (the scanned decode step: four copies of
  the pool per layer). Checked on the optimised HLO of a write followed by a read of
  the pages, as the step does."""
  pages = jnp.zeros((9, 8, 4, 16), jnp.int8 if kv_dtype == "int8" else jnp.float32)
  scales = jnp.zeros((9, 4), jnp.float32) if kv_dtype == "int8" else None

  def step(pages, k, v, slots):
    if scales is None:
      out = kernels.write_kv(pages, k, v, slots)
      return out, out[:2].astype(jnp.float32).sum()
    out, sc = kernels.write_kv(pages, k, v, slots, kv_scales=scales)
    return out, out[:2].astype(jnp.float32).sum() + sc.sum()

  k = v = jnp.ones((1, 2, 16), jnp.float32)
  hlo = jax.jit(step, donate_argnums=0).lower(
      pages, k, v, jnp.array([3], jnp.int32)).compile().as_text()
  shape = f"{pages.dtype.name.replace('float', 'f').replace('int', 's')}[{9 * 8},4,16]"
  whole = [line for line in hlo.splitlines()
           if " copy(" in line and (shape in line or "[9,8,4,16]" in line)]
  assert not whole, "\n".join(whole)


@pytest.mark.parametrize("kw,match", [
    (dict(backend="pallas_tpu", interpret=True, page_size=4),
     r"the Pallas tpu backend needs page_size in \[8, 128\], got 4"),
    (dict(backend="pallas_gpu", interpret=True, head_dim=32),
     r"the Pallas gpu backend needs head_dim in \(64, 128, 256\), got 32"),
    (dict(num_q_heads=3), "not a multiple of num_kv_heads"),
    (dict(q_dtype=jnp.bfloat16), "bfloat16 with kv_pages dtype float32"),
    (dict(kv_dtype=jnp.float16), "kv_pages dtype float16 not supported"),
    (dict(page_size=8.0), "page_size must be a positive int"),
    (dict(backend="pallas_gpu", interpret=True, page_size=24),
     "the Pallas gpu backend needs a power-of-two page_size, got 24"),
    (dict(backend="pallas_tpu"), "needs a tpu device"),
])
def test_check_backend_config(kw, match):
  args = dict(backend="reference", interpret=False, page_size=16, head_dim=64,
              num_q_heads=4, num_kv_heads=2, q_dtype=jnp.float32, kv_dtype=jnp.float32,
              platform="cpu")
  args.update(kw)
  with pytest.raises(ValueError, match=match):
    kernels.check_backend_config(args.pop("backend"), **args)
  ok = dict(args, page_size=16, head_dim=64, num_q_heads=4, q_dtype=jnp.float32,
            kv_dtype=jnp.float32, interpret=True)
  assert kernels.check_backend_config("reference", **ok) == "reference"


def test_write_kv_and_attend_quantized_returns_scales():
  """int8 pages: the fused call returns (out, kv_pages, kv_scales), equal to write_kv
  then paged_attention over the written pages and scales."""
  rng = np.random.default_rng(0)
  # Two sequences (5 tokens in pages 2, 3; 1 token in page 0) of a 6-block pool, 4-token
  # pages; page 6 is the padding page. T = 8 (2 padding tokens).
  slots = jnp.array([8, 9, 10, 11, 12, 0, 24, 24], jnp.int32)
  kv_lens = jnp.array([5, 1, 0, 0], jnp.int32)
  pages = jnp.array([[2, 3], [0, 6], [6, 6], [6, 6]], jnp.int32)
  cu = jnp.array([0, 5, 6, 6, 6], jnp.int32)
  num_seqs = jnp.array([2], jnp.int32)
  q = jnp.asarray(rng.normal(size=(8, 2, 16)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(8, 1, 16)), jnp.float32) for _ in range(2))
  kv = jnp.zeros((7, 4, 2, 16), jnp.int8)
  scales = jnp.zeros((7, 2), jnp.float32)
  # (eager: the jitted reference inside is the same program as `want`'s; jit is
  # covered by the float test above)
  fused = functools.partial(kernels.write_kv_and_attend, sm_scale=0.25, num_blocks=6,
                            backend="reference")
  out, kv_f, scales_f = fused(q, k, v, kv, slots, kv_lens, pages, cu, num_seqs,
                              kv_scales=scales)
  kv_w, scales_w = kernels.write_kv(kv, k, v, slots, scales)
  want = kernels.paged_attention(q, kv_w, kv_lens, pages, cu, num_seqs, sm_scale=0.25,
                                 kv_scales=scales_w, backend="reference")
  np.testing.assert_array_equal(np.asarray(kv_f), np.asarray(kv_w))
  np.testing.assert_array_equal(np.asarray(scales_f), np.asarray(scales_w))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
  assert np.abs(np.asarray(out[:6])).max() > 0.1  # live rows attend to written keys
