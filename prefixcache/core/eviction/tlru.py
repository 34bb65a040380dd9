"""``tlru``: tail-optimized LRU (Zhang et al., NeurIPS 2025, arXiv 2510.15152; SGLang's
``tlru`` eviction strategy): blocks whose eviction cannot push a conversation's next
prefill past the latency threshold ("TEL-safe") go first, LRU among each class.

The rule, as SGLang's ``TLRUStrategy.get_priority`` implements it (followed here, in
blocks): a conversation whose history is ``L`` blocks long and whose next prompt is
expected to add ``next_prompt`` blocks (the paper's Q-hat) must keep its first
``budget = max(L + next_prompt - threshold, 0)`` blocks cached for its next prefill to
stay within ``threshold`` blocks (the paper's xi, the TTFT budget in blocks); a block
whose prefix before it is already ``>= budget`` blocks long (its position ``p`` in the
chain: ``p >= budget``) is TEL-safe. Every TEL-safe candidate is evicted before every
other one (the paper's phase 1), then plain recency (phase 2); within each class the
least recently released first (the ``lru`` policy's key, vLLM's free-queue order).

``L`` is the conversation's high-water depth, as in SGLang: the most full blocks any
request that cached or released the block has held (``request.num_tokens //
block_size``, at least the block's own depth), never shrinking while the block stays
cached, so a trimmed tail does not make the remaining prefix look over budget.

Options (both counts of blocks, as the paper states them; SGLang's are tokens: divide
by the page size): ``threshold`` (xi; an int >= 0, default 0) and ``next_prompt``
(Q-hat; an int >= 0, default 0). With ``threshold <= next_prompt`` no block is
TEL-safe and ``tlru`` orders the candidates exactly as ``lru``'s key does.
"""

from __future__ import annotations

from prefixcache._validate import check_count, check_positive_int
from prefixcache.core.eviction.base import KeyedPolicy


class TLRUPolicy(KeyedPolicy):
    """TEL-safe blocks first, LRU among each class (see the module docstring).

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block (the manager passes its own).
        threshold: the latency threshold xi, in blocks (an int >= 0).
        next_prompt: the expected next prompt Q-hat, in blocks (an int >= 0).
    """

    name = "tlru"
    needs_block_size = True

    def __init__(self, num_blocks: int, *, block_size: int, threshold: int = 0,
                 next_prompt: int = 0):
        self.threshold = check_count("tlru: threshold", threshold)
        self.next_prompt = check_count("tlru: next_prompt", next_prompt)
        self.block_size = check_positive_int("tlru: block_size", block_size)
        super().__init__(num_blocks)
        self.depth = [0] * num_blocks  # the block's position in its chain
        self.history = [0] * num_blocks  # L: the high-water depth of its conversation

    def _blocks_of(self, request) -> int:
        n = getattr(request, "num_tokens", None)  # (a host-tier origin carries none)
        return n // self.block_size if isinstance(n, int) else 0

    def on_cached(self, block, block_hash, request, position) -> None:
        super().on_cached(block, block_hash, request, position)
        bid = block.block_id
        self.depth[bid] = position
        self.history[bid] = max(position + 1, self._blocks_of(request))

    def on_release(self, block, request, position) -> None:
        super().on_release(block, request, position)
        bid = block.block_id
        # (hits are counted here: every request that adopted the block releases it)
        self.history[bid] = max(self.history[bid], self._blocks_of(request))

    def tel_safe(self, bid: int) -> bool:
        """Whether evicting block ``bid`` keeps its conversation's next prefill within
        ``threshold`` blocks."""
        budget = max(self.history[bid] + self.next_prompt - self.threshold, 0)
        return self.depth[bid] >= budget

    def key(self, block) -> tuple[int, int]:
        bid = block.block_id
        return (0 if self.tel_safe(bid) else 1, self.released_at[bid])
