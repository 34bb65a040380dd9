"""Why a prompt block missed: one reason per block that was not a prefix-cache hit.

The first question of every prefix-caching study ("why is my hit rate low?") asked of
each block. At each admission ``MissAccountant`` gives every prompt block after the hit
one reason:

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
* ``window`` (layouts with sliding-window or state groups): the block is cached in the
  full-attention group but the lookup stopped before it, because a sliding-window group
  does not hold the window ending there (released to the null block, or evicted) or a
  state (Mamba) group kept no state checkpoint there;
* ``preempted`` (the engine): the request had computed the block itself before it was
  preempted by recompute, and lost it (a re-admission's missed blocks below what it
  had computed);
* a block that is still cached but unreachable because an earlier block of its chain
  missed takes the reason of the first missed block (the chain was broken there; in a
  sliding-window layout, of the nearest earlier block that is not cached, else
  ``window``).

Invariant (tested as a property): the reasons of an admission sum exactly to its
missed prompt blocks, ``ceil(num_tokens / block_size) - num_hit_blocks``.

How the cache's state is known (``MissAccountant.for_manager``):

* probe (one full-attention group, the hash index or the radix tree, host tier or
  not): the key is looked up in the pool's hash map (the radix tree: none of a lookup's
  missed blocks is in the tree, it strands none, but for the whole-prompt hit cut to
  ``num_tokens - 1`` tokens, checked on the tree) and the host tier's, at the lookup; a
  key not cached was "ever cached" iff it is in ``dropped`` (key -> tier), the dict the
  pool's / tree's and the host tier's ``evicted_by`` hook fills at each eviction (a
  reset gives the pool a new dict). No events, no work per cached block: one dict
  store per eviction, and per admission set operations over the missed blocks' keys.
* group probes (``GroupProbeAccountant``: a layout of full-attention and
  sliding-window groups with a full-attention group, the hash or radix index): the
  same, in the hybrid pool's ``(hash, group)`` map or on the tree.
* events (where ``probe_refusal`` says why not: state groups, sliding-window-only
  layouts, other indexes): the accountant follows the manager's KV events
  (``observe``), which it must be built to queue (``enable_events=True,
  int_event_hashes=False``); in a group layout only the first full-attention group's
  events are followed.

How ``isolated`` is found cheaply: a request without extra keys (no salt, adapter or
multimodal item) keys its blocks by their tokens alone, so its block hash *is* the
content key of its token prefix. A request with extra keys needs the plain chain of
its tokens (the hasher's keys without extras), hashed lazily: only when one of its
missed blocks is neither cached nor evicted, from the plain key of its own last
registered block (``_plain_of``), block by block through the accountant's memo
``(parent plain key, token bytes) -> plain key``, and only up to the first block whose
plain key was never cached ("ever cached" is prefix-closed: a block is cached only
with its parent); while no request without extra keys was admitted (since a reset), no
block is cached under a plain key, so a block the memo does not know is that first
block, unhashed. Its admission registers the plain keys it hashed; the computed
blocks past them wait as one pending run ``(parent plain key, first block's token
bytes) -> its token bytes``, hashed and registered when a later lookup reaches the
same parent and tokens (the only way to ask for them). A block then is ``isolated``
when its plain key was cached under another key (the radix tree: the plain token path
from the base model's root reaches it). Exact (no filter): equal to hashing every
salted request's plain chain (the property test). (A replay keying blocks by Mooncake
hash ids has no extra keys, so nothing is isolated there.)

Zero cost when not used (the replay and the engine build one only when asked). Host
only: nothing here imports jax.
"""

from __future__ import annotations

import array
import collections
from typing import Any, Iterable, Mapping

from prefixcache._validate import check_positive_int
from prefixcache.core.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)

REASONS = ("cold", "evicted", "isolated", "partial", "last_token", "window", "preempted")
# Sub-counts of ``evicted`` (not reasons of their own: they do not add to the sum).
EVICTED_BY = ("evicted_device", "evicted_host")
# With tiers below the host (``prefixcache.core.tiers``): ``evicted_<tier>`` for the
# last tier that held the block (``evicted_disk``, ``evicted_remote``, a user tier's
# name), and ``corrupt_disk`` for a disk page that failed its check at a lookup (also
# sub-counts of ``evicted``; present only when nonzero).
# The tier a KV event's ``medium`` names (a tier of one's own: its medium, lowercased).
_MEDIUM_TIERS = {MEDIUM_GPU: "device", MEDIUM_CPU: "host", "DISK": "disk", "REMOTE": "remote"}


def _sub_name(tier: str) -> str:
    """The evicted sub-count of an ``evicted_by`` value (a tier's name, or
    ``corrupt_<tier>``)."""
    return tier if tier.startswith("corrupt_") else "evicted_" + tier


class _ChainKeys:
    """The keys the host tier and the exclusive and inclusive tiers below it hold, as
    one read-only view (membership, emptiness, ``keys().isdisjoint``)."""

    __slots__ = ("host", "tiers")

    def __init__(self, host, chain):
        self.host = host
        self.tiers = chain.tiers

    def __contains__(self, k) -> bool:
        return k in self.host or any(k in t.entries for t in self.tiers)

    def __bool__(self) -> bool:
        return bool(self.host) or any(t.entries for t in self.tiers)

    def __len__(self) -> int:
        return len(self.host) + sum(len(t.entries) for t in self.tiers)

    def keys(self):
        return self

    def isdisjoint(self, keys) -> bool:
        return self.host.keys().isdisjoint(keys) and all(
            t.entries.keys().isdisjoint(keys) for t in self.tiers)


