"""Bring your own model: prefix caching for a small decoder written in plain JAX.

Nothing here uses `prefixcache.model` or `prefixcache.engine`: the model is ours (a
2-layer decoder, head_dim 16, blocks of 4 tokens), and prefixcache supplies the three
pieces a model needs to cache prefixes:

  * `KVCacheManager` (host, numpy): which KV blocks a request reuses and which it gets;
  * `MetadataBuilder` / `ScheduledSeq` (host, numpy): one step's int32 index arrays
    (block tables, KV lengths, ragged query offsets, the slot of every new token);
  * `prefixcache_kernels.write_kv_and_attend` (device, pure JAX): writes this step's
    K/V into the paged cache and attends, returning `(out, kv_pages)`.

Three requests share a 12-token prefix (3 blocks). Run with the cache on, the second
and third requests prefill only their own suffix (the prefix's KV is read from the
first request's blocks); run with the cache off, they prefill everything. The logits
of every step agree, and so do the greedy tokens.

Run:  python examples/byom_decoder.py
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import prefixcache_kernels as kernels
from prefixcache import KVCacheManager, Request
from prefixcache.metadata import MetadataBuilder, ScheduledSeq

# The model: small on purpose. head_dim 16 and 4-token blocks run on the reference
# kernel (any head_dim, any block size); the Pallas kernels need head_dim 64/128/256
# and blocks of 8..128 tokens (the table in `kernels.check_backend_config`).
VOCAB, D_MODEL, NUM_LAYERS = 64, 32, 2
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 2, 1, 16  # grouped-query attention: 2 q heads per kv head
MAX_LEN = 32  # longest sequence (learned position embeddings)
BACKEND = "reference"
# The cache: 32 blocks of 4 tokens.
NUM_BLOCKS, BLOCK_SIZE = 32, 4


def init_params(seed: int = 0) -> dict:
  """Random weights: embed f32[VOCAB, D], pos f32[MAX_LEN, D], per layer wq/wk/wv/wo and
  an MLP."""
  keys = iter(jax.random.split(jax.random.key(seed), 2 + 6 * NUM_LAYERS))

  def dense(shape):
    return jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(shape[0])

  layers = [dict(wq=dense((D_MODEL, NUM_HEADS * HEAD_DIM)),
                 wk=dense((D_MODEL, NUM_KV_HEADS * HEAD_DIM)),
                 wv=dense((D_MODEL, NUM_KV_HEADS * HEAD_DIM)),
                 wo=dense((NUM_HEADS * HEAD_DIM, D_MODEL)),
                 w1=dense((D_MODEL, 4 * D_MODEL)), w2=dense((4 * D_MODEL, D_MODEL)))
            for _ in range(NUM_LAYERS)]
  return dict(embed=dense((VOCAB, D_MODEL)), pos=dense((MAX_LEN, D_MODEL)), layers=layers)


def rms_norm(x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


@jax.jit
def forward(params, kv_caches, input_ids, md):
  """One step over the ragged batch the metadata describes.

  Args:
    params: `init_params()`.
    kv_caches: one f32[NUM_BLOCKS + 1, BLOCK_SIZE, 2 * NUM_KV_HEADS, HEAD_DIM] per layer.
    input_ids: i32[T], the step's tokens (T: the builder's token bucket).
    md: the step's `AttentionMetadata` (numpy int32 arrays; a pytree).

  Returns:
    (logits f32[T, VOCAB], the updated kv_caches).
  """
  T = input_ids.shape[0]
  x = params["embed"][input_ids] + params["pos"][md.positions]  # [T, D]
  new_caches = []
  for layer, kv_pages in zip(params["layers"], kv_caches):
    h = rms_norm(x)
    q = (h @ layer["wq"]).reshape(T, NUM_HEADS, HEAD_DIM)
    k = (h @ layer["wk"]).reshape(T, NUM_KV_HEADS, HEAD_DIM)
    v = (h @ layer["wv"]).reshape(T, NUM_KV_HEADS, HEAD_DIM)
    # Writes k/v at md.slot_mapping, then attends over each sequence's pages: the cached
    # prefix, earlier chunks and this step's tokens, causally.
    attn, kv_pages = kernels.write_kv_and_attend(
        q, k, v, kv_pages, md.slot_mapping, md.kv_lens, md.page_indices, md.cu_q_lens,
        md.num_seqs, sm_scale=HEAD_DIM ** -0.5, num_blocks=NUM_BLOCKS, backend=BACKEND)
    x = x + attn.reshape(T, NUM_HEADS * HEAD_DIM) @ layer["wo"]
    x = x + jax.nn.gelu(rms_norm(x) @ layer["w1"]) @ layer["w2"]
    new_caches.append(kv_pages)
  return rms_norm(x) @ params["embed"].T, new_caches


def generate(params, prompts, *, enable_caching: bool, max_new_tokens: int = 3) -> dict:
  """Greedy generation, the first prompt alone, then the others batched.

  Returns:
    {"logits": per request, f32[1 + max_new_tokens, VOCAB] (the last prompt token's and
     each decode step's), "tokens": per request the generated ids, "hit_tokens": per
     request the prompt tokens read from the cache}.
  """
  manager = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                           max_model_len=MAX_LEN, enable_caching=enable_caching)
  # Sizes stated once: the builder takes num_blocks, block_size and the longest
  # sequence's pages (max_model_len / block_size) from the manager.
  # One shape bucket, so `forward` compiles once (the default buckets, powers of two,
  # bound the number of programs a long run compiles).
  builder = MetadataBuilder.from_manager(manager, max_num_seqs=4, max_num_tokens=32,
                                         token_buckets=(32,), page_buckets=(8,))
  # num_blocks + 1 pages: the last one is the padding page all padding points at.
  kv_caches = [jnp.zeros(builder.kv_pages_shape(NUM_KV_HEADS, HEAD_DIM), jnp.float32)
               for _ in range(NUM_LAYERS)]
  out = {"logits": {}, "tokens": {}, "hit_tokens": {}}

  def run_step(requests, scheduled):
    """Runs one step over `scheduled` (one ScheduledSeq per request); returns the
    logits of each request's last scheduled token."""
    nonlocal kv_caches
    step = builder.build(scheduled)
    logits, kv_caches = forward(params, kv_caches, step.input_ids, step.metadata)
    for req, seq in zip(requests, scheduled):
      req.num_computed_tokens += len(seq.token_ids)  # the caller advances it, as vLLM's
    return np.asarray(logits)[step.logits_indices[:len(requests)]]

  for wave in (prompts[:1], prompts[1:]):
    requests = [Request(f"r{len(out['tokens']) + i}", p) for i, p in enumerate(wave)]
    scheduled = []
    for req in requests:
      hit_blocks, num_hit = manager.get_computed_blocks(req)
      if manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit_blocks) is None:
        raise RuntimeError("the pool is too small for this example")
      req.num_computed_tokens = num_hit  # the hit prefix's KV is already in the pages
      out["hit_tokens"][req.request_id] = num_hit
      # Prefill only what is not cached: the tokens after the hit.
      scheduled.append(ScheduledSeq(manager.get_block_ids(req.request_id), num_hit,
                                    req.all_token_ids[num_hit:]))
    logits = [run_step(requests, scheduled)]
    tokens = [[] for _ in requests]
    for _ in range(max_new_tokens):
      scheduled = []
      for i, req in enumerate(requests):
        token = int(np.argmax(logits[-1][i]))
        tokens[i].append(token)
        req.append_output_token_ids(token)
        if manager.allocate_slots(req, 1) is None:  # a slot for the new token's K/V
          raise RuntimeError("the pool is too small for this example")
        scheduled.append(ScheduledSeq(manager.get_block_ids(req.request_id),
                                      req.num_computed_tokens, [token]))
      logits.append(run_step(requests, scheduled))
    for i, req in enumerate(requests):
      out["logits"][req.request_id] = np.stack([step_logits[i] for step_logits in logits])
      out["tokens"][req.request_id] = tokens[i]
      manager.free(req)  # its full blocks stay cached for later requests
  return out


def main() -> dict:
  prefix = [5, 9, 2, 7, 1, 3, 8, 6, 4, 10, 11, 12]  # 12 tokens: 3 full blocks
  prompts = [prefix + [20, 21, 22], prefix + [30, 31], prefix + [40, 41, 42, 43, 44]]
  params = init_params()
  on = generate(params, prompts, enable_caching=True)
  off = generate(params, prompts, enable_caching=False)
  max_diff = max(float(np.max(np.abs(on["logits"][r] - off["logits"][r]))) for r in on["logits"])
  print("prompt tokens read from the cache:", on["hit_tokens"])
  print("greedy tokens (cache on): ", on["tokens"])
  print(f"max |logits(cache on) - logits(cache off)| = {max_diff:.2e}")
  assert on["hit_tokens"] == {"r0": 0, "r1": 12, "r2": 12}, on["hit_tokens"]
  assert all(n == 0 for n in off["hit_tokens"].values())
  assert on["tokens"] == off["tokens"]
  assert max_diff <= 1e-5, max_diff
  return {"on": on, "off": off, "max_diff": max_diff}


if __name__ == "__main__":
  main()
