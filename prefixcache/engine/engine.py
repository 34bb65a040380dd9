"""The serving engine: requests in, tokens out, prefix caching underneath.

    from prefixcache.engine import Engine, SamplingParams
    from prefixcache.model import ModelConfig

    engine = Engine(ModelConfig.tiny(), num_blocks=256, block_size=16)
    outs = engine.generate([[1, 2, 3], [1, 2, 4]], SamplingParams(max_tokens=8))
    outs[0].token_ids, outs[0].metrics.num_cached_tokens, engine.metrics().token_hit_rate

One `step()` = schedule (host) -> build inputs (host) -> one device step -> append the
sampled tokens and finish requests (host).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import operator
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from prefixcache.engine.model_runner import ModelRunner
from prefixcache.engine.outputs import EngineMetrics, RequestMetrics, RequestOutput
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.scheduler import (FINISH_ERROR, FINISH_LENGTH, FINISH_STOP,
                                          EngineRequest, RequestStatus, Scheduler,
                                          SchedulerOutput)


_REQUEST_ID = operator.attrgetter("state.request.request_id")
_log = logging.getLogger(__name__)


def _positive_int(name: str, value) -> int:
    from prefixcache._validate import check_positive_int  # the one rule for sizes

    return check_positive_int(name, value)


class Engine:
    """A small vLLM-style engine over one model and one paged KV pool.

    Invariants:
      - every added request is, at any time, exactly one of: waiting or running in the
        scheduler, or finished with its RequestOutput queued for the next `step()`;
      - the KV pool has `num_blocks` allocatable blocks (+1 padding page on the device);
        the manager is the only owner of block bookkeeping;
      - outputs do not depend on `enable_caching` (greedy decoding is token-for-token
        the same; the cache only skips prefill work).

    Args:
      model_config: a `prefixcache.model.ModelConfig` (e.g. `ModelConfig.tiny()`).
      num_blocks: allocatable KV blocks in the pool (give this or `kv_cache_bytes`).
      block_size: tokens per block.
      enable_caching: automatic prefix caching on/off.
      seed: model init seed (when `model` is None) and base of per-request sampling seeds.
      max_num_seqs: most running requests.
      max_num_batched_tokens: token budget per step (chunked prefill beyond it).
      max_model_len: longest request (prompt + output); default: the model's maximum
        position count if it has one, else `num_blocks * block_size`.
      hash_algo, hash_seed: block hashing (see `prefixcache.core.hashing`).
      attention_backend, interpret: passed to the model's step function.
      mesh: a `jax.sharding.Mesh` to shard the model and KV over (None: one device).
      model: an already built/loaded `Transformer` (None: random init from `seed`).
      token_buckets, seq_buckets, page_buckets: shape buckets of the MetadataBuilder.
      eviction: the KV cache manager's eviction policy (`prefixcache.core.eviction`;
        default "lru", vLLM's). `belady` is rejected: it needs the trace's future,
        which online serving does not have. Its options go in `manager_kwargs`
        (`eviction_options`).
      index: the prefix index: "hash" (vLLM's hash chain, the default) or "radix"
        (`prefixcache.core.radix`, SGLang's radix tree); `prefixcache.core.indexes`.
      manager_kwargs: extra keyword arguments for `KVCacheManager`.
      share_programs_with: another Engine over the same model, backend and mesh whose
        compiled step programs this one reuses (its own KV pool and cache stay separate);
        e.g. a caching-on and a caching-off engine compared side by side.
      lora_cache_key_only: without `enable_lora` the model applies no LoRA adapters, so
        requests with a `lora` are rejected (ValueError) unless this is True: then they
        run the base model and the adapter only keys the cache (for cache-isolation
        studies). Not together with `enable_lora`.
      enable_lora: apply LoRA adapters in the model (`prefixcache.model.lora`): each
        request's `LoRARequest(name, path)` names a PEFT adapter directory, read and
        validated when the request is added (a bad adapter is a ValueError then); up to
        `max_loras` distinct adapters run in one step (device slots, least recently used
        reloaded; a request whose adapter gets no slot waits), each of rank <=
        `max_lora_rank` (the padded rank of the one compiled step). The adapter's name
        and path key the prefix cache as without it.
      max_loras, max_lora_rank: see `enable_lora` (positive ints; used only with it).
        The stacked device weights of `max_loras + 1` slots at rank `max_lora_rank`
        (`prefixcache.model.lora.lora_weights_nbytes`) are checked with the KV arrays
        against the free memory here, before anything is built.
      max_cpu_loras: the most adapters kept read on the host (`lora_adapters`, vLLM's
        `max_cpu_loras`); None (default): `max_loras`; an int >= `max_loras`. Past it,
        the least recently used adapters (last added or run) that no unfinished request
        names and no device slot holds are dropped after each add; one requested again
        is re-read from disk and re-validated. Used only with `enable_lora`.
      tokenizer: a `prefixcache.text.Tokenizer` of the model (None: token ids only).
        With one, prompts may be strs, `chat()` renders conversations through its chat
        template, `RequestOutput.text` is the decoded output, requests also stop on the
        tokenizer's `stop_token_ids` (eos, end of turn) and `SamplingParams.stop`
        strings work. Its vocabulary must not exceed the model's.
      scheduling_policy: the waiting queue's admission order (``fcfs``, vLLM's and the
        default; ``lpm``: longest cached prefix first; ``dfs_weight``; see
        `prefixcache.scheduling`).
      num_host_blocks: blocks of the host-memory tier (0, the default: off).
        Cached blocks the device pool evicts are demoted to host pages (numpy, owned
        by the runner: `runner.host_pages`) and promoted back on a hit; each step's
        copies run batched before the step computes (`prefixcache.engine.host_pages`).
        With a quantized `kv_dtype` a host page keeps the quantized values and the
        page's scales, moved together.
      host_eviction: the host tier's eviction policy (a `prefixcache.core.eviction`
        name; not belady).
      disk_dir, disk_bytes: the disk tier under the host tier (off unless both are
        given; it needs `num_host_blocks`): blocks the host tier evicts are demoted to
        KV page files in `disk_dir` (`prefixcache.engine.page_files`: one file per
        block key, header + crc32, written to a temporary file and renamed), at most
        `disk_bytes` of pages (an int or a string such as "8GiB"; the core disk tier
        holds `disk_bytes // kv_bytes_per_block` blocks), and loaded back into device
        pages on a hit, in the same batched copies as the host tier's. A page file
        that fails its checks at lookup is a miss (`corrupt_disk`), never wrong KV.
      disk_eviction: the disk tier's eviction policy (an online
        `prefixcache.core.eviction` name).
      disk_reuse: keep the pages of an earlier run over `disk_dir` of the same model,
        KV dtype, block size and hash algorithm and seed (`disk_fingerprint`) and
        preload the disk tier with them, oldest first; False (default): the
        directory's pages of this fingerprint are deleted at start (other files stay).
      kv_dtype: the KV pages' dtype, one of `prefixcache.kv_dtypes.KV_DTYPES`
        ("bfloat16", "float32", "float8_e4m3fn", "int8"); None (default): the model's
        dtype, as before. float8_e4m3fn / int8 store per-(page, kv head) scales
        (`kernels.quant`); `num_blocks` is still the block count, and the memory check
        counts the dtype's bytes per block, scales included
        (`prefixcache.kv_dtypes.kv_bytes_per_block`).
      cache_config: a `prefixcache.CacheConfig` holding the cache keywords above
        (`num_blocks` / `kv_cache_bytes`, `block_size`, `enable_caching`,
        `max_model_len`, `hash_algo`, `hash_seed`, `eviction`, `index`, the host tier,
        the disk tier's `disk_bytes` / `disk_eviction`, `kv_dtype`) and the manager's
        `free_order`, `eviction_options`, `host_eviction_options`, `enable_events`
        (`page_bytes` must be unset or the engine's `kv_bytes_per_block`; a remote
        store or tiers of one's own, `remote_bytes` / `tiers`, keep their pages in host
        memory: `page_files.MemoryPages`); a cache keyword given with a
        non-default value overrides its field. Its `kv_cache_groups` is None (the
        model's layers decide them: `model_kv_cache_groups`) or a layout of group
        kinds of one's own over the same groups, layers and windows.
      kv_cache_bytes: the pool's size as a byte budget instead of `num_blocks` (an int
        or a string such as "2GiB", `prefixcache.kv_dtypes.parse_bytes`; as vLLM's
        `kv_cache_memory_bytes`, but for the whole pool over all devices of a mesh, not
        per device). Exactly one of `num_blocks` and `kv_cache_bytes` (ValueError
        otherwise). The pool gets the most blocks whose KV arrays fit it, counting the
        padding page: `num_blocks = kv_cache_bytes // kv_bytes_per_block - 1`, where
        `kv_bytes_per_block` covers all layers in `kv_dtype`, scales included; so one
        budget holds about twice the blocks in fp8/int8 as in bf16. A budget below two
        blocks (one block and the padding page) is a ValueError.
      residency: block residency statistics (``prefixcache.core.residency``): the share
        of block hashes tracked, in (0, 1] (1.0: every block, exact; vLLM samples 0.01);
        `EngineMetrics.residency` then holds per-tier histograms of block lifetime,
        idle time before eviction, reuse gap (wall seconds) and hits per stay. They read
        the manager's KV events, so the manager queues them and the engine drains them
        each step: refused together with a KV-event publisher (which drains them too).
        ``None`` (the default): nothing tracked, no cost.
      miss_reasons: classify every missed prompt block (``prefixcache.core.misses``:
        cold / evicted by tier / isolated / partial / last_token / preempted) into
        `RequestOutput.metrics.miss_reasons` and `EngineMetrics.miss_reasons`, by
        probing the index, no KV events (`misses.probe_refusal`, the one rule): the hash
        or radix index, of one full-attention group or with sliding-window layers
        (`window`: cached in the full-attention group, past the hit the windows allow;
        `misses.GroupProbeAccountant`); ValueError otherwise. False: no cost.
      scan_layers: run the decoder's layers under one `lax.scan` over stacked params
        (`make_step_fn`'s default): compile time does not grow with depth; the KV arrays
        are one stacked array (`make_kv_caches(stacked=True)`). The weights are held
        once for a stacked model (the loaders' default, and the engine's own random
        model); a per-layer `model` gets a stacked copy. False: the unrolled step over
        per-layer KV arrays (the plain path the scanned one is tested against).

    Sliding-window and hybrid models (`model_config.sliding_window`): the manager gets
    vLLM's KV cache groups (`model_config.kv_groups`: equal-size groups of one attention
    kind each, e.g. S,S,F,S -> three sliding groups and one full group of one layer) and
    keeps one block table per group; the i-th layer of every group shares one KV array
    (`model_config.layer_kv_slots`), so a block id costs one group's layers' bytes and
    `num_blocks` blocks take num_blocks x `kv_group_size` layer pages. A sliding group
    holds only the blocks overlapping the window (the earlier ones go back to the cache,
    their slots read the padding page), and each layer reads its group's table. Such models
    take any online eviction policy with its options and index "hash" or "radix"
    (`core/radix_hybrid.py`; ValueError here otherwise); a host
    tier (`num_host_blocks`) runs with index "hash" (one host slot = one page of each KV
    array, i.e. one block of one group; the radix index refuses it by the one rule).

    Attributes:
      num_blocks: allocatable blocks of the pool (given, or derived from the budget).
      kv_cache_bytes: the byte budget given, or None (sized by `num_blocks`).
      kv_bytes_per_block: device bytes of one block (all layers, scales included);
        kv_pool_bytes: those of the KV arrays, `(num_blocks + 1) * kv_bytes_per_block`
        (<= `kv_cache_bytes` when a budget was given).
      kv_cache_manager, scheduler, runner: the parts (host manager, scheduler, device
        runner with its MetadataBuilder `runner.builder` and KV arrays).
      record_logits: when True, each step also fetches the next-token logits of the
        requests that sampled (one explicit device_get) into `step_logits`: a list per
        step of {request_id: f32[vocab]} (for numerics checks; grows without bound).
      lora_adapters: (name, path) -> `prefixcache.model.lora.LoRAAdapter` kept read on
        the host, least recently used first (with enable_lora; the device slots are
        `runner.lora_slots`): at most `max_cpu_loras`, or more while unfinished
        requests name more (see `max_cpu_loras`).
      disk_files: the disk tier's `prefixcache.engine.page_files.PageFiles` (None
        without one); disk_fingerprint: the identity its pages are written under.
      last_scheduler_output: the SchedulerOutput of the latest step.
      last_step_times: (schedule, prepare, device, update) seconds of the latest step
        that ran the model.
      fault_injector: None, or a callable `(point, scheduler_output)` run at
        "before_device" and "after_device" of every model step (see
        `prefixcache.engine.faults`); what it raises is a failed step.

    A configuration the kernels cannot run (page size, head size, dtypes, backend) or
    KV arrays / a block pool larger than the free memory raise ValueError here, before
    anything is allocated. A model step that raises does not break the engine: the
    requests that caused it finish with finish_reason "error" (the exception in
    `.error`; every request of the step when no single one did) and, while the KV
    arrays are intact, the others and the prefix cache go on as if nothing happened
    (`_isolate_failed_step`); when the KV arrays were lost (or the host tier had copies
    in flight) the other running requests are recomputed, the prefix cache is reset
    and the KV arrays re-created (`_recover_failed_step`); a KeyboardInterrupt during a
    step requeues every request and is re-raised.
    """

    def __init__(self, model_config, *, num_blocks: int | None = None, block_size: int = 16,
                 enable_caching: bool = True, seed: int = 0, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, max_model_len: int | None = None,
                 hash_algo: str = "sha256", hash_seed=None,
                 attention_backend: str = "auto", interpret: bool = False, mesh=None,
                 model=None, token_buckets=None, seq_buckets=None, page_buckets=None,
                 manager_kwargs: Mapping[str, Any] | None = None,
                 share_programs_with: "Engine | None" = None,
                 lora_cache_key_only: bool = False, scheduling_policy: str = "fcfs",
                 eviction: str = "lru", index: str = "hash", enable_lora: bool = False,
                 max_loras: int = 4, max_lora_rank: int = 16, num_host_blocks: int = 0,
                 host_eviction: str = "lru", kv_dtype: str | None = None,
                 kv_cache_bytes: int | str | None = None, max_cpu_loras: int | None = None,
                 tokenizer=None, cache_config=None, miss_reasons: bool = False,
                 residency: float | None = None,
                 disk_dir=None, disk_bytes: int | str = 0, disk_eviction: str = "lru",
                 disk_reuse: bool = False, scan_layers: bool = True):
        if cache_config is not None:  # its fields fill the cache keywords (see _ENGINE_CACHE)
            (num_blocks, block_size, enable_caching, max_model_len, hash_algo, hash_seed,
             eviction, index, num_host_blocks, host_eviction, kv_dtype, kv_cache_bytes,
             disk_bytes, disk_eviction, manager_kwargs) = _unpack_cache_config(
                 cache_config, manager_kwargs, dict(
                     num_blocks=num_blocks, block_size=block_size,
                     enable_caching=enable_caching, max_model_len=max_model_len,
                     hash_algo=hash_algo, hash_seed=hash_seed, eviction=eviction,
                     index=index, num_host_blocks=num_host_blocks,
                     host_eviction=host_eviction, kv_dtype=kv_dtype,
                     kv_cache_bytes=kv_cache_bytes, disk_bytes=disk_bytes,
                     disk_eviction=disk_eviction))
        from prefixcache._validate import check_count
        from prefixcache.core import KVCacheManager
        from prefixcache.core.eviction import get_policy_class
        from prefixcache.core.indexes import get_index_class
        from prefixcache.kv_dtypes import check_kv_dtype
        from prefixcache.scheduling import make_scheduling_policy

        # None: the model's dtype (today's behaviour); unknown names fail here, first.
        kv_dtype = check_kv_dtype(model_config.dtype if kv_dtype is None else kv_dtype)
        # The pool's size: num_blocks, or the blocks a byte budget holds (kv_cache_bytes).
        num_blocks, kv_cache_bytes, kv_block_bytes = _pool_size(
            model_config, num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes,
            block_size=block_size, kv_dtype=kv_dtype)

        if get_policy_class(eviction).needs_future:  # unknown name -> ValueError
            raise ValueError(f"eviction={eviction!r} needs the trace's future (an offline "
                             "bound for the replay): an online engine has none")
        get_index_class(index)  # unknown name -> ValueError
        if manager_kwargs and ({"eviction", "index", "num_host_blocks", "host_eviction",
                                "disk_bytes", "disk_eviction"} & set(manager_kwargs)):
            raise ValueError("pass eviction=, index=, num_host_blocks=, host_eviction=, "
                             "disk_bytes= and disk_eviction= to Engine, not in manager_kwargs")
        if manager_kwargs:
            page = manager_kwargs.get("page_bytes")
            if page is not None and page != kv_block_bytes:
                raise ValueError(f"page_bytes={page!r}: the engine's page is "
                                 f"{kv_block_bytes} bytes (every layer, {kv_dtype}); leave "
                                 "page_bytes unset")
        given_groups = None
        if manager_kwargs and "kv_cache_groups" in manager_kwargs:
            # A layout of the user's (group kinds of their own): it must group the
            # model's layers as the model does (checked in _kv_cache_groups).
            manager_kwargs = dict(manager_kwargs)
            given_groups = manager_kwargs.pop("kv_cache_groups")
        num_host_blocks = check_count("num_host_blocks", num_host_blocks)
        if get_policy_class(host_eviction).needs_future:  # unknown name -> ValueError
            raise ValueError(f"host_eviction={host_eviction!r} needs the trace's future: "
                             "an online engine has none")
        disk_bytes = _check_disk(disk_dir=disk_dir, disk_bytes=disk_bytes,
                                 disk_eviction=disk_eviction, disk_reuse=disk_reuse,
                                 num_host_blocks=num_host_blocks, hash_algo=hash_algo,
                                 hash_seed=hash_seed, enable_caching=enable_caching)
        kv_cache_groups = _kv_cache_groups(model_config, eviction=eviction, index=index,
                                           given=given_groups)
        if kv_cache_groups is not None and num_host_blocks:
            # NOTE: served by the hash index (per-group host slots, core/hybrid.py): a
            # block id is a page of every shared KV array, which holds one layer of each
            # group, so a transfer's page copy in every array IS its group's layers'
            # page (`HostTransfer.group` names the group). The one rule otherwise.
            from prefixcache.core.indexes import refusal  # noqa: PLC0415

            why = refusal(index, kv_cache_groups, eviction, num_host_blocks)
            if why is not None:
                raise ValueError(why)
        if miss_reasons:
            from prefixcache.core.misses import probe_refusal  # noqa: PLC0415

            why = probe_refusal(index, kv_cache_groups)
            if why is not None:
                raise ValueError(
                    f"miss_reasons=True: the engine classifies misses by probing the index "
                    f"(its KV events are the publisher's): {why}; not supported (replay a "
                    "trace with miss_reasons=True instead)")

        if residency is not None:
            from prefixcache.core.residency import ResidencyTracker  # noqa: PLC0415

            ResidencyTracker(residency)  # (the sample rate's check, before anything is built)
            if kv_cache_groups is not None or index != "hash":
                raise ValueError("residency statistics need the hash index with one "
                                 "full-attention group")
            manager_kwargs = {**dict(manager_kwargs or {}), "enable_events": True}
        num_blocks = _positive_int("num_blocks", num_blocks)
        block_size = _positive_int("block_size", block_size)
        max_num_seqs = _positive_int("max_num_seqs", max_num_seqs)
        max_num_batched_tokens = _positive_int("max_num_batched_tokens",
                                               max_num_batched_tokens)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        max_loras = _positive_int("max_loras", max_loras)
        max_lora_rank = _positive_int("max_lora_rank", max_lora_rank)
        if not isinstance(enable_lora, (bool, np.bool_)):  # ("no" would be truthy)
            raise ValueError(f"enable_lora must be a bool, got {enable_lora!r}")
        if not isinstance(interpret, (bool, np.bool_)):  # ("no" would run interpreted)
            raise ValueError(f"interpret must be a bool, got {interpret!r}")
        if max_cpu_loras is None:
            max_cpu_loras = max_loras  # vLLM's default
        max_cpu_loras = _positive_int("max_cpu_loras", max_cpu_loras)
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras "
                             f"({max_loras}): every adapter in a device slot is kept read "
                             "on the host")
        if enable_lora and lora_cache_key_only:
            raise ValueError("enable_lora applies adapters, lora_cache_key_only runs the "
                             "base model under an adapter's cache key: give one, not both")
        policy = make_scheduling_policy(scheduling_policy)  # unknown name: ValueError
        _check_tokenizer(tokenizer, model_config)
        model_max = _model_max_len(model_config)
        if max_model_len is None:
            max_model_len = model_max if model_max is not None else num_blocks * block_size
        max_model_len = _positive_int("max_model_len", max_model_len)
        if model_max is not None and max_model_len > model_max:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's maximum "
                             f"of {model_max} positions")
        # Everything the kernels or the machine cannot run is refused here, before the
        # block pool, the model or the KV arrays are allocated (not at the first step).
        _check_runnable(model_config, num_blocks=num_blocks, block_size=block_size,
                        max_num_seqs=max_num_seqs, attention_backend=attention_backend,
                        interpret=interpret, mesh=mesh, num_host_blocks=num_host_blocks,
                        kv_dtype=kv_dtype,
                        lora=(max_loras, max_lora_rank) if enable_lora else None)
        # Shape buckets (they must end at the maxima: max_num_batched_tokens, max_num_seqs
        # and the pages of max_model_len) and the hash seed, before anything is built.
        from prefixcache.metadata import MetadataBuilder
        MetadataBuilder(block_size=block_size, num_blocks=num_blocks,
                        max_num_seqs=max_num_seqs, max_num_tokens=max_num_batched_tokens,
                        max_pages_per_seq=-(-max_model_len // block_size),
                        token_buckets=token_buckets, seq_buckets=seq_buckets,
                        page_buckets=page_buckets)
        from prefixcache._validate import check_hash_seed
        check_hash_seed(hash_seed)
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.kv_cache_bytes = kv_cache_bytes
        self.kv_bytes_per_block = kv_block_bytes
        self.kv_pool_bytes = (num_blocks + 1) * kv_block_bytes  # + the padding page
        self.enable_caching = bool(enable_caching)
        self.seed = int(seed)
        self.max_model_len = max_model_len
        self.lora_cache_key_only = bool(lora_cache_key_only)
        self.enable_lora = bool(enable_lora)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        # (name, path) -> LoRAAdapter read from disk (host arrays), least recently used
        # first; at most max_cpu_loras beyond those pinned (see `_maybe_drop_loras`).
        self.lora_adapters: collections.OrderedDict = collections.OrderedDict()
        self.vocab_size = int(model_config.vocab_size)
        self.num_host_blocks = num_host_blocks
        if num_host_blocks:
            manager_kwargs = {**dict(manager_kwargs or {}), "num_host_blocks": num_host_blocks,
                              "host_eviction": host_eviction}
        if disk_bytes:
            manager_kwargs = {**manager_kwargs, "disk_bytes": disk_bytes,
                              "disk_eviction": disk_eviction}
        if manager_kwargs and (disk_bytes or any(
                manager_kwargs.get(k) for k in ("remote_bytes", "remote", "tiers"))):
            # (the tiers below the host are sized in pages of the engine's own size)
            manager_kwargs = {**manager_kwargs, "page_bytes": kv_block_bytes}
        self.kv_cache_manager = KVCacheManager(
            num_blocks, block_size, enable_caching=enable_caching, hash_algo=hash_algo,
            hash_seed=hash_seed, max_model_len=max_model_len, eviction=eviction, index=index,
            **({"kv_cache_groups": kv_cache_groups} if kv_cache_groups else {}),
            **dict(manager_kwargs or {}))
        self.scheduler = Scheduler(self.kv_cache_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=max_model_len,
                                   scheduling_policy=policy,
                                   max_loras=max_loras if enable_lora else None)
        self.residency = None
        if residency is not None:
            from prefixcache.core.residency import ManagerResidency  # noqa: PLC0415

            self.residency = self.scheduler.residency = ManagerResidency(
                self.kv_cache_manager, residency)
        self.miss_reasons = bool(miss_reasons)
        if miss_reasons:  # (checked before anything was built: _check_miss_reasons)
            from prefixcache.core.misses import (  # noqa: PLC0415
                GroupProbeAccountant, MissAccountant)

            self.scheduler.miss_accountant = (
                GroupProbeAccountant if kv_cache_groups is not None
                else MissAccountant).for_manager(self.kv_cache_manager)
        program = None
        if share_programs_with is not None:
            if model is not None and model is not share_programs_with.model:
                raise ValueError("share_programs_with: the engines must run the same model")
            if share_programs_with.model_config != model_config:
                raise ValueError("share_programs_with: different model configs")
            if share_programs_with.kv_dtype != kv_dtype:
                raise ValueError("share_programs_with: different kv_dtype")
            model = share_programs_with.model
            program = share_programs_with.runner.program
        if model is None:
            model = _init_model(model_config, seed)
            if scan_layers:
                from prefixcache.model.llama import stack_layers  # noqa: PLC0415

                stack_layers(model)  # (the engine's own: its weights held once)
        elif getattr(model, "config", None) != model_config:
            raise ValueError("model.config differs from model_config: pass the loaded "
                             "model's own config (load_hf_checkpoint returns both)")
        self.model = model
        lora_slots = None
        if self.enable_lora:
            from prefixcache.model.lora import LoRASlots
            lora_slots = LoRASlots(
                model_config, max_loras=max_loras, max_lora_rank=max_lora_rank,
                sharding=None if mesh is None else _replicated(mesh))
        self.runner = ModelRunner(
            model, model_config, num_blocks=num_blocks, block_size=block_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, attention_backend=attention_backend,
            interpret=interpret, mesh=mesh, token_buckets=token_buckets,
            seq_buckets=seq_buckets, page_buckets=page_buckets, program=program,
            lora_slots=lora_slots, lora_adapters=self.lora_adapters,
            num_host_blocks=num_host_blocks, kv_dtype=kv_dtype, scan_layers=scan_layers)
        self.disk_files = None
        self.disk_fingerprint = None
        if disk_bytes:
            self._open_disk(disk_dir, reuse=bool(disk_reuse), hash_algo=hash_algo,
                            hash_seed=hash_seed)
        # (tier, MemoryPages) of the other tiers below the host (remote, one's own).
        self._memory_tiers = self._open_memory_tiers()
        self._pending_outputs: list[RequestOutput] = []
        self._known_ids: set[str] = set()
        self.record_logits = False
        # Fault injection (tests, reproductions): None, or a callable
        # `(point, scheduler_output) -> None` run at "before_device" and "after_device"
        # of every step that runs the model; whatever it raises is handled as a failed
        # model step (see `step`).
        self.fault_injector = None
        self.step_logits: list[dict[str, np.ndarray]] = []
        self.last_scheduler_output: SchedulerOutput | None = None
        self.last_step_times: tuple[float, float, float, float] | None = None
        # `num_programs_built` when `warmup()` last finished (None: never warmed up).
        self._programs_at_warmup: int | None = None
        self.reset_metrics()

    @classmethod
    def from_pretrained(cls, path, *, dtype: str | None = None, tokenizer=True,
                        **engine_kwargs) -> "Engine":
        """An engine over a real checkpoint: an HF directory or a GGUF file.

            engine = Engine.from_pretrained(".../SmolLM2-135M-Instruct.Q4_1.gguf",
                                            num_blocks=512)

        Loads `prefixcache.model.load_pretrained(path, dtype=dtype)` and builds
        `Engine(config, model=model, **engine_kwargs)`; `engine_kwargs` are the
        constructor's (`num_blocks` or `kv_cache_bytes` is needed). `max_model_len`
        keeps the constructor's default: the model's context (`max_position_embeddings`,
        GGUF `{arch}.context_length`: 8192 for SmolLM2). With `tokenizer` true and the
        text extra present (`prefixcache.text`), the checkpoint's tokenizer (when it has
        one: `Pretrained.tokenizer_path`) is passed as `tokenizer=`; False / None: none; a
        `prefixcache.text.Tokenizer` object: that one. `engine.pretrained`
        keeps the `Pretrained` record (source, format, tokenizer_path).

        Raises:
          ValueError: the loader's errors (a missing path, a malformed checkpoint, an
            unknown architecture...), or `model` / `model_config` in `engine_kwargs`.
        """
        import importlib.util  # noqa: PLC0415

        from prefixcache.model import load_pretrained  # noqa: PLC0415

        clash = sorted({"model", "model_config"} & set(engine_kwargs))
        if clash:
            raise ValueError(f"Engine.from_pretrained loads the model itself: do not pass "
                             f"{clash}")
        # (the layout the step reads: the weights are held once)
        pre = load_pretrained(path, dtype=dtype,
                              stacked=bool(engine_kwargs.get("scan_layers", True)))
        if tokenizer is not None and not isinstance(tokenizer, (bool, np.bool_)):
            engine_kwargs["tokenizer"] = tokenizer  # (the constructor checks it)
        elif (tokenizer and pre.tokenizer_path is not None
                and importlib.util.find_spec("prefixcache.text") is not None):
            from prefixcache.text import Tokenizer  # noqa: PLC0415

            engine_kwargs["tokenizer"] = Tokenizer.from_pretrained(pre.tokenizer_path)
        engine = cls(pre.config, model=pre.model, **engine_kwargs)
        engine.pretrained = pre
        return engine

    # -- requests -------------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams | None = None, *,
                    request_id: str | None = None, mm_features: Sequence = (),
                    mm_embeddings: Mapping[str, np.ndarray] | None = None,
                    cache_salt: str | None = None, lora=None, lora_request=None,
                    priority: int = 0, retention=None) -> str:
        """Queues one request.

        A request that can never run (prompt longer than max_model_len, more blocks than
        the whole pool, token ids outside the vocabulary) is not raised on: it finishes
        at once with finish_reason "error" and a message in `.error`; the others go on.

        Args:
          prompt: list of token ids, a `prefixcache.Request` (then mm_features,
            cache_salt, lora and request_id come from it and must not be given here), or
            a str (encoded with the engine's tokenizer, special tokens added as the
            tokenizer does; an engine without a tokenizer rejects it).
          params: SamplingParams (default: SamplingParams()).
          request_id: unique id (default: a fresh "req-<n>").
          mm_features: `MultiModalFeature(identifier, offset, length)` items.
          mm_embeddings: identifier -> f32[length, d_model] embedding rows of each item.
          cache_salt: forwarded to the core Request (it enters the first block's hash).
          lora: a LoRARequest: applied with enable_lora (its adapter is read and checked
            now); with lora_cache_key_only it only enters the block hashes (the base model
            runs); otherwise rejected.
          lora_request: the same as `lora` (vLLM's name); give at most one of the two.
          priority: forwarded to the core Request's `priority` (an int; larger = more
            important, read by the ``priority`` eviction policy); with a `Request`
            prompt it must stay 0 (set it on the Request).
          retention: the client's `prefixcache.core.request.RetentionHints` (or a dict
            of their fields), forwarded to the core Request and read by the ``hinted``
            eviction policy; with a `Request` prompt it must stay None.

        Returns:
          The request id.

        Raises:
          ValueError: malformed input (not a token list, empty prompt, duplicate id,
            params not a SamplingParams, missing or mis-shaped multimodal embeddings; a
            text prompt or stop strings without a tokenizer).
        """
        if lora is not None and lora_request is not None:
            raise ValueError("give lora or lora_request (the same thing), not both")
        # NOTE: adapters read while validating go to `read`, and reach the memo only
        # once the request is valid: a refused call leaves `lora_adapters` unchanged.
        read: dict = {}
        state = self._new_state(prompt, params, request_id=request_id,
                                mm_features=mm_features, mm_embeddings=mm_embeddings,
                                cache_salt=cache_salt,
                                lora=lora if lora is not None else lora_request,
                                read_loras=read, priority=priority, retention=retention)
        try:
            self._adopt_loras([state], read)
            self._commit(state)
        finally:
            # After the commit: the new request's adapter is pinned by then.
            self._maybe_drop_loras()
        return state.request_id

    def _new_state(self, prompt, params, *, request_id=None, mm_features=(),
                   mm_embeddings=None, cache_salt=None, lora=None,
                   taken_ids=frozenset(), read_loras=None, priority: int = 0,
                   retention=None) -> EngineRequest:
        """Validates one request and builds its state; changes nothing in the engine.

        Adapters not in `lora_adapters` yet are read into `read_loras` ((name, path) ->
        adapter), for `_adopt_loras` to add once every request of the call is valid."""
        from prefixcache.core import Request

        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params = self._with_tokenizer_stops(params)
        if isinstance(prompt, str):
            prompt = self._encode_prompt(prompt)
        if isinstance(prompt, Request):
            if (request_id is not None or mm_features or cache_salt is not None or lora
                    or priority != 0 or retention is not None):
                raise ValueError("pass request_id / mm_features / cache_salt / lora / "
                                 "priority / retention on the Request itself, not to "
                                 "add_request")
            if prompt.num_computed_tokens or prompt.num_tokens != prompt.num_prompt_tokens:
                raise ValueError(f"request {prompt.request_id!r} already has computed or "
                                 "output tokens")
            if prompt.hasher is not None and not (
                    prompt.hasher == self.kv_cache_manager.hasher
                    and prompt.block_size == self.block_size):
                raise ValueError(f"request {prompt.request_id!r} is bound to another hasher "
                                 "or block size than this engine's")
            req = prompt
        else:
            tokens = _as_token_list(prompt)
            if request_id is None:
                # The first free "req-<n>" (n from the number of ids seen so far).
                k = len(self._known_ids) + len(taken_ids)
                while f"req-{k}" in self._known_ids or f"req-{k}" in taken_ids:
                    k += 1
                request_id = f"req-{k}"
            req = Request(request_id, tokens, mm_features=tuple(mm_features), lora=lora,
                          cache_salt=cache_salt, priority=priority, retention=retention)
        if req.lora is not None and self.enable_lora:
            self._load_lora(req.lora, {} if read_loras is None else read_loras)
        elif req.lora is not None and not self.lora_cache_key_only:
            # NOTE: the model has no adapter weights; running a LoRA request on the base
            # model would silently produce base-model tokens under an adapter's cache key.
            raise ValueError(f"request {req.request_id!r} asks for LoRA adapter "
                             f"{req.lora.name!r}, but the engine applies no adapters "
                             "(Engine(..., enable_lora=True) applies them; "
                             "Engine(..., lora_cache_key_only=True) runs the base model "
                             "with the adapter as a cache key only)")
        rid = req.request_id
        if rid in self._known_ids or rid in taken_ids:
            raise ValueError(f"duplicate request id {rid!r}")
        embeds = self._check_mm(req, mm_embeddings or {})
        seed = params.seed if params.seed is not None else _derive_seed(self.seed, rid)
        state = EngineRequest(req, params, seed, embeds)
        if params.stop:
            state.text = _RequestText(self.tokenizer, req.prompt_token_ids, params)
        return state

    # -- text -----------------------------------------------------------------------

    def _encode_prompt(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("the engine has no tokenizer, so prompts must be token ids: "
                             "give Engine(..., tokenizer=Tokenizer.from_pretrained(path)) "
                             "or use Engine.from_pretrained(path)")
        return self.tokenizer.encode(text)

    def _with_tokenizer_stops(self, params: SamplingParams) -> SamplingParams:
        """`params` with the tokenizer's stop ids added (eos, end of turn)."""
        if self.tokenizer is None:
            if params.stop:
                raise ValueError(f"stop strings {params.stop!r} need an engine with a "
                                 "tokenizer (Engine(..., tokenizer=...)); stop_token_ids "
                                 "work without one")
            return params
        extra = tuple(t for t in self.tokenizer.stop_token_ids
                      if t not in params.stop_token_ids)
        if not extra:
            return params
        return dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)

    def _output_text(self, state: EngineRequest) -> str | None:
        if self.tokenizer is None:
            return None
        if state.text is not None:
            return state.text.finish()
        return self.tokenizer.decode(_in_vocab(state.request.output_token_ids,
                                               self.tokenizer.vocab_size),
                                     skip_special_tokens=state.params.skip_special_tokens)

    def _apply_stop_strings(self, sched: SchedulerOutput,
                            finished: list[EngineRequest]) -> None:
        """Feeds this step's tokens to the requests with stop strings; finishes those
        whose text now holds one (finish reason "stop", also over "length")."""
        for s in sched.scheduled:
            state = s.state
            text = state.text
            if text is None or not text.update(state.request.output_token_ids):
                continue
            if state.status is RequestStatus.RUNNING:
                self.scheduler.finish_request(state, FINISH_STOP)
                finished.append(state)
            elif state.finish_reason == FINISH_LENGTH:
                state.finish_reason = FINISH_STOP  # as vLLM: the stop string wins

    def chat(self, conversations, params: SamplingParams | Sequence[SamplingParams]
             | None = None, *, add_generation_prompt: bool = True,
             **template_kwargs) -> list[RequestOutput]:
        """Runs chat conversations to completion through the tokenizer's chat template.

        Args:
          conversations: one conversation (a list of {"role", "content"} messages) or a
            list of them.
          params: one SamplingParams for all, or one per conversation.
          add_generation_prompt: end each prompt with the assistant turn's header.
          template_kwargs: passed to `Tokenizer.apply_chat_template` (e.g. `tools`).

        Returns:
          RequestOutputs in the order of the conversations (`.text` is the reply).

        Raises:
          ValueError: no tokenizer, no chat template, malformed messages (the
            conversation and message index named); nothing is queued then.
        """
        if self.tokenizer is None:
            raise ValueError("chat() needs an engine with a tokenizer: give "
                             "Engine(..., tokenizer=Tokenizer.from_pretrained(path)) or use "
                             "Engine.from_pretrained(path)")
        if (isinstance(conversations, Sequence) and not isinstance(conversations, str)
                and conversations and isinstance(conversations[0], Mapping)):
            conversations = [conversations]  # one conversation
        if isinstance(conversations, (str, Mapping)) or not isinstance(conversations,
                                                                       Sequence):
            raise ValueError("conversations must be a list of messages or a list of such "
                             f"lists, got {type(conversations).__name__}")
        prompts = []
        for k, conv in enumerate(conversations):
            try:
                prompts.append(self.tokenizer.apply_chat_template(
                    conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                    **template_kwargs))
            except ValueError as e:
                raise ValueError(f"conversation {k}: {e}") from None
        return self.generate(prompts, params)

    def _load_lora(self, lora, read: dict) -> None:
        """Reads and checks `lora`'s adapter once into `read` unless the memo or `read`
        holds it already (ValueError naming the problem); changes nothing in the engine."""
        from prefixcache.core import LoRARequest
        from prefixcache.model.lora import load_lora_adapter

        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora must be a LoRARequest, got {type(lora).__name__}")
        key = (lora.name, lora.path)
        if key not in self.lora_adapters and key not in read:
            # NOTE: a memo of the file's contents (host arrays), filled at validation
            # time; adapters reach device slots only when a step runs them. A dropped
            # adapter is read and validated again (the file may have changed).
            read[key] = load_lora_adapter(
                lora.path, self.model_config, max_lora_rank=self.max_lora_rank,
                name=lora.name)

    def _adopt_loras(self, states, read: dict) -> None:
        """Commits the adapters of validated `states`: newly read ones enter the memo,
        known ones become the most recently used (in the order of `states`)."""
        if not self.enable_lora:
            return
        for st in states:
            lo = st.request.lora
            if lo is None:
                continue
            key = (lo.name, lo.path)
            if key in read:
                self.lora_adapters[key] = read.pop(key)
            self.lora_adapters.move_to_end(key)  # most recently used

    def _maybe_drop_loras(self) -> None:
        """Drops least recently used adapters from `lora_adapters` past `max_cpu_loras`,
        never one that an unfinished request names (a step reads it from here) or that
        a device slot holds (its slot is reused without reading the file again)."""
        memo = self.lora_adapters
        excess = len(memo) - self.max_cpu_loras
        if excess <= 0:
            return
        pinned = set(self.runner.lora_slots.resident)
        for state in self.scheduler.requests.values():
            if (lo := state.request.lora) is not None:
                pinned.add((lo.name, lo.path))
        for key in [k for k in memo if k not in pinned][:excess]:
            del memo[key]

    def _commit(self, state: EngineRequest) -> None:
        self._known_ids.add(state.request_id)
        state.arrival_time = time.perf_counter()
        error = self._admission_error(state.request)
        if error is not None:
            state.status = RequestStatus.FINISHED
            state.finish_reason = FINISH_ERROR
            state.error = error
            state.finish_time = time.perf_counter()
            self._finish(state)
            return
        self.scheduler.add_request(state)

    def _check_mm(self, req, mm_embeddings: Mapping[str, np.ndarray]
                  ) -> dict[str, np.ndarray]:
        d_model = self.runner.d_model
        out = {}
        for f in req.mm_features:
            if f.identifier not in mm_embeddings:
                raise ValueError(f"request {req.request_id!r}: no embedding rows for "
                                 f"multimodal item {f.identifier!r}")
            rows = np.asarray(mm_embeddings[f.identifier])
            if rows.shape != (f.length, d_model):
                raise ValueError(
                    f"request {req.request_id!r}: embeddings of item {f.identifier!r} have "
                    f"shape {rows.shape}, expected ({f.length}, {d_model})")
            if not np.all(np.isfinite(rows)):
                raise ValueError(f"request {req.request_id!r}: embeddings of item "
                                 f"{f.identifier!r} are not finite")
            if f.offset < 0 or f.offset + f.length > req.num_prompt_tokens:
                raise ValueError(
                    f"request {req.request_id!r}: item {f.identifier!r} spans "
                    f"[{f.offset}, {f.offset + f.length}) outside the prompt of "
                    f"{req.num_prompt_tokens} tokens")
            out[f.identifier] = rows
        extra = set(mm_embeddings) - {f.identifier for f in req.mm_features}
        if extra:
            raise ValueError(f"request {req.request_id!r}: embeddings given for unknown "
                             f"items {sorted(extra)}")
        return out

    def _admission_error(self, req) -> str | None:
        n = req.num_prompt_tokens
        if n > self.max_model_len:
            # NOTE: as vLLM: a prompt of exactly max_model_len tokens still gets one token
            # (its KV is max_model_len long; the stop check then ends it).
            return f"prompt of {n} tokens is longer than max_model_len={self.max_model_len}"

        needed = -(-n // self.block_size)
        if needed > self.num_blocks:
            return (f"prompt of {n} tokens needs {needed} KV blocks of {self.block_size} "
                    f"but the whole pool has {self.num_blocks} blocks")
        tokens = np.asarray(req.prompt_token_ids, np.int64)
        bad = (tokens < 0) | (tokens >= self.vocab_size)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            return (f"prompt token id {int(tokens[i])} at position {i} is outside the "
                    f"vocabulary [0, {self.vocab_size})")
        return None

    def abort_request(self, request_id: str) -> None:
        """Aborts an unfinished request (its output comes with the next `step()`)."""
        state = self.scheduler.abort_request(request_id)
        self._finish(state)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending_outputs)

    def output_token_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The output tokens of an unfinished request so far, from index `start` (a
        copy): a streaming front end calls it after each `step()` for the tokens that
        step added (finished requests come whole in `step()`'s RequestOutputs).

        Raises:
          KeyError: `request_id` is not an unfinished request of this engine.
        """
        state = self.scheduler.requests.get(request_id)
        if state is None:
            raise KeyError(f"no unfinished request {request_id!r}")
        req = state.request
        return list(req.all_token_ids[req.num_prompt_tokens + start:])

    # -- the disk tier --------------------------------------------------------------

    def _disk_tier(self):
        """The manager's disk tier (the core `DiskTier` of its tier chain)."""
        chain = self.kv_cache_manager.tier_chain
        tier = None if chain is None else chain.get("disk")
        assert tier is not None, "a disk tier was asked for, the manager has none"
        return tier

    def _open_disk(self, disk_dir, *, reuse: bool, hash_algo, hash_seed) -> None:
        """Opens the page files, hooks their check into the core disk tier (its
        `validator`) and preloads the tier (`reuse`) or empties the store."""
        from prefixcache.engine.page_files import PageFiles  # noqa: PLC0415

        pages = self.runner.host_pages
        self.disk_fingerprint = disk_fingerprint(
            self.model, self.model_config, kv_dtype=self.kv_dtype,
            block_size=self.block_size, hash_algo=hash_algo, hash_seed=hash_seed)
        files = PageFiles(disk_dir, fingerprint=self.disk_fingerprint,
                          block_size=self.block_size, parts=pages.page_parts,
                          num_layers=pages.num_layers)
        pages.attach_files(files)
        tier = self._disk_tier()
        tier.validator = pages.validate
        if reuse:
            # NOTE: oldest first, so the tier's policy evicts the oldest pages first
            # when the directory holds more than the budget.
            tier.preload([kg for kg in files.keys_oldest_first()
                          if tier.page_hash(*kg) is not None])
        else:
            files.clear()
        self.disk_files = files
        # The directory may exceed the tier's budget by a quarter before the files of
        # blocks the tier no longer holds are deleted (`_maybe_collect_disk`).
        self._disk_collect_bytes = tier.num_blocks * (pages.page_bytes + 4096) * 5 // 4
        self._maybe_collect_disk(force=True)

    def _open_memory_tiers(self) -> list:
        """Host-memory pages (`page_files.MemoryPages`) for each tier below the host
        but the disk: a remote store, a tier of one's own (kept on the tier object, so
        engines sharing a remote store share its pages)."""
        chain = self.kv_cache_manager.tier_chain
        out = []
        for tier in (chain.tiers if chain is not None else ()):
            if tier.name == "disk":
                continue
            from prefixcache.engine.page_files import MemoryPages  # noqa: PLC0415

            pages = self.runner.host_pages
            store = MemoryPages.for_tier(tier, parts=pages.page_parts,
                                         num_layers=pages.num_layers)
            pages.attach_store(tier.name, store)
            out.append((tier, store))
        return out

    def _maybe_collect_memory_tiers(self) -> None:
        """Drops the memory pages of blocks their tier no longer holds once a store
        holds a quarter more pages than its tier's capacity."""
        for tier, store in self._memory_tiers:
            if len(store) > tier.num_blocks * 5 // 4 + 8:
                live = {tier.page_key(h) for h in tier.entries}
                store.retain(lambda key, group: (key, group) in live)

    def _maybe_collect_disk(self, force: bool = False) -> None:
        """Deletes the page files of blocks the core disk tier no longer holds (loaded
        back, evicted for good, dropped at a reset) once the directory passes
        `_disk_collect_bytes` (amortized: each pass removes at least a fifth)."""
        files = self.disk_files
        if files is None or not (force or files.nbytes > self._disk_collect_bytes):
            return
        tier = self._disk_tier()
        page_hash, entries = tier.page_hash, tier.entries
        files.retain(lambda key, group: page_hash(key, group) in entries)

    # -- stepping -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one engine step.

        Returns:
          The requests that finished since the previous step (incl. rejected ones).
        """
        t0 = time.perf_counter()
        if self.disk_files is not None:
            self.runner.host_pages.forget_validated()
        sched = self.scheduler.schedule()
        # The host tier's copies of this schedule (demotions, promotions); None: off.
        transfers = (self.kv_cache_manager.take_host_transfers() if self.num_host_blocks
                     else None)
        t1 = time.perf_counter()
        for state in sched.finished:
            self._finish(state)
        self._usage_sum += self.kv_cache_manager.usage
        self._usage_peak = max(self._usage_peak, self.kv_cache_manager.usage)
        self._num_usage_samples += 1
        if sched.scheduled:
            phase = "before_device"
            tokens = logits = None
            try:
                if self.fault_injector is not None:
                    self.fault_injector("before_device", sched)
                if transfers:
                    self.runner.apply_host_transfers(transfers)
                phase = "prepare"
                prepared = self.runner.prepare(
                    sched.scheduled, self.scheduler.kv_group_tables or self.scheduler.block_tables)
                t2 = time.perf_counter()
                phase = "device"
                tokens, logits = self.runner.execute(prepared,
                                                     return_logits=self.record_logits)
                phase = "after_device"
                if self.fault_injector is not None:
                    self.fault_injector("after_device", sched)
            except BaseException as e:
                if isinstance(e, Exception) and not transfers and not self.num_host_blocks:
                    rerun = self._isolate_failed_step(sched, e, phase, tokens, logits)
                else:
                    rerun = None
                if rerun is None:
                    self._recover_failed_step(sched, e)
                    if not isinstance(e, Exception):
                        raise  # KeyboardInterrupt & co: the engine is consistent again
                    self.last_scheduler_output = sched
                    outs, self._pending_outputs = self._pending_outputs, []
                    return outs
                tokens, logits = rerun
                t2 = time.perf_counter()
            t3 = time.perf_counter()
            sampled = dict(zip(map(_REQUEST_ID, sched.scheduled), np.asarray(tokens).tolist()))
            if logits is not None:
                self.step_logits.append({
                    s.request_id: logits[i] for i, s in enumerate(sched.scheduled)
                    if s.completes_sequence})
            finished = self.scheduler.update_from_output(sched, sampled)
            self._apply_stop_strings(sched, finished)
            for state in finished:
                self._finish(state)
            t4 = time.perf_counter()
            self._num_steps += 1
            self._num_computed_tokens += sched.total_num_scheduled_tokens
            self._host_prepare_s += t2 - t1
            self._device_s += t3 - t2
            self._host_update_s += t4 - t3
            self.last_step_times = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        elif transfers:
            # NOTE: the manager copies only while it allocates for scheduled requests;
            # should copies come without a step, they still run in order (no step to
            # overlap with).
            self.runner.apply_host_transfers(transfers)
            self.runner.host_pages.finish()
        self._host_schedule_s += t1 - t0
        if self.disk_files is not None:
            self._maybe_collect_disk()
        if self._memory_tiers:
            self._maybe_collect_memory_tiers()
        self.last_scheduler_output = sched
        outs, self._pending_outputs = self._pending_outputs, []
        return outs

    def _isolate_failed_step(self, sched: SchedulerOutput, exc: Exception, phase: str,
                             tokens, logits):
        """Contains a failed model step to the requests that caused it, keeping the
        prefix cache, when the KV arrays are intact: (tokens, logits) of the step to
        go on with, or None (then `_recover_failed_step`, which resets everything).

        NOTE: the choices made:
          * culprits: a step that failed while its inputs were built on the host
            (`runner.prepare`: e.g. a value its int32 / float32 arrays cannot hold) is
            built again for each of its requests alone; those whose own inputs fail are
            the culprits. Otherwise (a fault before or after the device call, or one
            no request fails alone) every request of the step is, as before;
          * the cache: every block this step was to write was already cached when it
            was scheduled. If the device call never completed, the step runs again
            with the culprits' sampling rows made greedy (their KV is computed, their
            tokens thrown away), so every cached block holds its KV and nothing is
            dropped; running requests outside the step are not touched. If that run
            fails too, or the KV arrays were lost (a donated step that failed), or the
            host tier has copies in flight, None: the full recovery;
          * the culprits then finish with finish_reason "error"; the other requests of
            the step take their tokens from the second run (the same tokens: sampling
            is a pure function of seed and position).
        """
        if self.runner.ensure_valid_kv_caches():
            return None  # every page is gone: nothing cached is intact
        tables = self.scheduler.kv_group_tables or self.scheduler.block_tables
        culprits = list(sched.scheduled)
        if phase == "prepare" and len(culprits) > 1:
            alone = []
            for s in culprits:
                try:
                    self.runner.prepare([s], tables)
                except Exception:  # noqa: BLE001 - this request's own inputs fail
                    alone.append(s)
            culprits = alone or culprits
        if phase != "after_device":
            for s in culprits:
                st = s.state
                st.params = SamplingParams(max_tokens=st.params.max_tokens)
            try:
                prepared = self.runner.prepare(sched.scheduled, tables)
                tokens, logits = self.runner.execute(prepared,
                                                     return_logits=self.record_logits)
            except BaseException as again:
                if not isinstance(again, Exception):  # KeyboardInterrupt & co
                    self._recover_failed_step(sched, again)
                    raise
                _log.warning("a failed model step failed again without its culprits' "
                             "sampling; every running request is recomputed")
                return None  # not contained: the full recovery
        error = f"model step failed: {type(exc).__name__}: {exc}"
        for s in culprits:
            state = s.state
            if state.status is RequestStatus.RUNNING:
                self.scheduler.finish_request(state, FINISH_ERROR, error)
                self._finish(state)
        return tokens, logits

    def _recover_failed_step(self, sched: SchedulerOutput, exc: BaseException) -> None:
        """Leaves the engine usable after the model step of `sched` raised.

        NOTE: what a failed step may have broken, and the choice made:
          * its requests' blocks were allocated and their full blocks already entered
            the prefix cache when they were scheduled, but their KV was (maybe) never
            written: a later hit on them would read garbage;
          * the KV arrays are donated to the jitted step: if it failed after taking
            them, the old arrays are deleted (or carry the error) and every page is
            lost, including cached prefixes and other running requests' KV.
          So: the step's requests finish with finish_reason "error" and the exception
          in `.error` (an Exception: retrying a deterministic failure would fail
          forever; for a KeyboardInterrupt they are requeued instead, and it is
          re-raised), every other running request is preempted by recompute (blocks
          freed, back to the front of the waiting queue; counted as a preemption),
          the prefix cache is reset (nothing computed before can be trusted) and the
          KV arrays are re-created if they are no longer valid. Requests that were
          not in the step then produce the same tokens as without the fault (greedy,
          or sampling: a pure function of seed and position).
        """
        if isinstance(exc, Exception):
            error = f"model step failed: {type(exc).__name__}: {exc}"
            for s in sched.scheduled:
                state = s.state
                if state.status is RequestStatus.RUNNING:
                    self.scheduler.finish_request(state, FINISH_ERROR, error)
                    self._finish(state)
        self.scheduler.preempt_all_running()
        if self.runner.host_pages is not None:
            # Both tiers are reset below: no host slot is served before a store rewrites it.
            self.runner.host_pages.discard_pending()
        if not self.kv_cache_manager.reset_prefix_cache():  # pragma: no cover - a bug
            raise AssertionError("blocks still held after a failed step was rolled back")
        self.runner.ensure_valid_kv_caches()

    def _finish(self, state: EngineRequest) -> None:
        req = state.request
        start = state.arrival_time
        metrics = RequestMetrics(
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=state.num_cached_tokens,
            ttft_s=None if state.first_token_time is None else state.first_token_time - start,
            e2e_s=None if state.finish_time is None else state.finish_time - start,
            queue_s=(None if state.first_scheduled_time is None
                     else state.first_scheduled_time - start),
            num_preemptions=state.num_preemptions,
            num_output_tokens=state.num_output_tokens,
            miss_reasons=(None if state.miss_reasons is None else dict(state.miss_reasons)))
        acct = self.scheduler.miss_accountant
        if acct is not None:
            acct.forget(req)
            if state.miss_reasons:
                lora = req.lora
                tag = (req.cache_salt or "", "" if lora is None else lora.name)
                c = self._miss_by_tag.get(tag)
                if c is None:
                    c = self._miss_by_tag[tag] = collections.Counter()
                c.update(state.miss_reasons)
        out = RequestOutput(
            request_id=state.request_id, prompt_token_ids=list(req.prompt_token_ids),
            token_ids=list(req.output_token_ids), finish_reason=state.finish_reason,
            error=state.error, metrics=metrics, text=self._output_text(state))
        self._pending_outputs.append(out)
        self._num_requests += 1
        if state.error is not None:
            self._num_rejected += 1
        if state.admitted:
            self._num_admitted += 1
            self._num_prompt_tokens += req.num_prompt_tokens
            self._num_cached_tokens += state.num_cached_tokens
            self._num_hit_requests += state.num_cached_tokens > 0
            # Reuse per tenant (cache salt) and per adapter (LoRA name); "": none.
            for groups, key in ((self._per_tenant, req.cache_salt or ""),
                                (self._per_adapter, "" if req.lora is None else req.lora.name)):
                g = groups.setdefault(key, [0, 0, 0])
                g[0] += 1
                g[1] += req.num_prompt_tokens
                g[2] += state.num_cached_tokens

    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams]
                 | None = None, *, mm_embeddings: Sequence | None = None,
                 lora_request=None) -> list[RequestOutput]:
        """Runs requests to completion.

        Args:
          prompts: token-id lists, `prefixcache.Request`s or strs (with a tokenizer; one
            str alone is one prompt).
          params: one SamplingParams for all, or one per prompt.
          mm_embeddings: optional, one {identifier: rows} mapping (or None) per prompt
            (for `Request`s carrying multimodal features).
          lora_request: one `LoRARequest` for all prompts, or a list with one LoRARequest
            or None per prompt (see `add_request`'s `lora`).

        Returns:
          RequestOutputs in the order of `prompts`.
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        mms = [None] * len(prompts) if mm_embeddings is None else list(mm_embeddings)
        if len(mms) != len(prompts):
            raise ValueError(f"{len(mms)} mm_embeddings for {len(prompts)} prompts")
        if lora_request is None or not isinstance(lora_request, (list, tuple)):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"{len(loras)} lora_requests for {len(prompts)} prompts")
        if self.scheduler.has_unfinished_requests():
            raise ValueError("generate() needs an idle engine; drain step() first")
        # Validate everything first, so a bad prompt leaves the engine unchanged.
        # Adapters read on the way reach `lora_adapters` only once all are valid.
        states, taken, read = [], set(), {}
        for p, sp, mm, lo in zip(prompts, params, mms, loras):
            st = self._new_state(p, sp, mm_embeddings=mm, lora=lo, taken_ids=taken,
                                 read_loras=read)
            taken.add(st.request_id)
            states.append(st)
        try:
            self._adopt_loras(states, read)
            for st in states:
                self._commit(st)
        finally:
            # After every commit: each prompt's adapter is pinned by then.
            self._maybe_drop_loras()
        ids = [st.request_id for st in states]
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                done[out.request_id] = out
        return [done[i] for i in ids]

    # -- warm-up --------------------------------------------------------------------

    def warmup(self, *, progress: bool = True, multimodal: bool = False,
               threads: int | None = None):
        """Compiles every step program the scheduler can produce, before any request.

        Runs one step of each program key (`runner.warmup_keys()`: the bucketed (T, S, P)
        shapes a step can fill, greedy and sampling, with the engine's LoRA and KV-group
        layout) on inputs that point only at the padding page: the prefix cache, the
        block pool, every allocatable block's KV, the metrics window and the KV events
        are unchanged. Afterwards `num_compiles_after_warmup` counts programs built
        since (0 for any request mix of text requests; host-tier copy programs and,
        without `multimodal`, multimodal steps are not warmed and would show there).
        With the persistent compilation cache on (`prefixcache.engine.warmup.
        enable_compilation_cache`) a second process loads the programs instead.

        Args:
          progress: show a tqdm bar (programs done / total, seconds).
          multimodal: also the steps that inject multimodal embedding rows.
          threads: programs compiled at once (XLA compiles outside the GIL; tracing
            and lowering stay on this thread); None: the cores this process may use
            (`prefixcache.engine.warmup.default_warmup_threads`); 1: one after another.

        Returns:
          `prefixcache.engine.warmup.WarmupResult` (num_programs, num_built, seconds).

        Raises:
          ValueError: `threads` is not an int >= 1.
        """
        from prefixcache.engine.warmup import warmup_engine  # noqa: PLC0415

        result = warmup_engine(self, progress=progress, multimodal=multimodal,
                               threads=threads)
        self._programs_at_warmup = self.runner.num_programs_built
        return result

    @property
    def num_programs_built(self) -> int:
        """Programs the engine's jitted step (and host-copy) functions hold, from jax's
        caches (`ModelRunner.num_programs_built`)."""
        return self.runner.num_programs_built

    @property
    def num_compiles_after_warmup(self) -> int | None:
        """Programs built since `warmup()` finished; None before any warm-up."""
        if self._programs_at_warmup is None:
            return None
        return self.runner.num_programs_built - self._programs_at_warmup

    # -- metrics --------------------------------------------------------------------

    def reset_metrics(self) -> None:
        """Starts a new metrics window (the cache contents are kept)."""
        self._num_requests = self._num_rejected = self._num_admitted = 0
        self._num_prompt_tokens = self._num_cached_tokens = self._num_hit_requests = 0
        self._per_tenant: dict[str, list[int]] = {}
        self._per_adapter: dict[str, list[int]] = {}
        self._miss_by_tag: dict[tuple[str, str], collections.Counter] = {}
        self._num_computed_tokens = self._num_steps = 0
        self._usage_sum = self._usage_peak = 0.0
        self._num_usage_samples = 0
        self._host_schedule_s = self._host_prepare_s = 0.0
        self._device_s = self._host_update_s = 0.0
        self._evictions_base = self._num_evictions_total()
        self._host_base = self._host_counters()
        self._tier_base = self._tier_counters()
        self._preemptions_base = self.scheduler.num_preemptions

    def _host_counters(self) -> tuple[int, int, int, int] | None:
        """The manager's cumulative host-tier counters (None: no host tier)."""
        if not self.num_host_blocks:
            return None
        m = self.kv_cache_manager
        return (m.device_hit_tokens, m.host_hit_tokens, m.host_blocks_loaded,
                m.host_blocks_stored)

    def _host_metrics(self) -> dict:
        now = self._host_counters()
        if now is None:
            return {}
        dev, host, loaded, stored = (a - b for a, b in zip(now, self._host_base))
        pages = self.runner.host_pages
        return dict(device_hit_tokens=dev, host_hit_tokens=host, host_blocks_loaded=loaded,
                    host_blocks_stored=stored, host_bytes_loaded=loaded * pages.page_bytes,
                    host_bytes_stored=stored * pages.page_bytes,
                    host_pool_bytes=pages.nbytes,
                    host_copy_programs=len(pages.compiled_shapes))

    def _tier_counters(self) -> tuple[dict | None, tuple[int, int, int] | None]:
        """(the manager's cumulative hit tokens by tier or None, the disk pages'
        (loaded, stored, corrupt, write errors) or None)."""
        by_tier = getattr(self.kv_cache_manager, "hit_tokens_by_tier", None)
        files = getattr(self, "disk_files", None)
        pages = self.runner.host_pages if files is not None else None
        return (None if by_tier is None else dict(by_tier),
                None if files is None else (pages.num_disk_loaded, pages.num_disk_stored,
                                            files.num_corrupt, pages.num_disk_write_errors))

    def _tier_metrics(self) -> dict:
        (by_tier, disk), (by_tier0, disk0) = self._tier_counters(), self._tier_base
        out = {}
        if by_tier is not None and self.num_host_blocks:
            by_tier0 = by_tier0 or {}
            out["hit_tokens_by_tier"] = {k: v - by_tier0.get(k, 0) for k, v in by_tier.items()}
        if disk is not None:
            disk0 = disk0 or (0, 0, 0, 0)
            loaded, stored, corrupt, failed = (a - b for a, b in zip(disk, disk0))
            page = self.runner.host_pages.page_bytes
            out.update(disk_blocks_loaded=loaded, disk_blocks_stored=stored,
                       disk_bytes_loaded=loaded * page, disk_bytes_stored=stored * page,
                       disk_corrupt=corrupt, disk_write_errors=failed,
                       disk_used_bytes=self.disk_files.nbytes)
        return out

    def _num_evictions_total(self) -> int:
        return int(self.kv_cache_manager.num_evictions)

    def metrics(self) -> EngineMetrics:
        """Per-run metrics since construction or the last `reset_metrics()`."""
        n_adm = self._num_admitted
        return EngineMetrics(
            num_requests=self._num_requests, num_rejected=self._num_rejected,
            num_prompt_tokens=self._num_prompt_tokens,
            num_cached_tokens=self._num_cached_tokens,
            token_hit_rate=(self._num_cached_tokens / self._num_prompt_tokens
                            if self._num_prompt_tokens else 0.0),
            request_hit_rate=self._num_hit_requests / n_adm if n_adm else 0.0,
            num_computed_tokens=self._num_computed_tokens,
            num_preemptions=self.scheduler.num_preemptions - self._preemptions_base,
            num_evictions=self._num_evictions_total() - self._evictions_base,
            peak_usage=self._usage_peak,
            mean_usage=(self._usage_sum / self._num_usage_samples
                        if self._num_usage_samples else 0.0),
            num_steps=self._num_steps,
            num_compiled_programs=self.runner.num_compiled_programs,
            num_programs_built=self.num_programs_built,
            num_compiles_after_warmup=self.num_compiles_after_warmup,
            host_schedule_s=self._host_schedule_s, host_prepare_s=self._host_prepare_s,
            device_s=self._device_s, host_update_s=self._host_update_s,
            num_blocks=self.num_blocks, kv_dtype=self.kv_dtype,
            kv_bytes_per_block=self.kv_bytes_per_block, kv_pool_bytes=self.kv_pool_bytes,
            kv_cache_bytes=self.kv_cache_bytes,
            per_tenant=_reuse_groups(self._per_tenant),
            per_adapter=_reuse_groups(self._per_adapter),
            miss_reasons=self._miss_summary(),
            residency=(None if self.residency is None else self.residency.summary(
                time.monotonic() - self.scheduler._t0)),
            **self._host_metrics(), **self._tier_metrics())

    def _miss_summary(self) -> dict | None:
        """The finished requests' miss reasons summed, per tenant and per adapter."""
        if not self.miss_reasons:
            return None
        from prefixcache.core.misses import REASONS, full_reasons  # noqa: PLC0415

        total: collections.Counter = collections.Counter()
        tenants: dict[str, collections.Counter] = {}
        adapters: dict[str, collections.Counter] = {}
        for (salt, lora), c in self._miss_by_tag.items():
            total.update(c)
            tenants.setdefault(salt, collections.Counter()).update(c)
            adapters.setdefault(lora, collections.Counter()).update(c)
        return {"missed_blocks": sum(total[r] for r in REASONS),
                "reasons": full_reasons(total),
                "per_tenant": {k: full_reasons(v) for k, v in tenants.items()},
                "per_adapter": {k: full_reasons(v) for k, v in adapters.items()}}


