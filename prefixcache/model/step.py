"""The jitted engine step and the paged KV caches."""
from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import prefixcache_kernels as kernels
from prefixcache._validate import check_count, check_positive_int
from prefixcache.metadata import AttentionMetadata
from prefixcache.model.config import ModelConfig
from prefixcache.model.llama import (
    Transformer,
    _local_attend,
    is_stacked,
    stack_layer_params,
    unstack_layers,
)
from prefixcache.model.sharding import (
    MODEL_AXIS,
    kv_cache_sharding,
    shard_layer_stack,
    shard_model,
    validate_mesh,
)

__all__ = ["check_kv_cache_memory", "make_kv_caches", "make_step_fn"]


def check_kv_cache_memory(config: ModelConfig, num_pages: int, page_size: int, dtype=None,
                          mesh: Mesh | None = None, *, per_layer: bool = False,
                          extra: Sequence[tuple[str, int]] = ()) -> int:
    """Refuses KV caches that cannot fit, before allocating them.

    The caches are `config.kv_group_size` arrays (`num_layers` with `per_layer`; the
    same for a model with one attention kind), as `make_kv_caches` makes them.

    Compares the caches' bytes (per device: kv heads are split over the mesh's "model"
    axis) with the free device memory where the device reports it (GPU, TPU), else
    with the host's available memory (CPU: XLA's buffers live there; touching more
    than it has would end in the OOM killer, not an error).

    `dtype` (default `config.dtype`) may be a quantized KV dtype (float8_e4m3fn, int8):
    its per-(page, kv head) f32 scales count too (`prefixcache.kv_dtypes`).

    `extra`: other arrays allocated with the caches, as (what, bytes) pairs, replicated
    on every device (e.g. the stacked LoRA weights): they must fit together with the
    caches, and the message names each with its bytes.

    Returns:
      The bytes of all layers' caches (whole, not per device).

    Raises:
      ValueError: naming the sizes when they do not fit.
    """
    from prefixcache._validate import check_host_memory
    from prefixcache.kv_dtypes import KV_DTYPES, kv_bytes_per_block

    dtype = jnp.dtype(dtype if dtype is not None else config.dtype)
    arrays = config.num_layers if per_layer else config.kv_group_size
    if dtype.name in KV_DTYPES:
        nbytes = num_pages * kv_bytes_per_block(
            num_layers=arrays, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, block_size=page_size, kv_dtype=dtype.name)
    else:
        nbytes = (arrays * num_pages * page_size * 2 * config.num_kv_heads
                  * config.head_dim * dtype.itemsize)
    what = (f"the KV cache ({arrays} layers x {num_pages} pages x {page_size} "
            f"tokens x {2 * config.num_kv_heads} x {config.head_dim} {dtype.name})")
    shards = int(dict(mesh.shape).get(MODEL_AXIS, 1)) if mesh is not None else 1
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    extra_bytes = sum(int(b) for _, b in extra)
    hint = "use fewer blocks"
    if extra:
        # NOTE: the caches and the extra arrays are refused together: each may fit
        # alone while both do not (the extra arrays are allocated after the caches' check).
        what = (f"{what}, {nbytes / 2**30:.3g} GiB, with "
                + " and ".join(f"{w}, {int(b)} bytes ({int(b) / 2**30:.3g} GiB)"
                               for w, b in extra) + ",")
        hint = "use fewer blocks or make the other arrays smaller"
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        stats = None
    if stats and "bytes_limit" in stats:
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        per_device = nbytes // shards + extra_bytes
        if per_device > free:
            raise ValueError(
                f"{what} needs about {per_device / 2**30:.3g} GiB per device but only "
                f"{free / 2**30:.3g} GiB of device memory is free; {hint}")
    else:
        check_host_memory(what, nbytes + extra_bytes)
    return nbytes