def uses_probes(index: str, kv_cache_groups) -> bool:
    """Whether a manager built with this index and layout is followed by probes (no
    events needed: ``probe_refusal`` is ``None``); ``False``: build it with
    ``enable_events=True, int_event_hashes=False`` and call ``observe``."""
    return probe_refusal(index, kv_cache_groups) is None


def _group_index(impl) -> str | None:
    """The index of a multi-group manager ``GroupProbeAccountant`` can probe
    (``"hash"`` / ``"radix"``), or ``None``: another kind of manager."""
    from prefixcache.core.hybrid import HybridKVCacheManager  # noqa: PLC0415
    from prefixcache.core.radix_hybrid import RadixHybridKVCacheManager  # noqa: PLC0415

    t = type(impl)
    if t is HybridKVCacheManager:
        return "hash"
    return "radix" if t is RadixHybridKVCacheManager else None


def _tracked_group(kv_cache_groups) -> tuple[int, bool]:
    """(the group whose events are followed, whether the layout has sliding windows)."""
    from prefixcache.core.kv_groups import FullAttentionSpec, is_hybrid  # noqa: PLC0415

    if kv_cache_groups is None or not is_hybrid(tuple(kv_cache_groups)):
        return 0, False
    for g, group in enumerate(kv_cache_groups):
        if isinstance(group.spec, FullAttentionSpec):
            return g, True
    return 0, True  # only sliding-window groups: the first one's cached keys