def _check_disk(*, disk_dir, disk_bytes, disk_eviction, disk_reuse, num_host_blocks,
                hash_algo, hash_seed, enable_caching) -> int:
    """The disk tier's byte budget (0: off), or ValueError naming the bad argument."""
    import os  # noqa: PLC0415

    from prefixcache.core.eviction import get_policy_class  # noqa: PLC0415
    from prefixcache.kv_dtypes import parse_bytes  # noqa: PLC0415

    if not isinstance(disk_reuse, (bool, np.bool_)):
        raise ValueError(f"disk_reuse must be a bool, got {disk_reuse!r}")
    if isinstance(disk_bytes, bool):
        raise ValueError(f"disk_bytes must be a byte count, got {disk_bytes!r}")
    if disk_bytes in (0, None, "0"):
        if disk_dir is not None or disk_reuse:
            raise ValueError("disk_dir / disk_reuse need disk_bytes > 0 (the disk tier's "
                             "budget)")
        return 0
    try:
        disk_bytes = parse_bytes(disk_bytes)
    except ValueError as e:
        raise ValueError(f"disk_bytes={disk_bytes!r}: {e}") from None
    if disk_dir is None:
        raise ValueError("disk_bytes needs disk_dir (the directory of the KV page files)")
    try:
        disk_dir = os.fspath(disk_dir)
    except TypeError:
        raise ValueError(f"disk_dir must be a path, got {disk_dir!r}") from None
    if os.path.exists(disk_dir) and not os.path.isdir(disk_dir):
        raise ValueError(f"disk_dir={disk_dir!r} exists and is not a directory")
    if not num_host_blocks:
        raise ValueError("disk_bytes needs a host tier (num_host_blocks > 0): the disk tier "
                         "sits under it and takes the blocks it evicts")
    if not enable_caching:
        raise ValueError("disk_bytes needs enable_caching=True (the disk tier holds cached "
                         "blocks)")
    if get_policy_class(disk_eviction).needs_future:  # unknown name -> ValueError
        raise ValueError(f"disk_eviction={disk_eviction!r} needs the trace's future: an "
                         "online engine has none")
    if (disk_reuse and hash_seed is None and str(hash_algo).startswith("xxhash")
            and os.environ.get("PYTHONHASHSEED") is None):
        raise ValueError(f"disk_reuse=True with hash_algo={hash_algo!r} needs a hash_seed "
                         "(without one its block keys are random per process: no page of an "
                         "earlier run could ever be found)")
    return disk_bytes


