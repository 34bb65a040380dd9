"""Validation of arguments at the package's public boundaries (host only, no jax).

One helper per kind of argument, so every entry point rejects the same mistakes with
the same message and BEFORE it changes any state:

* ``check_count(name, value, min=0)``: a count or size (tokens, blocks, sequences).
  Python ``int`` and numpy integer scalars are accepted (returned as ``int``); bools,
  floats (also integral ones such as ``np.float64(10.0)``), strings, None are not.
* ``check_int_sequence(name, values)``: token ids / block ids given as a sequence:
  ordered containers only (list, tuple, range, ``array.array``, 1-D integer numpy
  arrays, other ``Sequence`` types); sets, dicts and other mappings, strings and
  bytes are rejected because their iteration order or element type is not the
  caller's intent.
* ``check_token_array(name, values)``: token ids given as a numpy array: 1-D, of an
  integer dtype, none negative.
* ``check_host_memory(what, nbytes)``: an allocation the caller is about to make
  (a block pool, a KV array) fits in the memory the machine has; refused up front
  with a message naming the sizes instead of exhausting memory part way.

* ``check_positive_int(name, value, optional=False)``: a size (``num_blocks``,
  ``block_size``, a model dimension, ``max_tokens``): the same int rule, >= 1.
* ``check_int(name, value)``: an int of any sign (a priority).
* ``check_bool(name, value)``: an on/off option: ``True``/``False`` (numpy bools
  accepted); ``"no"``, ``0``, ``None`` refused (``"no"`` would be truthy).
* ``check_path(name, value)``: a file or directory: ``str`` or ``os.PathLike``
  (``pathlib.Path``), returned as ``str``.
* ``check_request`` / ``check_arrival`` / ``held_state`` / ``check_release_inputs``:
  the managers' request arguments -- ``on_arrival(request, index)`` and
  ``free(request)`` follow ONE rule in every index, layout and tier.

The rule for numbers, everywhere a count is taken (managers, ``CacheConfig``,
``ModelConfig``, ``make_kv_caches``, ``replay``, ``Engine``, ``SamplingParams``,
``LoRARequest``, ``Request``): Python ``int`` and numpy integer scalars are ints
(converted to ``int`` where stored); ``bool`` is never an int.

Type errors raise `ArgumentTypeError`, which is both a ``TypeError`` and a
``ValueError``: callers written against either (``run_cli`` catches ValueError,
Python convention says TypeError) see it.
"""

from __future__ import annotations

import array
import collections.abc
import os
from typing import Any

import numpy as np

__all__ = [
    "ArgumentTypeError",
    "available_host_memory",
    "check_arrival",
    "check_bool",
    "check_count",
    "check_hash_seed",
    "check_host_memory",
    "check_int",
    "check_int_sequence",
    "check_path",
    "check_positive_int",
    "check_release_inputs",
    "check_request",
    "check_token_array",
    "held_state",
]

