"""KV byte budgets for the capacity experiments (``--kv_bytes`` / ``--kv_dtype``).

A budget is converted to a block count with the model preset's bytes per block for
the KV dtype (`prefixcache.kv_dtypes.kv_bytes_per_block`: values plus, for fp8 /
int8, the per-(page, kv head) f32 scales), so one budget holds about twice the blocks
in fp8 as in bf16. Rows then carry ``kv_dtype``, ``bytes_per_block`` and
``kv_bytes`` (the bytes of the blocks actually used: ``num_blocks * bytes_per_block``)
and ``kv_bytes_budget`` (the budget asked for, or None), so hit rate per GiB of KV can
be compared across dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence


def parse_kv_dtypes(value) -> tuple[str, ...]:
    """Comma-separated KV dtypes (or a sequence), each one of ``KV_DTYPES``."""
    from prefixcache.kv_dtypes import check_kv_dtype  # noqa: PLC0415

    items = [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) \
        else list(value) if isinstance(value, (list, tuple)) else [value]  # (one value)
    if not items:
        raise ValueError(f"kv_dtype must name at least one KV dtype, got {value!r}")
    return tuple(dict.fromkeys(check_kv_dtype(i) for i in items))


def parse_budgets(value) -> tuple[int, ...]:
    """Comma-separated byte budgets ("2GiB,512MiB", ints), sorted and unique; "" -> ()."""
    from prefixcache.kv_dtypes import parse_bytes  # noqa: PLC0415

    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value]
    items = [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) \
        else list(value) if isinstance(value, (list, tuple)) else [value]  # (one value)
    return tuple(sorted({parse_bytes(i) for i in items}))


def bytes_per_block(model: str, block_size: int, kv_dtype: str) -> int:
    """Bytes of one block of ``model``'s KV (a ``prefixcache.sim.cost_model`` preset)."""
    from prefixcache.kv_dtypes import kv_bytes_per_block  # noqa: PLC0415
    from prefixcache.sim.cost_model import ModelShape  # noqa: PLC0415

    if not model:
        raise ValueError("a KV byte budget or kv_dtype needs a model preset for the bytes "
                         "per block (config.model, e.g. 'llama_3_2_1b')")
    shape = ModelShape.preset(model)
    return kv_bytes_per_block(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                              head_dim=shape.head_dim, block_size=block_size,
                              kv_dtype=kv_dtype)


def resolve(*, capacities, kv_bytes, kv_dtype, model: str, block_size: int
            ) -> list[tuple[str, int, int, int | None]]:
    """The (kv_dtype, num_blocks, bytes_per_block, budget) of every capacity to run.

    Either block counts (``capacities``) or byte budgets (``kv_bytes``), not both;
    budgets are converted per dtype (``budget // bytes_per_block`` blocks).

    Raises:
        ValueError: both or neither given, an unknown dtype or model, a bad budget, or a
            budget smaller than one block -- before anything runs.
    """
    from prefixcache.kv_dtypes import num_blocks_for_bytes  # noqa: PLC0415

    budgets = parse_budgets(kv_bytes) if kv_bytes not in (None, "") else ()
    has_caps = bool(capacities) and capacities != ""
    if budgets and has_caps:
        raise ValueError("give the cache size as capacities (blocks) or kv_bytes (bytes), "
                         f"not both (capacities={capacities!r}, kv_bytes={kv_bytes!r})")
    if not budgets and not has_caps:
        raise ValueError("give the cache size as capacities (blocks) or kv_bytes (bytes)")
    dtypes = parse_kv_dtypes(kv_dtype)
    out = []
    for dt in dtypes:
        bpb = bytes_per_block(model, block_size, dt)
        if budgets:
            out += [(dt, num_blocks_for_bytes(b, bpb), bpb, b) for b in budgets]
        else:
            out += [(dt, int(c), bpb, None) for c in _caps(capacities)]
    return out


def _caps(capacities) -> Sequence[int]:
    from prefixcache.sim.compare import parse_capacities  # noqa: PLC0415

    return parse_capacities(capacities)


def row_fields(kv_dtype: str, num_blocks: int, bytes_per_block: int,
               budget: int | None) -> dict:
    """The KV fields every capacity row carries."""
    return {"kv_dtype": kv_dtype, "bytes_per_block": bytes_per_block,
            "kv_bytes": num_blocks * bytes_per_block, "kv_bytes_budget": budget}