def disk_fingerprint(model, model_config, *, kv_dtype: str, block_size: int, hash_algo,
                     hash_seed) -> str:
    """What makes a disk page's bytes reusable by another engine: the model config, a
    sample of its weights (the first values of every parameter array, so two
    checkpoints of one architecture differ), the KV dtype, the block size and the
    block hashes' algorithm and seed, digested (`page_files.engine_fingerprint`)."""
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from prefixcache.engine.page_files import FORMAT_VERSION, engine_fingerprint  # noqa: PLC0415

    from prefixcache.model.sharding import _leaf_path  # noqa: PLC0415

    # NOTE: the same sample whatever the layers' layout (per layer or stacked): each
    # param's first values by its per-layer path, in path order.
    named = []
    for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model)):
        if not isinstance(x, jax.Array):
            continue  # (a stacked model's per-layer shapes)
        keys = _leaf_path(path)
        if keys[0] == "layer_stack":  # [L, ...]: layer i's sample is row i
            rows = x[(slice(None),) + (0,) * (x.ndim - 2)][:, :8]
            named += [(("layers", i, *keys[1:]), rows, i) for i in range(x.shape[0])]
        else:
            named.append((keys, x[(0,) * (x.ndim - 1)][:8] if x.ndim else x, None))
    named.sort(key=lambda kx: tuple(str(k) for k in kx[0]))
    sample = [x for _, x, _ in named]
    rows = [i for _, _, i in named]
    with jax.transfer_guard("allow"):
        sample = jax.device_get(sample)
    sample = [x if i is None else x[i] for x, i in zip(sample, rows)]
    weights = hashlib.sha256()
    for x in sample:
        weights.update(np.asarray(x).tobytes())
    return engine_fingerprint("prefixcache kv page", FORMAT_VERSION, repr(model_config),
                              weights.hexdigest(), kv_dtype, block_size, hash_algo,
                              repr(hash_seed))