class MissAccountant:
    """Per-block miss reasons for the admissions of one manager (module docstring).

    Args:
        block_size: the manager's tokens per block.
        hasher: the manager's ``BlockHasher`` (for the plain token chain of requests
            with extra keys); ``None``: ``isolated`` is never reported.
        track_group: in events mode, the KV cache group whose events are followed.
        windowed: the layout has sliding-window groups (cached but unreachable blocks
            are ``window`` misses).

    Built directly it follows events (``observe``); ``for_manager`` picks probes where
    the manager allows them. Use, per admission: ``observe(manager.take_events())``
    (events mode) before the lookup; ``lookup(request, num_hit_tokens)`` right after
    ``get_computed_blocks`` (before ``allocate_slots`` changes the cache); after a
    successful admission ``admit(request, num_hit_tokens, reasons)`` adds them to the
    totals. ``preempted(request)`` before a request's blocks are freed by a
    preemption.
    """

    def __init__(self, block_size: int, hasher=None, *, track_group: int = 0,
                 windowed: bool = False):
        self.block_size = check_positive_int("block_size", block_size)
        self.hasher = hasher
        self.track_group = track_group
        self.windowed = windowed
        self.uses_events = True
        # Whether ``classify`` reads the cached keys from ``_device`` / ``_host`` (the
        # events' counts, or a subclass's own probe maps) rather than probing ``_pool``.
        self._reads_key_maps = True
        self._pool = None  # probe mode: the pool (its hash map is re-read: reset swaps it)
        self._radix = False  # probe mode on the radix tree (``_tree``: the manager)
        self._tree = None
        self._tier = None  # probe mode: the host tier, if any
        self._device: collections.Counter = collections.Counter()  # events: key -> blocks
        # events: key -> entries in the tiers below the device (the host's, and with
        # tiers below it theirs: an inclusive store may hold a host entry's key too)
        self._host: collections.Counter = collections.Counter()
        self._lower_events = False  # events of a tier below the host were observed
        self._medium_tiers = _MEDIUM_TIERS  # an event's medium -> its tier's name
        self._dropped: dict = {}  # key -> the tier that dropped it last ("device", ...)
        # plain keys of the token prefixes requests with extra keys cached (module
        # docstring): a never-cached key was never registered, so "cached under another
        # key" is plain membership
        self._extras_content: set = set()
        # Lazy plain chains (module docstring): (parent plain key or None, the block's
        # token bytes) -> its plain key, for every plain block this accountant hashed; and
        # the same key -> (parent, first block, token bytes) of an admitted request's
        # computed blocks whose plain keys were never hashed (registered as "seen" on
        # demand: a later lookup that reaches the same parent and tokens hashes them).
        # Invariant: no key is in both.
        self._plain_next: dict = {}
        self._pending: dict = {}
        self._plain_of: dict = {}  # a request's own block key -> its plain key
        self._plain_tag = None  # the hasher's plain_block_tag (() where it has none)
        # Whether a request without extra keys was admitted since the last reset: until
        # then no block is cached under a plain key, so a plain block this accountant
        # never hashed (nor holds pending) was never cached: no need to hash it.
        self._plain_admitted = False
        self._lost: dict = {}  # request id -> full blocks it had computed when preempted
        # [request, b0, its plain keys from block b0 on, the first block to register at
        # admission, the parent of block b0] (``_plain_to``)
        self._plain_memo = None
        # (cache salt or None, LoRA name or None) -> reasons summed
        self._by_tag: dict[tuple, collections.Counter] = {}

    @classmethod
    def for_manager(cls, manager) -> "MissAccountant":
        """An accountant for ``manager`` (a ``KVCacheManager``): probes for the hash
        index with one full-attention group (installs the pool's and the host tier's
        ``drop_listener``); events otherwise (``ValueError`` if the manager was not
        built with ``enable_events=True, int_event_hashes=False``)."""
        from prefixcache.core.kv_cache_manager import HashKVCacheManager  # noqa: PLC0415
        from prefixcache.core.radix import RadixKVCacheManager  # noqa: PLC0415

        impl = getattr(manager, "implementation", manager)
        groups = getattr(manager, "kv_cache_groups", None)
        if cls is MissAccountant and groups is not None:
            index = _group_index(impl)
            if index is not None and probe_refusal(index, groups) is None:
                return GroupProbeAccountant.for_manager(manager)
        radix = type(impl) is RadixKVCacheManager  # (not the sliding-window tree)
        if isinstance(impl, HashKVCacheManager) or radix:
            acct = cls(manager.block_size, manager.hasher)
            pool = impl.block_pool
            if pool.evicted_by is not None:
                raise ValueError("this manager already has a miss accountant attached")
            acct.uses_events = False
            acct._reads_key_maps = False  # (probes ``_pool``'s hash map)
            acct._pool = pool
            pool.evicted_by = acct._dropped
            if radix:
                acct._radix = True
                acct._tree = impl
            tier = impl.host_tier
            if tier is not None:
                acct._tier = tier
                tier.evicted_by = acct._dropped
                if tier.lower is not None:
                    tier.lower.evicted_by = acct._dropped
            return acct
        if not getattr(impl, "enable_events", False):
            raise ValueError(
                f"miss accounting follows the events of a {type(impl).__name__}: build "
                "it with enable_events=True, int_event_hashes=False")
        g, windowed = _tracked_group(groups)
        acct = cls(manager.block_size, manager.hasher, track_group=g, windowed=windowed)
        chain = getattr(impl, "tier_chain", None)
        if chain is not None:  # (a tier of one's own names its evictions by its name)
            acct._medium_tiers = {**_MEDIUM_TIERS, **{t.medium: t.name for t in chain.tiers}}
        return acct

    def _radix_cached(self, request, hit: int, num_full: int, n: int) -> dict:
        """The missed keys the radix tree holds: none, but for the whole-prompt hit a
        lookup cuts to ``num_tokens - 1`` tokens (the tree strands no block: a lookup
        stops at the first block it does not hold)."""
        if hit != num_full - 1 or n != num_full * self.block_size:
            return {}
        from prefixcache.core.radix import _namespace, block_keys  # noqa: PLC0415

        tree = self._tree
        nodes = tree._lookup_nodes(request)
        if len(nodes) != hit:  # (host hits: the last block is not below them in the tree)
            return {}
        parent = nodes[-1] if nodes else tree._roots.get(_namespace(request))
        if parent is None:
            return {}
        key = block_keys(request, hit, num_full, self.block_size, tree._extras(request))[0]
        if key not in parent.children:
            return {}
        return {request.block_hashes[hit]: True}

    def cleared(self) -> None:
        """The prefix cache was reset (a reset is not an eviction for capacity: later
        misses are classified as for a fresh cache)."""
        self._dropped.clear()
        self._extras_content.clear()
        self._plain_next.clear()
        self._pending.clear()
        self._plain_of.clear()
        self._plain_admitted = False

    # -- the cache's state, from the manager's events ---------------------------------
    def observe(self, events: Iterable) -> None:
        dev, host, dropped = self._device, self._host, self._dropped
        group = self.track_group
        for ev in events:
            t = type(ev)
            if t is BlockStored:
                if ev.group_idx != group:
                    continue
                hashes = ev.block_hashes
                if ev.medium == MEDIUM_GPU:
                    dev.update(hashes)
                else:  # (the host tier, or a tier below it: held off the device)
                    host.update(hashes)
                    if ev.medium != MEDIUM_CPU:
                        self._lower_events = True
                if dropped:
                    for k in hashes:
                        dropped.pop(k, None)
            elif t is BlockRemoved:
                if ev.group_idx != group:
                    continue
                counts = dev if ev.medium == MEDIUM_GPU else host
                for k in ev.block_hashes:
                    if counts[k] > 1:
                        counts[k] -= 1
                    else:
                        counts.pop(k, None)
                    if k not in host and k not in dev:
                        dropped[k] = self._medium_tiers.get(ev.medium) or ev.medium.lower()
            elif t is AllBlocksCleared:
                dev.clear()
                host.clear()
                self.cleared()

    # -- classification ------------------------------------------------------------
    def _has_extras(self, request) -> bool:
        return self.hasher is not None and bool(
            request.cache_salt or request.lora is not None or request.mm_features)

    def _digest(self, parent, chunk: bytes) -> bytes:
        """The plain key of one block (its parent's plain key, its token bytes)."""
        key = (parent, chunk)
        nxt = self._plain_next
        d = nxt.get(key)
        if d is None:
            if self._pending and key in self._pending:
                self._materialize(key)
                return nxt[key]
            a = array.array("Q")
            a.frombytes(chunk)
            hasher = self.hasher
            tag = self._plain_tag
            if tag is None:
                tag = self._plain_tag = hasher.plain_block_tag(self.block_size) or ()
            if tag:  # one block, no extra keys: the hasher's decode-path entry
                d = hasher.hash_plain_block(parent or hasher.root, a, tag)
            else:
                d = hasher.hash_token_blocks(a, self.block_size, parent=parent)[0]
            nxt[key] = d
        return d

    def _materialize(self, key) -> None:
        """Hash a pending run's plain keys and register them (``_extras_content``)."""
        parent, tb = self._pending.pop(key)
        w = 8 * self.block_size
        content = self._extras_content
        for off in range(0, len(tb), w):
            d = self._digest(parent, tb[off:off + w])
            content.add(d)
            parent = d

    def _plain_to(self, request, a: int, m: int, tb: bytes | None = None) -> list:
        """The memo ``[request, b0, plain keys of blocks b0.., registration start]``
        with ``b0 <= a`` and the keys known up to block ``m`` (hashed lazily: the parent
        of block ``b0`` is the plain key of the request's own key ``b0 - 1`` when an
        admission registered it, ``_plain_of``). ``tb``: the token bytes from 0 on."""
        memo = self._plain_memo
        if memo is None or memo[0] is not request or memo[1] > a:
            b0 = 0
            parent = None
            if a and self._plain_of:
                po = self._plain_of
                ks = request.block_hashes[:a]
                for j in range(a - 1, -1, -1):
                    d = po.get(ks[j])
                    if d is not None:
                        b0 = j + 1
                        parent = d
                        break
            memo = self._plain_memo = [request, b0, [], None, parent]
        b0, plain = memo[1], memo[2]
        n = b0 + len(plain)
        if n < m:
            bs = self.block_size
            w = 8 * bs
            if tb is None:
                tb = request.token_bytes(n * bs, m * bs)
                base = n * w
            else:
                base = 0
            parent = plain[-1] if plain else memo[4]
            digest = self._digest
            get = self._plain_next.get
            append = plain.append
            for i in range(n, m):
                chunk = tb[i * w - base:(i + 1) * w - base]
                d = get((parent, chunk))
                parent = digest(parent, chunk) if d is None else d
                append(parent)
        return memo

    def _isolated_plain(self, request, a: int, b: int, dev, host, dropped) -> int:
        """Blocks ``a, a+1, ...`` (< ``b``) of a request with extra keys whose plain
        key was ever cached (a prefix of the run: "ever cached" is prefix-closed);
        hashes its plain chain only up to the first block never cached, and notes where
        its admission registers its own plain keys."""
        bs = self.block_size
        tb = request.token_bytes(0, b * bs)
        memo = self._plain_to(request, a, a, tb)
        b0, plain = memo[1], memo[2]
        content = self._extras_content
        w = 8 * bs
        digest = self._digest
        get = self._plain_next.get
        append = plain.append
        parent = plain[a - b0 - 1] if a > b0 else memo[4]
        known = b0 + len(plain)
        # the radix tree: a plain key is cached iff the plain token path reaches it
        depth = self._radix_plain_depth(tb, b) if self._radix else 0
        for p in range(a, b):
            if p < known:
                d = plain[p - b0]
            else:
                chunk = tb[p * w:(p + 1) * w]
                d = get((parent, chunk))
                if d is None:
                    if not self._plain_admitted and (parent, chunk) not in self._pending:
                        memo[3] = p  # never cached (``_plain_admitted``): not hashed
                        return p - a
                    d = digest(parent, chunk)
                append(d)
            if p >= depth and not (d in content or d in dev or d in dropped
                                   or (host and d in host)):
                memo[3] = p  # its admission registers blocks p.. as seen
                return p - a
            parent = d
        return b - a

    def _radix_plain_depth(self, tb: bytes, b: int) -> int:
        """How many of the blocks ``0 .. b - 1`` of token bytes ``tb`` the radix tree
        holds without extra keys (the base model's root, plain token keys)."""
        root = self._tree._roots.get(None)
        if root is None:
            return 0
        w = 8 * self.block_size
        children = root.children
        for p in range(b):
            node = children.get(tb[p * w:(p + 1) * w])
            if node is None:
                return p
            children = node.children
        return b

    def _isolated_keys(self, request, ks, a: int) -> int:
        """Blocks ``a, a+1, ...`` of a request without extra keys (its keys are its
        plain keys: ``ks[i]`` is block ``a + i``'s) that requests with extra keys
        cached (a prefix of the run)."""
        content = self._extras_content
        pending = self._pending
        n = 0
        bs = self.block_size
        for i, k in enumerate(ks):
            if k not in content:
                if not pending:
                    break
                p = a + i
                key = (ks[i - 1] if i else (self._plain_parent(request, a) if p else None),
                       request.token_bytes(p * bs, (p + 1) * bs))
                if key not in pending:
                    break
                self._materialize(key)
                if k not in content:  # pragma: no cover - equal tokens, equal keys
                    break
            n += 1
        return n

    @staticmethod
    def _plain_parent(request, a: int):
        return request.block_hashes[a - 1]

    def _register(self, request) -> None:
        """An admitted request with extra keys computed its missed blocks: their plain
        keys are now cached (under its key). Those hashed by the lookup are registered;
        the rest wait in ``_pending`` until a lookup reaches them."""
        memo = self._plain_memo
        if memo is None or memo[0] is not request or memo[3] is None:
            return  # every missed block was already ever cached (or none missed)
        bs = self.block_size
        num_full = request.num_tokens // bs
        b0, plain, start = memo[1], memo[2], memo[3]
        n = b0 + len(plain)
        if n < num_full:
            parent = plain[-1] if plain else memo[4]
            key = (parent, request.token_bytes(n * bs, (n + 1) * bs))
            if key in self._plain_next or key in self._pending:
                self._plain_to(request, b0, num_full)  # (rare) hash them now
                n = num_full
            else:
                self._pending[key] = (parent, request.token_bytes(n * bs, num_full * bs))
        self._extras_content.update(plain[start - b0:num_full - b0])
        # its own keys -> their plain keys: a later request hitting them starts there
        self._plain_of.update(zip(request.block_hashes[b0:n], plain))

    def lookup(self, request, num_hit_tokens: int) -> dict[str, int]:
        """The reasons of ``request``'s missed blocks for a lookup that hit
        ``num_hit_tokens`` (call it before ``allocate_slots``; no totals changed)."""
        return self.classify(request, num_hit_tokens)

    def classify(self, request, num_hit_tokens: int) -> dict[str, int]:
        """The reasons of ``request``'s missed prompt blocks (no totals changed)."""
        bs = self.block_size
        n = request.num_tokens
        num_full = n // bs
        hit = num_hit_tokens // bs
        reasons: dict[str, int] = {}
        if num_full > hit:
            extras = self._has_extras(request)
            memo = self._plain_memo
            if memo is not None and memo[0] is request:
                memo[3] = None  # (a lookup again: this one decides what is registered)
            if self._reads_key_maps:
                dev, host = self._device, self._host
            else:
                pool = self._pool
                if pool.evicted_by is not self._dropped:  # the pool was reset
                    self.cleared()
                    self._dropped = pool.evicted_by
                if self._radix:
                    dev = self._radix_cached(request, hit, num_full, n)
                else:
                    dev = pool.cached_block_hash_to_block
                tier = self._tier
                host = (() if tier is None else tier.hash_to_slot if tier.lower is None
                        else _ChainKeys(tier.hash_to_slot, tier.lower))
            dropped = self._dropped
            content = self._extras_content
            lost = self._lost.get(request.request_id, 0) if self._lost else 0
            windowed = self.windowed
            # NOTE: one slice (the view's per-item indexing is a Python-level call).
            ks = request.block_hashes[hit:num_full]
            # A block is cached only with every block before it (its key chains its
            # parent's), so "ever cached" (cached now, or evicted) is a prefix of the
            # run: its length ``ever``, by bisection (a dict of every evicted key is
            # large: each probe is a cache miss). The blocks past it were never cached.
            lo, hi = 0, len(ks)
            if dropped or dev or host:
                while lo < hi:
                    mid = (lo + hi) // 2
                    k = ks[mid]
                    if k in dropped or k in dev or (host and k in host):
                        lo = mid + 1
                    else:
                        hi = mid
            ever = lo
            # (a sliding-window group may cache a block whose parent it never cached:
            # there the prefix rule holds for the evicted keys only, so all are checked)
            head = ks if (windowed or ever == len(ks)) else ks[:ever]
            if (not lost and dev.keys().isdisjoint(head)
                    and (not host or host.isdisjoint(head) if type(host) is set
                         else not host or host.keys().isdisjoint(head))):
                # The common case: no missed block is cached (only the first ``ever``
                # can be), so each one is classified alone (no chain): the ever-cached
                # ones were evicted.
                ne = lo
                if ne and (self._lower_events or self._tier is not None
                           and self._tier.lower is not None):
                    for t, c in collections.Counter(
                            map(dropped.__getitem__, ks[:ne])).items():
                        reasons[_sub_name(t)] = c
                    reasons["evicted"] = ne
                elif ne:
                    nh = (list(map(dropped.__getitem__, ks[:ne])).count("host")
                          if self._tier is not None or self._reads_key_maps else 0)
                    if ne - nh:
                        reasons["evicted_device"] = ne - nh
                    if nh:
                        reasons["evicted_host"] = nh
                    reasons["evicted"] = ne
                rest = len(ks) - ne
                if rest:
                    if extras:  # the same tokens cached under another key (or registered)
                        ni = self._isolated_plain(request, hit + ne, num_full, dev, host,
                                                  dropped)
                    elif content or self._pending:
                        ni = self._isolated_keys(request, ks[ne:] if ne else ks, hit + ne)
                    else:
                        ni = 0
                    if rest - ni:
                        reasons["cold"] = rest - ni
                    if ni:
                        reasons["isolated"] = ni
                if n > num_full * bs:
                    reasons["partial"] = 1
                return reasons
            hashes = ks
            plain = None
            depth = 0
            if extras:  # (the general path: the whole plain chain, registered as before)
                if self._radix:
                    depth = self._radix_plain_depth(
                        request.token_bytes(0, num_full * bs), num_full)
                memo = self._plain_to(request, hit, num_full)
                memo[3] = hit
                plain = memo[2]
                b0 = memo[1]
            elif self._pending:  # requests with extra keys' runs this one may reach
                for i in range(hit, num_full):
                    key = (hashes[i - hit - 1] if i > hit else (
                        self._plain_parent(request, i) if i else None),
                        request.token_bytes(i * bs, (i + 1) * bs))
                    if key in self._pending:
                        self._materialize(key)
            chain_reason = None  # the reason of the first missed block
            chain_sub = None  # and its tier, when it was evicted
            for i in range(hit, num_full):
                k = hashes[i - hit]
                if k in dev or k in host:
                    if i == num_full - 1 and n == num_full * bs and i == hit:
                        r = "last_token"
                    elif i < lost:
                        r = "preempted"
                    elif chain_reason is not None:
                        r = chain_reason
                        if chain_sub is not None:  # evicted upstream: by the same tier
                            reasons[chain_sub] += 1
                    elif windowed:
                        r = "window"
                    else:
                        raise AssertionError(
                            f"request {request.request_id!r}: block {i} is cached and "
                            f"reachable but the lookup hit only {hit} blocks: the "
                            "accountant and the manager disagree (were all events observed?)")
                    if windowed:  # cached: the break is upstream (or the window)
                        reasons[r] = reasons.get(r, 0) + 1
                        continue
                elif i < lost:
                    r = "preempted"
                elif k in dropped:
                    r = "evicted"
                    d = _sub_name(dropped[k])
                    reasons[d] = reasons.get(d, 0) + 1
                    if chain_reason is None or windowed:
                        chain_sub = d
                elif plain is None:
                    r = "isolated" if k in content else "cold"
                else:
                    pk = plain[i - b0]
                    r = "isolated" if (pk in content or pk in dev or pk in host
                                       or pk in dropped or i < depth) else "cold"
                if chain_reason is None or windowed:
                    chain_reason = r
                    if r != "evicted":
                        chain_sub = None
                reasons[r] = reasons.get(r, 0) + 1
        if n > num_full * bs:
            reasons["partial"] = reasons.get("partial", 0) + 1
        return reasons

    def preempted(self, request) -> None:
        """``request`` is being preempted (before its blocks are freed): its computed
        full blocks are ``preempted`` misses at its re-admission."""
        lost = request.num_computed_tokens // self.block_size
        if lost > self._lost.get(request.request_id, 0):
            self._lost[request.request_id] = lost

    def forget(self, request) -> None:
        """``request`` finished: drop its preemption record (if any)."""
        if self._lost:
            self._lost.pop(request.request_id, None)

    def admit(self, request, num_hit_tokens: int, reasons=None) -> dict[str, int]:
        """Add an admitted request's reasons to the totals (``reasons``: what
        ``lookup`` answered; ``None``: classified now) and (a request with extra keys)
        register its tokens' plain keys. Returns its reasons."""
        if reasons is None:
            reasons = self.classify(request, num_hit_tokens)
        if self._has_extras(request):
            self._register(request)
        else:
            self._plain_admitted = True
        self._plain_memo = None
        if self._lost:
            self._lost.pop(request.request_id, None)
        lora = request.lora
        tag = (request.cache_salt or None, None if lora is None else lora.name)
        c = self._by_tag.get(tag)
        if c is None:
            c = self._by_tag[tag] = collections.Counter()
        c.update(reasons)
        return reasons

    @property
    def totals(self) -> collections.Counter:
        """Every admission's reasons (and evicted sub-counts) summed."""
        out: collections.Counter = collections.Counter()
        for c in self._by_tag.values():
            out.update(c)
        return out

    def _per(self, pos: int) -> dict[Any, collections.Counter]:
        out: dict[Any, collections.Counter] = {}
        for tag, c in self._by_tag.items():
            out.setdefault(tag[pos], collections.Counter()).update(c)
        return out

    @property
    def per_tenant(self) -> dict[Any, collections.Counter]:
        """Reasons summed per cache salt (``None``: no salt)."""
        return self._per(0)

    @property
    def per_adapter(self) -> dict[Any, collections.Counter]:
        """Reasons summed per LoRA name (``None``: the base model)."""
        return self._per(1)

    @property
    def num_missed_blocks(self) -> int:
        """Missed blocks over all admissions (the reasons' sum)."""
        t = self.totals
        return sum(t[r] for r in REASONS)

    def summary(self) -> dict[str, Any]:
        """Totals (every reason, zeros included), and the breakdowns by tenant (cache
        salt; ``""`` = no salt) and adapter (LoRA name; ``""`` = base model)."""
        totals = self.totals
        return {
            "missed_blocks": sum(totals[r] for r in REASONS),
            "reasons": full_reasons(totals),
            "per_tenant": {("" if k is None else k): full_reasons(v)
                           for k, v in self.per_tenant.items()},
            "per_adapter": {("" if k is None else k): full_reasons(v)
                            for k, v in self.per_adapter.items()},
        }


