"""Shared building blocks of the experiment configs (not a config itself).

Every experiment reads its requests through ``experiments._common.requests_from_config``:
``dataset`` (a public trace by name, ``prefixcache.sim.datasets``: downloaded once into
``$PREFIXCACHE_DATA``, checksum verified), ``trace`` (a file), neither to generate;
``trace_format``, ``max_requests`` (0: all),
``seed`` and ``workload.name`` / ``workload.kwargs`` (a generator of
``prefixcache.sim.workloads``, or ``mooncake_scale``).
"""

import dataclasses

import ml_collections

# Default kwargs per generated workload (the generators' own defaults, spelled out so
# they can be overridden as --config.workload.kwargs.<name>=...).
WORKLOAD_KWARGS = {
    "shared_system_prompt": dict(num_requests=2000, system_len=1024, unique_len=(64, 512),
                                 output_len=(16, 64), vocab=32000),
    "multi_turn": dict(num_conversations=300, num_turns=6, new_tokens=(50, 200),
                       output_len=(16, 128), vocab=32000),
    "few_shot": dict(num_headers=10, num_questions=200, header_len=3000,
                     question_len=(30, 80), output_len=(16, 64), vocab=32000),
    "mm_salt": dict(num_requests=500, prefix_len=10, image_len=576, num_images=5,
                    num_salts=4, num_loras=2, suffix_len=(32, 256), output_len=(16, 64),
                    vocab=32000),
    "rag": dict(num_requests=1000, num_documents=200, doc_len=(256, 1024), docs_per_request=2,
                zipf_a=1.1, system_len=256, question_len=(16, 64), output_len=(16, 128),
                vocab=32000),
    "tenant_prefixes": dict(num_requests=3000, num_tenants=150, prefix_len=6000,
                            question_len=(128, 1024), output_len=(64, 256), vocab=32000,
                            arrival_rate=20.0),
    "mooncake_scale": dict(num_requests=20000),
}


QUICK = "quick"


def variant(arg) -> bool:
    """Whether ``get_config(arg)`` asks for the quick variant (``--config=<file>:quick``).

    Raises:
      ValueError: ``arg`` is neither empty nor ``"quick"``.
    """
    if arg in (None, ""):
        return False
    if arg != QUICK:
        raise ValueError(f"unknown config variant {arg!r}: expected ':{QUICK}' or nothing")
    return True


def requests_config(workload: str = "shared_system_prompt", *, trace: str = "", dataset: str = "",
                    seed: int = 0, max_requests: int = 0, **kwargs) -> ml_collections.ConfigDict:
    """The request-source fields shared by all experiments.

    Args:
      workload: generator name (ignored when ``trace`` is set, but kept so it can be
        switched on the command line).
      trace: a trace file; "" to generate ``workload`` (or read ``dataset``).
      dataset: a public trace by name (``prefixcache.sim.datasets.DATASETS``);
        exclusive with ``trace``.
      seed: workload seed (and the run's seed).
      max_requests: 0 for all requests, N for the first N.
      **kwargs: overrides of the workload's default kwargs.
    """
    c = ml_collections.ConfigDict()
    c.seed = seed
    c.trace = trace
    c.dataset = dataset
    c.trace_format = "auto"
    c.max_requests = max_requests
    c.workload = ml_collections.ConfigDict()
    c.workload.name = workload
    c.workload.kwargs = ml_collections.ConfigDict({**WORKLOAD_KWARGS[workload], **kwargs})
    if workload == "mooncake_scale":
        c.workload.path = ""  # "" -> <workdir>/mooncake_scale-<digest>.jsonl
    c.workdir = ""
    return c


