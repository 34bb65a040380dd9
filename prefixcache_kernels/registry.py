"""Kernel backends as records: one `KernelBackend` per backend, looked up by name.

Modelled on vLLM's attention-backend registry (`register_backend`): a backend is a
record of its name, the platforms it runs compiled on, a check of what it supports and
its function; backend selection ("auto" and by name), the errors and the
supported-feature refusals of `prefixcache_kernels.api` read only these records, so a
new backend is one file with its function plus one record.

The registry is a read-only mapping (no module-level mutable state). The built-in one is
`prefixcache_kernels.api.KERNEL_BACKENDS`; a user's own package registers a backend
without editing this package by `register_backend(record)`, which returns a NEW mapping
to pass as `backends=` to `resolve_backend` / `check_backend_config` /
`paged_attention` -- or by passing the record itself as `backend=`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class AttentionQuery:
  """What a call asks of a backend, known before any array exists.

  `platform` is the platform it runs on (`jax.default_backend()`: "cpu", "gpu",
  "tpu"); `compute_capability` the GPU's ("8.0", ...) when the caller knows it, else
  None (a check that needs it may ask the device).
  """
  page_size: int
  head_dim: int
  num_q_heads: int
  num_kv_heads: int
  q_dtype: Any
  kv_dtype: Any
  interpret: bool
  platform: str
  compute_capability: str | None = None


@dataclasses.dataclass(frozen=True)
class KernelBackend:
  """One paged-attention backend.

  Attributes:
    name: the name `backend=` selects it by.
    attention: `fn(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
      sm_scale, sliding_window, soft_cap[, kv_scales][, block_sizes][, interpret])`
      with `paged_attention`'s semantics; `kv_scales` / `block_sizes` are passed only
      when given, `interpret` only when `interpretable`.
    platforms: the platforms it runs compiled on; () for every platform.
    interpretable: it takes `interpret=` and then runs on any platform.
    block_sizes: the tile type `block_sizes=` must be for it (None: it takes none).
    check: `check(query: AttentionQuery) -> str | None`: why it cannot run that
      configuration (the reason, shown in the ValueError), or None when it can. The
      checks every backend shares (`common.check_attention_config`) run before it.
    auto: "auto" may pick it on its platforms (the first such record in the registry
      whose platforms contain the current one; the first with no platforms otherwise).
  """
  name: str
  attention: Callable[..., Any]
  platforms: tuple[str, ...] = ()
  interpretable: bool = False
  block_sizes: type | None = None
  check: Callable[[AttentionQuery], str | None] | None = None
  auto: bool = True

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name or self.name == AUTO:
      raise ValueError(f"a kernel backend needs a name other than {AUTO!r}, got {self.name!r}")
    if not callable(self.attention):
      raise ValueError(f"kernel backend {self.name!r}: attention must be callable")
    if isinstance(self.platforms, str) or not all(isinstance(p, str) for p in self.platforms):
      raise ValueError(f"kernel backend {self.name!r}: platforms must be a tuple of str, "
                       f"got {self.platforms!r}")
    if self.check is not None and not callable(self.check):
      raise ValueError(f"kernel backend {self.name!r}: check must be callable or None")

  def runs_on(self, platform: str, interpret: bool) -> bool:
    """It can run on `platform` (compiled, or in interpret mode when asked and able)."""
    return not self.platforms or platform in self.platforms or (interpret and self.interpretable)


def register_backend(backend: KernelBackend,
                     registry: Mapping[str, KernelBackend]) -> MappingProxyType:
  """A new read-only registry: `registry` plus `backend` (the given one is unchanged).

  Raises:
    ValueError: `backend` is not a `KernelBackend`, or its name is taken.
  """
  if not isinstance(backend, KernelBackend):
    raise ValueError(f"register_backend takes a KernelBackend, got {type(backend).__name__}")
  if backend.name in registry:
    raise ValueError(f"kernel backend {backend.name!r} is already registered")
  return MappingProxyType({**registry, backend.name: backend})
