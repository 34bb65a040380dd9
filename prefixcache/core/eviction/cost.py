"""``cost``: recency combined with the prefill FLOPs a block saves per byte it occupies
(GreedyDual-Size), in the spirit of Marconi (arXiv 2411.19379).

Marconi scores cache entries by recency plus FLOP efficiency: the compute a hit saves
per byte of memory the entry holds. GreedyDual-Size (Cao & Irani, USENIX ITS 1997) is
the classic, competitive-optimal way to combine recency with cost per byte without a
hand-tuned weight: a candidate gets ``H = L + cost / size`` when it becomes evictable,
the victim is the smallest ``H``, and ``L`` (the inflation value) rises to the victim's
``H``. A block that saves much compute outlives cheap ones for a while; a block that is
not reused sinks below newer ones as ``L`` catches up (aging).

Here ``size`` is the bytes one block of KV occupies (``kv_bytes_per_token *
block_size``: the same for every block) and ``cost(p)`` is the prefill FLOPs of a
block at position ``p`` over ``p`` cached blocks (``prefill_flops(shape, block_size,
p * block_size, lm_head=False)``): the work a hit on it saves. Its attention term grows
with ``p``, so deeper blocks save more. Ties fall back to LRU order.

NOTE: the FLOPs come from ``prefixcache.cost_model`` (host only, no jax; below
``core``), imported inside the constructor so the default path does not load it.
"""

from __future__ import annotations

from prefixcache._validate import check_positive_int
from prefixcache.core.eviction.base import KeyedPolicy, PolicyError

DEFAULT_MODEL = "llama_3_1_8b"



def model_shape(policy: str, model):
    """``model`` (a ``cost_model.MODEL_PRESETS`` name or a ``ModelShape``) as a
    ``ModelShape``; an error naming ``policy`` otherwise (the FLOP-aware policies' one
    check)."""
    from prefixcache.cost_model import ModelShape

    if isinstance(model, str):
        return ModelShape.preset(model)  # unknown name -> ValueError naming presets
    if isinstance(model, ModelShape):
        return model
    raise TypeError(f"{policy}: model must be a preset name or a ModelShape, got {model!r}")


class CostPolicy(KeyedPolicy):
    """GreedyDual-Size over FLOPs saved per byte (see the module docstring).

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block (the manager passes its own).
        model: a ``prefixcache.cost_model.MODEL_PRESETS`` name, or a
            ``ModelShape``.
    """

    name = "cost"
    needs_block_size = True

    def __init__(self, num_blocks: int, *, block_size: int, model=DEFAULT_MODEL):
        super().__init__(num_blocks)
        from prefixcache.cost_model import prefill_flops

        block_size = check_positive_int("cost: block_size", block_size)
        shape = model_shape("cost", model)
        self.model = model if isinstance(model, str) else "custom"
        self.block_size = block_size
        self._shape = shape
        self._flops = prefill_flops
        self.bytes_per_block = shape.kv_bytes_per_token * block_size
        self._value: list[float] = []  # cost(p) / bytes, by position p (filled lazily)
        self.inflation = 0.0  # GreedyDual's L
        self.position = [0] * num_blocks
        self.h = [0.0] * num_blocks  # H of each candidate, set at add()

    def value(self, position: int) -> float:
        """FLOPs a hit on a block at ``position`` saves, per byte the block holds."""
        vals = self._value
        while len(vals) <= position:
            p = len(vals)
            bs = self.block_size
            vals.append(self._flops(self._shape, bs, p * bs, lm_head=False) / self.bytes_per_block)
        return vals[position]

    def on_cached(self, block, block_hash, request, position) -> None:
        super().on_cached(block, block_hash, request, position)
        self.position[block.block_id] = position

    def key(self, block) -> tuple[float, int]:
        bid = block.block_id
        h = self.inflation + self.value(self.position[bid])
        self.h[bid] = h
        return (h, self.released_at[bid])

    def pop(self):
        block = super().pop()
        self.inflation = self.h[block.block_id]
        return block

    def clear(self) -> None:
        super().clear()
        self.inflation = 0.0

    def current_key(self, block) -> tuple[float, int]:
        bid = block.block_id
        return (self.h[bid], self.released_at[bid])

    def check_invariants(self, candidate_ids) -> None:
        super().check_invariants(candidate_ids)
        token = self._token
        for (h, _), tok, block in self._heap:
            if token[block.block_id] == tok and h < self.inflation:
                raise PolicyError(
                    f"cost: candidate block {block.block_id} has H={h} below L={self.inflation}"
                )
