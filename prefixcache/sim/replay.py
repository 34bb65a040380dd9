"""Replay a request trace through ``KVCacheManager`` at full speed, without a model.

The semantics are exactly those of ``experiments/peers/vllm_replay.py`` (which drives
vLLM 0.33's own manager), so the two can be compared request by request:

for each request, in trace order:
  1. If ``concurrency`` requests are running, free the oldest.
  2. Build the ``Request`` (hashes the prompt's full blocks).
  3. Admission: ``get_computed_blocks`` then one ``allocate_slots`` for the whole
     rest of the prompt. If it does not fit, free the oldest running request and
     retry; with none running, record the request as failed and skip it.
  4. The prefill step samples output token 0 (``num_computed_tokens`` becomes the
     prompt length, token 0 is appended).
  5. ``output_len - 1`` decode steps: ``allocate_slots(req, 1)``, then
     ``num_computed_tokens += 1`` and append ``output_token(id, step)``. The last
     sampled token is never fed back, so its KV is never allocated. A decode
     allocation that fails frees the oldest *other* running request and retries,
     or (none left) stops the request's decode early (``decode_truncated_at``).
  6. A request holds its blocks until it is the oldest of a full window; at the
     end every running request is freed.

With ``free_order="unhashed_first"`` and ``num_blocks = N - 1`` this gives vLLM's hits
and block ids (vLLM's are ours + 1: it reserves block 0) for ``--num-blocks N``.

Memory is bounded by the window and the cache: the trace is consumed as a stream
and per-request records are handed to ``on_record``, never kept.

Eviction policies (``eviction=``, ``prefixcache.core.eviction.POLICIES``): the default
``"lru"`` is vLLM's order (the manager's fast path, unchanged). The offline bound
``"belady"`` needs the future, so the replay reads the trace twice: pass 1 hashes every
prompt's full blocks (same hasher, root, block size, salt, LoRA and multimodal keys as
the replay) into a compact ``TraceFuture`` (per distinct hash, the int32 indices of
the requests holding it), pass 2 replays, calling ``manager.on_arrival(request, i)``
before each request's lookup. For it, ``requests`` must be re-iterable (a list) or a
zero-arg callable returning a fresh iterator each call (e.g. ``lambda:
read_trace(path)``: streams twice, memory stays bounded).

The waiting queue (``eviction="queue_aware"``, or any policy with ``needs_waiting``): the
replay runs one request at a time, so its queue is a look-ahead: before request ``i``'s
lookup the requests ``i .. i + queue_depth`` (default ``concurrency``) have been
announced to the manager (``on_waiting`` with the prompt blocks a lookup can adopt),
and each admission drops its own request; a failed request is dropped too. Other
policies never build the look-ahead (the default path is unchanged).

A time-varying policy (``needs_time``: ``ttl_lru``) is told the clock before each
request's lookup: the request's ``timestamp`` (seconds; a policy counting seconds
refuses a request without one) and its index in the trace (steps). Other policies: no
clock.

Cache memory: the summary reports the blocks in the cache (held or free, cached under
a hash) sampled after every admission (``peak_cached_blocks``, ``mean_cached_blocks``;
in bytes with ``model=``), and ``stranded_blocks``: cached blocks no lookup can reach
because an earlier block of their chain is not cached, counted once at the end
(freeing drops no hash, so before or after the final frees is the same count; a
per-request peak would cost O(cached blocks) per sample and is not kept).

Hash ids as block keys (opt-in, by how the trace is read): a request whose prompt is a
`MooncakePrompt` (``read_trace(..., mooncake_tokens="lazy")``: Mooncake's 512-token
ids, Qwen-Bailian's 16, Claude Code's 64), without LoRA, multimodal items or salt, at a
block size dividing the prompt's ``block_tokens``, gets its prompt's full
blocks keyed by the hash ids (``BlockHasher.hash_keyed_blocks`` over (hash id, block
within the id)) instead of digests of the expanded tokens; only the last partial
block's tokens are materialised (the blocks it starts, which decode fills, are hashed
from tokens as usual; the other prompt tokens are zeros nobody reads). Equal hash ids
at equal chain positions are equal token blocks, so hits, evictions and records equal
the token path's (tests check both Mooncake traces); the digests themselves are not
vLLM's. Any other prompt takes the token path, and so does every prompt under an
index that keys blocks by their tokens (`KEYS_BY_BLOCK_HASH = False`: the radix tree).
"""

from __future__ import annotations

import collections
import gc
import time
import zlib
from typing import Any, Callable, Iterable

import numpy as np

from prefixcache._validate import check_bool, check_count, check_hash_seed, check_positive_int
from prefixcache.core.cache_config import UNSET, CacheConfig, resolve
from prefixcache.core.eviction import (
    TraceFuture,
    get_policy_class,
    policy_clock,
    policy_name,
    reads_waiting_queue,
)
from prefixcache.core.hashing import BlockHasher
from prefixcache.core.indexes import DEFAULT_INDEX, get_index_class, index_name
from prefixcache.core.kv_cache_manager import KVCacheManager
from prefixcache.core.kv_groups import is_hybrid, needs_aligned_prefill
from prefixcache.core.request import LoRARequest, MultiModalFeature, Request
from prefixcache.sim.cost_model import ModelShape
from prefixcache.sim.trace import MooncakePrompt, TraceRequest


