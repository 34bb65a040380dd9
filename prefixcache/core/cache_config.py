"""One typed cache configuration, validated once, taken by every driver.

    from prefixcache import CacheConfig, KVCacheManager

    cfg = CacheConfig(num_blocks=1024, block_size=16, eviction="lfu", index="radix")
    manager = KVCacheManager(**cfg.manager_kwargs())
    replay(trace, cache_config=cfg)                       # prefixcache.sim.replay
    simulate(trace, cost_model=cost, cache_config=cfg)    # prefixcache.sim.des
    simulate_cluster(trace, ..., cache_config=cfg)        # prefixcache.sim.cluster
    Engine(model_config, cache_config=cfg)                # prefixcache.engine
    cfg.replace(num_blocks=4096)                          # a sweep's next cell

``CacheConfig`` sits beside the scheduler's batching limits
(``prefixcache.sim.des.SchedulerConfig``): it holds what the KV cache *is* (block size,
pool size, hashing, eviction, index, host tier, groups), not how requests are batched.
Every field is checked once, in ``__post_init__`` (``ValueError`` / ``ArgumentTypeError``
naming the field), so a driver never re-validates, and a field added here reaches every
driver through ``manager_kwargs()`` (``tests/core/test_cache_config.py`` checks that each
driver takes ``cache_config`` and hands each field on).

The drivers keep their keywords (``replay(trace, num_blocks=..., block_size=...)``): they
are collected with `resolve` into one ``CacheConfig`` -- the keywords given override the
fields of ``cache_config`` when both are passed, so the config is the one path.

The pool's size is ``num_blocks`` or ``kv_cache_bytes`` (exactly one): a byte budget is
turned into blocks by the driver that knows the bytes of one block (the engine from the
model config and ``kv_dtype``; the simulators from the cost model's shape) with
`with_pool_blocks`.

Provenance: ``to_dict()`` is JSON-ready (groups as ``{"kind", "sliding_window",
"layer_names"}`` rows) and ``from_dict(to_dict())`` round-trips; ``from_config_dict``
reads an ``ml_collections.ConfigDict`` (or any mapping) of an experiment config, taking
the fields it names and ignoring the experiment's other keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from prefixcache._validate import ArgumentTypeError, check_count, check_hash_seed

__all__ = ["CacheConfig", "UNSET", "resolve"]


class _Unset:
    """The default of a driver keyword that was not given (see `resolve`)."""

    _instance = None

    def __new__(cls):
        # One instance, so ``is UNSET`` works across pickling and copies.
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<unset>"

    def __reduce__(self):
        return (_Unset, ())


UNSET: Any = _Unset()


def _check_bool(name: str, value: Any) -> bool:
    if type(value) is not bool:
        raise ArgumentTypeError(f"{name} must be a bool, got {value!r}")
    return value


def _check_name(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be a name (str), got {value!r}")
    return value


def _check_policy(name: str, value: Any) -> Any:
    """A policy name (str) or an ``EvictionPolicy`` subclass (a user's own plug-in)."""
    from prefixcache.core.eviction import is_policy_class  # noqa: PLC0415

    return value if is_policy_class(value) else _check_name(name, value)


def _check_index(value: Any) -> Any:
    """An index name (str) or an index class (a user's own plug-in, checked by
    ``indexes.check_index_class``)."""
    from prefixcache.core.indexes import is_index_class  # noqa: PLC0415

    return value if is_index_class(value) else _check_name("index", value)


def _check_options(name: str, value: Any) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ArgumentTypeError(f"{name} must be a mapping or None, got {value!r}")
    for k in value:
        if not isinstance(k, str):
            raise ArgumentTypeError(f"{name} keys must be option names (str), got {k!r}")
    return dict(value)


def _groups_to_rows(groups) -> list[dict]:
    # (a kind's own spec fields follow: MambaSpec's mamba_cache_mode, retention_interval)
    return [{"kind": g.spec.kind, "sliding_window": g.spec.sliding_window,
             "layer_names": list(g.layer_names), **dataclasses.asdict(g.spec)}
            for g in groups]


def _groups_from_value(value):
    """``kv_cache_groups`` from a tuple of groups, rows of `_groups_to_rows` or the
    ``"full,sw32"`` text of ``parse_kv_groups``."""
    from prefixcache.core import kv_groups as kg  # noqa: PLC0415

    if value is None or value == "":
        return None
    if isinstance(value, str):
        return kg.parse_kv_groups(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(r, Mapping) for r in value):
        groups = []
        for i, row in enumerate(value):
            kind = row.get("kind")
            if kind == kg.FullAttentionSpec.kind:
                spec = kg.FullAttentionSpec()
            elif kind == kg.SlidingWindowSpec.kind:
                spec = kg.SlidingWindowSpec(row.get("sliding_window"))
            elif kind in kg.GROUP_KINDS:  # another kind: its spec's fields from the row
                cls = kg.group_manager_class(kind).spec_class
                spec = cls(**{f.name: row[f.name] for f in dataclasses.fields(cls)
                              if f.name in row})
            else:
                raise ValueError(f"kv_cache_groups[{i}]: unknown kind {kind!r}")
            groups.append(kg.KVCacheGroup(spec, tuple(row.get("layer_names", ()))))
        return tuple(groups)
    return value


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV cache's configuration (frozen; every field checked in ``__post_init__``).

    Args:
      num_blocks: allocatable KV blocks (give this or ``kv_cache_bytes``).
      block_size: tokens per block.
      kv_cache_bytes: the pool as a byte budget (an int or ``"4GiB"``), turned into
        blocks by the driver (`with_pool_blocks`); exclusive with ``num_blocks``.
      kv_dtype: the KV arrays' dtype (``prefixcache.kv_dtypes.KV_DTYPES``; None: the
        model's). Sizes blocks for ``kv_cache_bytes``; the engine stores pages in it.
      enable_caching: automatic prefix caching on/off.
      hash_algo: block hash (``prefixcache.core.hashing.HASH_ALGOS``).
      hash_seed: seed of the hash chain root: None (``BlockHasher``'s default), a
        str, an int or bytes (``_validate.check_hash_seed``).
      free_order: ``"append"`` or vLLM's ``"unhashed_first"``.
      eviction: the device eviction policy (``prefixcache.core.eviction.POLICIES``), or
        an ``EvictionPolicy`` subclass of the user's own (no registration needed;
        ``to_dict`` records its ``name``).
      eviction_options: the policy's keyword options (a mapping or None).
      index: the prefix index (``prefixcache.core.indexes.INDEXES``), or an index class
        of the user's own (``INDEX_NAME`` and the manager protocol; no registration
        needed; ``to_dict`` records its ``INDEX_NAME``).
      num_host_blocks: host-tier slots under the device cache (0: none).
      host_eviction: the host tier's policy (any policy that needs no future; a name or
        a class, as ``eviction``).
      host_eviction_options: its options.
      disk_bytes: a disk tier under the host tier, in bytes (0: none;
        ``prefixcache.core.tiers``); it holds ``disk_bytes // page_bytes`` blocks.
      disk_eviction: the disk tier's policy (as ``host_eviction``).
      page_bytes: one block's KV page, every layer, in bytes (sizes the disk and remote
        tiers; None: the driver's model gives it).
      remote_bytes: a remote store under the host (and disk) tier, in bytes (0: none);
        a cluster shares one store of this size among its replicas.
      remote_eviction: the remote store's policy.
      tiers: tiers of one's own between the disk and the remote store: mappings with a
        ``"tier"`` item (a registered name or a ``KeyTier`` subclass) and its keywords.
      kv_cache_groups: the model's KV cache groups (``prefixcache.core.kv_groups``;
        None: one full-attention group).
      enable_events: the manager records KV cache events.
      max_model_len: longest request in tokens (None: no limit / the model's).
    """

    num_blocks: int | None = None
    block_size: int = 16
    kv_cache_bytes: int | str | None = None
    kv_dtype: str | None = None
    enable_caching: bool = True
    hash_algo: str = "sha256"
    hash_seed: int | str | None = None
    free_order: str = "append"
    eviction: str = "lru"
    eviction_options: Mapping[str, Any] | None = None
    index: str = "hash"
    num_host_blocks: int = 0
    host_eviction: str = "lru"
    host_eviction_options: Mapping[str, Any] | None = None
    disk_bytes: int = 0
    disk_eviction: str = "lru"
    page_bytes: int | None = None
    remote_bytes: int = 0
    remote_eviction: str = "lru"
    tiers: tuple | None = None
    kv_cache_groups: tuple | None = None
    enable_events: bool = False
    max_model_len: int | None = None

    # NOTE: the one place these options are checked. Imports are local so that
    # ``import prefixcache.core.cache_config`` stays cheap and cycle-free.
    def __post_init__(self):
        from prefixcache.core.block_pool import FREE_ORDERS  # noqa: PLC0415
        from prefixcache.core.eviction import get_policy_class, policy_name  # noqa: PLC0415
        from prefixcache.core.hashing import HASH_ALGOS  # noqa: PLC0415
        from prefixcache.core.indexes import get_index_class  # noqa: PLC0415
        from prefixcache.core.kv_groups import check_kv_cache_groups  # noqa: PLC0415

        def put(name, value):
            object.__setattr__(self, name, value)

        if self.num_blocks is not None:
            put("num_blocks", check_count("num_blocks", self.num_blocks, min=1))
        put("block_size", check_count("block_size", self.block_size, min=1))
        if self.kv_cache_bytes is not None:
            from prefixcache.kv_dtypes import parse_bytes  # noqa: PLC0415

            try:
                parse_bytes(self.kv_cache_bytes)
            except ValueError as e:
                raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes!r}: {e}") from None
            if self.num_blocks is not None:
                raise ValueError(
                    "give the KV pool's size as one of num_blocks (blocks) and kv_cache_bytes "
                    f"(bytes), not both; got num_blocks={self.num_blocks!r}, "
                    f"kv_cache_bytes={self.kv_cache_bytes!r}")
        if self.kv_dtype is not None:
            from prefixcache.kv_dtypes import check_kv_dtype  # noqa: PLC0415

            put("kv_dtype", check_kv_dtype(self.kv_dtype))
        _check_bool("enable_caching", self.enable_caching)
        _check_bool("enable_events", self.enable_events)
        if _check_name("hash_algo", self.hash_algo) not in HASH_ALGOS:
            raise ValueError(f"hash_algo: unknown hash algorithm {self.hash_algo!r}; valid: "
                             f"{', '.join(HASH_ALGOS)}")
        # hash_seed: None, a str, an int or bytes, as BlockHasher's (the one rule,
        # _validate.check_hash_seed: an object's str carries its address).
        check_hash_seed(self.hash_seed)
        if _check_name("free_order", self.free_order) not in FREE_ORDERS:
            raise ValueError(f"unknown free_order {self.free_order!r}; expected one of {FREE_ORDERS}")
        try:
            get_policy_class(_check_policy("eviction", self.eviction))
        except ValueError as e:
            raise ValueError(f"eviction: {e}") from None
        put("eviction_options", _check_options("eviction_options", self.eviction_options))
        try:
            get_index_class(_check_index(self.index))
        except ValueError as e:
            raise ValueError(f"index: {e}") from None
        put("num_host_blocks", check_count("num_host_blocks", self.num_host_blocks))
        try:
            host_cls = get_policy_class(_check_policy("host_eviction", self.host_eviction))
        except ValueError as e:
            raise ValueError(f"host_eviction: {e}") from None
        if host_cls.needs_future:
            raise ValueError(
                f"host_eviction={policy_name(self.host_eviction)!r} needs the trace's "
                "future, which the "
                "host tier never has; use a policy with needs_future=False")
        put("host_eviction_options",
            _check_options("host_eviction_options", self.host_eviction_options))
        if self.num_host_blocks and not self.enable_caching:
            raise ValueError(f"num_host_blocks={self.num_host_blocks} needs prefix caching "
                             "(enable_caching=True)")
        put("disk_bytes", check_count("disk_bytes", self.disk_bytes))
        put("remote_bytes", check_count("remote_bytes", self.remote_bytes))
        if self.page_bytes is not None:
            put("page_bytes", check_count("page_bytes", self.page_bytes, min=1))
        from prefixcache.core.tiers.base import check_tier_policy  # noqa: PLC0415

        for name in ("disk_eviction", "remote_eviction"):
            check_tier_policy(name, _check_policy(name, getattr(self, name)))
        if self.tiers is not None:
            if isinstance(self.tiers, (str, bytes, Mapping)) or not all(
                    isinstance(t, Mapping) and "tier" in t for t in self.tiers):
                raise ValueError(f"tiers must be a sequence of mappings with a 'tier' item, "
                                 f"got {self.tiers!r}")
            put("tiers", tuple(dict(t) for t in self.tiers) or None)
        if (self.disk_bytes or self.remote_bytes or self.tiers) and not self.num_host_blocks:
            raise ValueError("disk_bytes / remote_bytes / tiers need a host tier "
                             "(num_host_blocks > 0): a block reaches them when the host "
                             "evicts it")
        groups = _groups_from_value(self.kv_cache_groups)
        put("kv_cache_groups", None if groups is None else check_kv_cache_groups(groups))
        if self.max_model_len is not None:
            put("max_model_len", check_count("max_model_len", self.max_model_len, min=1))

    # -- derived -------------------------------------------------------------------

    @property
    def needs_future(self) -> bool:
        """The device policy needs the trace's future (an offline bound: replay only)."""
        from prefixcache.core.eviction import get_policy_class  # noqa: PLC0415

        return get_policy_class(self.eviction).needs_future

    def with_pool_blocks(self, bytes_per_block: int, *, num_padding_pages: int = 0
                         ) -> CacheConfig:
        """This config with ``num_blocks`` set: itself when it has one, else the blocks
        of ``bytes_per_block`` that ``kv_cache_bytes`` holds (``num_padding_pages``
        extra pages paid from the budget, as the engine's padding page)."""
        if self.num_blocks is not None:
            return self
        if self.kv_cache_bytes is None:
            raise ValueError("the KV pool's size is missing: give num_blocks (blocks) or "
                             "kv_cache_bytes (bytes)")
        from prefixcache.kv_dtypes import num_pool_blocks_for_bytes, parse_bytes  # noqa: PLC0415

        budget = parse_bytes(self.kv_cache_bytes)
        try:
            n = num_pool_blocks_for_bytes(budget, bytes_per_block,
                                          num_padding_pages=num_padding_pages)
        except ValueError as e:
            raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes!r}: {e}") from None
        return dataclasses.replace(self, num_blocks=n, kv_cache_bytes=None)

    def manager_kwargs(self) -> dict[str, Any]:
        """``KVCacheManager(**kwargs)`` keywords of this config (``num_blocks`` and
        ``block_size`` included; ``kv_cache_groups`` only when set, so one
        full-attention group builds exactly today's manager).

        Raises:
          ValueError: the pool is given in bytes only (call `with_pool_blocks` first).
        """
        if self.num_blocks is None:
            raise ValueError(
                "num_blocks is not set: the pool is given as kv_cache_bytes="
                f"{self.kv_cache_bytes!r}; resolve it with with_pool_blocks(bytes_per_block)"
                if self.kv_cache_bytes is not None else
                "the KV pool's size is missing: give num_blocks (blocks) or kv_cache_bytes")
        kw = {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "enable_caching": self.enable_caching,
            "hash_algo": self.hash_algo,
            "hash_seed": self.hash_seed,
            "free_order": self.free_order,
            "enable_events": self.enable_events,
            "max_model_len": self.max_model_len,
            "eviction": self.eviction,
            "eviction_options": None if self.eviction_options is None
            else dict(self.eviction_options),
            "index": self.index,
            "num_host_blocks": self.num_host_blocks,
            "host_eviction": self.host_eviction,
            "host_eviction_options": None if self.host_eviction_options is None
            else dict(self.host_eviction_options),
        }
        if self.kv_cache_groups is not None:
            kw["kv_cache_groups"] = self.kv_cache_groups
        # The tiers below the host only when asked for (each implementation that serves
        # no such tier keeps its keywords).
        if self.disk_bytes or self.remote_bytes or self.tiers:
            kw.update(disk_bytes=self.disk_bytes, disk_eviction=self.disk_eviction,
                      page_bytes=self.page_bytes, remote_bytes=self.remote_bytes,
                      remote_eviction=self.remote_eviction,
                      tiers=None if self.tiers is None else [dict(t) for t in self.tiers])
        return kw

    # -- building ------------------------------------------------------------------

    def replace(self, **changes) -> CacheConfig:
        """A copy with ``changes`` applied (checked again); unknown names raise."""
        unknown = sorted(set(changes) - _FIELD_NAMES)
        if unknown:
            raise ValueError(f"unknown CacheConfig field(s) {unknown}; "
                             f"expected some of {sorted(_FIELD_NAMES)}")
        if "num_blocks" in changes and changes["num_blocks"] is not None:
            changes.setdefault("kv_cache_bytes", None)
        elif changes.get("kv_cache_bytes") is not None:
            changes.setdefault("num_blocks", None)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (a provenance row); `from_dict` reads it back."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k in ("eviction_options", "host_eviction_options"):
            if d[k] is not None:
                d[k] = dict(d[k])
        from prefixcache.core.eviction import policy_name  # noqa: PLC0415

        for k in ("eviction", "host_eviction", "disk_eviction", "remote_eviction"):
            d[k] = policy_name(d[k])  # a plug-in class: its name
        if d["tiers"] is not None:
            d["tiers"] = [{k: (v.__name__ if isinstance(v, type) else v) for k, v in t.items()}
                          for t in d["tiers"]]
        from prefixcache.core.indexes import index_name  # noqa: PLC0415

        d["index"] = index_name(d["index"])
        if d["kv_cache_groups"] is not None:
            d["kv_cache_groups"] = _groups_to_rows(d["kv_cache_groups"])
        if d["hash_seed"] is not None and type(d["hash_seed"]) not in (int, str):
            d["hash_seed"] = str(d["hash_seed"])  # what the hasher uses: the same root
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CacheConfig:
        """The config of a `to_dict` row; unknown keys raise (a typo is not ignored)."""
        if not isinstance(d, Mapping):
            raise ArgumentTypeError(f"CacheConfig.from_dict needs a mapping, got {d!r}")
        unknown = sorted(set(d) - _FIELD_NAMES)
        if unknown:
            raise ValueError(f"unknown CacheConfig field(s) {unknown}; "
                             f"expected some of {sorted(_FIELD_NAMES)}")
        return cls(**d)

    @classmethod
    def from_config_dict(cls, config: Any, **overrides) -> CacheConfig:
        """The fields an experiment config (an ``ml_collections.ConfigDict`` or a
        mapping) names, plus ``overrides``; its other keys (workload, model, ...) are
        not the cache's and are ignored. As a ConfigDict's typed fields cannot hold
        None, an empty string means "unset" for the optional text fields and ``0`` /
        ``-1`` for ``num_blocks`` / ``max_model_len`` (``--config.hash_seed=``,
        ``--config.max_model_len=0``), and empty option mappings mean None."""
        if hasattr(config, "to_dict") and not isinstance(config, Mapping):
            config = config.to_dict()
        elif hasattr(config, "to_dict"):
            config = config.to_dict()
        if not isinstance(config, Mapping):
            raise ArgumentTypeError(
                f"from_config_dict needs a ConfigDict or a mapping, got {type(config).__name__}")
        kw = {k: config[k] for k in _FIELD_NAMES if k in config}
        kw.update(overrides)
        for k in ("kv_cache_bytes", "kv_dtype", "hash_seed", "kv_cache_groups", "tiers"):
            if kw.get(k) == "":
                kw[k] = None
        for k in ("max_model_len", "num_blocks", "page_bytes"):
            if type(kw.get(k)) is int and kw[k] in (0, -1):
                kw[k] = None
        for k in ("eviction_options", "host_eviction_options"):
            if kw.get(k) is not None and not kw[k]:
                kw[k] = None
        return cls(**kw)

    @classmethod
    def from_flags(cls, flag_values: Any = None, **overrides) -> CacheConfig:
        """The fields present as absl flags of the same names (``FLAGS.num_blocks``,
        ...; default: ``absl.flags.FLAGS``), plus ``overrides``."""
        if flag_values is None:
            from absl import flags  # noqa: PLC0415

            flag_values = flags.FLAGS
        names = set(flag_values) if hasattr(flag_values, "__iter__") else set()
        kw = {k: flag_values[k].value for k in _FIELD_NAMES if k in names}
        return cls.from_config_dict(kw, **overrides)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(CacheConfig))


def resolve(cache_config: CacheConfig | None, **keywords) -> CacheConfig:
    """The one config of a driver: ``cache_config`` (default ``CacheConfig()``) with the
    driver keywords that were given (not `UNSET`) applied.

    Raises:
      ArgumentTypeError: ``cache_config`` is not a ``CacheConfig``.
      ValueError / ArgumentTypeError: a bad field (named).
    """
    given = {k: v for k, v in keywords.items() if v is not UNSET}
    if cache_config is None:
        return CacheConfig(**given)
    if not isinstance(cache_config, CacheConfig):
        raise ArgumentTypeError(
            f"cache_config must be a prefixcache CacheConfig, got {type(cache_config).__name__}")
    return cache_config.replace(**given) if given else cache_config
