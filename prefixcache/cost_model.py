"""Roofline cost model: how long a prefill or decode step takes on an accelerator.

Host only (no jax): the simulator must run where no accelerator or model exists.
It lives at the package root, below ``prefixcache.core`` (the ``cost`` eviction
policy reads its FLOPs) and ``prefixcache.sim`` (``prefixcache.sim.cost_model``
re-exports it), so no layer imports upward.

A step's time is ``max(flops / (peak_flops * flops_efficiency),
bytes / (hbm_bandwidth * bandwidth_efficiency)) + step_overhead_s`` — the
classic roofline, which bounds what any implementation can achieve. FLOPs count
multiply-adds as 2; bytes count HBM traffic (weights read once per step, KV of
the attended context read, KV of new tokens written).

Prefill of ``n`` new tokens over ``c`` cached tokens (a prefix-cache hit is
``c > 0``), per layer, with ``D = d_model``, ``Hq, Hkv`` heads of size ``hd``,
``F = ffn_dim``:

* projections: ``2 n D (Hq hd)`` (Q) + ``2 n D (2 Hkv hd)`` (K, V) + ``2 n (Hq hd) D`` (O)
* gated MLP (three matrices, SwiGLU): ``2 n D F * 3``
* attention: token ``i`` (absolute position ``c + i``) attends to ``c + i + 1``
  keys; QK^T and PV each cost ``2 Hq hd`` per key, so
  ``4 Hq hd (n c + n (n + 1) / 2)`` in total (causal; no masked-out work counted)

plus the LM head for the last token only (``2 D V``): the engine computes logits
of each sequence's last scheduled token (``logits_indices``). Norms, rotary
embeddings and the softmax are O(n D) and ignored.

NOTE: a cache hit removes the ``c`` tokens' projection/MLP work and their own
causal attention, but the new tokens still attend to all ``c`` cached keys and
the cached KV must be read: TTFT never drops to zero, and for long prefixes
the attention term dominates what remains. This is what the seeds warn about:
saved compute does not translate one-to-one into lower TTFT.

Host memory tier: a block found in host memory must be copied to the
device before the step that uses it. ``HostLink`` is that copy path (host DRAM ->
device memory over PCIe / the host DMA engine): an *effective* bandwidth (a
published peak times a stated efficiency) and a fixed latency per transfer;
``CostModel.load_time(num_bytes)`` is the seconds one batched host->device copy of
``num_bytes`` takes (``HOST_LINKS`` holds named presets). Every chip the model is
sharded over has its own link and copies its own shard of each block, so the
bandwidth scales with ``num_chips`` as the HBM bandwidth does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

# ----------------------------------------------------------------------------
# Accelerators (published peak numbers, dense bf16, per chip)
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """Peak numbers of one chip.

    Attributes:
      name: short name (the key in ``ACCELERATORS``).
      peak_flops: dense bf16 FLOP/s (no structured sparsity).
      hbm_bandwidth: HBM bytes/s.
      hbm_bytes: HBM capacity in bytes (for sizing the KV cache).
    """

    name: str
    peak_flops: float
    hbm_bandwidth: float
    hbm_bytes: float

    def __post_init__(self):
        for field in ("peak_flops", "hbm_bandwidth", "hbm_bytes"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Accelerator.{field} must be > 0, got {getattr(self, field)!r}")


_T = 1e12
_G = 1e9
_GIB = 2**30

ACCELERATORS: dict[str, Accelerator] = {
    # Cloud TPU v5e: 197 TFLOP/s bf16, 819 GB/s HBM2, 16 GiB per chip
    # (cloud.google.com/tpu/docs/v5e, "System architecture").
    "tpu_v5e": Accelerator("tpu_v5e", 197 * _T, 819 * _G, 16 * _GIB),
    # Cloud TPU v6e (Trillium): 918 TFLOP/s bf16, 1640 GB/s HBM, 32 GiB per chip
    # (cloud.google.com/tpu/docs/v6e, "System architecture").
    "tpu_v6e": Accelerator("tpu_v6e", 918 * _T, 1640 * _G, 32 * _GIB),
    # NVIDIA H100 SXM5: 989.4 TFLOP/s dense bf16 (1,979 with 2:4 sparsity),
    # 3.35 TB/s HBM3, 80 GB (NVIDIA H100 Tensor Core GPU datasheet).
    "h100": Accelerator("h100", 989.4 * _T, 3350 * _G, 80e9),
    # NVIDIA H200 SXM: same compute as H100 (989 TFLOP/s dense bf16),
    # 4.8 TB/s HBM3e, 141 GB (NVIDIA H200 Tensor Core GPU datasheet).
    "h200": Accelerator("h200", 989.4 * _T, 4800 * _G, 141e9),
}


def get_accelerator(name: str) -> Accelerator:
    """The preset named ``name`` (one of ``ACCELERATORS``)."""
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise ValueError(f"unknown accelerator {name!r}; known: {sorted(ACCELERATORS)}") from None


# ----------------------------------------------------------------------------
# Host -> device links (the host memory tier's copy path)
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostLink:
    """The host -> device copy path of one chip: how long loading KV from host takes.

    A transfer of ``b`` bytes takes ``latency_s + b / (peak_bandwidth * efficiency)``
    seconds; an empty transfer (``b == 0``) takes none.

    Attributes:
      name: short name (the key in ``HOST_LINKS``).
      peak_bandwidth: the link's published one-direction peak, bytes/s per chip
        (``math.inf``: copies cost only the latency).
      efficiency: achievable fraction of the peak in (0, 1] (protocol overhead, DMA
        engine); ``effective_bandwidth = peak_bandwidth * efficiency``.
      latency_s: fixed cost of one transfer (issue + completion), >= 0.
    """

    name: str
    peak_bandwidth: float
    efficiency: float = 1.0
    latency_s: float = 0.0

    def __post_init__(self):
        bw = self.peak_bandwidth
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0:
            raise ValueError(f"HostLink.peak_bandwidth must be a number > 0 (bytes/s; inf "
                             f"allowed), got {bw!r}")
        eff = self.efficiency
        if isinstance(eff, bool) or not isinstance(eff, (int, float)) or not 0 < eff <= 1:
            raise ValueError(f"HostLink.efficiency must be in (0, 1], got {eff!r}")
        lat = self.latency_s
        if (isinstance(lat, bool) or not isinstance(lat, (int, float)) or not lat >= 0
                or lat == math.inf):
            raise ValueError(f"HostLink.latency_s must be a finite number >= 0 (seconds), "
                             f"got {lat!r}")

    @property
    def effective_bandwidth(self) -> float:
        """Bytes/s one chip's copies actually reach: ``peak_bandwidth * efficiency``."""
        return self.peak_bandwidth * self.efficiency

    def load_time(self, num_bytes: float, num_chips: int = 1) -> float:
        """Seconds for one transfer of ``num_bytes`` spread evenly over ``num_chips`` links.

        Raises:
          ValueError: ``num_bytes`` negative or not a number, ``num_chips`` < 1.
        """
        if (isinstance(num_bytes, bool) or not isinstance(num_bytes, (int, float))
                or not num_bytes >= 0 or num_bytes == math.inf):
            raise ValueError(f"num_bytes must be a finite number >= 0, got {num_bytes!r}")
        if isinstance(num_chips, bool) or not isinstance(num_chips, int) or num_chips < 1:
            raise ValueError(f"num_chips must be a positive int, got {num_chips!r}")
        if num_bytes == 0:
            return 0.0
        return self.latency_s + num_bytes / (self.effective_bandwidth * num_chips)