def cache_defaults(c: ml_collections.ConfigDict, *names: str) -> None:
    """Set ``c.<name>`` to ``prefixcache.CacheConfig``'s default for each cache field in
    ``names`` (the one table of defaults: nothing spelled twice), in a ConfigDict's
    form: a ``None`` default as ``""`` (text fields) or ``0`` (``num_blocks``,
    ``max_model_len``), which ``CacheConfig.from_config_dict`` reads back as ``None``."""
    from prefixcache.core.cache_config import CacheConfig  # noqa: PLC0415

    fields = {f.name: f for f in dataclasses.fields(CacheConfig)}
    for name in names:
        value = fields[name].default
        if value is None:
            value = 0 if name in ("num_blocks", "max_model_len", "page_bytes") else ""
        setattr(c, name, value)


def replay_config(workload: str = "shared_system_prompt", *, trace: str = "", dataset: str = "",
                  num_blocks: int = 4096, block_size: int = 16, concurrency: int = 8,
                  **kwargs) -> ml_collections.ConfigDict:
    """A config of ``experiments.replay``."""
    c = requests_config(workload, trace=trace, dataset=dataset, **kwargs)
    c.num_blocks = num_blocks
    c.block_size = block_size
    # hash_algo, hash_seed ("" -> the algorithm's default root), free_order, eviction
    # (prefixcache.core.eviction.POLICIES; belady: the offline bound), index
    # (prefixcache.core.indexes.INDEXES), num_host_blocks (host-memory tier slots under
    # the device cache; 0 -> none), host_eviction (not belady), max_model_len (0 -> no
    # limit): CacheConfig's defaults.
    cache_defaults(c, "hash_algo", "hash_seed", "free_order", "eviction", "index",
                   "num_host_blocks", "host_eviction", "max_model_len")
    # Below the host tier (prefixcache.core.tiers; 0: none): disk_bytes, remote_bytes in
    # bytes of pages of page_bytes (0 -> the model's block bytes: needs model).
    cache_defaults(c, "disk_bytes", "disk_eviction", "remote_bytes", "remote_eviction",
                   "page_bytes")
    c.model = ""  # a cost_model preset: report cache memory in bytes ("" -> blocks only)
    c.concurrency = concurrency
    # Why each missed prompt block missed (prefixcache.core.misses): records get
    # miss_reasons (reason -> blocks), the summary the totals.
    c.miss_reasons = False
    # Block residency (prefixcache.core.residency): the share of block hashes tracked,
    # in (0, 1] (1.0: every block); the summary gets per-tier histograms of lifetime,
    # idle time before eviction, reuse gap and hits per stay. 0.0 -> off.
    c.residency = 0.0
    c.out = ""  # "" -> <workdir>/requests.jsonl when a workdir is given
    return c


def route_config(workload: str = "tenant_prefixes", *, trace: str = "", dataset: str = "",
                 **kwargs) -> ml_collections.ConfigDict:
    """A config of ``experiments.route``."""
    c = requests_config(workload, trace=trace, dataset=dataset, **kwargs)
    c.replicas = "1,2,4,8"  # comma-separated, as the --replicas flag
    c.policies = "random,round_robin,least_loaded,session,cache_aware,kv_events"
    c.num_blocks = 0  # per replica; 0 -> all HBM left after the weights
    c.block_size = 16
    c.model = "llama_3_1_8b"
    c.accelerator = "h100"
    c.num_chips = 1
    c.max_num_batched_tokens = 8192
    c.max_num_seqs = 256
    c.time_scale = 1.0
    c.arrival_rate = 0.0  # 0 -> the trace's timestamps
    # hash_algo, eviction (every replica's policy, prefixcache.core.eviction), and the
    # host-memory tier per replica (num_host_blocks, 0: none; host_eviction):
    # CacheConfig's defaults. Host loads go over host_link (cost_model.HOST_LINKS);
    # kv_events scores host blocks at host_weight ("auto": 1 - load/prefill of a block).
    cache_defaults(c, "hash_algo", "eviction", "num_host_blocks", "host_eviction")
    # Below the host tier (0: none): a disk per replica and one remote store shared by
    # every replica, in bytes (pages of the model's block size; prefixcache.core.tiers).
    cache_defaults(c, "disk_bytes", "disk_eviction", "remote_bytes", "remote_eviction")
    c.host_link = "h200_pcie5"
    c.host_weight = "auto"
    return c