def full_reasons(c: Mapping[str, int]) -> dict[str, int]:
    """Every reason and evicted sub-count of ``c``, zeros included."""
    d = {r: int(c.get(r, 0)) for r in REASONS}
    for r in EVICTED_BY:
        d[r] = int(c.get(r, 0))
    for r, n in c.items():  # the tiers below the host's sub-counts, when present
        if r not in d and n:
            d[r] = int(n)
    return d


def sum_summaries(summaries: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """``MissAccountant.summary()`` dicts summed (the replicas of a cluster): totals,
    per tenant and per adapter, every reason, zeros included."""
    totals: collections.Counter = collections.Counter()
    per: dict[str, dict[str, collections.Counter]] = {"per_tenant": {}, "per_adapter": {}}
    for sm in summaries:
        totals.update(sm["reasons"])
        for part, out in per.items():
            for k, v in sm[part].items():
                out.setdefault(k, collections.Counter()).update(v)
    return {
        "missed_blocks": sum(totals[r] for r in REASONS),
        "reasons": full_reasons(totals),
        **{part: {k: full_reasons(v) for k, v in out.items()} for part, out in per.items()},
    }



# -- probes for the hybrid coordinator (the engine with sliding-window layers) ---------
def probe_refusal(index, kv_cache_groups) -> str | None:
    """Why a manager with this index and layout cannot be followed by probes (the
    engine's miss accounting: its KV events belong to the KV-event publisher), or
    ``None``: the hash or radix index of one full-attention group
    (``MissAccountant.for_manager``), or the hash or radix index of a layout of
    full-attention and sliding-window groups with a full-attention group
    (``GroupProbeAccountant``). The one rule."""
    from prefixcache.core.indexes import DEFAULT_INDEX  # noqa: PLC0415
    from prefixcache.core.kv_groups import (  # noqa: PLC0415
        FullAttentionSpec, SlidingWindowSpec, is_hybrid)

    if kv_cache_groups is None or not is_hybrid(tuple(kv_cache_groups)):
        if index in (DEFAULT_INDEX, "radix"):
            return None
        return (f"index={index!r}: miss reasons probe the hash or radix index (one "
                "full-attention group)")
    kinds = sorted({type(g.spec).__name__ for g in kv_cache_groups
                    if not isinstance(g.spec, (FullAttentionSpec, SlidingWindowSpec))})
    if index not in (DEFAULT_INDEX, "radix"):
        return (f"index={index!r} with sliding-window layers: miss reasons probe the "
                "hash or radix index of a layout of full-attention and sliding-window "
                "groups")
    if kinds:
        return (f"{', '.join(kinds)} groups: miss reasons probe full-attention and "
                "sliding-window groups only (state checkpoints are not probed)")
    if not any(isinstance(g.spec, FullAttentionSpec) for g in kv_cache_groups):
        return ("only sliding-window groups: miss reasons probe the hash map of a "
                "full-attention group")
    return None


class _GroupKeys:
    """The digests one group holds in a ``(hash, group)``-keyed map, as the set the
    events mode keeps (``k in view``, ``view.keys().isdisjoint(ks)``); the map is
    re-read on every call (a reset replaces it)."""

    __slots__ = ("_owner", "_attr", "_suffix")

    def __init__(self, owner, attr: str, suffix: bytes):
        self._owner, self._attr, self._suffix = owner, attr, suffix

    def __contains__(self, k) -> bool:
        return k + self._suffix in getattr(self._owner, self._attr)

    def __len__(self) -> int:  # (a truth test: whether the map holds anything)
        return len(getattr(self._owner, self._attr))

    def keys(self):
        return self

    def isdisjoint(self, ks) -> bool:
        m = getattr(self._owner, self._attr)
        s = self._suffix
        for k in ks:
            if k + s in m:
                return False
        return True


class _TierKeys:
    """The keys a host tier and the tiers below it hold now (``held``: a ``_ChainKeys``
    made on each read, the tier's map being replaced by a reset), as ``_GroupKeys``'
    owner."""

    __slots__ = ("_tier",)

    def __init__(self, tier):
        self._tier = tier

    @property
    def held(self) -> _ChainKeys:
        return _ChainKeys(self._tier.hash_to_slot, self._tier.lower)


class GroupEvictions:
    """The ``evicted_by`` hook of a hybrid pool and its host tier (``hook[key] = tier``,
    as ``BlockPool.evicted_by``): keeps the evictions of one group's ``(hash, group)``
    keys as ``digest -> tier`` in ``dropped`` (the accountant's dict); the other groups'
    are ignored."""

    __slots__ = ("dropped", "_suffix", "_n")

    def __init__(self, dropped: dict, suffix: bytes):
        self.dropped, self._suffix, self._n = dropped, suffix, len(suffix)

    def __setitem__(self, key: bytes, tier: str) -> None:
        if key.endswith(self._suffix):
            self.dropped[key[:-self._n]] = tier

    def replay(self, hook: dict) -> None:
        """Take the entries of a plain hook (a dict ``key -> tier``), in order."""
        for k, t in hook.items():
            self[k] = t


class GroupProbeAccountant(MissAccountant):
    """Miss reasons for a layout of full-attention and sliding-window groups, by
    probes: no events, so the manager's KV events stay the KV-event publisher's. The
    first full-attention group is followed as in events mode (``_tracked_group``).

    * The hash index (``core/hybrid.py``): its digests are probed in the pool's
      ``(hash, group)`` map and the host tier's (and the tiers' below it).
    * The radix index (``core/radix_hybrid.py``): a full-attention group holds a block
      on every node, so its cached missed blocks are the lookup's walked path past the
      hit (and, for the whole-prompt hit cut to ``num_tokens - 1`` tokens, the last
      block's node); plain keys are probed on the tree as for one group.

    Evictions come from the ``evicted_by`` hook of the pool / tree: a plain dict of
    the tracked group's digests, which the pool (``evicted_suffix``) or tree
    (``evicted_group``) filters itself; with a host tier, a ``GroupEvictions`` that
    the pool and the tier both feed ``(hash, group)`` keys. A block cached there but
    past the aligned hit is a ``window`` miss, as the replay gives it. Equal to the events mode (tested against
    the replay)."""

    _tree = None  # the radix index: the manager (its tree is walked per lookup)

    @classmethod
    def for_manager(cls, manager) -> "GroupProbeAccountant":
        from prefixcache.core.groups.base import group_suffix  # noqa: PLC0415

        impl = getattr(manager, "implementation", manager)
        index = _group_index(impl)
        tree = index == "radix"
        if index is None:
            raise ValueError(
                "GroupProbeAccountant probes the hash or radix index of a hybrid layout "
                "(HybridKVCacheManager, RadixHybridKVCacheManager), not a "
                f"{type(impl).__name__}")
        groups = impl.kv_cache_groups
        why = probe_refusal(index, groups)
        if why is not None:
            raise ValueError(why)
        pool = impl.block_pool
        if pool.evicted_by is not None:
            raise ValueError("this manager already has a miss accountant attached")
        g, windowed = _tracked_group(groups)
        acct = cls(manager.block_size, manager.hasher, track_group=g, windowed=windowed)
        acct.uses_events = False
        suffix = group_suffix(g)
        acct._hpool = pool
        acct._tier = impl.host_tier
        # No host tier: the pool / tree records the tracked group's digests itself
        # (``evicted_suffix`` / ``evicted_group``: no Python call per eviction); with
        # one, device and host tier both feed a filtering hook (``GroupEvictions``).
        if acct._tier is None:
            acct._hook = None
            if tree:
                impl.evicted_group = g
            else:
                pool.evicted_suffix = suffix
        else:
            acct._hook = GroupEvictions(acct._dropped, suffix)
        if tree:
            acct._tree = impl  # (``_radix``: plain keys probed on the tree)
            acct._radix = True
        else:
            acct._device = _GroupKeys(pool, "cached_block_hash_to_block", suffix)
        tier = acct._tier
        acct._host = (() if tier is None
                      else _GroupKeys(tier, "hash_to_slot", suffix) if tier.lower is None
                      else _GroupKeys(_TierKeys(tier), "held", suffix))
        acct._install()
        return acct

    def _install(self) -> None:
        if self._hook is None:
            self._hpool.evicted_by = self._dropped
            return
        self._hpool.evicted_by = self._hook
        if self._tier is not None:
            self._tier.evicted_by = self._hook
            if self._tier.lower is not None:
                self._tier.lower.evicted_by = self._hook

    def observe(self, events: Iterable) -> None:
        raise TypeError("GroupProbeAccountant probes the manager: it takes no events")

    def classify(self, request, num_hit_tokens: int) -> dict[str, int]:
        hook = self._hpool.evicted_by
        if self._hook is None:
            if hook is not self._dropped:  # the pool was reset: its new dict is the record
                self.cleared()
                self._dropped = hook
        elif hook is not self._hook:  # the pool was reset (it holds a new plain hook)
            self.cleared()
            self._hook.dropped = self._dropped
            self._hook.replay(hook)  # (evictions since the reset, if any)
            self._install()
        if self._tree is not None:
            self._device = self._tree_cached(request, num_hit_tokens)
        # NOTE: ``MissAccountant.classify`` reads ``_device`` / ``_host`` (``_reads_key_maps``),
        # which are the probes here (and takes ``_dropped`` as a dict).
        return super().classify(request, num_hit_tokens)

    def _tree_cached(self, request, num_hit_tokens: int) -> dict:
        """The request's missed keys the tree's full-attention group holds: the walked
        path past the hit, and the last block's node when the walk stopped short of it
        (a lookup walks at most ``num_tokens - 1`` tokens)."""
        from prefixcache.core.radix import _namespace, block_keys  # noqa: PLC0415

        tree = self._tree
        bs = self.block_size
        n = request.num_tokens
        num_full = n // bs
        hit = num_hit_tokens // bs
        if num_full <= hit:
            return {}
        nodes = tree._lookup_nodes(request)
        ks = request.block_hashes
        out = dict.fromkeys(ks[hit:len(nodes)], True)
        last = num_full - 1
        if len(nodes) == last and n == num_full * bs:
            parent = nodes[-1] if nodes else tree._roots.get(_namespace(request))
            if parent is not None:
                key = block_keys(request, last, num_full, bs, tree._extras(request))[0]
                if key in parent.children:
                    out[ks[last]] = True
        return out
