"""The model runner: host batch -> device step -> sampled token ids.

The only place the engine meets the device. Per step it
1. builds the padded int32 index arrays with the `MetadataBuilder` (block tables from
   the scheduler's `BlockTables`, one row gather), the per-row sampling parameters and, when a
   scheduled chunk covers multimodal placeholder positions, the embedding rows to inject;
2. moves all of them to the device with ONE `jax.device_put`: the int32/float32 index and
   sampling arrays packed into one int32 buffer (`pack_inputs`; a transfer per array
   cost ~15 us each, ~0.2 ms a step), the multimodal rows, when present, beside it;
3. runs one jitted function (unpacks the buffer with static slices, model step +
   sampling; the paged KV is donated);
4. fetches the sampled token ids with ONE explicit `jax.device_get`.

Nothing else crosses the host/device boundary, so the step loop runs clean under
`jax.transfer_guard("disallow")`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import operator
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prefixcache.engine.block_table import BlockTables
from prefixcache.engine.sampler import SamplingArrays, sample
from prefixcache.engine.scheduler import ScheduledRequest
from prefixcache.metadata import AttentionMetadata, MetadataBuilder, ScheduledSeq, StepInputs


# ScheduledRequest / EngineRequest field getters (C-level iteration in `prepare`).
_STATE = operator.attrgetter("state")
_NUM_COMPUTED = operator.attrgetter("num_computed_tokens")
_NUM_NEW = operator.attrgetter("num_new_tokens")
_BLOCK_ROW = operator.attrgetter("block_row")
_TEMPERATURE = operator.attrgetter("params.temperature")
_MM_EMBEDDINGS = operator.attrgetter("mm_embeddings")
_ALL_TOKEN_IDS = operator.attrgetter("request.all_token_ids")


class DeviceInputs(NamedTuple):
    """The pytree moved to the device once per step.

    Attributes:
      step: StepInputs (input_ids i32[T], metadata, logits_indices i32[S]).
      sampling: SamplingArrays, each [S].
      mm_embeds: f32[T, d_model] embedding rows to inject, or None.
      mm_mask: bool[T] rows of `mm_embeds` that replace the token embedding, or None.
      lora_slots: i32[T] each token row's LoRA adapter slot (0: none; padding rows 0),
        or None when the engine runs without LoRA.
    """

    step: StepInputs
    sampling: SamplingArrays
    mm_embeds: np.ndarray | None
    mm_mask: np.ndarray | None
    lora_slots: np.ndarray | None = None


# (treedef, ((shape, dtype), ...)) of the packed arrays: static in the jitted step.
PackLayout = tuple
_I32 = np.dtype(np.int32)


class PackedInputs(NamedTuple):
    """`DeviceInputs` as moved by a packing runner (`StepProgram` takes either).

    Attributes:
      packed: i32[n] device buffer from `pack_inputs` (step + sampling arrays).
      mm_embeds, mm_mask: as in `DeviceInputs` (device arrays or None).
      layout: the `pack_inputs` layout (static: part of the compiled program's key).
    """

    packed: Any
    mm_embeds: Any
    mm_mask: Any
    layout: PackLayout


def pack_inputs(step: StepInputs, sampling: SamplingArrays | None,
                lora_slots: np.ndarray | None = None) -> tuple[np.ndarray, PackLayout]:
    """The step's index and sampling arrays (None: none) as ONE flat int32 buffer.

    With `lora_slots` (i32[T]) it is packed too and `unpack_inputs` returns a 3-tuple
    `(step, sampling, lora_slots)`.

    Every array has a native 4-byte dtype (int32, float32, uint32); float32 and uint32
    go in bit for bit (`view`), so `unpack_inputs` returns them unchanged.

    Returns:
      (i32[sum of sizes], layout): `layout` (hashable) says how to cut it back.
    """
    leaves, treedef = jax.tree.flatten(
        (step, sampling) if lora_slots is None else (step, sampling, lora_slots))
    for a in leaves:
        if a.dtype.itemsize != 4 or not a.dtype.isnative:
            raise ValueError(f"pack_inputs: {a.dtype} array of shape {a.shape} is not a "
                             "native 4-byte dtype")
    # NOTE: `ravel` alone for the int32 arrays (a `view` each costs ~0.3 us).
    packed = np.concatenate([a.ravel() if a.dtype is _I32 else a.ravel().view(_I32)
                             for a in leaves])
    return packed, (treedef, tuple((a.shape, a.dtype) for a in leaves))


def unpack_inputs(packed, layout: PackLayout
                  ) -> tuple[StepInputs, SamplingArrays | None]:
    """Inverse of `pack_inputs` (traced: static slices and bitcasts of `packed`)."""
    treedef, specs = layout
    out, off = [], 0
    for shape, dtype in specs:
        n = math.prod(shape)
        x = packed[off:off + n]
        if dtype != np.int32:
            x = jax.lax.bitcast_convert_type(x, dtype)
        out.append(x.reshape(shape))
        off += n
    return jax.tree.unflatten(treedef, out)


@dataclasses.dataclass
class PreparedStep:
    """Host-side result of `ModelRunner.prepare` (all numpy).

    `packed`/`layout` (from `pack_inputs`) hold `inputs.step` and `inputs.sampling` as
    one buffer when the runner packs its transfers; None otherwise.
    """

    inputs: DeviceInputs
    num_seqs: int
    all_greedy: bool
    packed: np.ndarray | None = None
    layout: PackLayout | None = None

    @property
    def shape_key(self) -> tuple:
        """The key of the compiled program this step runs."""
        step = self.inputs.step
        if not isinstance(step.metadata, AttentionMetadata):  # one per KV group
            step = step._replace(metadata=step.metadata[0])
        t, s, p = MetadataBuilder.shape_of(step)
        key = (t, s, p, self.all_greedy, self.inputs.mm_embeds is not None)
        return key if self.inputs.lora_slots is None else key + ("lora",)


def mm_rows_for_step(
    scheduled: Sequence[ScheduledRequest], logits_indices: np.ndarray, num_rows: int,
    d_model: int, dtype,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Embedding rows of the multimodal items this step's chunks cover.

    A scheduled chunk of request r covers positions [c, c + q) (c = its
    num_computed_tokens); its last token sits at token row `logits_indices[i]`, and its
    rows are contiguous, so position p sits at row `logits_indices[i] - (c + q - 1 - p)`.

    Args:
      scheduled: the step's requests, in the order given to the MetadataBuilder.
      logits_indices: i32[S] from the built StepInputs.
      num_rows: T, the step's token bucket.
      d_model: embedding width.
      dtype: numpy dtype of the rows.

    Returns:
      (mm_embeds [T, d_model], mm_mask bool[T]) or None when no chunk covers an item.
    """
    embeds = mask = None
    for i, s in enumerate(scheduled):
        feats = s.state.request.mm_features
        if not feats:
            continue
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        last_row = int(logits_indices[i])
        for f in feats:
            lo, hi = max(start, f.offset), min(end, f.offset + f.length)
            if lo >= hi:
                continue
            if embeds is None:
                embeds = np.zeros((num_rows, d_model), dtype)
                mask = np.zeros(num_rows, np.bool_)
            rows = s.state.mm_embeddings[f.identifier]
            r0 = last_row - (end - 1 - lo)
            embeds[r0:r0 + hi - lo] = rows[lo - f.offset:hi - f.offset]
            mask[r0:r0 + hi - lo] = True
    return None if embeds is None else (embeds, mask)


class StepProgram:
    """The jitted device function of one model: model step + sampler, KV donated.

    Separate from the runner so that several engines over the same model (e.g. with
    caching on and off) share compiled programs while each keeps its own KV arrays.

    Args:
      model: a `prefixcache.model.Transformer` (with a mesh, laid out over it in place).
      attention_backend, interpret: passed to `make_step_fn`.
      mesh: a `jax.sharding.Mesh` or None (one device).
      scan_layers: the layers under one `lax.scan` (`make_step_fn`'s default): the KV
        arrays are then in the stacked layout (`make_kv_caches(stacked=True)`); False:
        the unrolled step over a list of KV arrays.
    """

    def __init__(self, model, *, attention_backend: str = "auto", interpret: bool = False,
                 mesh=None, kv_dtype=None, scan_layers: bool = True):
        from prefixcache.model import make_step_fn

        self.model = model
        self.config = model.config
        self.mesh = mesh
        self.attention_backend = attention_backend
        self.interpret = interpret
        self.kv_dtype = kv_dtype
        self.scan_layers = bool(scan_layers)
        step = make_step_fn(model, attention_backend=attention_backend, interpret=interpret,
                            mesh=mesh, kv_dtype=kv_dtype, scan_layers=self.scan_layers)
        # NOTE: one jitted function runs the model step and the sampler, with the weights
        # as an argument (`step.pure` + `step.params`, not constants folded into the
        # program) and the paged KV donated.
        pure = step.pure
        self.params = step.params
        # NOTE: the weights go in as their flat leaf list (flattened once here): an
        # nnx.State argument is flattened by Python code on every call (~15 us a step).
        self._param_leaves, param_treedef = jax.tree.flatten(step.params)

        def device_step(param_leaves, kv_caches, inputs: DeviceInputs, lora_weights=None, *,
                        all_greedy: bool):
            params = jax.tree.unflatten(param_treedef, param_leaves)
            lora = None
            if inputs.lora_slots is not None:
                from prefixcache.model.lora import LoRABatch
                lora = LoRABatch(inputs.lora_slots, lora_weights)
            logits, kv_caches = pure(params, kv_caches, inputs.step.input_ids,
                                     inputs.step.metadata, inputs.step.logits_indices,
                                     inputs.mm_embeds, inputs.mm_mask, lora)
            tokens = sample(logits, inputs.sampling, all_greedy=all_greedy)
            return tokens, logits, kv_caches

        if mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec
            from prefixcache.model import kv_cache_sharding
            replicated = NamedSharding(mesh, PartitionSpec())
            kv_sharding = kv_cache_sharding(mesh, kv_dtype, stacked=self.scan_layers)
            out_shardings = (replicated, replicated,
                             kv_sharding if self.scan_layers
                             else [kv_sharding] * self.config.kv_group_size)
            self.input_sharding = replicated
        else:
            out_shardings = None
            self.input_sharding = None

        def packed_step(param_leaves, kv_caches, packed, mm_embeds, mm_mask,
                        lora_weights=None, *, layout, all_greedy: bool):
            unpacked = unpack_inputs(packed, layout)
            lora_slots = unpacked[2] if len(unpacked) == 3 else None
            return device_step(param_leaves, kv_caches,
                               DeviceInputs(unpacked[0], unpacked[1], mm_embeds, mm_mask,
                                            lora_slots),
                               lora_weights, all_greedy=all_greedy)

        self._jitted = jax.jit(device_step, donate_argnums=1, static_argnames="all_greedy",
                               out_shardings=out_shardings)
        self._jitted_packed = jax.jit(packed_step, donate_argnums=1,
                                      static_argnames=("layout", "all_greedy"),
                                      out_shardings=out_shardings)

    @property
    def num_programs_built(self) -> int:
        """Executables its jitted step functions hold (compiled or loaded from the
        persistent compilation cache), read from jax's caches."""
        return self._jitted._cache_size() + self._jitted_packed._cache_size()

    def lower(self, kv_caches, inputs: DeviceInputs | PackedInputs, *, all_greedy: bool,
              lora_weights=None):
        """The `jax.stages.Lowered` program `__call__` would run on these arguments
        (traced and lowered, not compiled; nothing runs, nothing is donated).

        `.compile()` on it builds the very executable that jax's caches then hand to
        `__call__` with arguments of the same shapes (compiling releases the GIL, so
        several can compile at once on threads: `prefixcache.engine.warmup`).
        """
        if isinstance(inputs, PackedInputs):
            traced = self._jitted_packed.trace(
                self._param_leaves, kv_caches, inputs.packed, inputs.mm_embeds,
                inputs.mm_mask, lora_weights, layout=inputs.layout, all_greedy=all_greedy)
        else:
            traced = self._jitted.trace(self._param_leaves, kv_caches, inputs, lora_weights,
                                        all_greedy=all_greedy)
        return traced.lower()

    def __call__(self, kv_caches, inputs: DeviceInputs | PackedInputs, *,
                 all_greedy: bool, lora_weights=None):
        """(tokens i32[S], logits f32[S, V], new kv_caches); `kv_caches` is donated.

        `lora_weights`: `LoRASlots.weights` when the inputs carry LoRA slots, else None.
        """
        if isinstance(inputs, PackedInputs):
            return self._jitted_packed(self._param_leaves, kv_caches, inputs.packed,
                                       inputs.mm_embeds, inputs.mm_mask, lora_weights,
                                       layout=inputs.layout, all_greedy=all_greedy)
        return self._jitted(self._param_leaves, kv_caches, inputs, lora_weights,
                            all_greedy=all_greedy)


class ModelRunner:
    """Runs engine steps of one model on one device or a mesh.

    Invariants:
      - `kv_caches` is always the latest (donated-and-returned) KV; the previous one is
        invalid after `execute`.
      - `compiled_shapes` holds the key of every distinct program run so far (bucketed
        (T, S, P), all-greedy flag, multimodal flag).

    Args:
      model: a `prefixcache.model.Transformer`.
      config: its ModelConfig.
      num_blocks, block_size: the KV pool (the KV arrays get one extra padding page).
      max_num_seqs, max_num_batched_tokens, max_model_len: the engine's limits.
      attention_backend, interpret: passed to `make_step_fn`.
      mesh: a `jax.sharding.Mesh` or None (one device).
      token_buckets, seq_buckets, page_buckets: MetadataBuilder buckets (None: defaults).
      program: a StepProgram to reuse (same model, backend and mesh), or None to build one.
      pack_transfers: move the step's arrays as one packed buffer (`pack_inputs`); False
        moves the `DeviceInputs` pytree as is (the plain path the packed one is tested
        against). Settable (`runner.pack_transfers`) between steps.
      lora_slots: a `prefixcache.model.lora.LoRASlots` (the stacked adapter weights)
        when LoRA is enabled, else None.
      lora_adapters: an OrderedDict (name, path) -> `LoRAAdapter` of every adapter
        requests may name (the engine's loaded adapters, least recently used first;
        read at `prepare`, which moves the step's adapters to the end), with `lora_slots`.
      num_host_blocks: host-tier pages (`host_pages`, a `HostPages`; 0: none, None).
    """

    def __init__(self, model, config, *, num_blocks: int, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 attention_backend: str = "auto", interpret: bool = False, mesh=None,
                 token_buckets=None, seq_buckets=None, page_buckets=None,
                 program: StepProgram | None = None, pack_transfers: bool = True,
                 lora_slots=None, lora_adapters=None, num_host_blocks: int = 0,
                 kv_dtype=None, scan_layers: bool = True):
        from prefixcache.model import make_kv_caches

        if lora_adapters is not None and not isinstance(lora_adapters,
                                                        collections.OrderedDict):
            raise ValueError("lora_adapters must be a collections.OrderedDict (its order "
                             f"is the adapters' recency), got {type(lora_adapters).__name__}")
        if program is None:
            program = StepProgram(model, attention_backend=attention_backend,
                                  interpret=interpret, mesh=mesh, kv_dtype=kv_dtype,
                                  scan_layers=scan_layers)
        elif (program.model is not model or program.mesh is not mesh
              or program.attention_backend != attention_backend
              or program.interpret != interpret or program.kv_dtype != kv_dtype
              or program.scan_layers != bool(scan_layers)):
            raise ValueError("a shared StepProgram needs the same model object, mesh, "
                             "attention_backend, interpret flag, kv_dtype and scan_layers")
        self.program = program
        self.model = model
        self.config = config
        self.mesh = mesh
        self.builder = MetadataBuilder(
            block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
            max_num_tokens=max_num_batched_tokens,
            max_pages_per_seq=-(-max_model_len // block_size),
            token_buckets=token_buckets, seq_buckets=seq_buckets, page_buckets=page_buckets)
        self.kv_dtype = kv_dtype
        self.stacked_kv = program.scan_layers  # the KV layout, fixed for the runner's life
        self.kv_caches = make_kv_caches(config, num_blocks=num_blocks, block_size=block_size,
                                        mesh=mesh, kv_dtype=kv_dtype, stacked=self.stacked_kv)
        # numpy dtype of injected multimodal rows (bfloat16 via ml_dtypes, as jax does).
        self._embed_dtype = jnp.dtype(config.dtype)
        self.compiled_shapes: set[tuple] = set()
        self._greedy_sampling: dict[int, SamplingArrays] = {}
        self.pack_transfers = bool(pack_transfers)
        self.lora_slots = lora_slots
        self.lora_adapters = (lora_adapters if lora_adapters is not None
                              else collections.OrderedDict())
        # The first KV group is sliding-window (e.g. Mistral): its table has null slots.
        kv_groups = getattr(config, "kv_groups", ((None, ()),))
        self._sliding_group0 = kv_groups[0][0] is not None
        self._num_kv_groups = len(kv_groups)
        self.host_pages = None
        if num_host_blocks:
            from prefixcache.engine.host_pages import HostPages
            self.host_pages = HostPages(self.kv_caches, num_blocks=num_blocks,
                                        num_host_blocks=num_host_blocks, mesh=mesh)

    @property
    def d_model(self) -> int:
        return int(self.config.d_model)

    def prepare(self, scheduled: Sequence[ScheduledRequest],
                block_tables: BlockTables | Sequence[BlockTables] | Callable[[str], list[int]]
                ) -> PreparedStep:
        """Builds the step's host arrays.

        Args:
          scheduled: the step's requests (>= 1).
          block_tables: the scheduler's `BlockTables` (each request's row is
            `state.block_row`), or a function request id -> its block table (e.g.
            `KVCacheManager.get_block_ids`; slower: whole tables every step), or, for a
            model with several KV cache groups (hybrid sliding-window models), the
            scheduler's `kv_group_tables` (one `BlockTables` per group, in
            `config.kv_groups` order): the step's metadata is then a tuple of
            `AttentionMetadata`, one per group, differing in `page_indices` and
            `slot_mapping` (null slots read the padding page).

        Returns:
          PreparedStep (numpy only; nothing is on the device yet).
        """
        n = len(scheduled)
        states = list(map(_STATE, scheduled))
        all_greedy = not any(map(_TEMPERATURE, states))
        has_mm = any(map(_MM_EMBEDDINGS, states))
        group_tables = None
        if isinstance(block_tables, (tuple, list)):
            if len(block_tables) != len(self.config.kv_groups):
                raise ValueError(f"{len(block_tables)} block tables for the model's "
                                 f"{len(self.config.kv_groups)} KV cache groups")
            group_tables, block_tables = block_tables, block_tables[0]
        elif self._num_kv_groups > 1:
            raise ValueError(f"the model has {self._num_kv_groups} KV cache groups: pass one "
                             "BlockTables per group (the scheduler's kv_group_tables)")
        if isinstance(block_tables, BlockTables):
            # NOTE: the engine's path: columns gathered at C level, the page table one
            # row gather from the persistent tables (no per-request lists or arrays).
            comps = list(map(_NUM_COMPUTED, scheduled))
            q_lens = list(map(_NUM_NEW, scheduled))
            views = map(_ALL_TOKEN_IDS, states)
            if sum(q_lens) == n:  # decode only: the token at position c
                tokens = list(map(operator.getitem, views, comps))
            else:
                tokens = []
                for v, c, q in zip(views, comps, q_lens):
                    tokens += v[c:c + q]
            rows = np.fromiter(map(_BLOCK_ROW, states), np.int64, n)
            step = self.builder.build_rows(block_tables.table, rows,
                                           block_tables.lengths[rows], comps, q_lens,
                                           tokens, null_slots_ok=self._sliding_group0)
            if group_tables is not None and len(group_tables) > 1:
                # NOTE: the other groups' inputs differ only in page_indices and
                # slot_mapping; built the same way from their own tables.
                metadata = [step.metadata]
                for (w, _), t in zip(self.config.kv_groups[1:], group_tables[1:]):
                    metadata.append(self.builder.build_rows(
                        t.table, rows, t.lengths[rows], comps, q_lens, tokens,
                        null_slots_ok=w is not None).metadata)
                step = step._replace(metadata=tuple(metadata))
        else:
            if self._sliding_group0:
                raise ValueError("a sliding-window model's step needs the scheduler's "
                                 "kv_group_tables (null slots), not a block-table function")
            step = self.builder.build([
                ScheduledSeq(block_tables(st.request.request_id), s.num_computed_tokens,
                             st.request.all_token_ids[s.num_computed_tokens:
                                                      s.num_computed_tokens
                                                      + s.num_new_tokens])
                for s, st in zip(scheduled, states)])
        num_rows = step.logits_indices.shape[0]
        if all_greedy:
            # NOTE: the all-greedy program never reads the sampling arrays; reuse one
            # (read-only) set per row bucket instead of rebuilding it every step.
            sampling = self._greedy_sampling.get(num_rows)
            if sampling is None:
                sampling = self._greedy_sampling[num_rows] = SamplingArrays.build([], num_rows)
        else:
            sampling = SamplingArrays.build(
                [(s.state.params.temperature, s.state.params.top_k, s.state.params.top_p,
                  s.state.seed, s.state.num_output_tokens) for s in scheduled], num_rows)
        mm = (mm_rows_for_step(scheduled, step.logits_indices, step.input_ids.shape[0],
                               self.d_model, self._embed_dtype) if has_mm else None)
        mm_embeds, mm_mask = mm if mm is not None else (None, None)
        lora_slots = (None if self.lora_slots is None
                      else self._lora_token_slots(scheduled, step))
        prepared = PreparedStep(DeviceInputs(step, sampling, mm_embeds, mm_mask, lora_slots),
                                n, all_greedy)
        if self.pack_transfers:
            # NOTE: the all-greedy program never reads the sampling arrays: not packed.
            prepared.packed, prepared.layout = pack_inputs(
                step, None if all_greedy else sampling, lora_slots)
        return prepared

    def _lora_token_slots(self, scheduled: Sequence[ScheduledRequest], step: StepInputs
                          ) -> np.ndarray:
        """i32[T]: the adapter slot of every token row (loads the step's adapters into
        slots first; padding rows 0)."""
        adapters = self.lora_adapters
        keys = [None if (lo := s.state.request.lora) is None else (lo.name, lo.path)
                for s in scheduled]
        slots = np.asarray(self.lora_slots.activate(
            [None if k is None else adapters[k] for k in keys]), np.int32)
        for k in keys:  # used now: the most recently used (the engine drops from the front)
            if k is not None:
                adapters.move_to_end(k)
        out = np.zeros(step.input_ids.shape[0], np.int32)
        if slots.any():
            # Sequence i's token rows end at logits_indices[i] and are contiguous
            # (rows are grouped by kind, so not in scheduled order).
            q = np.fromiter(map(_NUM_NEW, scheduled), np.int64, len(scheduled))
            starts = step.logits_indices[:len(scheduled)] - q + 1
            order = np.argsort(starts, kind="stable")
            out[:int(q.sum())] = np.repeat(slots[order], q[order])
        return out

    def execute(self, prepared: PreparedStep, *, return_logits: bool = False
                ) -> tuple[np.ndarray, np.ndarray | None]:
        """Runs one step on the device.

        Args:
          prepared: from `prepare`.
          return_logits: also fetch the step's logits (f32[num_seqs, vocab]).

        Returns:
          (token ids i32[num_seqs] in scheduled order, logits or None).
        """
        self.compiled_shapes.add(prepared.shape_key)
        inputs = self._device_inputs(prepared)
        if self.lora_slots is None:
            tokens, logits, self.kv_caches = self.program(
                self.kv_caches, inputs, all_greedy=prepared.all_greedy)
        else:
            tokens, logits, self.kv_caches = self.program(
                self.kv_caches, inputs, all_greedy=prepared.all_greedy,
                lora_weights=self.lora_slots.weights)
        if self.host_pages is not None:
            self.host_pages.finish()  # the pending stores' one device_get, step dispatched
        if return_logits:
            tokens, logits = jax.device_get((tokens, logits))
            return tokens[:prepared.num_seqs], logits[:prepared.num_seqs]
        tokens = jax.device_get(tokens)
        return tokens[:prepared.num_seqs], None

    def _device_inputs(self, prepared: PreparedStep) -> DeviceInputs | PackedInputs:
        """The step's inputs moved to the device (one packed transfer when packed)."""
        sharding = self.program.input_sharding
        if prepared.packed is not None:
            host = (prepared.packed, prepared.inputs.mm_embeds, prepared.inputs.mm_mask)
            packed, mm_embeds, mm_mask = (jax.device_put(host) if sharding is None
                                          else jax.device_put(host, sharding))
            return PackedInputs(packed, mm_embeds, mm_mask, prepared.layout)
        return (jax.device_put(prepared.inputs) if sharding is None
                else jax.device_put(prepared.inputs, sharding))

    def lower(self, prepared: PreparedStep):
        """The lowered (not compiled) program `execute(prepared)` would run, with the
        same arguments (`StepProgram.lower`); runs nothing and donates nothing."""
        return self.program.lower(
            self.kv_caches, self._device_inputs(prepared), all_greedy=prepared.all_greedy,
            lora_weights=None if self.lora_slots is None else self.lora_slots.weights)

    def apply_host_transfers(self, transfers) -> None:
        """Dispatches the manager's ordered host-tier copies (`HostTransfer`s) before
        the step computes (see `prefixcache.engine.host_pages`); the stores' pages reach
        the host in `execute` (or `host_pages.finish()`)."""
        self.kv_caches = self.host_pages.apply(self.kv_caches, transfers)

    @property
    def num_host_transfers(self) -> int:
        """Host-tier device_put + device_get calls so far (0 without a host tier)."""
        pages = self.host_pages
        return 0 if pages is None else pages.num_h2d + pages.num_d2h

    @property
    def num_compiled_programs(self) -> int:
        """Distinct step programs run so far (bounded by the bucket count x 4)."""
        return len(self.compiled_shapes)

    @property
    def num_programs_built(self) -> int:
        """Executables the runner's jitted functions hold: the step program (shared with
        engines that share it) and the host tier's copy program.

        Counted from jax's own executable caches (`_cache_size()`), so a program
        compiled -- or loaded from the persistent compilation cache -- shows here
        whatever key made it; `compiled_shapes` only counts the keys the runner knows.
        """
        n = self.program.num_programs_built
        if self.host_pages is not None:
            n += self.host_pages.num_programs_built
        return n

    def warmup_keys(self, *, multimodal: bool = False) -> list[tuple[int, int, int, bool, bool]]:
        """Every step program key the scheduler can produce, as `(T, S, P, all_greedy,
        multimodal)`.

        (T, S, P) runs over `builder.shape_buckets` less the shapes no step can fill:
        T tokens over S rows of at most P pages each hold at most S * P * block_size
        tokens, so T's bucket is unreachable when that is not above the bucket below T.
        Each comes greedy and sampling; with `multimodal`, also with embedding rows.
        """
        b = self.builder
        t_prev = dict(zip(b.token_buckets, (0,) + b.token_buckets[:-1]))
        keys = []
        for t, s, p in b.shape_buckets:
            if min(t, s * p * b.block_size) <= t_prev[t]:
                continue  # (more tokens than S rows of P pages hold)
            for mm in ((False, True) if multimodal else (False,)):
                for greedy in (True, False):
                    keys.append((t, s, p, greedy, mm))
        return keys

    def dummy_step(self, key: tuple[int, int, int, bool, bool], *,
                   max_model_len: int) -> PreparedStep:
        """A step of program `key` (from `warmup_keys`) that touches only the padding page.

        Built by the same builder and packing as `prepare` (so its arrays, layout and
        static arguments are those of a real step of that shape): min(S, T) rows over
        T tokens (or as many as the rows' pages hold), the first row attending to P
        pages; every page-table cell and slot is the padding page, so running it
        writes K/V there only (no allocatable block, cached or not, changes) and the
        sampled ids are thrown away. No LoRA adapter, multimodal rows all masked.
        """
        T, S, P, all_greedy, mm = key
        b = self.builder
        bs, pad = b.block_size, b.padding_page
        n = min(S, T)
        num_tokens = min(T, n * P * bs)
        q = np.full(n, num_tokens // n, np.int64)
        q[:num_tokens % n] += 1
        kv = q.copy()
        kv[0] = max(int(q[0]), min(P * bs, max_model_len))
        computed = kv - q
        pages = -(-kv // bs)
        table = np.full((n, P), pad, np.int32)
        step = b.build_rows(table, np.arange(n), pages, computed, q,
                            np.zeros(num_tokens, np.int64), null_slots_ok=True)
        if self._num_kv_groups > 1:  # (as `prepare`: one metadata per KV group)
            step = step._replace(metadata=(step.metadata,) * self._num_kv_groups)
        num_rows = step.logits_indices.shape[0]
        if all_greedy:
            sampling = self._greedy_sampling.get(num_rows)
            if sampling is None:
                sampling = self._greedy_sampling[num_rows] = SamplingArrays.build([], num_rows)
        else:
            sampling = SamplingArrays.build([(1.0, 0, 1.0, 0, 0)] * n, num_rows)
        mm_embeds = mm_mask = None
        if mm:
            mm_embeds = np.zeros((step.input_ids.shape[0], self.d_model), self._embed_dtype)
            mm_mask = np.zeros(step.input_ids.shape[0], np.bool_)
        lora_slots = (None if self.lora_slots is None
                      else np.zeros(step.input_ids.shape[0], np.int32))
        prepared = PreparedStep(DeviceInputs(step, sampling, mm_embeds, mm_mask, lora_slots),
                                n, all_greedy)
        if self.pack_transfers:
            prepared.packed, prepared.layout = pack_inputs(
                step, None if all_greedy else sampling, lora_slots)
        assert prepared.shape_key[:5] == key, (prepared.shape_key, key)
        return prepared

    def ensure_valid_kv_caches(self) -> bool:
        """Re-creates the KV arrays (zeroed) when they are no longer usable: deleted by a
        donation to a step that then failed, or carrying a failed computation's error.

        Returns:
          True when they had to be re-created (every page's content is then gone).
        """
        from prefixcache.model import make_kv_caches

        try:
            ok = not any(x.is_deleted() for x in jax.tree.leaves(self.kv_caches))
            if ok:
                jax.block_until_ready(self.kv_caches)
        except Exception:  # noqa: BLE001 - an array holding an async error
            ok = False
        if ok:
            return False
        self.kv_caches = None  # drop the broken arrays before allocating new ones
        self.kv_caches = make_kv_caches(self.config, num_blocks=self.builder.num_blocks,
                                        block_size=self.builder.block_size, mesh=self.mesh,
                                        kv_dtype=self.kv_dtype, stacked=self.stacked_kv)
        return True
