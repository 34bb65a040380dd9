"""Why a prompt block missed: one reason per block that was not a prefix-cache hit.

The first question of every prefix-caching study ("why is my hit rate low?") asked of
each block. ``MissAccountant`` follows a manager's KV events (which blocks are cached
on the device and in the host tier, and which left it) and, at each admission, gives
every prompt block after the hit one reason:

* ``partial``: the prompt's last block is not full (only full blocks are cached);
* ``last_token``: the prompt is a whole number of blocks, all cached, but a lookup
  adopts at most ``num_tokens - 1`` tokens (the last token is always computed), so the
  last block is computed again;
* ``evicted``: the block's key was computed and cached before and has since been
  dropped for capacity -- the "eviction-induced prefills" capacity studies compare;
  counted per tier that dropped it last (``evicted_device``: the device pool's policy
  with no host tier, or demotion disabled; ``evicted_host``: the host tier's policy);
* ``isolated``: the key was never cached, but the same tokens (the same token prefix)
  were, under another key: another cache salt, LoRA adapter or multimodal item;
* ``cold``: neither the key nor its tokens were ever cached;
* a block that is still cached but unreachable because an earlier block of its chain
  missed takes the reason of the first missed block (the chain was broken there).

``window`` (outside a sliding window, or a state checkpoint not kept) and
``preempted`` (recomputed after a preemption) need the engine's or a hybrid manager's
view; this accountant serves one full-attention group and refuses a manager built with
sliding-window groups.

Invariant (tested as a property): the reasons of an admission sum exactly to its
missed prompt blocks, ``ceil(num_prompt_tokens / block_size) - num_hit_blocks``.

How ``isolated`` is found cheaply: a request without extra keys (no salt, adapter or
multimodal item) keys its blocks by their tokens alone, so its block hash *is* the
content key of its token prefix. Only a request with extra keys computes the plain
chain of its tokens (``BlockHasher.hash_token_blocks`` without extras, through the
hasher's memo) and registers it; a block then is ``isolated`` when its plain key was
cached under another key. (A replay keying blocks by Mooncake hash ids has no extra
keys, so nothing is isolated there.)

Zero cost when not used (the replay builds one only with ``miss_reasons=True``). Host
only: nothing here imports jax.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable, Mapping

from prefixcache.core.events import MEDIUM_CPU, AllBlocksCleared, BlockRemoved, BlockStored

REASONS = ("cold", "evicted", "isolated", "partial", "last_token")


class MissAccountant:
    """Per-block miss reasons for the admissions of one manager (module docstring).

    Args:
        block_size: the manager's tokens per block.
        hasher: the manager's ``BlockHasher`` (for the plain token chain of requests
            with extra keys); ``None``: ``isolated`` is never reported.

    Use: build the manager with ``enable_events=True, int_event_hashes=False``; before
    each admission's final lookup call ``observe(manager.take_events())``; after a
    successful admission call ``admit(request, num_hit_tokens)``, which returns the
    request's reasons and adds them to the totals.
    """

    def __init__(self, block_size: int, hasher=None):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.hasher = hasher
        self._device: collections.Counter = collections.Counter()  # key -> cached blocks
        self._host: set = set()
        self._dropped: dict = {}  # key -> "device" | "host": the tier that dropped it last
        self._ever: set = set()  # keys ever cached (either tier) since the last reset
        # plain key of a token prefix -> the set of keys it was cached under by requests
        # with extra keys (module docstring)
        self._extras_content: dict = {}
        self.totals: collections.Counter = collections.Counter()
        self.per_tenant: dict[Any, collections.Counter] = {}
        self.per_adapter: dict[Any, collections.Counter] = {}
        self.num_missed_blocks = 0

    # -- the cache's state, from the manager's events ---------------------------------
    def observe(self, events: Iterable) -> None:
        dev, host, dropped, ever = self._device, self._host, self._dropped, self._ever
        for ev in events:
            t = type(ev)
            if t is BlockStored:
                hashes = ev.block_hashes
                ever.update(hashes)
                if ev.medium == MEDIUM_CPU:
                    host.update(hashes)
                else:
                    dev.update(hashes)
                if dropped:
                    for k in hashes:
                        dropped.pop(k, None)
            elif t is BlockRemoved:
                on_host = ev.medium == MEDIUM_CPU
                for k in ev.block_hashes:
                    if on_host:
                        host.discard(k)
                    elif dev[k] > 1:
                        dev[k] -= 1
                    else:
                        dev.pop(k, None)
                    if k not in host and k not in dev:
                        dropped[k] = "host" if on_host else "device"
            elif t is AllBlocksCleared:
                # NOTE: a reset is not an eviction for capacity: the cache starts over,
                # and later misses are classified as for a fresh cache.
                dev.clear()
                host.clear()
                dropped.clear()
                ever.clear()
                self._extras_content.clear()

    # -- classification ------------------------------------------------------------
    def _plain_keys(self, request) -> list | None:
        """The request's plain token chain when it has extra keys, else None."""
        if self.hasher is None or not (request.cache_salt or request.lora is not None
                                       or request.mm_features):
            return None
        n = request.num_prompt_tokens // self.block_size * self.block_size
        return self.hasher.hash_token_blocks(request.prompt_token_ids[:n], self.block_size)

    def classify(self, request, num_hit_tokens: int, plain=None) -> dict[str, int]:
        """The reasons of ``request``'s missed prompt blocks (no totals changed).

        ``plain``: the request's plain token chain (``_plain_keys``), if known."""
        bs = self.block_size
        n = request.num_prompt_tokens
        num_full = n // bs
        hit = num_hit_tokens // bs
        reasons: dict[str, int] = {}
        if num_full > hit:
            hashes = request.block_hashes
            dev, host, ever = self._device, self._host, self._ever
            content = self._extras_content
            chain_reason = None  # the reason of the first missed block
            chain_sub = None  # and its tier, when it was evicted
            for i in range(hit, num_full):
                k = hashes[i]
                if k in dev or k in host:
                    if i == num_full - 1 and n == num_full * bs and i == hit:
                        r = "last_token"
                    elif chain_reason is not None:
                        r = chain_reason
                        if chain_sub is not None:  # evicted upstream: by the same tier
                            reasons[chain_sub] += 1
                    else:
                        raise AssertionError(
                            f"request {request.request_id!r}: block {i} is cached and "
                            f"reachable but the lookup hit only {hit} blocks: the "
                            "accountant and the manager disagree (were all events observed?)")
                elif k in ever:
                    r = "evicted"
                    d = "evicted_" + self._dropped.get(k, "device")
                    reasons[d] = reasons.get(d, 0) + 1
                    if chain_reason is None:
                        chain_sub = d
                elif plain is None:
                    others = content.get(k) if content else None
                    r = "isolated" if others else "cold"
                else:
                    pk = plain[i]
                    others = content.get(pk)
                    r = "isolated" if (pk in ever or (others and others != {k})) else "cold"
                if chain_reason is None:
                    chain_reason = r
                reasons[r] = reasons.get(r, 0) + 1
        if n > num_full * bs:
            reasons["partial"] = reasons.get("partial", 0) + 1
        return reasons

    def admit(self, request, num_hit_tokens: int) -> dict[str, int]:
        """Classify an admitted request, add it to the totals, and (a request with
        extra keys) register its tokens' plain keys. Returns its reasons."""
        plain = self._plain_keys(request)
        reasons = self.classify(request, num_hit_tokens, plain)
        if plain is not None:
            content = self._extras_content
            for pk, k in zip(plain, request.block_hashes):
                content.setdefault(pk, set()).add(k)
        totals = self.totals
        for r, v in reasons.items():
            totals[r] += v
            if r in REASONS:
                self.num_missed_blocks += v
        salt = request.cache_salt or None
        lora = request.lora.name if request.lora is not None else None
        self.per_tenant.setdefault(salt, collections.Counter()).update(reasons)
        self.per_adapter.setdefault(lora, collections.Counter()).update(reasons)
        return reasons

    def summary(self) -> dict[str, Any]:
        """Totals (every reason, zeros included), and the breakdowns by tenant (cache
        salt; ``""`` = no salt) and adapter (LoRA name; ``""`` = base model)."""
        def full(c: Mapping[str, int]) -> dict[str, int]:
            d = {r: int(c.get(r, 0)) for r in REASONS}
            d["evicted_device"] = int(c.get("evicted_device", 0))
            d["evicted_host"] = int(c.get("evicted_host", 0))
            return d

        return {
            "missed_blocks": self.num_missed_blocks,
            "reasons": full(self.totals),
            "per_tenant": {("" if k is None else k): full(v) for k, v in self.per_tenant.items()},
            "per_adapter": {("" if k is None else k): full(v)
                            for k, v in self.per_adapter.items()},
        }
