"""LoRA adapters applied in the model: several in one batch (Punica / S-LoRA style).

    from prefixcache.model.lora import load_lora_adapter, LoRASlots

    adapter = load_lora_adapter("/adapters/sql", config, max_lora_rank=16)
    slots = LoRASlots(config, max_loras=4, max_lora_rank=16)
    slot_ids = slots.activate([adapter, None])   # one slot per entry (0 = base model)
    model(..., lora=LoRABatch(token_slots, slots.weights))

Three parts:

1. `load_lora_adapter(path, config, *, max_lora_rank)`: a PEFT-format adapter directory
   (`adapter_config.json` + `adapter_model.safetensors`, keys
   `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` [r, in] and
   `...lora_B.weight` [out, r]) read and validated against the model: every problem
   (missing path or file, rank above the maximum, a target module the model lacks,
   shapes, layers out of range, unsupported PEFT options) is a ValueError naming it.
   Scaling: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`.
2. `LoRASlots`: the stacked device weights, for each of `TARGET_MODULES`
   `A: [max_loras + 1, L, in, R]` and `B: [max_loras + 1, L, R, out]`, every adapter
   zero-padded to the maximum rank R (exact: the padded rank columns contribute 0) and
   its scaling folded into B. Slot 0 is all zeros (no adapter). `activate` puts a step's
   adapters into slots, least recently used slot first when all are taken.
3. `lora_delta(x, lora.layer(i), module)`: `(x @ A[slot_t]) @ B[slot_t]` for each token t,
   added to a projection's output by `prefixcache.model.llama`. The shapes depend only
   on (max_loras, R), so any mix of adapters runs one compiled step.

Module shapes (`module_dims`), in HF's [in, out] terms: q_proj D -> N*H, k_proj and
v_proj D -> K*H, o_proj N*H -> D, gate_proj and up_proj D -> F, down_proj F -> D.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from prefixcache.model.config import ModelConfig
from prefixcache.model.safetensors_io import read_safetensors

__all__ = [
    "TARGET_MODULES",
    "LoRAAdapter",
    "LoRABatch",
    "LoRASlots",
    "lora_delta",
    "load_lora_adapter",
    "lora_weights_nbytes",
    "module_dims",
]

# The projections an adapter may target, in the stacking order of `LoRASlots.weights`.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                  "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)"
                  r"\.lora_([AB])(?:\.default)?\.weight")
# PEFT options that change what an adapter computes and that this loader does not apply:
# rejected by name rather than silently ignored.
_EMBEDDING_MODULES = ("embed_tokens", "lm_head", "wte", "embed_in")


def module_dims(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """module name -> (in_features, out_features) of each target projection."""
    D, F = config.d_model, config.mlp_dim
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D),
            "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}


def lora_weights_nbytes(config: ModelConfig, *, max_loras: int, max_lora_rank: int) -> int:
    """Bytes of `LoRASlots.weights`: A [S, L, in, R] and B [S, L, R, out] of every
    module of TARGET_MODULES, S = max_loras + 1 slots (slot 0: no adapter), in
    `config.dtype`. The arrays are replicated: every device of a mesh holds them all."""
    S, L, R = max_loras + 1, config.num_layers, max_lora_rank
    per_slot = sum(L * R * (i + o) for i, o in module_dims(config).values())
    return S * per_slot * jnp.dtype(config.dtype).itemsize


@dataclasses.dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """One adapter read from disk (host numpy, float32).

    Attributes:
      name, path: as given (`LoRARequest.name`, `.path`).
      rank: r. scaling: alpha / r (or alpha / sqrt(r) with rsLoRA); not folded in here.
      target_modules: the projections it changes (a subset of TARGET_MODULES).
      a: module -> f32[L, in, r] (`lora_A.weight` transposed; zeros for layers the adapter
        leaves alone, e.g. with `layers_to_transform`).
      b: module -> f32[L, r, out] (`lora_B.weight` transposed).
    """

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    a: dict
    b: dict

    @property
    def key(self) -> tuple[str, str]:
        return (self.name, self.path)

    def delta_weight(self, module: str, layer: int) -> np.ndarray:
        """`scaling * B @ A` as f64[out, in] (HF layout): what merging adds to the weight."""
        a = np.asarray(self.a[module][layer], np.float64)  # [in, r]
        b = np.asarray(self.b[module][layer], np.float64)  # [r, out]
        return self.scaling * (a @ b).T


def _fail(path: str, msg: str):
    raise ValueError(f"LoRA adapter {path!r}: {msg}")


def _read_config(path: str, config: ModelConfig, max_lora_rank: int
                 ) -> tuple[int, float, tuple[str, ...], tuple[int, ...] | None]:
    cfg_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_file):
        _fail(path, f"no {CONFIG_FILE} in the directory (a PEFT adapter has one)")
    try:
        with open(cfg_file) as f:
            cfg = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # (Recursion: nesting too deep)
        _fail(path, f"unreadable {CONFIG_FILE}: {e}")
    if not isinstance(cfg, dict):
        _fail(path, f"{CONFIG_FILE} must hold a JSON object, got {type(cfg).__name__}")
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        _fail(path, f"peft_type {peft_type!r} is not supported (only 'LORA')")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        _fail(path, f"'r' must be a positive int, got {r!r}")
    if r > max_lora_rank:
        _fail(path, f"rank r={r} exceeds max_lora_rank={max_lora_rank} (raise "
                    "max_lora_rank to load it)")
    alpha = cfg.get("lora_alpha")
    # (a comparison, not math.isfinite: an int past a float's range would overflow)
    if (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
            or not 0 < alpha <= sys.float_info.max):
        _fail(path, f"'lora_alpha' must be a positive number, got {alpha!r}")
    # Unsupported options: each changes the adapter's function, so none is ignored.
    bias = cfg.get("bias", "none")
    if bias != "none":
        _fail(path, f"bias={bias!r} is not supported (only 'none': no bias terms)")
    if cfg.get("use_dora"):
        _fail(path, "use_dora=True (DoRA) is not supported")
    if cfg.get("modules_to_save"):
        _fail(path, f"modules_to_save={cfg['modules_to_save']!r} is not supported (fully "
                    "trained extra modules)")
    if cfg.get("fan_in_fan_out"):
        _fail(path, "fan_in_fan_out=True (GPT-2 Conv1D layout) is not supported")
    for opt in ("rank_pattern", "alpha_pattern"):
        if cfg.get(opt):
            _fail(path, f"{opt}={cfg[opt]!r} (per-module ranks/alphas) is not supported")
    if cfg.get("layers_pattern"):
        _fail(path, f"layers_pattern={cfg['layers_pattern']!r} is not supported")
    targets = cfg.get("target_modules")
    if targets == "all-linear":
        targets = list(TARGET_MODULES)  # PEFT: every linear layer but the LM head
    if isinstance(targets, str) or not isinstance(targets, list) or not targets:
        _fail(path, f"'target_modules' must be a non-empty list of module names (or "
                    f"'all-linear'), got {targets!r}")
    for t in targets:
        if t in _EMBEDDING_MODULES:
            _fail(path, f"target module {t!r}: adapters on embeddings or the LM head are "
                        "not supported")
        if t not in TARGET_MODULES:
            _fail(path, f"target module {t!r} is not a module of the model (it has "
                        f"{', '.join(TARGET_MODULES)})")
    layers = cfg.get("layers_to_transform")
    if layers is not None:
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        if (not isinstance(layers, list) or not layers
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)):
            _fail(path, f"layers_to_transform must be an int or a list of ints, got "
                        f"{cfg['layers_to_transform']!r}")
        bad = [i for i in layers if not 0 <= i < config.num_layers]
        if bad:
            _fail(path, f"layers_to_transform {bad} out of range: the model has "
                        f"{config.num_layers} layers")
        layers = tuple(sorted(set(layers)))
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    ordered = tuple(m for m in TARGET_MODULES if m in set(targets))
    return r, float(scaling), ordered, layers


def load_lora_adapter(path, config: ModelConfig, *, max_lora_rank: int,
                      name: str | None = None) -> LoRAAdapter:
    """Reads and validates one PEFT LoRA adapter for `config`'s model.

    Args:
      path: the adapter directory (adapter_config.json + adapter_model.safetensors).
      config: the base model's config (layers and projection shapes are checked).
      max_lora_rank: the largest rank accepted (the stacked weights' padded rank).
      name: the adapter's name (default: the path).

    Returns:
      The LoRAAdapter (float32 host arrays).

    Raises:
      ValueError: naming the problem: a path that is not a directory, a missing or bad
        config or weights file, rank > max_lora_rank, a target module the model does not
        have, unsupported options (bias, DoRA, modules_to_save, embeddings, per-module
        ranks), unexpected/missing tensors, wrong shapes, layers out of range,
        non-finite weights.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"LoRA adapter path must be a str or path, got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.exists(path):
        _fail(path, "the path does not exist")
    if not os.path.isdir(path):
        _fail(path, "not a directory (a PEFT adapter is a directory with "
                    f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    r, scaling, targets, layers = _read_config(path, config, max_lora_rank)
    wfile = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(wfile):
        extra = (" (adapter_model.bin, a pickle, is not read: convert it to safetensors)"
                 if os.path.exists(os.path.join(path, "adapter_model.bin")) else "")
        _fail(path, f"no {WEIGHTS_FILE}{extra}")
    try:
        tensors = read_safetensors(wfile)
    except (OSError, ValueError) as e:
        _fail(path, f"unreadable {WEIGHTS_FILE}: {e}")
    dims = module_dims(config)
    L = config.num_layers
    a = {m: np.zeros((L, dims[m][0], r), np.float32) for m in targets}
    b = {m: np.zeros((L, r, dims[m][1]), np.float32) for m in targets}
    seen = set()
    for key in sorted(tensors):
        if "lora_embedding" in key:
            _fail(path, f"tensor {key!r}: adapters on embeddings are not supported")
        match = _KEY.fullmatch(key)
        if match is None:
            _fail(path, f"unexpected tensor {key!r} (expected base_model.model.model.layers."
                        "{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight)")
        layer, parent, module, ab = int(match[1]), match[2], match[3], match[4]
        if module not in TARGET_MODULES or _PARENT[module] != parent:
            _fail(path, f"tensor {key!r}: {parent}.{module} is not a module of the model")
        if module not in targets:
            _fail(path, f"tensor {key!r}: module {module!r} is not in target_modules "
                        f"{list(targets)}")
        if not 0 <= layer < L:
            _fail(path, f"tensor {key!r}: layer {layer} out of range (the model has {L} "
                        "layers)")
        if layers is not None and layer not in layers:
            _fail(path, f"tensor {key!r}: layer {layer} is not in layers_to_transform "
                        f"{list(layers)}")
        t = tensors[key]
        fan_in, fan_out = dims[module]
        want = (r, fan_in) if ab == "A" else (fan_out, r)
        if tuple(t.shape) != want:
            _fail(path, f"tensor {key!r} has shape {tuple(t.shape)}, expected {want} "
                        f"(lora_{ab} of {module} with r={r})")
        if t.dtype.kind != "f" and str(t.dtype) != "bfloat16":
            _fail(path, f"tensor {key!r} has dtype {t.dtype}, expected a float dtype")
        t = np.asarray(t, np.float32)
        if not np.all(np.isfinite(t)):
            _fail(path, f"tensor {key!r} has non-finite values")
        if ab == "A":
            a[module][layer] = t.T
        else:
            b[module][layer] = t.T
        seen.add((layer, module, ab))
    want_layers = layers if layers is not None else range(L)
    missing = [f"layers.{i}.{_PARENT[m]}.{m}.lora_{ab}" for i in want_layers for m in targets
               for ab in "AB" if (i, m, ab) not in seen]
    if missing:
        _fail(path, f"{len(missing)} tensors missing from {WEIGHTS_FILE}, e.g. "
                    f"{missing[:3]}")
    adapter_name = os.path.basename(os.path.normpath(path)) if name is None else name
    return LoRAAdapter(name=adapter_name, path=path, rank=r, scaling=scaling,
                       target_modules=targets, a=a, b=b)


class LoRABatch(NamedTuple):
    """The model's LoRA input of one step.

    Attributes:
      slots: i32[T] the adapter slot of each token row (0: base model; padding rows 0).
      weights: `LoRASlots.weights`: module -> (A [S, L, in, R], B [S, L, R, out]).
    """

    slots: jax.Array
    weights: dict

    def layer(self, i: int) -> LoRABatch:
        """The same batch with layer i's weights only (A [S, in, R], B [S, R, out])."""
        return LoRABatch(self.slots, {m: (a[:, i], b[:, i])
                                      for m, (a, b) in self.weights.items()})


def lora_delta(x: jax.Array, lora: LoRABatch | None, module: str):
    """The adapters' change of one projection's output, or None without LoRA.

    Args:
      x: [T, in] the projection's input.
      lora: one layer's LoRABatch (`LoRABatch.layer(i)`), or None.
      module: one of TARGET_MODULES.

    Returns:
      [T, out] in x's dtype: `(x[t] @ A[slot_t]) @ B[slot_t]` for each token t.
    """
    if lora is None:
        return None
    a, b = lora.weights[module]  # [S, in, R], [S, R, out]
    # NOTE: the per-token gather (Punica's BGMV) written as a one-hot sum over the S
    # slots: x @ A for every slot ([T, S, R], small), keep each token's own slot, then
    # one contraction with B over (slot, rank). Gathering A[slot_t] / B[slot_t] per
    # token would materialize [T, in, R] and [T, R, out] weight copies; this costs S
    # times the (small) rank-R FLOPs instead, and is exact (the other slots add 0).
    onehot = jax.nn.one_hot(lora.slots, a.shape[0], dtype=jnp.float32)  # [T, S]
    xa = jnp.einsum("ti,sir->tsr", x, a, preferred_element_type=jnp.float32)
    xa = xa * onehot[:, :, None]
    y = jnp.einsum("tsr,sro->to", xa, b.astype(jnp.float32),
                   preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


@jax.jit
def _write_slot(weights: dict, slot: jax.Array, new: dict) -> dict:
    """weights with slot `slot` (i32 scalar) replaced by `new` (module -> (A, B) of one
    slot: [L, in, R], [L, R, out])."""
    return {m: (jax.lax.dynamic_update_index_in_dim(a, new[m][0], slot, 0),
                jax.lax.dynamic_update_index_in_dim(b, new[m][1], slot, 0))
            for m, (a, b) in weights.items()}


class LoRASlots:
    """`max_loras` device slots of stacked adapter weights, assigned least recently used.

    Invariants:
      - slot 0 is all zeros and never assigned (tokens without an adapter);
      - `resident` maps each adapter key (name, path) held in a slot to that slot, in
        least-recently-used-first order; slots 1..max_loras not in it are free (their
        weights are stale but never read: no token is given a free slot);
      - `weights` always holds the adapters of `resident` in their slots, scaling folded
        into B and the rank zero-padded to `max_lora_rank`.

    Args:
      config: the model config.
      max_loras: adapters that can be used in one step (>= 1).
      max_lora_rank: the padded rank R (>= 1).
      sharding: where the stacked arrays live (None: the default device; with a mesh,
        a replicated NamedSharding).
    """

    def __init__(self, config: ModelConfig, *, max_loras: int, max_lora_rank: int,
                 sharding=None):
        from prefixcache._validate import check_count, check_host_memory

        self.max_loras = check_count("max_loras", max_loras, min=1)
        self.max_lora_rank = check_count("max_lora_rank", max_lora_rank, min=1)
        self.config = config
        self.dtype = jnp.dtype(config.dtype)
        self.sharding = sharding
        S, L, R = self.max_loras + 1, config.num_layers, self.max_lora_rank
        dims = module_dims(config)
        nbytes = lora_weights_nbytes(config, max_loras=self.max_loras, max_lora_rank=R)
        check_host_memory(f"the stacked LoRA weights ({S} slots x rank {R})", nbytes)
        self.weights = {m: (jnp.zeros((S, L, dims[m][0], R), self.dtype, device=sharding),
                            jnp.zeros((S, L, R, dims[m][1]), self.dtype, device=sharding))
                        for m in TARGET_MODULES}
        self.resident: collections.OrderedDict[tuple[str, str], int] = (
            collections.OrderedDict())
        self.num_loads = 0

    def _padded(self, adapter: LoRAAdapter) -> dict:
        """module -> (A f[L, in, R], B f[L, R, out]) of one slot, host numpy."""
        L, R = self.config.num_layers, self.max_lora_rank
        np_dtype = self.dtype  # ml_dtypes bfloat16 for "bfloat16"
        out = {}
        for m, (fan_in, fan_out) in module_dims(self.config).items():
            a = np.zeros((L, fan_in, R), np.float32)
            b = np.zeros((L, R, fan_out), np.float32)
            if m in adapter.target_modules:
                a[:, :, :adapter.rank] = adapter.a[m]
                b[:, :adapter.rank, :] = adapter.b[m] * np.float32(adapter.scaling)
            out[m] = (a.astype(np_dtype), b.astype(np_dtype))
        return out

    def warmup(self) -> None:
        """Compiles the slot-write program by rewriting slot 0 with its own zeros (no
        adapter changes; `Engine.warmup`)."""
        L, R = self.config.num_layers, self.max_lora_rank
        zeros = {m: (np.zeros((L, fi, R), self.dtype), np.zeros((L, R, fo), self.dtype))
                 for m, (fi, fo) in module_dims(self.config).items()}
        slot_arr, new = (jax.device_put((np.int32(0), zeros)) if self.sharding is None
                         else jax.device_put((np.int32(0), zeros), self.sharding))
        self.weights = _write_slot(self.weights, slot_arr, new)

    def activate(self, adapters: Sequence[LoRAAdapter | None]) -> list[int]:
        """Slots for one step's adapters, loading those not resident.

        Args:
          adapters: one entry per request (None: no adapter).

        Returns:
          The slot of each entry (0 for None).

        Raises:
          ValueError: more than `max_loras` distinct adapters (the scheduler admits no
            such step), before any slot changes.
        """
        wanted = {}
        for ad in adapters:
            if ad is not None:
                wanted.setdefault(ad.key, ad)
        if len(wanted) > self.max_loras:
            raise ValueError(f"{len(wanted)} distinct LoRA adapters in one step, but "
                             f"max_loras={self.max_loras}")
        resident = self.resident
        for key, ad in wanted.items():
            if key in resident:
                resident.move_to_end(key)
                continue
            used = set(resident.values())
            free = [s for s in range(1, self.max_loras + 1) if s not in used]
            if free:
                slot = free[0]
            else:
                # NOTE: least recently used first, never an adapter this step needs
                # (those were just moved to the end, and there are <= max_loras of them).
                victim = next(k for k in resident if k not in wanted)
                slot = resident.pop(victim)
            # One explicit transfer of the slot's weights, then one jitted update of the
            # stacked arrays (the slot index is an array: one program for every slot).
            new = self._padded(ad)
            slot_arr, new = (jax.device_put((np.int32(slot), new)) if self.sharding is None
                             else jax.device_put((np.int32(slot), new), self.sharding))
            self.weights = _write_slot(self.weights, slot_arr, new)
            resident[key] = slot
            self.num_loads += 1
        return [0 if ad is None else resident[ad.key] for ad in adapters]