HOST_LINKS: dict[str, HostLink] = {
    # H200 SXM node: each GPU reaches host DRAM over PCIe Gen5 x16. Peak: 32 GT/s x 16
    # lanes with 128b/130b encoding = 63.0 GB/s per direction (PCI-SIG PCIe 5.0 base
    # spec; NVIDIA's H200 datasheet lists "PCIe Gen5: 128GB/s", both directions).
    # Efficiency 0.85 -> 53.6 GB/s: TLP headers at a 256 B max payload cost ~9%, and
    # copy-engine host->device copies from pinned memory on Gen5 x16 reach ~55 GB/s
    # (a published NVbandwidth `host_to_device_memcpy_ce` run: 55.6 GB/s;
    # github.com/NVIDIA/nvbandwidth). Not measured by us (no GPU in this project's CI).
    # Latency 10 us per transfer: one cudaMemcpyAsync issue + completion (an assumed
    # order of magnitude).
    "h200_pcie5": HostLink("h200_pcie5", 32e9 * 16 * 128 / 130 / 8, 0.85, 10e-6),
    # Cloud TPU v5e host: "PCIe bandwidth is typically around 1.5e10 bytes / second per
    # chip" (How to Scale Your Model, part 2 "All About TPUs",
    # jax-ml.github.io/scaling-book/tpus; Google publishes no separate v5e host-DMA
    # figure). Efficiency 0.9 -> 13.5 GB/s: large page copies, assumed. Latency 30 us
    # per transfer: a PjRt host->device buffer transfer's dispatch (assumed).
    "tpu_v5e_host": HostLink("tpu_v5e_host", 15 * _G, 0.9, 30e-6),
    # Cloud TPU v6e (Trillium): "32GB/s, about 2x higher than v5" (same source).
    "tpu_v6e_host": HostLink("tpu_v6e_host", 32 * _G, 0.9, 30e-6),
}