# The Engine's cache keywords and their defaults: with `cache_config`, a keyword at a
# non-default value overrides the config's field of the same name.
_ENGINE_CACHE = {"num_blocks": None, "block_size": 16, "enable_caching": True,
                 "max_model_len": None, "hash_algo": "sha256", "hash_seed": None,
                 "eviction": "lru", "index": "hash", "num_host_blocks": 0,
                 "host_eviction": "lru", "kv_dtype": None, "kv_cache_bytes": None,
                 "disk_bytes": 0, "disk_eviction": "lru"}
# CacheConfig fields the Engine hands to the manager through manager_kwargs (the tiers
# the engine keeps no pages for, remote and one's own, are refused there; page_bytes
# must be the engine's own).
_ENGINE_MANAGER_FIELDS = ("free_order", "eviction_options", "host_eviction_options",
                          "enable_events", "page_bytes", "remote_bytes", "remote_eviction",
                          "tiers", "kv_cache_groups")


def _unpack_cache_config(cache_config, manager_kwargs, keywords: dict) -> tuple:
    """The Engine's cache keywords (in `_ENGINE_CACHE` order) and manager_kwargs from
    a `CacheConfig`, the keywords given with non-default values applied over it."""
    from prefixcache.core.cache_config import CacheConfig

    if not isinstance(cache_config, CacheConfig):
        raise ValueError(f"cache_config must be a prefixcache CacheConfig, got "
                         f"{type(cache_config).__name__}")
    given = {k: v for k, v in keywords.items() if v is not _ENGINE_CACHE[k] and not (
        type(v) is type(_ENGINE_CACHE[k]) and v == _ENGINE_CACHE[k])}
    cfg = cache_config.replace(**given) if given else cache_config
    if cfg.kv_cache_groups is not None:
        from prefixcache.core.kv_groups import needs_aligned_prefill  # noqa: PLC0415

        if needs_aligned_prefill(cfg.kv_cache_groups):  # (before the model is read)
            raise ValueError(
                "cache_config.kv_cache_groups has a state-space (Mamba) group: the engine's "
                "model has no state-space layers, so it cannot run one; study the layout "
                "with prefixcache.sim.replay.replay(kv_cache_groups=...)")
    if manager_kwargs and set(_ENGINE_MANAGER_FIELDS) & set(manager_kwargs):
        raise ValueError(f"give {sorted(set(_ENGINE_MANAGER_FIELDS) & set(manager_kwargs))} "
                         "in cache_config or in manager_kwargs, not both")
    extra = {k: getattr(cfg, k) for k in _ENGINE_MANAGER_FIELDS
             if getattr(cfg, k) != CacheConfig.__dataclass_fields__[k].default}
    merged = {**dict(manager_kwargs or {}), **extra} or None
    return (*(getattr(cfg, k) for k in _ENGINE_CACHE), merged)


