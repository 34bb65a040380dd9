"""How many more tokens a position-independent chunk cache could reuse than prefix caching.

Prefix caching reuses a block only when every block before it matches too. CacheBlend
(EuroSys'25) and EPIC reuse the KV of a chunk that recurs after a *different* prefix,
recomputing a fraction of its tokens to repair cross-attention. This module bounds what
that could add on a trace, at infinite capacity, before anyone builds it:

* **prefix hits**: a request's leading full blocks whose whole chain (parent blocks,
  tokens, extra keys) some earlier request computed -- the infinite-cache ideal of
  prefix caching;
* **non-prefix hits**: every further full block whose *content* (its tokens plus the
  same extra keys: LoRA adapter, multimodal items relative to the block, the tenant's
  salt) some earlier request computed at any position. Each saves
  ``(1 - recompute_fraction)`` of its tokens (CacheBlend recomputes ~15% of a reused
  chunk's tokens; ``recompute_fraction=0`` gives the raw upper bound).

The model is the replay's at ``concurrency=1`` with nothing evicted: requests in trace
order; a request's computed tokens are its prompt plus ``max(output_len, 1) - 1``
generated tokens (``prefixcache.sim.trace.output_tokens``; the last sampled token is
never fed back); at most ``len(prompt) - 1`` prompt tokens can hit (the last one is always
computed), so the blocks considered are the first ``(len(prompt) - 1) // block_size``.
``alignment`` says where an earlier request's chunks may start: ``"block"`` (default)
at its block boundaries, as a paged cache stores them, so a chunk that recurs shifted by a
non-multiple of the block size is not found; ``"token"`` at any token offset (a chunk
store that re-rotates positions and cuts chunks where the application does, e.g. per
retrieved document): the looser bound.

Both counts come from the same walk, so ``nonprefix_hit_tokens >= prefix_hit_tokens``
always, with equality on a trace where no block recurs outside its prefix. Prompts given
as ``MooncakePrompt`` (hash-id traces) are keyed by their hash ids without expanding
tokens, when the block size divides the trace's block.

Host only: never imports jax.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from prefixcache._validate import check_positive_int
from prefixcache.sim.trace import MooncakePrompt, TraceRequest, output_tokens

import numpy as np

__all__ = ["nonprefix_bound"]


def _check_fraction(recompute_fraction) -> float:
    if isinstance(recompute_fraction, bool) or not isinstance(recompute_fraction, (int, float)):
        raise TypeError("recompute_fraction must be a number in [0, 1], got "
                        f"{type(recompute_fraction).__name__} {recompute_fraction!r}")
    if not 0.0 <= float(recompute_fraction) <= 1.0:
        raise ValueError(f"recompute_fraction must be in [0, 1], got {recompute_fraction!r}")
    return float(recompute_fraction)


def _block_contents(tr: TraceRequest, block_size: int, n_blocks: int) -> list[bytes]:
    """The content key (position-independent) of each of the first ``n_blocks`` full
    blocks of ``tr``'s computed tokens (prompt, then generated tokens)."""
    prompt = tr.prompt
    n_prompt = len(prompt)
    keyed = type(prompt) is MooncakePrompt and prompt.block_tokens % block_size == 0
    keys: list[bytes] = []
    if keyed:
        per = prompt.block_tokens // block_size
        n_keyed = min(n_blocks, n_prompt // block_size)
        ids = prompt.hash_ids
        keys = [b"h" + (int(ids[b // per]) & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
                + (b % per).to_bytes(2, "little") for b in range(n_keyed)]
        if n_keyed == n_blocks:
            return keys
    start = len(keys) * block_size
    need = n_blocks * block_size
    tokens = list(prompt[start:min(need, n_prompt)]) if start < n_prompt else []
    if need > n_prompt:
        tokens += output_tokens(tr.id, need - max(n_prompt, start))
    raw = np.asarray(tokens, dtype=np.int64).tobytes()
    width = 8 * block_size
    keys += [b"t" + raw[i:i + width] for i in range(0, len(raw), width)]
    return keys


def _extras(tr: TraceRequest, b: int, block_size: int, start: int | None = None) -> bytes:
    """The block's extra keys: LoRA, multimodal items overlapping it (offset relative to
    the block), and the tenant's salt (a chunk cache isolates tenants on every block).
    ``start``: the chunk's first token when it is not block ``b``'s."""
    parts = []
    if tr.lora is not None:
        parts.append(f"lora:{tr.lora[0]}:{tr.lora[1]}")
    if start is None:
        start = b * block_size
    end = start + block_size
    for ident, offset, length in tr.mm:
        if offset < end and offset + length > start:
            parts.append(f"mm:{ident}:{offset - start}")
    if tr.cache_salt:
        parts.append(f"salt:{tr.cache_salt}")
    return "|".join(parts).encode()


def _token_windows(tr: TraceRequest, block_size: int, n_tokens: int) -> list[bytes]:
    """The content keys of every ``block_size``-token window of ``tr``'s first
    ``n_tokens`` computed tokens, at every offset (``alignment="token"``)."""
    prompt = tr.prompt
    toks = list(prompt[:n_tokens]) if n_tokens <= len(prompt) else (
        list(prompt) + output_tokens(tr.id, n_tokens - len(prompt)))
    if n_tokens < block_size:
        return []
    raw = np.asarray(toks, dtype=np.int64).tobytes()
    width = 8 * block_size
    if not tr.lora and not tr.mm and not tr.cache_salt:  # the common case: no extras
        return [b"t" + raw[8 * i:8 * i + width] + b"#" for i in range(n_tokens - block_size + 1)]
    keys = []
    for i in range(n_tokens - block_size + 1):
        keys.append(b"t" + raw[8 * i:8 * i + width] + b"#" + _extras(tr, 0, block_size, start=i))
    return keys


_ALIGNMENTS = ("block", "token")


def nonprefix_bound(requests: Iterable[TraceRequest], block_size: int, *,
                    recompute_fraction: float = 0.15, alignment: str = "block"
                    ) -> dict[str, Any]:
    """Prefix-cache hits and the non-prefix (chunk-reuse) bound of a trace.

    Args:
        requests: the trace, in arrival order (consumed once, as a stream).
        block_size: tokens per block (the cache's block size).
        recompute_fraction: the share of a non-prefix reused block's tokens that must be
            recomputed (CacheBlend's selective recompute), in [0, 1].
        alignment: ``"block"`` or ``"token"``: where earlier chunks may start (module
            docstring).

    Returns:
        ``requests``, ``prompt_tokens``, ``prefix_hit_tokens`` (the infinite-cache prefix
        ideal), ``nonprefix_blocks`` (full blocks found by content only),
        ``nonprefix_hit_tokens`` (prefix hits plus ``(1 - recompute_fraction)`` of
        those blocks' tokens), both as rates of the prompt tokens
        (``prefix_hit_rate_tokens``, ``nonprefix_hit_rate_tokens``), ``block_size`` and
        ``recompute_fraction``.

    Raises:
        ValueError / TypeError: a bad ``block_size`` or ``recompute_fraction`` (before
            reading the trace).
    """
    check_positive_int("block_size", block_size)
    r = _check_fraction(recompute_fraction)
    if alignment not in _ALIGNMENTS:
        raise ValueError(f"alignment must be one of {_ALIGNMENTS}, got {alignment!r}")
    by_token = alignment == "token"
    chains: set[bytes] = set()    # chain keys (prefix caching's block keys)
    contents: set[bytes] = set()  # content keys (a chunk cache's keys)
    n_req = prompt_tokens = prefix_blocks = extra_blocks = 0
    for tr in requests:
        n_req += 1
        n_prompt = len(tr.prompt)
        prompt_tokens += n_prompt
        n_hit_max = (n_prompt - 1) // block_size  # blocks a lookup may adopt
        n_tokens = n_prompt + max(tr.output_len, 1) - 1  # tokens whose KV is computed
        n_total = n_tokens // block_size  # full blocks computed
        if by_token:
            windows = _token_windows(tr, block_size, n_tokens)
            keys = windows[:n_total * block_size:block_size]
        else:
            keys = [c + b"#" + _extras(tr, b, block_size)
                    for b, c in enumerate(_block_contents(tr, block_size, n_total))]
        parent = b""
        in_prefix = True
        new_chains = []
        for b, c in enumerate(keys):
            parent = hashlib.blake2b(parent + c, digest_size=16).digest()
            if b < n_hit_max:
                if in_prefix and parent in chains:
                    prefix_blocks += 1
                else:
                    in_prefix = False
                    if c in contents:
                        extra_blocks += 1
            new_chains.append(parent)
        # NOTE: registered after the walk: a request never reuses its own blocks.
        chains.update(new_chains)
        contents.update(windows if by_token else keys)
    prefix_hit = prefix_blocks * block_size
    nonprefix_hit = prefix_hit + (1.0 - r) * extra_blocks * block_size
    return {
        "requests": n_req,
        "prompt_tokens": prompt_tokens,
        "block_size": block_size,
        "recompute_fraction": r,
        "alignment": alignment,
        "prefix_hit_tokens": prefix_hit,
        "nonprefix_blocks": extra_blocks,
        "nonprefix_hit_tokens": nonprefix_hit,
        "prefix_hit_rate_tokens": prefix_hit / prompt_tokens if prompt_tokens else 0.0,
        "nonprefix_hit_rate_tokens": nonprefix_hit / prompt_tokens if prompt_tokens else 0.0,
    }
