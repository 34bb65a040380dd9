"""KV cache dtypes and their memory accounting (host only, no jax).

The paged KV cache stores K and V in one of `KV_DTYPES`:

* ``bfloat16`` / ``float32``: the values themselves (no scales).
* ``float8_e4m3fn`` / ``int8``: quantized, symmetric, round-to-nearest with
  saturation, one float32 scale per (page, kv head) for K and one for V
  (`kernels.write_kv` quantizes, the attention kernels dequantize). The scales of a
  layer are an f32 array ``[num_pages, 2 * num_kv_heads]`` next to its pages, so a
  quantized block costs ``2 * num_kv_heads * 4`` bytes per layer on top of its
  values.

`kv_bytes_per_block` is the one formula every byte budget goes through (the engine's
memory check, `experiments.sweep_capacity` / `experiments.compare_policies`
``--kv_bytes``, the engine's ``kv_cache_bytes``); `num_blocks_for_bytes` turns a
budget into a block count, `num_pool_blocks_for_bytes` into the allocatable blocks of
a device pool that also keeps padding pages (the engine's: one).
"""

from __future__ import annotations

import fractions
import re

from prefixcache._validate import ArgumentTypeError, check_count

__all__ = [
    "KV_DTYPES",
    "QUANTIZED_KV_DTYPES",
    "SCALE_BYTES",
    "check_kv_dtype",
    "is_quantized",
    "kv_bytes_per_block",
    "kv_dtype_itemsize",
    "num_blocks_for_bytes",
    "num_pool_blocks_for_bytes",
    "parse_bytes",
]

KV_DTYPES = ("bfloat16", "float32", "float8_e4m3fn", "int8")
QUANTIZED_KV_DTYPES = ("float8_e4m3fn", "int8")
_ITEMSIZE = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "int8": 1}
SCALE_BYTES = 4  # one float32 scale per (page, K or V of a kv head)


def check_kv_dtype(kv_dtype) -> str:
    """The canonical name of a KV dtype (a name or anything with ``.name``/``str``).

    Raises:
      ValueError: not one of `KV_DTYPES`.
    """
    name = getattr(kv_dtype, "name", None) or getattr(kv_dtype, "__name__", None)
    name = name if isinstance(name, str) else kv_dtype
    if not isinstance(name, str) or name not in KV_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; expected one of {KV_DTYPES}")
    return name


def is_quantized(kv_dtype) -> bool:
    """Whether pages of this dtype carry per-(page, kv head) scales."""
    return check_kv_dtype(kv_dtype) in QUANTIZED_KV_DTYPES


def kv_dtype_itemsize(kv_dtype) -> int:
    """Bytes of one stored K or V element."""
    return _ITEMSIZE[check_kv_dtype(kv_dtype)]


def kv_bytes_per_block(*, num_layers: int, num_kv_heads: int, head_dim: int,
                       block_size: int, kv_dtype) -> int:
    """Device bytes of one KV block over all layers, scales included.

    ``num_layers * (block_size * 2 * num_kv_heads * head_dim * itemsize
    + [quantized] 2 * num_kv_heads * SCALE_BYTES)``.
    """
    # (as Python ints: numpy ints would wrap around silently in the products)
    num_layers, num_kv_heads, head_dim, block_size = (
        check_count(name, v, min=1)
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("block_size", block_size)))
    values = block_size * 2 * num_kv_heads * head_dim * kv_dtype_itemsize(kv_dtype)
    scales = 2 * num_kv_heads * SCALE_BYTES if is_quantized(kv_dtype) else 0
    return num_layers * (values + scales)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value) -> int:
    """A byte count from an int or a string such as ``"2GiB"``, ``"512MB"``, ``"1.5e9"``.

    Raises:
      ValueError: not a positive byte count.
    """
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read a byte count from {value!r}; expected e.g. "
                             "'2GiB', '512MiB', '1e9' or an int")
        # NOTE: exact (Fraction, not float: "9007199254740993" stays that int), with
        # the magnitude bounded first (a float's: "1e400" is inf, and 10**1e9 would hang).
        approx = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if not approx < 2.0**128:
            raise ValueError(f"byte count {value!r} is too large (> 2**128 bytes)")
        n = fractions.Fraction(m.group(1)) * _UNITS[m.group(2).lower()]
        if n.denominator != 1:
            raise ValueError(f"byte count {value!r} is not a whole number of bytes")
        value = int(n)
    try:
        return check_count("kv_bytes", value, min=1)
    except ArgumentTypeError as e:
        raise ValueError(str(e)) from None


def num_blocks_for_bytes(kv_bytes, bytes_per_block: int) -> int:
    """Whole blocks a budget of ``kv_bytes`` holds.

    Raises:
      ValueError: the budget does not hold one block.
    """
    budget = parse_bytes(kv_bytes)
    bytes_per_block = check_count("bytes_per_block", bytes_per_block, min=1)
    if budget < bytes_per_block:
        raise ValueError(f"a KV budget of {budget} bytes is smaller than one block "
                         f"({bytes_per_block} bytes); give at least {bytes_per_block}")
    return budget // bytes_per_block


def num_pool_blocks_for_bytes(kv_bytes, bytes_per_block: int, *,
                              num_padding_pages: int = 1) -> int:
    """Allocatable blocks of a paged KV pool that fits in ``kv_bytes``.

    The pool allocates its blocks plus ``num_padding_pages`` pages of the same size
    (the engine's KV arrays have ``num_blocks + 1`` pages: page 0 pads the block
    tables), so the result is the largest ``n`` with
    ``(n + num_padding_pages) * bytes_per_block <= kv_bytes``.

    Raises:
      ValueError: a bad budget (`parse_bytes`), or one that does not hold one block and
        the padding pages.
    """
    budget = parse_bytes(kv_bytes)
    bytes_per_block = check_count("bytes_per_block", bytes_per_block, min=1)
    num_padding_pages = check_count("num_padding_pages", num_padding_pages)
    need = (1 + num_padding_pages) * bytes_per_block
    if budget < need:
        raise ValueError(
            f"a KV budget of {budget} bytes holds no allocatable block: a block is "
            f"{bytes_per_block} bytes and the pool also keeps {num_padding_pages} padding "
            f"page(s) of that size; give at least {need} bytes")
    return budget // bytes_per_block - num_padding_pages