def _pool_size(config, *, num_blocks, kv_cache_bytes, block_size,
               kv_dtype: str) -> tuple[int, int | None, int]:
    """(num_blocks, budget or None, bytes per block) of the engine's KV pool.

    Raises:
      ValueError: neither or both of num_blocks and kv_cache_bytes, a bad value of
        either, or a budget without room for one block and the padding page.
    """
    from prefixcache.kv_dtypes import (kv_bytes_per_block, num_pool_blocks_for_bytes,
                                       parse_bytes)

    if (num_blocks is None) == (kv_cache_bytes is None):
        raise ValueError("give the KV pool's size as exactly one of num_blocks (blocks) and "
                         f"kv_cache_bytes (bytes); got num_blocks={num_blocks!r}, "
                         f"kv_cache_bytes={kv_cache_bytes!r}")
    # NOTE: a block id costs one KV array page per array: `kv_group_size` arrays (all
    # layers for a plain model; one group's layers for a hybrid one, vLLM's layout).
    block_bytes = kv_bytes_per_block(
        num_layers=config.kv_group_size, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, block_size=_positive_int("block_size", block_size),
        kv_dtype=kv_dtype)
    if kv_cache_bytes is None:
        return _positive_int("num_blocks", num_blocks), None, block_bytes
    # NOTE: the KV arrays hold num_blocks + 1 pages (page num_blocks pads the tables), so
    # the padding page is paid from the budget too: (num_blocks + 1) * bytes <= budget.
    try:
        budget = parse_bytes(kv_cache_bytes)
        n = num_pool_blocks_for_bytes(budget, block_bytes, num_padding_pages=1)
    except ValueError as e:
        raise ValueError(f"kv_cache_bytes={kv_cache_bytes!r} ({kv_dtype}): {e}") from None
    return n, budget, block_bytes


