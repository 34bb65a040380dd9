"""One cell of a policy comparison: a replay of one trace under one (policy, index, capacity).

``experiments.compare_policies`` runs a grid of these cells in worker processes (or on a
Ray cluster); everything a cell computes is here, so a notebook can run one cell the
same way.

* ``policy_names()`` / ``index_names()``: the names a grid may use (the registries of
  ``prefixcache.core.eviction`` and ``prefixcache.core.indexes``).
* ``parse_names`` / ``parse_capacities``: comma-separated flag values, validated.
* ``check_replay_supports``: whether ``prefixcache.sim.replay.replay`` can run a
  (policy, index); a clear ``ValueError`` otherwise, before anything runs.
* ``resolve_policy_variants``: a grid's policies as labels -> (policy, options): a
  registered name, or a label of ``policy_variants`` (``{"eviction": name, "options":
  {...}}``), each variant's options checked by building its policy before any cell.
* ``replay_cell``: the replay of one cell; ``ideal_num_blocks``: a capacity at which
  nothing is ever evicted (the infinite-cache ideal).
* ``cell_row``: the row a cell publishes.

Host only: never imports jax.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

IDEAL = "ideal"  # the ``record`` of the infinite-cache row
HASH_INDEX = "hash"

# Fields of a cell's row taken from the replay summary as they are.
_SUMMARY_FIELDS = ("requests", "admitted", "failed", "prompt_tokens", "hit_tokens",
                   "hit_rate_tokens", "requests_with_hit", "evictions", "stranded_blocks",
                   "peak_cached_blocks", "mean_cached_blocks")
# ... and the cached bytes, which the replay reports with a model only (else None).
_BYTES_FIELDS = ("peak_cached_bytes", "mean_cached_bytes")
# Fields that are timings (they differ between runs; everything else must not).
TIMING_FIELDS = ("loop_s", "cell_s")


def policy_names() -> tuple[str, ...]:
    """The eviction policies registered in ``prefixcache.core.eviction``."""
    from prefixcache.core import eviction  # noqa: PLC0415

    return eviction.policy_names()


def index_names() -> tuple[str, ...]:
    """The prefix indexes registered in ``prefixcache.core.indexes``."""
    from prefixcache.core import indexes  # noqa: PLC0415

    return indexes.index_names()


def parse_names(value: str | Sequence[str], *, known: Sequence[str], what: str) -> tuple[str, ...]:
    """Comma-separated names (or a sequence), validated against ``known``.

    ``"all"`` means every known name. Order is kept, duplicates dropped.

    Raises:
        ValueError: empty, or a name not in ``known`` (the message names it and the
            choices).
    """
    names = [s.strip() for s in value.split(",")] if isinstance(value, str) else list(value)
    names = [n for n in names if n]
    if names == ["all"]:
        return tuple(known)
    if not names:
        raise ValueError(f"no {what} given; expected names from {tuple(known)} or 'all'")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown {what} {', '.join(map(repr, unknown))}; "
                         f"expected one of {tuple(known)} (or 'all')")
    return tuple(dict.fromkeys(names))


def parse_capacities(value: str | Sequence[int]) -> tuple[int, ...]:
    """Comma-separated block counts (or a sequence of ints), each >= 1, sorted, unique.

    Raises:
        ValueError: empty, not an int, or < 1.
    """
    items = [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) else list(value)
    out = []
    for item in items:
        try:
            n = int(item)
        except (TypeError, ValueError):
            n = None
        if n is None or isinstance(item, bool) or str(n) != str(item).strip() or n < 1:
            raise ValueError(f"capacities must be comma-separated positive block counts, got {value!r}")
        out.append(n)
    if not out:
        raise ValueError(f"capacities must name at least one block count, got {value!r}")
    return tuple(sorted(set(out)))


def check_replay_supports(policy: str, index: str, *, model: str | None = None) -> None:
    """Raises ``ValueError`` unless ``policy`` and ``index`` are registered names and
    ``model`` (when given) is a ``ModelShape`` preset: a cell asking for anything else
    fails here, before the grid runs."""
    from prefixcache.core.cache_config import CacheConfig  # noqa: PLC0415

    CacheConfig(eviction=policy, index=index)  # unknown names -> ValueError
    if model:
        from prefixcache.cost_model import ModelShape  # noqa: PLC0415

        ModelShape.preset(model)  # ValueError naming the presets


def check_policy_options(label: str, policy: str, options: dict, *, block_size: int) -> None:
    """Builds ``policy`` with ``options`` once (a tiny pool): an option it does not take
    or a bad value is a ``ValueError`` naming ``policy_variants[label]``."""
    from prefixcache.core.eviction import get_policy_class, make_policy  # noqa: PLC0415

    kw = {"block_size": block_size} if get_policy_class(policy).needs_block_size else {}
    try:
        make_policy(policy, num_blocks=2, **kw, **options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"policy_variants[{label!r}]: {e}") from None


def resolve_policy_variants(policies: Sequence[str], variants: dict | None, *,
                            block_size: int, extra_keys: Sequence[str] = (),
                            offline: bool = True) -> dict[str, dict]:
    """The grid's policies as ``{label: {"eviction": name, "options": dict, ...}}``.

    Args:
        policies: the labels, in order: a registered policy name (no options) or a key
            of ``variants``.
        variants: ``{label: {"eviction": name, "options": {...}}}`` (plain dicts; a
            label must not be a registered name); entries no label uses are not read.
        block_size: tokens per block (for policies that take it).
        extra_keys: further keys a variant may carry, returned as given (a study's own,
            e.g. ``hybrid_state``'s ``"tune"``).
        offline: a policy that needs the trace's future (``belady``) may be in the grid
            (without options: the replay builds its future); ``False``: refused.

    Raises:
        ValueError: an unknown label, a malformed variant, options its policy refuses
            (``policy_variants[label]: ...``), before anything runs.
    """
    from prefixcache.core.eviction import POLICIES, get_policy_class  # noqa: PLC0415

    variants = dict(variants or {})
    allowed = {"eviction", "options", *extra_keys}
    for label in variants:
        if label in POLICIES:
            raise ValueError(f"policy_variants[{label!r}]: {label!r} is a registered "
                             "policy's name; give the variant a label of its own")
    out: dict[str, dict] = {}
    for label in policies:
        v = variants.get(label)
        if v is None:
            entry = {"eviction": label, "options": {}}
        else:
            if (not isinstance(v, dict) or set(v) - allowed or "eviction" not in v
                    or not isinstance(v.get("options") or {}, dict)):
                extra = "".join(f", '{k}': ..." for k in extra_keys)
                raise ValueError(f"policy_variants[{label!r}] must be {{'eviction': name, "
                                 f"'options': {{...}}{extra}}}, got {v!r}")
            entry = {**v, "options": dict(v.get("options") or {})}
        cls = get_policy_class(entry["eviction"])  # unknown -> ValueError naming the choices
        if cls.needs_future:
            if not offline:
                raise ValueError(f"policy {label!r} needs the trace's future: not in this "
                                 "study")
            if entry["options"]:
                raise ValueError(f"policy_variants[{label!r}]: {entry['eviction']} takes no "
                                 "options here (the replay builds its future)")
        elif entry["options"]:
            check_policy_options(label, entry["eviction"], entry["options"],
                                 block_size=block_size)
        out[label] = entry
    return out


def replay_cell(make_requests: Callable[[], Iterable], *, policy: str, index: str,
                num_blocks: int, block_size: int, model: str | None = None,
                eviction_options: dict | None = None, **replay_kwargs) -> dict:
    """Replays the trace once under (``policy``, ``index``, ``num_blocks``).

    Args:
        make_requests: returns a fresh iterator over the trace (a policy that needs the
            future reads it twice: it gets this callable itself; every other policy one
            iterator).
        policy, index: registered names (``check_replay_supports`` is applied).
        num_blocks, block_size: the cache.
        model: a ``ModelShape`` preset name, for cached bytes (``None``: no bytes).
        eviction_options: the policy's options (``None``: its defaults).
        **replay_kwargs: ``hash_algo``, ``hash_seed``, ``free_order``, ``concurrency``,
            ``max_model_len``.

    Returns:
        The replay's summary.
    """
    from prefixcache.core.eviction import get_policy_class  # noqa: PLC0415
    from prefixcache.sim.replay import replay  # noqa: PLC0415

    check_replay_supports(policy, index, model=model)
    kwargs = dict(replay_kwargs, num_blocks=num_blocks, block_size=block_size,
                  eviction=policy, index=index)
    if eviction_options:
        kwargs["eviction_options"] = dict(eviction_options)
    if model:
        kwargs["model"] = model
    # NOTE: an offline bound needs the future: the replay reads the trace twice.
    requests = make_requests if get_policy_class(policy).needs_future else make_requests()
    return replay(requests, **kwargs)


def ideal_num_blocks(requests: Iterable, block_size: int) -> int:
    """A capacity at which the replay never evicts: every block any request may allocate.

    A request holds at most ``ceil((prompt + output_len) / block_size)`` blocks (the last
    sampled token is never allocated, so this is an upper bound); their sum over the
    trace is more than the replay can ever need at once, so every block that was ever
    cached stays cached.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    total = sum(math.ceil((len(r.prompt) + max(r.output_len, 1)) / block_size) for r in requests)
    return max(total, 1)


def cell_row(summary: dict, *, policy: str, index: str, num_blocks: int, block_size: int,
             concurrency: int, model: str | None = None, record: str = "cell",
             eviction: str | None = None, eviction_options: dict | None = None) -> dict:
    """The published row of one cell: ``summary``'s fields (the replay's, a
    ``KeyError`` for a missing one), ``peak_cached_bytes`` / ``mean_cached_bytes`` None
    when the replay ran without a model. ``policy`` is the cell's label; ``eviction`` /
    ``eviction_options`` the policy and options it ran (default: ``policy``, none)."""
    from prefixcache.core.indexes import index_name  # noqa: PLC0415

    row: dict[str, Any] = {"record": record, "policy": policy,
                           "eviction": policy if eviction is None else eviction,
                           "eviction_options": dict(eviction_options or {}),
                           "index": index_name(index),
                           "num_blocks": num_blocks, "block_size": block_size,
                           "capacity_tokens": num_blocks * block_size,
                           "concurrency": concurrency}
    for field in _SUMMARY_FIELDS:
        row[field] = summary[field]
    for field in _BYTES_FIELDS:
        row[field] = summary.get(field)
    row["model"] = model or None
    row["loop_s"] = summary["timing"]["loop_s"]
    return row