def _hash_id_inputs(tr: TraceRequest, block_size: int, *, keyed_index: bool = True
                    ) -> tuple[np.ndarray, list[bytes]] | None:
    """For the hash-id path (module docstring): the Request's tokens (zeros, but the
    last partial block's real ids) and one key per full prompt block (8 bytes of the
    hash id, 2 of the block's index within it); None when the token path applies
    (also for an index that keys blocks by their tokens: ``keyed_index=False``)."""
    prompt = tr.prompt
    if (
        not keyed_index
        or type(prompt) is not MooncakePrompt
        or prompt.block_tokens % block_size
        or tr.lora is not None
        or tr.mm
        or tr.cache_salt
    ):
        return None
    n = len(prompt)
    n_full = n // block_size
    per = prompt.block_tokens // block_size
    ids = prompt.hash_ids
    # NOTE: ids masked to 64 bits as the token expansion does (mooncake_tokens).
    keys = [
        (ids[b // per] & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
        + (b % per).to_bytes(2, "little")
        for b in range(n_full)
    ]
    tokens = np.zeros(n, dtype=np.uint64)
    if n_full * block_size < n:
        tokens[n_full * block_size :] = prompt[n_full * block_size :]
    return tokens, keys


def trace_future(requests: Iterable[TraceRequest], hasher: BlockHasher,
                 block_size: int, *, keyed_index: bool = True) -> TraceFuture:
    """Pass 1 of a ``belady`` replay: next uses of every prompt block hash.

    Args:
        requests: the trace, in arrival order (consumed once, streamed).
        hasher: the replay's hasher (same algorithm and root).
        block_size: tokens per block.
        keyed_index: the replay's index finds blocks by hash alone (hash-id prompts
            then keyed by their hash ids, as the replay does).
    """
    return TraceFuture.from_hashes(
        _prompt_hashes(tr, hasher, block_size, keyed_index) for tr in requests)


def _prompt_hashes(tr: TraceRequest, hasher: BlockHasher, block_size: int,
                   keyed_index: bool) -> list[bytes]:
    """The full prompt blocks' hashes the replay's ``Request`` for ``tr`` gets (hash-id
    prompts keyed by their hash ids, as the replay does)."""
    keyed = _hash_id_inputs(tr, block_size, keyed_index=keyed_index)
    if keyed is not None:
        return hasher.hash_keyed_blocks(keyed[1])
    return hasher.hash_token_blocks(tr.prompt, block_size, lora=tr.lora,
                                    mm_features=tr.mm, cache_salt=tr.cache_salt)


def _announce_waiting(requests: Iterable[TraceRequest], depth: int, on_waiting: Callable,
                      hasher: BlockHasher, block_size: int, keyed_index: bool):
    """The trace, in order, with the waiting queue a ``needs_waiting`` policy reads:
    each request is announced (``on_waiting(id, prompt block hashes)``) when it enters
    a look-ahead of ``depth`` requests, so when request ``i`` is yielded requests
    ``i .. i + depth`` are waiting (``i``'s admission drops it in the manager)."""
    buf: collections.deque = collections.deque()
    for tr in requests:
        # NOTE: only the blocks a lookup can adopt (at most num_tokens - 1 tokens): a
        # prompt that is exactly its cached blocks computes its last block again.
        hashes = _prompt_hashes(tr, hasher, block_size, keyed_index)
        on_waiting(tr.id, hashes[: (len(tr.prompt) - 1) // block_size])
        buf.append(tr)
        if len(buf) > depth:
            yield buf.popleft()
    while buf:
        yield buf.popleft()


def _clocked(requests: Iterable[TraceRequest], set_time: Callable):
    """The trace, in order, telling a time-varying policy (``needs_time``) the clock
    before each request reaches the loop: its arrival ``timestamp`` (seconds; ``None``
    without one) and its index in the trace (the step)."""
    for i, tr in enumerate(requests):
        set_time(tr.timestamp, i)
        yield tr


class _Residency:
    """The replay's feed of a ``ResidencyTracker`` (``residency=``): the manager's KV
    events, each admission's hit blocks, each finished request's blocks, on the replay's
    clock (the request's ``timestamp`` in seconds, or its index in the trace when it has
    none). Built only when asked for: the default loop never calls it."""

    def __init__(self, m, sample_rate: float, block_size: int, *, int_keys: bool):
        from prefixcache.core import residency as _residency  # noqa: PLC0415
        from prefixcache.core.block_pool import _bytes_block_hash, _int_block_hash  # noqa: PLC0415

        self.tracker = _residency.ResidencyTracker(sample_rate)
        self.hit_media = _residency.hit_media
        self.m = m
        self.take = m.take_events
        self.key = _int_block_hash if int_keys else _bytes_block_hash  # the events' form
        self.block_size = block_size
        self.now = 0.0
        self.seconds = self.steps = 0

    def clocked(self, requests):
        for i, tr in enumerate(requests):
            self.drain()  # what the previous request's decode and frees did, at its time
            if tr.timestamp is None:
                self.now = float(i)
                self.steps += 1
            else:
                self.now = float(tr.timestamp)
                self.seconds += 1
            yield tr

    def drain(self) -> list:
        events = self.take()
        self.tracker.on_events(events, self.now)
        return events

    def admitted(self, allocate_slots):
        m, bs = self.m, self.block_size
        tiered = m.num_host_blocks > 0

        def allocate(req, num_new_tokens, num_hit=0, computed=None):
            before = m.host_hit_tokens if tiered else 0
            out = allocate_slots(req, num_new_tokens, num_hit, computed)
            if out is not None and num_hit:  # an admission's hits (not a retried lookup)
                key = self.key
                keys = [key(h) for h in req.block_hashes[:num_hit // bs]]
                # NOTE: before this allocation's events are drained: a host (disk, ...)
                # hit is counted on its residency in that tier, which the promotion
                # then ends. Each hit counts on the tier it came from.
                if computed is not None:
                    media = self.hit_media(computed)
                    self.tracker.on_hit_run(keys, media, self.now)
                else:
                    n_host = (m.host_hit_tokens - before) // bs if tiered else 0
                    self.tracker.on_hits(keys[:len(keys) - n_host], self.now)
                    if n_host:
                        self.tracker.on_hits(keys[len(keys) - n_host:], self.now,
                                             medium="CPU")
            self.drain()
            return out
        return allocate

    def released(self, free):
        def release(req):
            key = self.key
            keys = [key(h) for h in req.block_hashes]
            free(req)
            self.drain()
            self.tracker.on_release(keys, self.now)
        return release

    def summary(self) -> dict:
        self.drain()
        self.tracker.finish(self.now)
        out = self.tracker.summary()
        out["clock"] = ("seconds" if self.seconds and not self.steps else
                        "requests" if not self.seconds else "mixed")
        return out


def _reuse(requests: int, prompt: int, hits: int) -> dict:
    return {"requests": requests, "prompt_tokens": prompt, "hit_tokens": hits,
            "hit_rate_tokens": hits / prompt if prompt else 0.0}


def _breakdown(tagged: dict, requests: int, prompt: int, hits: int) -> dict:
    """``per_tenant`` (by cache salt) and ``per_adapter`` (by LoRA name) reuse.

    Keys are the salt / adapter name; ``""`` holds the requests without one. Each
    value: ``requests``, ``prompt_tokens`` (failed requests included, as the totals),
    ``hit_tokens``, ``hit_rate_tokens``. The values of either breakdown sum to the
    totals.
    """
    out = {}
    for name, pos in (("per_tenant", 0), ("per_adapter", 1)):
        groups: dict[str, list[int]] = {}
        for key, counts in tagged.items():
            if key[pos]:
                g = groups.setdefault(key[pos], [0, 0, 0])
                for i in range(3):
                    g[i] += counts[i]
        rest = [requests, prompt, hits]  # "": the requests without a salt / adapter
        for g in groups.values():
            rest = [r - x for r, x in zip(rest, g)]
        groups[""] = rest
        out[name] = {k: _reuse(*groups[k]) for k in sorted(groups) if groups[k][0]}
    return out


def replay(
    requests: Iterable[TraceRequest] | Callable[[], Iterable[TraceRequest]],
    *,
    cache_config: CacheConfig | None = None,
    num_blocks: int = UNSET,
    block_size: int = UNSET,
    hash_algo: str = UNSET,
    hash_seed: Any = UNSET,
    free_order: str = UNSET,
    concurrency: int = 1,
    max_model_len: int | None = UNSET,
    on_record: Callable[[dict], None] | None = None,
    record_evictions: bool = False,
    progress: bool = False,
    total: int | None = None,
    eviction: str = UNSET,
    eviction_options: dict | None = UNSET,
    index: str = UNSET,
    model: str | None = None,
    kv_cache_groups=UNSET,
    num_host_blocks: int = UNSET,
    host_eviction: str = UNSET,
    enable_caching: bool = UNSET,
    host_eviction_options: dict | None = UNSET,
    miss_reasons: bool = False,
    queue_depth: int | None = None,
    residency: float | None = None,
) -> dict:
    """Replay ``requests`` through a fresh ``KVCacheManager``; see the module docstring.

    Args:
        requests: the trace, in arrival order (any iterable; consumed once), or a
            zero-arg callable returning one.
        cache_config: the cache (``prefixcache.CacheConfig``); the cache keywords
            below (``num_blocks`` ... ``host_eviction_options``, ``enable_caching``)
            override its fields when given, or build it alone. ``kv_cache_bytes`` needs
            ``model`` (the bytes of one block). ``belady`` reads it twice: a list (or
            other re-iterable) or a callable, not a one-shot iterator.
        num_blocks: allocatable KV cache blocks.
        block_size: tokens per block.
        hash_algo: block hash algorithm (``sha256``, ``sha256_cbor``, ``xxhash``,
            ``xxhash_cbor``).
        hash_seed: seed of the hash chain root (``None``: ``BlockHasher``'s default).
        free_order: ``"append"`` (the seed's) or ``"unhashed_first"`` (vLLM's).
        concurrency: most requests holding blocks at once (>= 1).
        max_model_len: passed to the manager (``None``: no limit).
        on_record: called with one dict per request, in trace order: ``id``,
            ``num_computed_tokens`` (hit tokens at admission), ``block_ids`` (right
            after the prompt allocation), ``prompt_tokens``, plus ``failed: True`` or
            ``decode_truncated_at: step`` when they happen. Key order matches vLLM's
            replay output.
        record_evictions: add ``evictions_so_far`` to admitted requests' records:
            cached blocks evicted so far, up to and including this request's prompt
            allocation (as vLLM's replay with ``--events``).
        progress: show a tqdm progress bar.
        total: the number of requests, when known in advance (the bar's total and
            ETA); ``None``: a bar without a total.
        queue_depth: with a policy that reads the waiting queue (``needs_waiting``:
            ``queue_aware``), the replay's waiting queue: before request ``i``'s lookup
            the next ``queue_depth`` requests of the trace are waiting (announced to
            the policy with their prompt block hashes; admission drops them). ``None``:
            ``concurrency``. Any other policy: must be ``None``.
        miss_reasons: classify every missed prompt block (``prefixcache.core.misses``):
            records get ``miss_reasons`` (reason -> blocks), the summary
            ``miss_reasons`` (totals, per tenant, per adapter). Off: no cost.
        residency: block residency statistics (``prefixcache.core.residency``): the
            share of block hashes tracked, in (0, 1] (1.0: every block; vLLM samples
            0.01). The summary gets ``residency``: per tier, histograms of
            ``lifetime``, ``idle_before_evict``, ``reuse_gap`` and
            ``hits_per_residency``, on the replay's clock (a request's ``timestamp``
            in seconds, or its index in the trace without one: ``clock``). One
            full-attention group only. ``None``: off, no cost.
        eviction: the eviction policy (``prefixcache.core.eviction.POLICIES``).
        eviction_options: the policy's options (``belady``'s ``future`` is built
            here; passing one is an error).
        index: the prefix index (``prefixcache.core.indexes.INDEXES``) or an index
            class (``CacheConfig.index``); the summary shows its name.
        model: a ``prefixcache.sim.cost_model.MODEL_PRESETS`` name: report the cache
            memory in bytes too (``kv_bytes_per_token * block_size`` per block).
        kv_cache_groups: the model's KV cache groups (``prefixcache.core.kv_groups``;
            ``None``: one full-attention group). With a sliding-window group the
            manager is the hybrid one and records' ``block_ids`` hold one list per
            group (null slots: id ``num_blocks``), as vLLM's replay with
            ``--kv-groups``.
        num_host_blocks: host-tier slots under the device cache (0: none; see
            ``prefixcache/core/host_tier.py``). ``hit_tokens`` then counts device and
            host hits (every prompt token not recomputed).
        host_eviction: the host tier's policy (a ``POLICIES`` name but ``belady``).

    Returns:
        Summary dict: ``requests``, ``admitted``, ``failed``, ``decode_truncated``,
        ``early_finishes``, ``prompt_tokens``, ``output_tokens`` (tokens appended),
        ``hit_tokens``, ``hit_rate_tokens`` (over all prompt tokens),
        ``hit_rate_tokens_admitted``, ``requests_with_hit``, ``per_tenant`` /
        ``per_adapter`` (reuse by ``cache_salt`` / by LoRA name: ``{name:
        {requests, prompt_tokens, hit_tokens, hit_rate_tokens}}``, ``""`` for the
        requests without one; each sums to the totals), ``evictions``,
        ``blocks_cached``, the configuration, and ``timing``: ``loop_s`` (the replay
        loop incl. building requests and hashing; not reading the trace or computing
        the deterministic output tokens), ``hashing_s`` (request construction +
        appending tokens, i.e. prompt and incremental hashing), ``manager_s`` (the
        manager calls, plus advancing ``num_computed_tokens`` after each decode
        step); the rest of ``loop_s`` is the loop's own bookkeeping (window, records,
        the prefill's ``num_computed_tokens``); ``future_s`` (``belady`` only: pass
        1, not in ``loop_s``). Also ``requests_per_s`` and ``prompt_tokens_per_s``
        over ``loop_s``. Cache memory: ``peak_cached_blocks``,
        ``mean_cached_blocks`` (after each admission), ``stranded_blocks`` (at the
        end), and with ``model`` ``bytes_per_block``, ``peak_cached_bytes``,
        ``mean_cached_bytes``; ``eviction``, ``index``, ``model``. With
        ``num_host_blocks > 0`` only (so the default summary is unchanged):
        ``num_host_blocks``, ``host_eviction``, ``device_hit_tokens``,
        ``host_hit_tokens`` (their sum is ``hit_tokens``), ``host_blocks_loaded``,
        ``host_blocks_stored``, ``peak_host_cached_blocks`` (after each admission),
        and with ``model`` ``host_bytes_loaded`` / ``host_bytes_stored``.

    Raises:
        ValueError: bad configuration (before anything runs) or a request the
            manager rejects (e.g. beyond ``max_model_len``, a duplicate running id).
    """
    cfg = resolve(cache_config, num_blocks=num_blocks, block_size=block_size,
                  hash_algo=hash_algo, hash_seed=hash_seed, free_order=free_order,
                  max_model_len=max_model_len, eviction=eviction,
                  eviction_options=eviction_options, index=index,
                  kv_cache_groups=kv_cache_groups, num_host_blocks=num_host_blocks,
                  host_eviction=host_eviction, enable_caching=enable_caching,
                  host_eviction_options=host_eviction_options)
    # (the one int rule: numpy ints are ints, bools are not -- _validate)
    concurrency = check_positive_int("concurrency", concurrency)
    for flag, value in (("record_evictions", record_evictions), ("progress", progress),
                        ("miss_reasons", miss_reasons)):
        check_bool(flag, value)  # ("no" would be truthy)
    total = check_count("total", total) if total is not None else None
    if queue_depth is not None:
        queue_depth = check_positive_int("queue_depth", queue_depth)
    check_hash_seed(cfg.hash_seed)  # an object's str carries its address: not reproducible
    if residency is not None:  # checked before anything runs
        from prefixcache.core.residency import ResidencyTracker  # noqa: PLC0415

        ResidencyTracker(residency)  # (the sample rate's check)
        if cfg.kv_cache_groups is not None and is_hybrid(cfg.kv_cache_groups):
            raise ValueError("residency statistics need one full-attention group; "
                             f"kv_cache_groups={cfg.kv_cache_groups!r}")
    bytes_per_block = None
    if model is not None:
        if not isinstance(model, str):
            raise ValueError(f"model must be a preset name or None, got {model!r}")
        shape = ModelShape.preset(model)
        cfg = cfg.with_pool_blocks(shape.kv_bytes_per_block(cfg.block_size, cfg.kv_dtype))
        bytes_per_block = shape.kv_bytes_per_block(cfg.block_size, cfg.kv_dtype)
    manager_kw = cfg.manager_kwargs()  # the pool in bytes without a model -> ValueError
    if "page_bytes" in manager_kw and manager_kw["page_bytes"] is None:
        if bytes_per_block is None:
            raise ValueError("disk_bytes / remote_bytes need page_bytes (the bytes of one "
                             "block's KV page) or model (a preset that gives it)")
        manager_kw["page_bytes"] = bytes_per_block
    num_blocks, block_size = cfg.num_blocks, cfg.block_size
    hash_algo, hash_seed, free_order = cfg.hash_algo, cfg.hash_seed, cfg.free_order
    max_model_len, eviction, index = cfg.max_model_len, cfg.eviction, cfg.index
    host_eviction = cfg.host_eviction
    policy_cls = get_policy_class(eviction)
    keyed_index = get_index_class(index).KEYS_BY_BLOCK_HASH
    if queue_depth is not None and not (policy_cls.needs_waiting or (
            cfg.num_host_blocks and get_policy_class(host_eviction).needs_waiting)):
        raise ValueError(f"queue_depth={queue_depth} is for a policy that reads the waiting "
                         f"queue (needs_waiting, e.g. queue_aware), not {eviction!r}")
    options = dict(cfg.eviction_options or {})
    t_future = None
    if policy_cls.needs_future:
        if "future" in options:
            raise ValueError(f"{eviction}: the replay builds the future itself; do not pass one")
        if callable(requests):
            fresh = requests
        elif iter(requests) is requests:
            raise ValueError(
                f"{eviction} reads the trace twice (pass 1 indexes next uses): pass a list "
                "or a zero-arg callable returning a fresh iterator, not a one-shot iterator"
            )
        else:
            source = requests

            def fresh():
                return source

        # NOTE: pass 1 hashes with the replay's own root: a seedless xxhash hasher
        # draws a random root, so the manager gets the resolved seed string.
        first = BlockHasher(hash_algo, hash_seed)
        hash_seed = first.seed
        t0 = time.perf_counter()
        options["future"] = trace_future(fresh(), first, block_size,
                                         keyed_index=keyed_index)
        t_future = time.perf_counter() - t0
        del first
        requests = fresh()
    elif callable(requests):
        requests = requests()
    manager_kw.update(hash_seed=hash_seed, eviction_options=options or None)
    if residency is not None:
        manager_kw["enable_events"] = True
    acct = acct_events = None
    if miss_reasons:
        from prefixcache.core.misses import MissAccountant, uses_probes  # noqa: PLC0415

        if not uses_probes(index, cfg.kv_cache_groups):  # (state groups, other indexes)
            manager_kw.update(enable_events=True, int_event_hashes=False)
    m = KVCacheManager(**manager_kw, log_stats=False)
    tiered = m.num_host_blocks > 0  # (validated by the manager)
    if miss_reasons:
        acct = MissAccountant.for_manager(m)
        acct_lookup = acct.lookup
        if acct.uses_events:
            acct_events = m.take_events
    res = (_Residency(m, residency, cfg.block_size,
                      int_keys=manager_kw.get("int_event_hashes", True))
           if residency is not None else None)
    if res is not None and acct_events is not None:  # one drain feeds both
        acct_events = res.drain
    drop_transfers = m.host_tier.drop_transfers if tiered else None
    chain = m.tier_chain if tiered else None  # the tiers below the host, or None
    tier_before = m.hit_tokens_by_tier if chain is not None else None
    tier_names = tuple(tier_before) if chain is not None else ()
    peak_host = 0
    hasher = m.hasher
    # NOTE: a group layout's get_block_ids is one list per group; records hold lists.
    per_group_ids = is_hybrid(m.kv_cache_groups)
    # NOTE: a state-space group's prefill stops where it keeps a state (vLLM's
    # _mamba_block_aligned_split): the first chunk is the admission, the others are
    # scheduled as decode steps are (finishing the oldest others to make room).
    prefill_chunks = (
        m.prefill_chunks if per_group_ids and needs_aligned_prefill(m.kv_cache_groups)
        else None)
    arrivals = policy_cls.needs_future  # the manager wants on_arrival calls
    on_arrival = m.on_arrival
    # Cached blocks after each admission: two counters of the hash index's pool (no
    # call on the default path); another index answers its num_cached_blocks.
    pool = m.block_pool if index == DEFAULT_INDEX else None
    peak_cached = sum_cached = 0
    running: collections.deque = collections.deque()
    get_computed_blocks = m.get_computed_blocks
    allocate_slots = m.allocate_slots
    free = m.free
    if res is not None:  # (off: the loop calls the manager directly)
        allocate_slots = res.admitted(allocate_slots)
        free = res.released(free)
    perf = time.perf_counter
    crc = zlib.crc32
    loras: dict[tuple[str, str], LoRARequest] = {}

    # Reuse per (cache_salt, LoRA name): [requests, prompt tokens, hit tokens], kept for
    # tagged requests only (an untagged trace pays one truth test per request); the
    # untagged remainder is the totals minus these (``_breakdown``).
    tagged: dict[tuple[str | None, str | None], list[int]] = {}
    n_req = n_admitted = n_failed = n_trunc = n_prefill_cut = n_early = n_with_hit = 0
    prompt_tokens = admitted_prompt = hit_tokens = output_appended = 0
    t_loop = t_hash = t_mgr = 0.0

    it: Iterable[TraceRequest] = requests
    drop_waiting = None
    if reads_waiting_queue(m):  # the waiting queue: a look-ahead over the trace
        queue_depth = concurrency if queue_depth is None else queue_depth
        it = _announce_waiting(it, queue_depth, m.on_waiting, hasher, block_size, keyed_index)
        drop_waiting = m.drop_waiting
    set_time = policy_clock(m)
    if set_time is not None:  # a time-varying policy: the clock, per request (no cost else)
        it = _clocked(it, set_time)
    if res is not None:
        it = res.clocked(it)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="replay", unit="req", total=total)

    # NOTE: as vLLM's EngineCore (and the peer harness) do after start-up, freeze the
    # heap built so far (the block pool) so GC passes in the loop do not walk it. No
    # ``gc.collect()`` first: it walks the caller's whole heap on every call (0.15 s per
    # replay in a process that has imported jax, more as the heap grows: most of the
    # test suite's late slowdown) and changes nothing the loop does; garbage frozen
    # here is collected normally after ``gc.unfreeze()``.
    gc.freeze()
    try:
        for tr in it:
            rid = tr.id
            prompt = tr.prompt
            num_prompt = len(prompt)
            n_req += 1
            prompt_tokens += num_prompt
            # Untimed: request-side inputs (frontend work in a real deployment) and
            # the deterministic sampled tokens.
            lora = tag = None
            if tr.lora is not None:
                lora = loras.get(tr.lora)
                if lora is None:
                    lora = loras[tr.lora] = LoRARequest(tr.lora[0], tr.lora[1])
            if tr.cache_salt or lora is not None:
                key = (tr.cache_salt or None, None if lora is None else tr.lora[0])
                tag = tagged.get(key)
                if tag is None:
                    tag = tagged[key] = [0, 0, 0]
                tag[0] += 1
                tag[1] += num_prompt
            mm = [MultiModalFeature(i, o, n) for i, o, n in tr.mm] if tr.mm else ()
            n_out = tr.output_len if tr.output_len > 1 else 1
            pre = f"{rid}:"
            out_tokens = [1 + crc(f"{pre}{k}".encode()) % 1000 for k in range(n_out)]
            keyed = (_hash_id_inputs(tr, block_size, keyed_index=keyed_index)
                     if type(prompt) is not list else None)

            t_start = perf()
            if len(running) >= concurrency:
                free(running.popleft())
            t0 = perf()
            t_mgr += t0 - t_start
            req = Request(
                rid,
                prompt if keyed is None else keyed[0],
                mm_features=mm,
                lora=lora,
                cache_salt=tr.cache_salt,
                hasher=hasher,
                block_size=block_size,
                priority=tr.priority,
                retention=tr.retention,
            )
            if keyed is not None:  # Mooncake hash ids as block keys
                req.adopt_block_hashes(hasher.hash_keyed_blocks(keyed[1]))
            req.block_hashes  # NOTE: hashing is lazy; do it here, on the hashing clock
            t1 = perf()
            t_hash += t1 - t0
            if arrivals:
                on_arrival(req, n_req - 1)
            # ---- admission --------------------------------------------------
            while True:
                if acct_events is not None:
                    acct.observe(acct_events())  # the cache as this lookup sees it
                computed, num_hit = get_computed_blocks(req)
                if acct is not None:  # (before the allocation changes the cache)
                    reasons = acct_lookup(req, num_hit)
                if prefill_chunks is None:
                    new_blocks = allocate_slots(req, num_prompt - num_hit, num_hit, computed)
                else:
                    chunks = prefill_chunks(req, num_hit)
                    new_blocks = allocate_slots(req, chunks[0], num_hit, computed)
                if new_blocks is not None or not running:
                    break
                free(running.popleft())
                n_early += 1
            prefill_cut = None
            if prefill_chunks is not None and new_blocks is not None and len(chunks) > 1:
                done = num_hit + chunks[0]
                for i, c in enumerate(chunks[1:], 1):
                    req.num_computed_tokens = done
                    nb = allocate_slots(req, c)
                    while nb is None and running:
                        free(running.popleft())  # the oldest other (req is not running yet)
                        n_early += 1
                        nb = allocate_slots(req, c)
                    if nb is None:
                        prefill_cut = i
                        break
                    done += c
            t2 = perf()
            t_mgr += t2 - t1
            if new_blocks is None:
                n_failed += 1
                t_loop += t2 - t_start
                if drop_waiting is not None:  # it leaves the queue unadmitted
                    drop_waiting(rid)
                if on_record is not None:
                    on_record(
                        {
                            "id": rid,
                            "num_computed_tokens": 0,
                            "block_ids": [],
                            "failed": True,
                            "prompt_tokens": num_prompt,
                        }
                    )
                if bar is not None:
                    bar.update(1)
                continue
            n_admitted += 1
            if acct is not None:
                acct.admit(req, num_hit, reasons)
            else:
                reasons = None
            if pool is not None:
                c = pool.num_blocks_cached - pool.num_evictions
            else:
                c = m.num_cached_blocks
            sum_cached += c
            if c > peak_cached:
                peak_cached = c
            if tiered:
                drop_transfers()  # (no pages to copy here: keep the list short)
                c = m.num_host_cached_blocks
                if c > peak_host:
                    peak_host = c
                if chain is not None:
                    now_by = m.hit_tokens_by_tier  # (a fresh dict)
                    tier_delta = {t: now_by[t] - tier_before[t] for t in tier_names}
                    tier_before = now_by
            admitted_prompt += num_prompt
            hit_tokens += num_hit
            if tag is not None:
                tag[2] += num_hit
            if num_hit:
                n_with_hit += 1
            rec = None
            if on_record is not None:
                rec = {
                    "id": rid,
                    "num_computed_tokens": num_hit,
                    "block_ids": (
                        list(m.get_block_ids(rid)) if per_group_ids else m.get_block_ids(rid)),
                    "prompt_tokens": num_prompt,
                }
                if chain is not None:
                    for t in tier_names:
                        rec["hit_tokens_" + t] = tier_delta[t]
                if record_evictions:
                    rec["evictions_so_far"] = m.num_evictions
                if reasons is not None:
                    rec["miss_reasons"] = reasons
                if prefill_chunks is not None and len(chunks) > 1:
                    # the chunks computed (those before the one that found no room)
                    rec["prefill_chunks"] = chunks[:prefill_cut]
                    if prefill_cut is not None:
                        rec["prefill_truncated_at"] = prefill_cut
            running.append(req)
            if prefill_cut is not None:  # a later chunk found no room: no decode
                n_prefill_cut += 1
                t_loop += perf() - t_start
                if rec is not None:
                    on_record(rec)
                if bar is not None:
                    bar.update(1)
                continue
            req.num_computed_tokens = num_prompt  # scheduler bookkeeping: on no clock
            t3 = perf()
            req.append_output_token_ids(out_tokens[0])
            ntok = num_prompt + 1
            if ntok % block_size == 0:
                req.block_hashes  # a block became full: hash it on the hashing clock
            t4 = perf()
            t_hash += t4 - t3
            output_appended += 1
            # ---- decode -----------------------------------------------------
            # NOTE: two clock reads per step; each step's manager interval starts
            # where the previous step's hashing interval ended. The scheduler's
            # ``num_computed_tokens += 1`` of a step runs after its append, at the
            # start of the next manager interval (conservative: on our manager clock;
            # the append does not read it, so the order changes nothing).
            t0 = perf()
            for step in range(1, n_out):
                new_blocks = allocate_slots(req, 1)
                while new_blocks is None:
                    if len(running) <= 1:
                        break
                    free(running.popleft())  # the oldest other (req is the newest)
                    n_early += 1
                    new_blocks = allocate_slots(req, 1)
                t1 = perf()
                t_mgr += t1 - t0
                if new_blocks is None:
                    n_trunc += 1
                    if rec is not None:
                        rec["decode_truncated_at"] = step
                    break
                req.append_output_token_ids(out_tokens[step])
                ntok += 1
                if ntok % block_size == 0:
                    req.block_hashes
                t0 = perf()
                t_hash += t0 - t1
                req.num_computed_tokens = ntok - 1  # scheduler bookkeeping: += 1
                output_appended += 1
            t_loop += perf() - t_start
            if rec is not None:
                on_record(rec)
            if bar is not None:
                bar.update(1)
        t0 = perf()
        while running:
            free(running.popleft())
        t1 = perf()
        t_mgr += t1 - t0
        t_loop += t1 - t0
        # NOTE: the final frees dropped no hash: this is also the count before them.
        # Counted while the heap is still frozen (its allocations would otherwise let
        # a full GC pass walk the whole trace: ~2% of a replay's instructions).
        stranded = m.num_stranded_blocks()
    finally:
        gc.unfreeze()
        if bar is not None:
            bar.close()
    m.check_invariants()
    if drop_waiting is not None and m.policy.waiting_ids():  # pragma: no cover - a bug
        raise AssertionError(f"replay leaked waiting requests: {m.policy.waiting_ids()[:5]}")
    if m.num_free_blocks != num_blocks:  # pragma: no cover - a bug, caught loudly
        raise AssertionError(f"replay leaked blocks: {num_blocks - m.num_free_blocks} held")
    counters = m.counters()
    mean_cached = sum_cached / n_admitted if n_admitted else 0.0
    memory = {
        "peak_cached_blocks": peak_cached,
        "mean_cached_blocks": mean_cached,
        "stranded_blocks": stranded,
    }
    if bytes_per_block is not None:
        memory["bytes_per_block"] = bytes_per_block
        memory["peak_cached_bytes"] = peak_cached * bytes_per_block
        memory["mean_cached_bytes"] = mean_cached * bytes_per_block
    if tiered:
        drop_transfers()
        host = {
            "num_host_blocks": m.num_host_blocks,
            "host_eviction": policy_name(host_eviction),
            "device_hit_tokens": m.device_hit_tokens,
            "host_hit_tokens": m.host_hit_tokens,
            "host_blocks_loaded": m.host_blocks_loaded,
            "host_blocks_stored": m.host_blocks_stored,
            "peak_host_cached_blocks": peak_host,
        }
        if chain is not None:
            by = m.hit_tokens_by_tier
            host["hit_tokens_by_tier"] = by
            host["tiers"] = {
                t.name: {"num_blocks": t.num_blocks, "eviction": policy_name(t.eviction),
                         "blocks_loaded": t.num_loaded, "blocks_stored": t.num_stored,
                         "blocks_evicted": t.num_evicted, "cached_blocks": len(t),
                         "link": t.link._asdict()}
                for t in chain.tiers}
            if sum(by.values()) != hit_tokens:  # pragma: no cover - a bug
                raise AssertionError(f"hit tokens by tier {by} != {hit_tokens} admitted")
        elif m.device_hit_tokens + m.host_hit_tokens != hit_tokens:  # pragma: no cover - a bug
            raise AssertionError(
                f"device {m.device_hit_tokens} + host {m.host_hit_tokens} hit tokens != "
                f"{hit_tokens} admitted hit tokens")
        if bytes_per_block is not None:
            host["host_bytes_loaded"] = m.host_blocks_loaded * bytes_per_block
            host["host_bytes_stored"] = m.host_blocks_stored * bytes_per_block
        memory.update(host)
    if acct is not None:
        memory["miss_reasons"] = acct.summary()
    if drop_waiting is not None:  # (only then: the default summary is unchanged)
        memory["queue_depth"] = queue_depth
    if res is not None:
        memory["residency"] = res.summary()
    timing = {"loop_s": t_loop, "hashing_s": t_hash, "manager_s": t_mgr}
    if t_future is not None:
        timing["future_s"] = t_future
    return {
        "eviction": policy_name(eviction),
        "index": index_name(index),
        "model": model,
        "hash_algo": hash_algo,
        "free_order": free_order,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "concurrency": concurrency,
        "max_model_len": max_model_len,
        "requests": n_req,
        "admitted": n_admitted,
        "failed": n_failed,
        "decode_truncated": n_trunc,
        # (layouts whose prefills are split: prompts cut short by a later chunk)
        **({"prefill_truncated": n_prefill_cut} if prefill_chunks is not None else {}),
        "early_finishes": n_early,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_appended,
        "hit_tokens": hit_tokens,
        "hit_rate_tokens": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "hit_rate_tokens_admitted": hit_tokens / admitted_prompt if admitted_prompt else 0.0,
        "requests_with_hit": n_with_hit,
        **_breakdown(tagged, n_req, prompt_tokens, hit_tokens),
        "evictions": counters["evictions"],
        "blocks_cached": counters["blocks_cached"],
        **memory,
        "timing": timing,
        "requests_per_s": n_req / t_loop if t_loop > 0 else 0.0,
        "prompt_tokens_per_s": prompt_tokens / t_loop if t_loop > 0 else 0.0,
    }
