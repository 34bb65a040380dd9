"""Full (causal) attention: the spec and its single-type manager (vLLM's
``FullAttentionSpec`` / ``FullAttentionManager``)."""

from __future__ import annotations

import dataclasses
from itertools import islice

from prefixcache.core.groups.base import SingleTypeManager


@dataclasses.dataclass(frozen=True)
class FullAttentionSpec:
    """Full (causal) attention: every earlier token's KV is kept until the request ends."""

    kind = "full_attention"  # vLLM's KV event spec kind

    @property
    def sliding_window(self) -> None:
        return None


class FullAttentionManager(SingleTypeManager):
    """Every block kept until the request ends; a hit is the cached run from the left."""

    spec_class = FullAttentionSpec
    downward_closed = True

    def find_longest_cache_hit(self, hashes, max_length, group_ids, suffixes):
        """``FullAttentionManager.find_longest_cache_hit``: cached blocks from the left."""
        bs = self.block_size
        get_cached = self.get_cached
        computed: list[list] = [[] for _ in group_ids]
        for h in islice(hashes, max_length // bs):
            got = get_cached(h, group_ids, suffixes)
            if got is None:
                break
            for c, b in zip(computed, got):
                c.append(b)
        return computed, len(computed[0]) * bs


__all__ = ["FullAttentionManager", "FullAttentionSpec"]