def _check_runnable(config, *, num_blocks: int, block_size: int, max_num_seqs: int,
                    attention_backend: str, interpret: bool, mesh,
                    num_host_blocks: int = 0, kv_dtype=None,
                    lora: tuple[int, int] | None = None) -> None:
    """ValueError when the kernels cannot run this model and pool, or its KV arrays
    (with the stacked LoRA weights of `lora` = (max_loras, max_lora_rank)), block
    tables and host-tier pages cannot fit in memory (device memory when the device
    reports it, else host memory)."""
    import prefixcache_kernels as kernels
    from prefixcache._validate import check_host_memory
    from prefixcache.kv_dtypes import kv_bytes_per_block
    from prefixcache.model import check_kv_cache_memory

    try:
        kernels.check_backend_config(
            attention_backend, interpret=bool(interpret), page_size=block_size,
            head_dim=config.head_dim, num_q_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads, q_dtype=config.dtype,
            kv_dtype=config.dtype if kv_dtype is None else kv_dtype)
    except ValueError as e:
        # NOTE: the kernels' page is the engine's block: a page-size limit is refused
        # under the name the user gave it.
        if "page_size" not in str(e):
            raise
        raise ValueError(f"block_size={block_size} is not supported by attention_backend="
                         f"{attention_backend!r} (the block is the kernel's KV page, "
                         f"page_size): {e}") from None
    extra = ()
    if lora is not None:
        from prefixcache.model.lora import TARGET_MODULES, lora_weights_nbytes

        max_loras, max_lora_rank = lora
        extra = ((f"the stacked LoRA weights (max_loras={max_loras} + 1 slots x "
                  f"max_lora_rank={max_lora_rank}: A and B of {len(TARGET_MODULES)} "
                  f"modules x {config.num_layers} layers, {config.dtype})",
                  lora_weights_nbytes(config, max_loras=max_loras,
                                      max_lora_rank=max_lora_rank)),)
    try:
        check_kv_cache_memory(config, num_blocks + 1, block_size, kv_dtype, mesh=mesh,
                              extra=extra)
    except ValueError as e:
        raise ValueError(f"num_blocks={num_blocks} (block_size={block_size}, plus the padding "
                         f"page) does not fit: {e}") from None
    check_host_memory(f"the block tables of max_num_seqs={max_num_seqs}",
                      max_num_seqs * 32 * 4)
    if num_host_blocks:
        # A host slot holds what a device block does: values and, quantized, scales
        # (a page of each KV array: `kv_group_size` layers, all of a plain model's).
        page_bytes = kv_bytes_per_block(
            num_layers=config.kv_group_size, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, block_size=block_size,
            kv_dtype=config.dtype if kv_dtype is None else kv_dtype)
        check_host_memory(f"the host tier's {num_host_blocks} pages", num_host_blocks
                          * page_bytes)