def get_host_link(name: str) -> HostLink:
    """The preset named ``name`` (one of ``HOST_LINKS``)."""
    try:
        return HOST_LINKS[name]
    except KeyError:
        raise ValueError(f"unknown host link {name!r}; known: {sorted(HOST_LINKS)}") from None


# ----------------------------------------------------------------------------
# Model shapes
# ----------------------------------------------------------------------------

# Attribute aliases accepted by ModelShape.from_config (duck typing over
# prefixcache.model.ModelConfig and Hugging Face style configs).
_ALIASES = {
    "num_layers": ("num_layers", "n_layers", "num_hidden_layers"),
    "d_model": ("d_model", "hidden_size", "embed_dim", "dim"),
    "num_q_heads": ("num_q_heads", "num_heads", "num_attention_heads", "n_heads"),
    "num_kv_heads": ("num_kv_heads", "num_key_value_heads", "n_kv_heads"),
    "head_dim": ("head_dim",),
    "ffn_dim": ("ffn_dim", "intermediate_size", "mlp_dim", "hidden_dim"),
    "vocab_size": ("vocab_size", "vocab", "num_embeddings"),
}

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1, "int8": 1, "float64": 8}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The shape numbers of a decoder-only transformer that the cost depends on.

    A plain frozen dataclass so ``prefixcache.sim`` never imports the model
    (jax). ``from_config`` reads a ``prefixcache.model.ModelConfig`` (or any
    object with the usual attribute names) by duck typing.

    Attributes:
      num_layers, d_model, num_q_heads, num_kv_heads, head_dim, ffn_dim,
      vocab_size: the usual; ``num_q_heads % num_kv_heads == 0`` (GQA).
      dtype_bytes: bytes per weight / KV element (2 for bf16).
      tie_embeddings: whether the LM head shares the embedding matrix (only
        changes the parameter count, not the bytes read per step).
    """

    num_layers: int
    d_model: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    dtype_bytes: int = 2
    tie_embeddings: bool = False

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name == "tie_embeddings":
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelShape.{f.name} must be a positive int, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    # -- presets (published configs) -------------------------------------------------

    @classmethod
    def tiny(cls) -> "ModelShape":
        """The shape of ``prefixcache.model.ModelConfig.tiny()`` (2 layers, f32)."""
        return cls(num_layers=2, d_model=128, num_q_heads=4, num_kv_heads=2, head_dim=64,
                   ffn_dim=256, vocab_size=512, dtype_bytes=4, tie_embeddings=True)

    @classmethod
    def qwen2_5_0_5b(cls) -> "ModelShape":
        """Qwen2.5-0.5B (config.json of Qwen/Qwen2.5-0.5B)."""
        return cls(num_layers=24, d_model=896, num_q_heads=14, num_kv_heads=2, head_dim=64,
                   ffn_dim=4864, vocab_size=151936, tie_embeddings=True)

    @classmethod
    def llama_3_2_1b(cls) -> "ModelShape":
        """Llama-3.2-1B (config.json of meta-llama/Llama-3.2-1B)."""
        return cls(num_layers=16, d_model=2048, num_q_heads=32, num_kv_heads=8, head_dim=64,
                   ffn_dim=8192, vocab_size=128256, tie_embeddings=True)

    @classmethod
    def llama_3_1_8b(cls) -> "ModelShape":
        """Llama-3.1-8B (config.json of meta-llama/Llama-3.1-8B)."""
        return cls(num_layers=32, d_model=4096, num_q_heads=32, num_kv_heads=8, head_dim=128,
                   ffn_dim=14336, vocab_size=128256)

    @classmethod
    def llama_3_1_70b(cls) -> "ModelShape":
        """Llama-3.1-70B (config.json of meta-llama/Llama-3.1-70B)."""
        return cls(num_layers=80, d_model=8192, num_q_heads=64, num_kv_heads=8, head_dim=128,
                   ffn_dim=28672, vocab_size=128256)

    @classmethod
    def preset(cls, name: str) -> "ModelShape":
        """A preset by name: one of ``MODEL_PRESETS``."""
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(MODEL_PRESETS)}")
        return getattr(cls, name)()

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """Reads the shape of a ``ModelConfig``-like object (duck typed).

        Accepts the attribute names of ``prefixcache.model.ModelConfig`` and of
        Hugging Face configs (``hidden_size``, ``intermediate_size``, ...).
        ``head_dim`` defaults to ``d_model // num_q_heads``; ``num_kv_heads`` to
        ``num_q_heads``; the dtype is read from ``dtype_bytes`` or ``dtype``
        (a name or an object with ``itemsize``/``name``), default bf16.

        Raises:
          ValueError: a required attribute is missing.
        """
        if isinstance(config, ModelShape):
            return config
        get = (lambda k: config.get(k)) if isinstance(config, dict) else (
            lambda k: getattr(config, k, None))

        def read(field):
            for name in _ALIASES[field]:
                v = get(name)
                if v is not None:
                    return v
            return None

        values = {f: read(f) for f in _ALIASES}
        if values["num_kv_heads"] is None:
            values["num_kv_heads"] = values["num_q_heads"]
        if values["head_dim"] is None and values["d_model"] and values["num_q_heads"]:
            values["head_dim"] = values["d_model"] // values["num_q_heads"]
        missing = [f for f, v in values.items() if v is None]
        if missing:
            raise ValueError(f"config {type(config).__name__} lacks shape attributes {missing}")
        values = {k: int(v) for k, v in values.items()}
        tie = get("tie_embeddings")
        if tie is None:
            tie = get("tie_word_embeddings")
        return cls(**values, dtype_bytes=_dtype_bytes(get("dtype_bytes"), get("dtype")),
                   tie_embeddings=bool(tie))

    # -- derived sizes ----------------------------------------------------------------

    @property
    def params_per_layer(self) -> int:
        """Matmul weights of one layer (attention projections + gated MLP)."""
        q = self.d_model * self.num_q_heads * self.head_dim
        kv = 2 * self.d_model * self.num_kv_heads * self.head_dim
        o = self.num_q_heads * self.head_dim * self.d_model
        mlp = 3 * self.d_model * self.ffn_dim
        return q + kv + o + mlp

    @property
    def num_params(self) -> int:
        """All matmul/embedding parameters (norms ignored)."""
        emb = self.vocab_size * self.d_model
        return self.num_layers * self.params_per_layer + emb * (1 if self.tie_embeddings else 2)

    @property
    def weight_bytes_per_step(self) -> int:
        """Weights read from HBM by one forward step: all layers + the LM head.

        The embedding lookup reads only the scheduled rows (ignored).
        """
        return (self.num_layers * self.params_per_layer + self.vocab_size * self.d_model) * (
            self.dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token occupies across all layers (K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def kv_bytes_per_block(self, block_size: int, kv_dtype: str | None = None) -> int:
        """KV bytes of one block of ``block_size`` tokens across all layers: the
        model's dtype (``kv_dtype=None``: ``kv_bytes_per_token * block_size``) or a
        ``prefixcache.kv_dtypes`` dtype (its item size plus the quantized scales)."""
        if kv_dtype is None:
            return self.kv_bytes_per_token * block_size
        from prefixcache.kv_dtypes import kv_bytes_per_block  # noqa: PLC0415

        return kv_bytes_per_block(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                                  head_dim=self.head_dim, block_size=block_size,
                                  kv_dtype=kv_dtype)


# The config keys CostModel.from_config reads (besides model and accelerator).
_COST_CONFIG_KEYS = ("model", "accelerator", "num_chips", "flops_efficiency",
                     "bandwidth_efficiency", "step_overhead_s", "host_link")

MODEL_PRESETS = ("tiny", "qwen2_5_0_5b", "llama_3_2_1b", "llama_3_1_8b", "llama_3_1_70b")


def _dtype_bytes(dtype_bytes: Any, dtype: Any) -> int:
    if dtype_bytes is not None:
        return int(dtype_bytes)
    if dtype is None:
        return 2
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int):
        return itemsize
    name = str(getattr(dtype, "name", None) or getattr(dtype, "__name__", None) or dtype)
    for key, size in _DTYPE_BYTES.items():
        if key in name:
            return size
    raise ValueError(f"cannot tell the byte size of dtype {dtype!r}")


# ----------------------------------------------------------------------------
# FLOPs and bytes
# ----------------------------------------------------------------------------


def _check_counts(n: int, c: int) -> None:
    if n < 0 or c < 0:
        raise ValueError(f"token counts must be >= 0, got new={n}, cached={c}")


def prefill_flops(shape: ModelShape, num_new_tokens: int, num_cached_tokens: int = 0, *,
                  lm_head: bool = True) -> float:
    """FLOPs to prefill ``num_new_tokens`` after ``num_cached_tokens`` cached ones.

    Args:
      shape: the model.
      num_new_tokens: ``n``, tokens computed in this step.
      num_cached_tokens: ``c``, tokens whose KV is already in the cache
        (prefix hit, or earlier chunks of a chunked prefill).
      lm_head: count logits for the last new token (``2 D V``).

    Returns:
      FLOPs (multiply-add = 2).
    """
    n, c = int(num_new_tokens), int(num_cached_tokens)
    _check_counts(n, c)
    if n == 0:
        return 0.0
    s = shape
    linear = 2 * n * s.params_per_layer
    attn = 4 * s.num_q_heads * s.head_dim * (n * c + n * (n + 1) // 2)
    head = 2 * s.d_model * s.vocab_size if lm_head else 0
    return float(s.num_layers * (linear + attn) + head)


def kv_bytes(shape: ModelShape, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
    """HBM bytes of KV traffic: read ``c + n`` keys/values (causal), write ``n``."""
    n, c = int(num_new_tokens), int(num_cached_tokens)
    _check_counts(n, c)
    if n == 0:
        return 0.0
    # NOTE: a flash-style kernel reads each KV page once per query tile; with one
    # tile per sequence chunk this is c + n tokens read, n written.
    return float(shape.kv_bytes_per_token * ((c + n) + n))


def decode_bytes(shape: ModelShape, context_lens: Sequence[int]) -> float:
    """HBM bytes of one decode step of a batch: weights once + each sequence's KV.

    Args:
      context_lens: per sequence, tokens already in the cache before this step.
    """
    return float(shape.weight_bytes_per_step
                 + sum(kv_bytes(shape, 1, c) for c in context_lens))


# ----------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Step times of ``shape`` on ``accelerator`` under the roofline.

    Attributes:
      shape: the model.
      accelerator: the chip (a preset from ``ACCELERATORS`` or a custom one).
      num_chips: chips the model is sharded over (peak FLOP/s and bandwidth
        scale linearly; communication is not modelled).
      flops_efficiency: achievable fraction of peak FLOP/s (1.0 = roofline bound).
      bandwidth_efficiency: achievable fraction of peak HBM bandwidth.
      step_overhead_s: fixed host/launch overhead added to every step.
      host_link: the host -> device copy path of each chip (``HostLink`` or a
        ``HOST_LINKS`` name), for a host memory tier's loads (``load_time``);
        ``None``: no host tier can be simulated with this model.
    """

    shape: ModelShape
    accelerator: Accelerator
    num_chips: int = 1
    flops_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0
    step_overhead_s: float = 0.0
    host_link: HostLink | None = None

    def __post_init__(self):
        if not isinstance(self.num_chips, int) or self.num_chips < 1:
            raise ValueError(f"num_chips must be a positive int, got {self.num_chips!r}")
        for f in ("flops_efficiency", "bandwidth_efficiency"):
            v = getattr(self, f)
            if not 0 < v <= 1:
                raise ValueError(f"{f} must be in (0, 1], got {v!r}")
        if self.step_overhead_s < 0:
            raise ValueError(f"step_overhead_s must be >= 0, got {self.step_overhead_s!r}")
        if isinstance(self.host_link, str):
            object.__setattr__(self, "host_link", get_host_link(self.host_link))
        elif self.host_link is not None and not isinstance(self.host_link, HostLink):
            raise ValueError(f"host_link must be a HostLink, a name from {sorted(HOST_LINKS)} "
                             f"or None, got {self.host_link!r}")

    @classmethod
    def create(cls, model: Any = "llama_3_1_8b", accelerator: str | Accelerator = "h100",
               **kwargs) -> "CostModel":
        """Builds from a preset name / ModelShape / ModelConfig-like and an accelerator."""
        shape = ModelShape.preset(model) if isinstance(model, str) else ModelShape.from_config(model)
        acc = get_accelerator(accelerator) if isinstance(accelerator, str) else accelerator
        return cls(shape=shape, accelerator=acc, **kwargs)

    @classmethod
    def from_config(cls, config: Any, **overrides) -> "CostModel":
        """The cost model an experiment config names (an ``ml_collections.ConfigDict``
        or a mapping): ``model`` and ``accelerator`` (required), and when present
        ``num_chips``, ``flops_efficiency``, ``bandwidth_efficiency``,
        ``step_overhead_s`` and ``host_link`` (an empty string / None: no link);
        ``overrides`` (e.g. ``accelerator=`` of a sweep) win over the config.

        Raises:
          ValueError: a missing ``model`` / ``accelerator`` or an unknown preset.
        """
        if hasattr(config, "to_dict"):
            config = config.to_dict()
        if not isinstance(config, dict):
            raise ValueError(f"CostModel.from_config needs a ConfigDict or a dict, got "
                             f"{type(config).__name__}")
        values = {k: config[k] for k in _COST_CONFIG_KEYS if k in config}
        values.update(overrides)
        missing = [k for k in ("model", "accelerator") if values.get(k) is None]
        if missing:
            raise ValueError(f"CostModel.from_config: the config lacks {missing}")
        if not values.get("host_link"):
            values.pop("host_link", None)
        return cls.create(values.pop("model"), values.pop("accelerator"), **values)

    @property
    def flops_per_s(self) -> float:
        return self.accelerator.peak_flops * self.num_chips * self.flops_efficiency

    @property
    def bytes_per_s(self) -> float:
        return self.accelerator.hbm_bandwidth * self.num_chips * self.bandwidth_efficiency

    @property
    def host_bytes_per_s(self) -> float:
        """Effective host -> device bytes/s over all chips' links.

        Raises:
          ValueError: the model has no ``host_link``.
        """
        return self._link().effective_bandwidth * self.num_chips

    def _link(self) -> HostLink:
        if self.host_link is None:
            raise ValueError("this CostModel has no host_link: pass host_link= (a HostLink "
                             f"or one of {sorted(HOST_LINKS)}) to simulate a host tier")
        return self.host_link

    def block_bytes(self, block_size: int) -> int:
        """KV bytes of one block of ``block_size`` tokens (all layers, K and V)."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        return self.shape.kv_bytes_per_token * block_size

    def load_time(self, num_bytes: float) -> float:
        """Seconds to copy ``num_bytes`` of KV from host memory to the device(s).

        One batched transfer: ``host_link.latency_s + num_bytes / host_bytes_per_s``
        (each chip loads its ``1 / num_chips`` shard over its own link, in parallel);
        0 for ``num_bytes == 0``.

        Raises:
          ValueError: no ``host_link``; ``num_bytes`` negative or not a number.
        """
        return self._link().load_time(num_bytes, self.num_chips)

    def kv_cache_blocks(self, block_size: int, hbm_fraction: float = 0.9) -> int:
        """How many KV blocks fit in the HBM left after the weights.

        Args:
          block_size: tokens per block.
          hbm_fraction: share of HBM the server may use (vLLM's
            ``gpu_memory_utilization``).
        """
        free = (self.accelerator.hbm_bytes * self.num_chips * hbm_fraction
                - self.shape.num_params * self.shape.dtype_bytes)
        return max(0, int(free // (self.shape.kv_bytes_per_token * block_size)))

    def _roofline(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops_per_s, nbytes / self.bytes_per_s) + self.step_overhead_s

    def prefill_time(self, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        """Seconds for one step prefilling ``n`` tokens over ``c`` cached ones alone."""
        return self.step_time([(num_new_tokens, num_cached_tokens)], ())

    def decode_step_time(self, context_lens: Iterable[int]) -> float:
        """Seconds for one decode step of a batch with these context lengths."""
        return self.step_time((), context_lens)

    def step_time(self, prefill_chunks: Iterable[tuple[int, int]],
                  decode_context_lens: Iterable[int] = ()) -> float:
        """Seconds for one mixed step (continuous batching).

        Args:
          prefill_chunks: ``(num_new_tokens, num_cached_tokens)`` per sequence
            computing several tokens this step; each also samples a token
            (LM head of its last token).
          decode_context_lens: per decoding sequence, tokens already cached
            (it computes one token over them).

        Returns:
          ``max(flops / flops_per_s, bytes / bytes_per_s) + step_overhead_s``;
          0 for an empty step.
        """
        flops = 0.0
        nbytes = 0.0
        for n, c in prefill_chunks:
            flops += prefill_flops(self.shape, n, c)
            nbytes += kv_bytes(self.shape, n, c)
        for c in decode_context_lens:
            flops += prefill_flops(self.shape, 1, c)
            nbytes += kv_bytes(self.shape, 1, c)
        if flops == 0.0:
            return 0.0
        return self._roofline(flops, nbytes + self.shape.weight_bytes_per_step)