# The int types a count may have: Python int (not bool) and numpy integer scalars.
_NP_INT = np.integer


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a ``TypeError`` and a ``ValueError``)."""


def check_count(name: str, value: Any, *, min: int = 0) -> int:  # noqa: A002 - as the brief
    """``value`` as an ``int`` >= ``min``, or an error naming ``name``.

    Raises:
      ArgumentTypeError: not an int (bool, float -- even ``10.0`` --, str, None, ...).
      ValueError: an int below ``min``.
    """
    t = type(value)
    if t is not int:
        if t is bool or not isinstance(value, (int, _NP_INT)) or isinstance(value, np.bool_):
            raise ArgumentTypeError(
                f"{name} must be an int, got {value!r} of type {t.__name__}")
        value = int(value)
    if value < min:
        raise ValueError(f"{name} must be >= {min}, got {value}")
    return value


_UNORDERED = (collections.abc.Set, collections.abc.Mapping)


def check_int_sequence(name: str, values: Any) -> None:
    """Raise unless ``values`` is an ordered container that may hold int ids.

    Only the container is checked here (O(1)); element types are checked by the
    caller's conversion (``array('q', ...)`` / numpy dtype checks at C speed).

    Raises:
      ArgumentTypeError: a set, frozenset, dict or other mapping, str / bytes-like, a
        non-iterable, or a numpy array that is not 1-D of an integer dtype.
    """
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise ArgumentTypeError(
                f"{name} must be a 1-D integer array, got dtype {values.dtype} shape "
                f"{values.shape}")
        return
    if type(values) in (list, tuple, range, array.array):
        return
    # NOTE: bytes-like prompts (bytes, bytearray, memoryview) are text, not token ids:
    # refused, never read as one id per byte.
    if isinstance(values, (str, bytes, bytearray, memoryview)) or isinstance(values, _UNORDERED):
        raise ArgumentTypeError(
            f"{name} must be an ordered sequence of int ids (list, tuple, 1-D int array), "
            f"got {type(values).__name__}")
    if not hasattr(values, "__iter__"):
        raise ArgumentTypeError(
            f"{name} must be a sequence of int ids, got {type(values).__name__}")


def check_token_array(name: str, values: np.ndarray) -> None:
    """Raise unless the numpy array ``values`` holds token ids: 1-D, of an integer
    dtype, none negative (one ``min`` at C speed; ids of an unsigned dtype skip it).

    Raises:
      ArgumentTypeError: not 1-D or not of an integer dtype (as `check_int_sequence`).
      ValueError: a negative id (the message names the smallest).
    """
    check_int_sequence(name, values)
    if values.size and values.dtype.kind == "i" and values.min() < 0:
        raise ValueError(f"{name}: negative token id {int(values.min())}")


def available_host_memory() -> int | None:
    """Bytes of host memory available for new allocations (Linux ``MemAvailable``;
    else physical pages), or None when it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _gib(n: int | float) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_host_memory(what: str, nbytes: int, *, available: int | None = None) -> None:
    """Raise ``ValueError`` when allocating ``nbytes`` for ``what`` cannot fit in host memory.

    Args:
      what: names the allocation and the arguments that size it (for the message).
      nbytes: bytes about to be allocated.
      available: bytes available (default: `available_host_memory()`; when that is
        unknown the check passes).
    """
    if available is None:
        available = available_host_memory()
    if available is not None and nbytes > available:
        raise ValueError(
            f"{what} needs about {_gib(nbytes)} of host memory but only {_gib(available)} "
            "is available; use a smaller size")


def check_hash_seed(hash_seed: Any) -> None:
    """Raise unless ``hash_seed`` is None, a str, an int or bytes.

    The seed enters the root of every block hash as ``str(seed)``; the str of an
    arbitrary object (``object()``, a function, ...) carries its memory address, so
    its hashes -- and every cache hit against another process -- change from run to
    run. Floats are refused too (``str`` of a float is exact, but a seed read back
    from a config as 1.0 vs 1 would hash differently).

    Raises:
      ArgumentTypeError: (a TypeError) naming the seed's type and value.
    """
    if hash_seed is None or isinstance(hash_seed, (str, bytes)):
        return
    if isinstance(hash_seed, (int, np.integer)) and not isinstance(hash_seed, (bool, np.bool_)):
        return
    raise ArgumentTypeError(
        f"hash_seed must be None, a str, an int or bytes (reproducible across processes), "
        f"got {type(hash_seed).__name__} {hash_seed!r}")


def check_positive_int(name: str, value: Any, *, optional: bool = False) -> int | None:
    """``value`` as an ``int`` >= 1 (None passes when ``optional``), or an error naming
    ``name``: the one rule for a size or length (a pool's blocks, a block's tokens, a
    model's dimensions, a sampling budget). Python ints and numpy integer scalars are
    accepted and returned as ``int`` (so the value compares, hashes and serializes as an
    int); bools, floats (even integral ones), strings are refused.

    Raises:
      ArgumentTypeError: not an int (a ``TypeError`` and a ``ValueError``).
      ValueError: an int below 1.
    """
    if value is None and optional:
        return None
    what = "a positive int or None" if optional else "a positive int"
    t = type(value)
    if t is not int:
        if t is bool or isinstance(value, np.bool_) or not isinstance(value, (int, _NP_INT)):
            raise ArgumentTypeError(f"{name} must be {what}, got {value!r}")
        value = int(value)
    if value < 1:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