def make_kv_caches(config: ModelConfig, num_pages: int | None = None,
                   page_size: int | None = None, dtype=None, sharding=None, *,
                   num_blocks: int | None = None, block_size: int | None = None,
                   mesh: Mesh | None = None, kv_dtype=None, per_layer: bool = False,
                   stacked: bool = False):
    """Zeroed paged KV caches, one per layer position of a KV cache group (vLLM's layout).

    A model with one attention kind has one group of every layer: one array per layer.
    A hybrid model (sliding-window and full layers) has `config.kv_groups` of
    `config.kv_group_size` layers each; layer i reads and writes array
    `config.layer_kv_slots[i]` (its position in its group) through its group's block
    table, so a block id holds `kv_group_size` layers' KV and the pool's bytes are
    num_pages x (one group's layers), as vLLM's `get_kv_cache_config_from_groups`.

    Either `num_pages` (total, padding page included) or `num_blocks` (allocatable blocks;
    one padding page is added: num_pages = num_blocks + 1); either `page_size` or
    `block_size` (the same thing).

    Args:
      config: the model config (L layers, K kv heads, head_dim H).
      num_pages / num_blocks: see above.
      page_size / block_size: tokens per page.
      dtype: cache dtype; default `config.dtype`.
      sharding: a `jax.sharding.Sharding` for each cache, or None.
      mesh: shorthand for `sharding=kv_cache_sharding(mesh, kv_dtype)` (kv heads over
        "model").
      kv_dtype: one of `prefixcache.kv_dtypes.KV_DTYPES` ("bfloat16", "float32",
        "float8_e4m3fn", "int8"), or None: `dtype` (the same thing; give one).
      per_layer: one array per layer whatever the groups (the layout before vLLM's
        shared arrays; a hybrid model may then run with one AttentionMetadata for every
        layer). Reference runs and tests only (not with a mesh: the step's output
        shardings are the shared layout's).
      stacked: the same L arrays as one array [L, num_pages, page_size, 2K, H] (quantized:
        one pair (pages [L, ...], scales f32[L, num_pages, 2K])), the layout of the
        scanned step (`make_step_fn(scan_layers=True)`, the default); with a mesh, axis 3
        (2K) is split over "model" (scales: axis 2).

    Returns:
      L = `config.kv_group_size` (per_layer: `config.num_layers`) arrays [num_pages,
      page_size, 2K, H] (K of kv head h at slot 2h, V at 2h+1);
      for a quantized kv_dtype (float8_e4m3fn, int8) L pairs (pages, scales) with
      zeroed scales f32[num_pages, 2K] (column 2h: K of kv head h, 2h+1: its V);
      with `stacked`, one array (pair) holding them all, as above.

    Raises:
      ValueError: an unknown kv_dtype or one that contradicts `dtype`, conflicting or
        missing sizes, non-positive sizes, a mesh that does not
        divide the kv heads, or caches larger than the free memory
        (`check_kv_cache_memory`).
    """
    from prefixcache.kv_dtypes import QUANTIZED_KV_DTYPES, check_kv_dtype

    if kv_dtype is not None:
        kv_dtype = check_kv_dtype(kv_dtype)
        if dtype is not None and jnp.dtype(dtype) != jnp.dtype(kv_dtype):
            raise ValueError(f"dtype {jnp.dtype(dtype).name} and kv_dtype {kv_dtype} differ; "
                             "give one")
        dtype = kv_dtype
    if (num_pages is None) == (num_blocks is None):
        raise ValueError("give exactly one of num_pages (padding page included) and "
                         "num_blocks (one padding page is added)")
    if (page_size is None) == (block_size is None):
        raise ValueError("give exactly one of page_size and block_size")
    # (the one rule for sizes: numpy ints are ints, bools are not -- _validate)
    if num_pages is not None:
        pages = check_positive_int("num_pages", num_pages)
    else:
        pages = check_count("num_blocks", num_blocks) + 1
    if page_size is not None:
        size = check_positive_int("page_size", page_size)
    else:
        size = check_positive_int("block_size", block_size)
    if mesh is not None:
        if sharding is not None:
            raise ValueError("give mesh or sharding, not both")
        validate_mesh(config, mesh)
        sharding = kv_cache_sharding(mesh, dtype, stacked=stacked)
    dtype = jnp.dtype(dtype if dtype is not None else config.dtype)
    check_kv_cache_memory(config, pages, size, dtype, mesh, per_layer=per_layer)
    arrays = config.num_layers if per_layer else config.kv_group_size
    shape = (pages, size, 2 * config.num_kv_heads, config.head_dim)
    if dtype.name in QUANTIZED_KV_DTYPES:
        page_sh, scale_sh = sharding if isinstance(sharding, tuple) else (sharding, None)
        scales = (pages, 2 * config.num_kv_heads)
        if stacked:
            return (jnp.zeros((arrays, *shape), dtype, device=page_sh),
                    jnp.zeros((arrays, *scales), jnp.float32, device=scale_sh))
        return [(jnp.zeros(shape, dtype, device=page_sh),
                 jnp.zeros(scales, jnp.float32, device=scale_sh))
                for _ in range(arrays)]
    if stacked:
        return jnp.zeros((arrays, *shape), dtype, device=sharding)
    return [jnp.zeros(shape, dtype, device=sharding) for _ in range(arrays)]