def _replicated(mesh):
    from jax.sharding import NamedSharding, PartitionSpec
    return NamedSharding(mesh, PartitionSpec())


def model_kv_cache_groups(config) -> tuple:
    """The KV cache groups an Engine builds for `config`'s layers: `config.kv_groups`
    (vLLM's rule: equal-size groups whose i-th layers share one KV array; the step's
    per-group metadata has the same order) as `KVCacheGroup`s over the layer names
    ``"layers.{i}"``, full attention or sliding window as each layer attends.

    A layout of one's own for an Engine (``CacheConfig(kv_cache_groups=...)``: group
    kinds of one's own package, whose spec class names its ``manager_class``) starts
    from this one and keeps its groups, their layers and each group's
    ``sliding_window``; only the spec's kind (which blocks its manager keeps, hits and
    frees) is the user's.
    """
    from prefixcache.core.kv_groups import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec

    groups = getattr(config, "kv_groups", None) or (
        (None, tuple(range(config.num_layers))),)
    return tuple(
        KVCacheGroup(FullAttentionSpec() if w is None else SlidingWindowSpec(w),
                     tuple(f"layers.{i}" for i in layers))
        for w, layers in groups)


def _check_given_groups(given, layout: tuple) -> tuple:
    """A user's ``kv_cache_groups`` for the Engine: checked, and grouping the model's
    layers as ``layout`` (`model_kv_cache_groups`) does, each group with its window."""
    from prefixcache.core.kv_groups import (  # noqa: PLC0415
        check_kv_cache_groups,
        needs_aligned_prefill,
    )

    given = check_kv_cache_groups(given)
    if needs_aligned_prefill(given):
        raise ValueError(
            "kv_cache_groups has a state-space (Mamba) group: the engine's model has no "
            "state-space layers, so it cannot run one; study the layout with "
            "prefixcache.sim.replay.replay(kv_cache_groups=...)")
    want = [(tuple(g.layer_names), g.spec.sliding_window) for g in layout]
    got = [(tuple(g.layer_names), getattr(g.spec, "sliding_window", None)) for g in given]
    if got != want:
        raise ValueError(
            "kv_cache_groups must group the model's layers as the model attends: "
            f"{[(list(n), w) for n, w in want]} as (layer names, sliding_window) per group, "
            f"got {[(list(n), w) for n, w in got]} (start from "
            "prefixcache.engine.model_kv_cache_groups(model_config) and change the specs' "
            "kind only)")
    return given