def check_int(name: str, value: Any) -> int:
    """``value`` as an ``int`` of any sign (a priority, a seed offset): Python ints and
    numpy integer scalars accepted (returned as ``int``); bools, floats, None refused
    with an ``ArgumentTypeError`` naming ``name``."""
    t = type(value)
    if t is int:
        return value
    if t is bool or isinstance(value, np.bool_) or not isinstance(value, (int, _NP_INT)):
        raise ArgumentTypeError(f"{name} must be an int, got {value!r} of type {t.__name__}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a ``bool`` (Python or numpy bool), or an ``ArgumentTypeError``
    naming ``name``: an on/off option never takes ``"no"`` (truthy), ``0`` or None."""
    if type(value) is bool:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise ArgumentTypeError(
        f"{name} must be a bool (True or False), got {value!r} of type {type(value).__name__}")


def check_path(name: str, value: Any) -> str:
    """``value`` as a non-empty ``str`` path: a ``str`` or any ``os.PathLike`` whose
    ``os.fspath`` is a str (``pathlib.Path``), the one rule for every argument that
    names a file or directory. Bytes paths are refused (a path that enters block keys
    or a JSON row must be text).

    Raises:
      ArgumentTypeError: not a str / PathLike, or a PathLike of bytes.
      ValueError: the empty path.
    """
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ArgumentTypeError(
            f"{name} must be a path (a str or os.PathLike), got {value!r} of type "
            f"{type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must be a non-empty path, got ''")
    return value


def _request_type():
    from prefixcache.core.request import Request  # noqa: PLC0415 - (core imports this module)

    return Request


def check_request(name: str, value: Any) -> None:
    """Raise ``ArgumentTypeError`` unless ``value`` is a prefixcache ``Request`` (an id,
    a prompt or None is not: the call needs the object's tokens and hashes)."""
    if not isinstance(value, _request_type()):
        raise ArgumentTypeError(
            f"{name} must be a prefixcache Request, got {value!r} of type "
            f"{type(value).__name__}")


def check_arrival(request: Any, index: Any) -> int:
    """The one rule for ``on_arrival(request, index)`` on every manager: a ``Request``
    and the trace position as an int >= 0 (numpy ints accepted); raises before the
    policy sees either."""
    check_request("on_arrival: request", request)
    return check_count("on_arrival: index", index)


def held_state(states: Any, request: Any) -> tuple[Any, Any]:
    """``(request_id, state)``: the state ``states`` (request id -> state with a
    ``.request``) holds for ``request``: the one rule for ``free(request)`` on every
    manager.

    ``request`` is the admitted ``Request`` object or its id (any hashable, as
    ``Request.request_id``). Refused before any change, with a ``ValueError``:
      * an id (of any type, unhashable included) that holds no blocks;
      * a ``Request`` whose id holds blocks for ANOTHER ``Request`` object (a copy or
        a re-built request: freeing it would release the blocks of the one running).
    """
    if isinstance(request, _request_type()):
        rid = request.request_id
        st = states.get(rid)
        if st is not None and st.request is not request:
            raise ValueError(
                f"request {rid!r}: this Request object is not the one holding blocks under "
                "that id (another object with the same id was admitted); free the admitted "
                "object or free by id")
    else:
        rid = request
        try:
            st = states.get(rid)
        except TypeError:  # an unhashable id: not one of ours
            st = None
    if st is None:
        raise ValueError(f"unknown request id {rid!r}: it holds no blocks")
    return rid, st


def check_release_inputs(request: Any) -> None:
    """Raise ``ValueError`` unless what a release reads from ``request`` is well formed
    (today: ``priority``, which the ``priority`` policy compares on every block it
    releases). Called by every manager's ``free`` before it changes anything, so a
    value forced past ``Request.priority``'s setter (``req._priority = None``) is
    refused whole, never half way through the release loop. (``allocate_slots`` makes
    the same check: the policy reads the priority when it caches a block.)"""
    p = getattr(request, "_priority", getattr(request, "priority", 0))
    if type(p) is not int:
        raise ValueError(
            f"request {getattr(request, 'request_id', '?')!r}: priority={p!r} is not an int "
            "(set it through Request.priority); nothing changed")