def _check_step_args(config: ModelConfig, kv_caches, input_ids, metadata, logits_indices,
                     mm_embeds, mm_mask) -> None:
    """Static (shape/dtype) checks; runs at trace time, so no device transfer."""
    metadata_arg = metadata
    if isinstance(metadata, (tuple, list)) and not isinstance(metadata, AttentionMetadata):
        # Hybrid models: one AttentionMetadata per KV group.
        if len(metadata) != len(config.kv_groups) or not all(
                isinstance(m, AttentionMetadata) for m in metadata):
            raise ValueError(f"metadata must be an AttentionMetadata or a tuple of "
                             f"{len(config.kv_groups)} (one per KV group), got "
                             f"{[type(m).__name__ for m in metadata]}")
        for g, m in enumerate(metadata):
            if m.page_indices.shape[0] != metadata[0].page_indices.shape[0]:
                raise ValueError(f"metadata[{g}].page_indices {m.page_indices.shape} has "
                                 f"another row count than metadata[0]")
        metadata = metadata[0]
    if not isinstance(metadata, AttentionMetadata):
        raise ValueError(f"metadata must be an AttentionMetadata, got {type(metadata).__name__}")
    if is_stacked(kv_caches):  # checked as the list of arrays it holds
        one = lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype)  # noqa: E731
        kv_caches = ([(one(kv_caches[0]), one(kv_caches[1]))] * kv_caches[0].shape[0]
                     if isinstance(kv_caches, tuple)
                     else [one(kv_caches)] * kv_caches.shape[0])
    if len(kv_caches) not in (config.num_layers, config.kv_group_size):
        raise ValueError(f"got {len(kv_caches)} kv caches for {config.num_layers} layers "
                         f"(expected {config.kv_group_size}, one per layer of a KV cache "
                         f"group, or {config.num_layers}, one per layer)")
    if (len(kv_caches) != config.num_layers and len(config.kv_groups) > 1
            and isinstance(metadata_arg, AttentionMetadata)):
        raise ValueError(f"the model's {len(config.kv_groups)} KV cache groups share "
                         f"{len(kv_caches)} KV arrays: pass one AttentionMetadata per group "
                         "(a tuple), or per-layer caches (make_kv_caches(per_layer=True))")
    want = (2 * config.num_kv_heads, config.head_dim)
    for i, c in enumerate(kv_caches):
        if isinstance(c, tuple):  # quantized: (pages, scales)
            if len(c) != 2 or c[1].shape != (c[0].shape[0], want[0]):
                raise ValueError(f"kv_caches[{i}] must be (pages, scales [num_pages, "
                                 f"{want[0]}]), got {[x.shape for x in c]}")
            c = c[0]
        if c.ndim != 4 or tuple(c.shape[2:]) != want:
            raise ValueError(f"kv_caches[{i}] shape {c.shape} is not [num_pages, page_size, "
                             f"{want[0]}, {want[1]}]")
    if input_ids.ndim != 1 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"input_ids must be i32[T], got {input_ids.dtype}{input_ids.shape}")
    T = input_ids.shape[0]
    if metadata.positions.shape != (T,) or metadata.slot_mapping.shape != (T,):
        raise ValueError(f"positions {metadata.positions.shape} / slot_mapping "
                         f"{metadata.slot_mapping.shape} must be ({T},) like input_ids")
    if logits_indices.ndim != 1:
        raise ValueError(f"logits_indices must be i32[S], got shape {logits_indices.shape}")
    if (mm_embeds is None) != (mm_mask is None):
        raise ValueError("mm_embeds and mm_mask go together (both or neither)")
    if mm_embeds is not None:
        if mm_embeds.shape != (T, config.d_model):
            raise ValueError(f"mm_embeds shape {mm_embeds.shape} must be ({T}, "
                             f"{config.d_model}) = [T, d_model]")
        if not jnp.issubdtype(mm_embeds.dtype, jnp.floating):
            raise ValueError(f"mm_embeds must be floating, got {mm_embeds.dtype}")
        if mm_mask.shape != (T,) or mm_mask.dtype != jnp.bool_:
            raise ValueError(f"mm_mask must be bool[{T}], got {mm_mask.dtype}{mm_mask.shape}")


