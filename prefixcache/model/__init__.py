"""Llama-style decoder (Flax NNX) over the paged KV cache: config, model, step, loading.
Llama, Qwen2, Mistral and Gemma 3 (text) checkpoints.

Modules: `config` (`ModelConfig`), `llama` (`Transformer`, `make_kv_caches`), `step`
(`make_step_fn`: the jitted device step over `prefixcache_kernels`), `loading` /
`safetensors_io` (HF checkpoints), `gguf` (GGUF files), `pretrained`
(`load_pretrained`), `lora` (adapters), `sharding` (tensor parallelism).

Public API (the contract the engine codes against)::

    from prefixcache.model import (ModelConfig, Transformer, make_kv_caches, make_step_fn,
                                   load_hf_checkpoint, save_hf_checkpoint, shard_model)

- `ModelConfig`: frozen, validated dataclass. Presets `ModelConfig.tiny()` (2 layers,
  d_model 128, 4 q heads / 2 kv heads, head_dim 64, vocab 512, f32: the test model),
  `ModelConfig.llama_3_2_1b()`, `ModelConfig.qwen2_5_0_5b()`, `ModelConfig.gemma3_270m()`,
  `ModelConfig.tiny_gemma3()`; `ModelConfig.from_hf_config(
  dict)` / `.to_hf_config()`; `.replace(**changes)`. Fields: vocab_size, d_model,
  num_layers, num_heads, num_kv_heads, head_dim, mlp_dim, rms_norm_eps, rope_theta,
  rope_scaling (`RopeScaling`, Llama-3), max_position_embeddings, tie_embeddings,
  qkv_bias, dtype ("float32" | "bfloat16"), architecture, sliding_window, layer_types,
  hidden_act ("silu" | "gelu_pytorch_tanh"), query_pre_attn_scalar, rope_local_theta.
  Gemma 3 (`architecture="Gemma3ForCausalLM"`, `config.gemma`): (1 + w) RMSNorms, q/k
  norms, norms on the attention and MLP outputs, embeddings times sqrt(d_model), GeGLU,
  RoPE base `rope_local_theta` on its sliding-window layers (5 of every 6).
  Sliding-window / hybrid models (HF `sliding_window`, `layer_types`, Qwen2's
  `use_sliding_window` + `max_window_layers`, Mistral's window on every layer): a
  sliding layer's query at position p attends to keys (p - W, p], as HF. Derived:
  `attention_types`, `layer_windows`, `kv_groups` ((window or None, layer ids) by
  vLLM 0.33's rule: equal-size groups of one attention kind, in first-seen order; S,S,F,S
  -> three sliding groups and one full group of one layer), `kv_group_size` (layers per
  group = KV arrays), `layer_kv_slots` (each layer's array), `layer_kv_groups`. Preset `ModelConfig.tiny_hybrid()` (4 layers S,S,F,S, W=16).
- `Transformer(config, *, rngs)`: `model(kv_caches, input_ids, metadata, logits_indices,
  mm_embeds=None, mm_mask=None, *, attend=None) -> (logits f32[S, V], kv_caches)`;
  `metadata` may be a tuple of `AttentionMetadata`, one per KV group (each layer reads
  its group's `page_indices` / `slot_mapping`). Two layouts of the layer weights:
  per layer (`model.layers[i]`, a model built by the constructor) or stacked
  (`model.stacked`: `model.layer_stack` holds every layer param as one [L, ...] array,
  `model.layers[i]` shapes only; the loaders' default). `llama.stack_layers(model)`
  (in place), `llama.unstack_layers(model)` (a per-layer copy).
- `make_kv_caches(config, num_pages=None, page_size=None, dtype=None, sharding=None, *,
  num_blocks=None, block_size=None, mesh=None, kv_dtype=None, per_layer=False,
  stacked=False) -> list` (`stacked=True`: one array [A, ...], the scanned step's layout):
  one zeroed `[num_pages, page_size, 2*num_kv_heads, head_dim]` array per layer of a KV
  group (`kv_group_size`; every layer for a model with one attention kind; vLLM's
  layout: the i-th layers of all groups share array i, each group with its own block
  ids; `per_layer=True`: one per layer, references only) (kv_dtype
  float8_e4m3fn / int8: a pair (pages, scales f32[num_pages, 2*num_kv_heads]) per layer,
  which the model passes to `kernels.write_kv` / `paged_attention` as is); `num_blocks` means
  `num_pages = num_blocks + 1` (the padding page, id num_blocks, of
  `prefixcache.metadata`); `mesh` shards axis 2 over "model". Caches larger than the
  free memory are refused first (`check_kv_cache_memory(config, num_pages, page_size,
  dtype=None, mesh=None)`: device memory where reported, else host memory).
- `make_step_fn(model, *, attention_backend="auto", interpret=False, mesh=None,
  kv_dtype=None, scan_layers=True)` ->
  `step(kv_caches, input_ids, metadata, logits_indices, mm_embeds=None, mm_mask=None)
  -> (logits f32[S, vocab], kv_caches)`; jitted, kv_caches donated, params captured once
  (`nnx.split`: graphdef static, params passed as arguments). `input_ids i32[T]`,
  `metadata: AttentionMetadata`, `logits_indices i32[S]` are `StepInputs` fields;
  `mm_embeds float[T, d_model]` + `mm_mask bool[T]`: rows where the mask is set replace
  the token embedding (None: no multimodal path, a separately compiled program).
  `step.pure(params, kv_caches, ...)` + `step.params`: the same, un-jitted, with params
  as an explicit argument, for callers that jit a larger function around the step (so the
  weights are arguments, not constants folded into the outer program).
  `scan_layers=True` (the default): the layers run under one `lax.scan` over their
  stacked params (a stacked model's own; else a stacked copy, `llama.stack_layer_params`;
  Gemma 3: units of 5 sliding + 1 full layer, `llama.layer_period`), so the program does
  not grow with depth; the caches best come in the stacked layout (`make_kv_caches(...,
  stacked=True)`: one array [A, num_pages, page_size, 2K, H], or one (pages, scales)
  pair; a list is stacked inside each call, one device only); on a mesh too, and the
  engine's host tier copies pages of the stacked layout. `scan_layers=False`: the
  unrolled step over a list of arrays (the reference the scan is tested against). On
  XLA:CPU each layer's weights are copied out of the stack before its matmuls
  (SmolLM2's steps ran within about 10% of the unrolled ones).
- `load_hf_checkpoint(path, dtype=None, *, stacked=True) -> (ModelConfig, Transformer)` for
  `LlamaForCausalLM` / `Qwen2ForCausalLM` / `MistralForCausalLM` (config.json +
  *.safetensors, sharded with
  model.safetensors.index.json or not; bf16 files read too); `save_hf_checkpoint(model,
  path, *, max_shard_bytes=None)` writes one (f32).
- `load_pretrained(path, *, dtype=None, progress=True, stacked=True,
  converted_cache=True) -> Pretrained(config, model, source,
  format "hf" | "gguf", tokenizer_path)`: an HF directory (`load_hf_checkpoint`) or a
  GGUF file (`prefixcache.model.gguf.load_gguf`: llama / qwen2 / gemma3, weights dequantized with
  the `gguf` package, the optional extra `[gguf]`; llama.cpp's Q/K RoPE row permutation
  undone; `converted_cache`: the dequantized stacked weights kept on disk by the
  file's sha256 and dtype and read back on the next load, `prefixcache.model.converted`,
  in `PREFIXCACHE_CACHE_DIR` or ~/.cache/prefixcache).
- `shard_model(model, mesh)`: tensor parallelism over kv heads along the mesh axis
  "model" (see `prefixcache.model.sharding`); `make_step_fn(model, mesh=mesh)` runs the
  attention of each device's kv heads under `jax.shard_map`.

- LoRA (`prefixcache.model.lora`): `load_lora_adapter(path, config, *, max_lora_rank,
  name=None) -> LoRAAdapter` (PEFT directory, validated against the model);
  `LoRASlots(config, *, max_loras, max_lora_rank, sharding=None)`: stacked device weights
  `.weights` (module -> (A [max_loras+1, L, in, R], B [max_loras+1, L, R, out]), scaling
  in B, slot 0 zeros) and `.activate(adapters) -> slots` (LRU); the model and
  `make_step_fn`'s step take `lora=LoRABatch(slots i32[T], weights)` (None: no LoRA, a
  separate program; any adapter mix of fixed max_loras and R: one program).

Numerics follow Hugging Face exactly: RMSNorm in f32, rotate-half RoPE (`rope_theta`,
optional Llama-3 scaling), query head i on kv head `i // (num_heads // num_kv_heads)`,
SwiGLU (GeGLU for Gemma), scale `head_dim ** -0.5` (`query_pre_attn_scalar ** -0.5`),
logits in f32.
"""
from prefixcache.model.config import ModelConfig, RopeScaling
from prefixcache.model.llama import Transformer
from prefixcache.model.loading import load_hf_checkpoint, read_safetensors, save_hf_checkpoint
from prefixcache.model.pretrained import Pretrained, load_pretrained
from prefixcache.model.lora import LoRAAdapter, LoRABatch, LoRASlots, load_lora_adapter
from prefixcache.model.sharding import MODEL_AXIS, kv_cache_sharding, shard_model
from prefixcache.model.step import check_kv_cache_memory, make_kv_caches, make_step_fn

__all__ = [
    "MODEL_AXIS",
    "LoRAAdapter",
    "LoRABatch",
    "LoRASlots",
    "ModelConfig",
    "Pretrained",
    "RopeScaling",
    "Transformer",
    "check_kv_cache_memory",
    "kv_cache_sharding",
    "load_hf_checkpoint",
    "load_lora_adapter",
    "load_pretrained",
    "make_kv_caches",
    "make_step_fn",
    "read_safetensors",
    "save_hf_checkpoint",
    "shard_model",
]
