"""KV cache events, with the field names of vLLM 0.33's ``vllm.distributed.kv_events``.

External KV-aware routers consume these to learn which blocks a cache holds. The
classes are plain ``__slots__`` dataclasses (vLLM's are ``msgspec.Struct``s); field
names, order and defaults follow vLLM so a consumer written against vLLM's events reads
ours unchanged. Block hashes are published as vLLM does by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the digest's low 64 bits, big-endian, as
an ``int``; with ``KVCacheManager(int_event_hashes=False)`` the raw digest ``bytes``.

``extra_keys`` is the *untagged* per-block form vLLM publishes
(``to_event_extra_keys``): for each block a tuple holding, in order, the LoRA name
(when a LoRA is set), one ``(mm_identifier, offset_in_block)`` pair per multimodal item
overlapping the block, and the cache salt (first block only); ``None`` for a block
without extra keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"  # the host tier (KVCacheManager(num_host_blocks=N)), as vLLM's offloading


@dataclasses.dataclass(slots=True)
class KVCacheEvent:
    """Base class of all KV cache events."""


@dataclasses.dataclass(slots=True)
class BlockStored(KVCacheEvent):
    """Blocks that became full and entered the prefix cache (one request, one call).

    Attributes:
        block_hashes: digests of the newly cached blocks, in block order.
        parent_block_hash: digest of the block before the first one, ``None`` when
            the first stored block is the request's block 0.
        token_ids: the token ids of all stored blocks, concatenated
            (``len == len(block_hashes) * block_size``).
        block_size: tokens per block.
        lora_id: vLLM's integer adapter id (``LoRARequest.int_id``; ``None`` without
            LoRA or when the request's LoRARequest has none); deprecated in vLLM,
            consumers key on ``lora_name``.
        medium: ``"GPU"``; ``"CPU"`` for a block demoted to the host tier (then
            ``token_ids`` is empty, as vLLM's offloading connector publishes).
        lora_name: the LoRA adapter name, or ``None``.
        extra_keys: one untagged entry per block (see the module docstring), or
            ``None`` when no block has extra keys.
        group_idx: KV cache group (always 0: one full-attention group).
        kv_cache_spec_kind: ``"full_attention"``.
    """

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


@dataclasses.dataclass(slots=True)
class BlockRemoved(KVCacheEvent):
    """A cached block was evicted (its hash dropped) so the block could be reused.

    Attributes:
        block_hashes: the evicted digest(s); one per event, as vLLM emits them.
        medium: ``"GPU"``, or ``"CPU"`` for an entry leaving the host tier (evicted
            by the host policy, promoted to the device, or cached again on the device).
        group_idx: KV cache group (always 0).
    """

    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclasses.dataclass(slots=True)
class AllBlocksCleared(KVCacheEvent):
    """``reset_prefix_cache()`` dropped every cached hash."""


def device_block_stored(request, block_hashes: list, parent_block_hash, start: int, end: int,
                        block_size: int, extra: list | None = None, *, group_idx: int = 0,
                        spec_kind: str = "full_attention",
                        sliding_window: int | None = None) -> BlockStored:
    """The ``BlockStored`` (medium ``"GPU"``) of ``request``'s newly cached blocks
    covering tokens ``[start, end)``: ``block_hashes`` / ``parent_block_hash`` already in
    the event form, ``extra`` one `event_extra_keys` entry per stored block (None: every
    block of the range is stored). Every index's and group kind's rule.

    NOTE: the callers' caching paths call this only with events on, and keep no
    comprehension of their own: its free variables would be cells made on every call
    (events off too)."""
    if extra is None:
        extra = [event_extra_keys(request, s, s + block_size)
                 for s in range(start, end, block_size)]
    lora = request.lora
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=parent_block_hash,
        token_ids=list(request.all_token_ids[start:end]),
        block_size=block_size,
        lora_id=lora.int_id if lora is not None else None,
        medium=MEDIUM_GPU,
        lora_name=lora.name if lora is not None else None,
        extra_keys=extra if any(e is not None for e in extra) else None,
        group_idx=group_idx,
        kv_cache_spec_kind=spec_kind,
        kv_cache_spec_sliding_window=sliding_window,
    )


def event_extra_keys(request, start: int, end: int) -> tuple[Any, ...] | None:
    """The untagged extra keys vLLM publishes for the block ``[start, end)``.

    Args:
        request: a ``prefixcache.core.request.Request`` (``lora``, ``mm_features``,
            ``cache_salt``).
        start: first token index of the block.
        end: one past its last token index.

    Returns:
        ``(lora_name?, (mm_identifier, offset - start)..., cache_salt?)`` or ``None``.
    """
    keys: list[Any] = []
    lora = request.lora
    if lora is not None:
        keys.append(lora.name)
    for feat in request.mm_features:
        # NOTE: overlap rule of the block hash (core/hashing.py): offset < end and
        # offset + length > start; features are kept sorted by offset.
        if feat.offset < end and feat.offset + feat.length > start:
            keys.append((feat.identifier, feat.offset - start))
    if start == 0 and request.cache_salt:
        keys.append(request.cache_salt)
    return tuple(keys) if keys else None