def _check_lora_args(config: ModelConfig, input_ids, lora) -> None:
    """Static checks of a LoRABatch (trace time)."""
    from prefixcache.model.lora import TARGET_MODULES, LoRABatch, module_dims

    if not isinstance(lora, LoRABatch):
        raise ValueError(f"lora must be a LoRABatch, got {type(lora).__name__}")
    T = input_ids.shape[0]
    if lora.slots.shape != (T,) or not jnp.issubdtype(lora.slots.dtype, jnp.integer):
        raise ValueError(f"lora.slots must be i32[{T}] like input_ids, got "
                         f"{lora.slots.dtype}{lora.slots.shape}")
    if set(lora.weights) != set(TARGET_MODULES):
        raise ValueError(f"lora.weights must have the modules {TARGET_MODULES}, got "
                         f"{sorted(lora.weights)}")
    dims = module_dims(config)
    for m, (a, b) in lora.weights.items():
        S, L, fan_in, R = a.shape if a.ndim == 4 else (None,) * 4
        if (a.ndim != 4 or (L, fan_in) != (config.num_layers, dims[m][0])
                or b.shape != (S, L, R, dims[m][1])):
            raise ValueError(f"lora.weights[{m!r}] shapes {a.shape}, {b.shape} are not "
                             f"[S, {config.num_layers}, {dims[m][0]}, R], "
                             f"[S, {config.num_layers}, R, {dims[m][1]}]")