def _kv_cache_groups(config, *, eviction: str, index: str, given=None) -> tuple | None:
    """The KV cache groups of the Engine's manager: None for a model whose layers all
    attend in full (the one-group manager) unless the user gave a layout (``given``:
    group kinds of their own, `_check_given_groups`); else `model_kv_cache_groups`.

    Raises:
      ValueError: a layout that does not match the model's layers, a sliding-window
        model with an index the hybrid managers do not serve, or a combination the one
        rule refuses (checked before anything is built; the policy's options are the
        manager's to check, before the model runner).
    """
    layout = model_kv_cache_groups(config)
    if given is not None:
        layout = _check_given_groups(given, layout)
    elif len(layout) == 1 and layout[0].spec.sliding_window is None:
        return None
    windows = sorted({g.spec.sliding_window for g in layout} - {None})
    # NOTE: both indexes serve sliding-window layers (hash: vLLM's hybrid manager;
    # radix: core/radix_hybrid.py, SGLang's SWA radix cache), with every online eviction
    # policy and its options (the one rule below says what is refused, and why).
    if index not in ("hash", "radix") and not isinstance(index, type):
        raise ValueError(f"sliding-window layers (window {windows}) need index='hash' or "
                         f"'radix' (the hybrid KV cache managers) or an index class; got "
                         f"index={index!r}")
    from prefixcache.core.indexes import refusal  # noqa: PLC0415

    why = refusal(index, layout, eviction, 0)  # (the host tier: checked by the caller)
    if why is not None:
        what = f"sliding-window layers (window {windows})" if windows else "kv_cache_groups"
        raise ValueError(f"{what}: {why}")
    return layout


def _as_token_list(prompt) -> list[int]:
    from prefixcache._validate import check_int_sequence

    if isinstance(prompt, (bytes, bytearray, memoryview)):
        # NOTE: iterating bytes gives ints 0..255: text passed as bytes would run as
        # token ids silently (a tokenizer's job).
        raise ValueError(f"prompt must be a list of token ids, got {type(prompt).__name__} "
                         "(encode text with a tokenizer first)")
    # Strings, sets, dicts: their order or element type is not a prompt's.
    check_int_sequence("prompt", prompt)
    try:
        tokens = list(prompt)
    except TypeError as e:
        raise ValueError(f"prompt must be a list of token ids, got {type(prompt).__name__}"
                         ) from e
    if not tokens:
        raise ValueError("prompt is empty")
    out = []
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"prompt token ids must be ints, got {t!r}")
        out.append(int(t))
    return out


def _check_tokenizer(tokenizer, model_config) -> None:
    if tokenizer is None:
        return
    from prefixcache.text import Tokenizer

    if not isinstance(tokenizer, Tokenizer):
        raise ValueError("tokenizer must be a prefixcache.text.Tokenizer (e.g. "
                         f"Tokenizer.from_pretrained(path)), got {type(tokenizer).__name__}")
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's "
                         f"vocabulary only {model_config.vocab_size}: a different model's "
                         "tokenizer?")


def _in_vocab(token_ids, vocab_size: int) -> list[int]:
    # NOTE: a model's embedding may have more rows than its tokenizer has tokens (padded
    # vocabularies); a sampled padding id has no text.
    return [t for t in token_ids if t < vocab_size]


class _RequestText:
    """A request's streaming detokenizer (for its stop strings) and how many of its
    output ids it has read."""

    __slots__ = ("detok", "num_read", "vocab_size")

    def __init__(self, tokenizer, prompt_token_ids, params: SamplingParams):
        self.detok = tokenizer.detokenizer(
            _in_vocab(prompt_token_ids, tokenizer.vocab_size),
            skip_special_tokens=params.skip_special_tokens, stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output)
        self.num_read = 0
        self.vocab_size = tokenizer.vocab_size

    def update(self, output_token_ids) -> bool:
        """Reads the new output ids; True when a stop string just matched."""
        if self.detok.stopped or self.num_read == len(output_token_ids):
            return False
        new = output_token_ids[self.num_read:]
        self.num_read = len(output_token_ids)
        self.detok.push(_in_vocab(new, self.vocab_size))
        return self.detok.stopped

    def finish(self) -> str:
        if not self.detok.stopped:
            self.detok.flush()
        return self.detok.text


def _derive_seed(engine_seed: int, request_id: str) -> int:
    # NOTE: a pure function of (engine seed, request id), so a request samples the same
    # tokens whatever order or batch it runs in.
    return zlib.crc32(f"{engine_seed}:{request_id}".encode()) & 0xFFFFFFFF


def _model_max_len(config) -> int | None:
    for name in ("max_position_embeddings", "max_seq_len", "max_model_len"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _init_model(config, seed: int):
    from flax import nnx
    from prefixcache.model import Transformer

    # NOTE: with a mesh, make_step_fn lays the params out over it (in place).
    return Transformer(config, rngs=nnx.Rngs(seed))


def _reuse_groups(groups: dict[str, list[int]]) -> dict[str, dict]:
    """``{name: {requests, prompt_tokens, cached_tokens, token_hit_rate}}`` of admitted
    requests (``EngineMetrics.per_tenant`` / ``per_adapter``)."""
    return {k: {"requests": n, "prompt_tokens": p, "cached_tokens": c,
                "token_hit_rate": c / p if p else 0.0}
            for k, (n, p, c) in sorted(groups.items())}