def make_step_fn(model: Transformer, *, attention_backend: str = "auto",
                 interpret: bool = False, mesh: Mesh | None = None, kv_dtype=None,
                 scan_layers: bool = True):
    """Builds the jitted step of `model` (params captured now; graphdef static).

    Returns `step(kv_caches, input_ids, metadata, logits_indices, mm_embeds=None,
    mm_mask=None, lora=None) -> (logits f32[S, V], kv_caches)`:
      kv_caches: the KV arrays (`make_kv_caches`), donated (invalid after the call): the
        scanned step (the default) takes the stacked layout (`stacked=True`: one array
        [A, num_pages, page_size, 2K, H]) or, one device only, the list of A arrays
        (stacked and unstacked inside the program: a copy of the caches per call, for
        tests and references); the unrolled step takes the list.
      input_ids: i32[T]; metadata: `AttentionMetadata` (or a tuple of them, one per KV
        group of a hybrid model: `Transformer.__call__`); logits_indices: i32[S] (the
        `StepInputs` of `prefixcache.metadata`).
      mm_embeds: float[T, D] rows replacing the token embedding where mm_mask: bool[T] is
        set, or None for both (a separately compiled program).
      lora: a `prefixcache.model.lora.LoRABatch` (per-token adapter slots i32[T] and
        the stacked adapter weights) or None (a separately compiled program).
    Every per-step value is an array argument, so one program is compiled per distinct
    (T, S, P, num_pages) shape, mm on/off and LoRA on/off (any adapter mix of a fixed
    max_loras and max rank: one program).

    `step.pure(params, kv_caches, input_ids, metadata, logits_indices, mm_embeds, mm_mask,
    lora)` is the un-jitted function with params (an `nnx.State`, `step.params`) as an
    argument, for callers that jit a larger function around it.

    Args:
      model: the Transformer, per-layer or stacked (`Transformer.stacked`). With `mesh`,
        its params are laid out over the mesh first (`shard_model`, in place).
      attention_backend: `kernels.paged_attention` backend ("auto", "reference", ...).
      interpret: run a Pallas backend in interpret mode.
      mesh: a Mesh with a "model" axis for tensor parallelism over kv heads, or None.
      kv_dtype: the caches' KV dtype (`make_kv_caches(kv_dtype=)`); read only with a
        mesh, whose output shardings follow the cache structure (None: unquantized).
      scan_layers: run the layers under one `lax.scan` over their stacked params
        (`stack_layer_params`; Gemma 3: over units of five sliding-window layers and one
        full), so compile time does not grow with depth (the default). Same numbers as
        the unrolled step (`scan_layers=False`, one copy of the layer code per layer:
        the plain path the scanned one is tested against).
        NOTE: the weights are held once when the model is stacked (the loaders'
        default); a per-layer model gets a stacked copy in `step.params` (and a stacked
        model run unrolled a per-layer copy). On XLA:CPU each layer's weights are
        copied out of the stack before its matmuls (a dynamic slice is not fused into
        the dot): a bare chain of matrix-vector products runs about 2x slower scanned;
        SmolLM2's engine steps, whose time goes mostly elsewhere, ran within about 10%
        (experiments/results/bench_first_step.md).

    Raises:
      ValueError: unknown backend or kv_dtype, or a mesh that does not divide the model.
    """
    if not isinstance(model, Transformer):
        raise ValueError(f"model must be a Transformer, got {type(model).__name__}")
    if not (isinstance(attention_backend, kernels.KernelBackend)
            or attention_backend in kernels.BACKENDS):
        raise ValueError(f"unknown attention_backend {attention_backend!r}; expected one of "
                         f"{kernels.BACKENDS} or a kernels.KernelBackend record")
    scan_layers = bool(scan_layers)
    if not scan_layers:
        model = unstack_layers(model)  # (itself when per-layer)
    config = model.config
    local = functools.partial(_local_attend, sm_scale=config.attention_scale,
                              backend=attention_backend, interpret=interpret)
    if mesh is None:
        attend = local
        out_shardings = None
    else:
        validate_mesh(config, mesh)
        shard_model(model, mesh)
        heads = P(None, MODEL_AXIS, None)  # [T, heads, H]
        pages = P(None, None, MODEL_AXIS, None)  # [num_pages, page_size, 2K, H]
        # NOTE: metadata is replicated (P() as a prefix spec for the whole NamedTuple);
        # each device writes and attends over its own kv heads only. The scanned step
        # views its stacked caches as one pool [A * num_pages, page_size, 2K, H]: the
        # same spec.
        def attend(q, k, v, kv_cache, metadata, sliding_window=None):
            fn = functools.partial(local, sliding_window=sliding_window)
            # Quantized caches are (pages, scales [num_pages, 2K]): scales split like pages.
            spec = (pages, P(None, MODEL_AXIS)) if isinstance(kv_cache, tuple) else pages
            return jax.shard_map(fn, mesh=mesh, in_specs=(heads, heads, heads, spec, P()),
                                 out_specs=(heads, spec), check_vma=False)(
                                     q, k, v, kv_cache, metadata)

        kv_sharding = kv_cache_sharding(mesh, kv_dtype, stacked=scan_layers)
        out_shardings = (NamedSharding(mesh, P()),
                         kv_sharding if scan_layers else [kv_sharding] * config.kv_group_size)
    if scan_layers:
        graphdef, layer_state, stack_state, rest = nnx.split(
            model, nnx.PathContains("layers"), nnx.PathContains("layer_stack"), ...)
        # The per-layer params are not read by the scanned call: shapes stand in for them
        # (and for the model's own stack, passed as `layer_params`).
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                (layer_state, stack_state))
        stack = stack_layer_params(model)  # (the model's own stack when stacked)
        if mesh is not None:
            stack = shard_layer_stack(stack, mesh)
        params = {"layers": stack, "rest": rest}
    else:
        graphdef, params = nnx.split(model)

    def pure(params, kv_caches, input_ids, metadata, logits_indices, mm_embeds=None,
             mm_mask=None, lora=None):
        if is_stacked(kv_caches) and not scan_layers:
            raise ValueError("the unrolled step (scan_layers=False) takes a list of KV "
                             "arrays, not the stacked KV layout (make_kv_caches(stacked=True))")
        if mesh is not None and scan_layers and not is_stacked(kv_caches):
            raise ValueError("the scanned step on a mesh takes the stacked KV layout "
                             "(make_kv_caches(stacked=True, mesh=...)), got a list")
        _check_step_args(config, kv_caches, input_ids, metadata, logits_indices, mm_embeds,
                         mm_mask)
        if lora is not None:
            _check_lora_args(config, input_ids, lora)
        if scan_layers:
            m = nnx.merge(graphdef, *abstract, params["rest"])
            return m(kv_caches, input_ids, metadata, logits_indices, mm_embeds, mm_mask,
                     attend=attend, lora=lora, layer_params=params["layers"])
        m = nnx.merge(graphdef, params)
        return m(list(kv_caches), input_ids, metadata, logits_indices, mm_embeds, mm_mask,
                 attend=attend, lora=lora)

    jitted = jax.jit(pure, donate_argnums=(1,), out_shardings=out_shardings)

    def step(kv_caches: Sequence[jax.Array], input_ids, metadata: AttentionMetadata,
             logits_indices, mm_embeds=None, mm_mask=None, lora=None):
        if not is_stacked(kv_caches):
            kv_caches = list(kv_caches)
        return jitted(params, kv_caches, input_ids, metadata, logits_indices,
                      mm_embeds, mm_mask, lora)

    step.pure = pure
    step.params = params
    step.graphdef = graphdef
    step.jitted = jitted
    step.scan_layers = scan_layers
    return step
