"""A converted copy of a GGUF file's dequantized weights, kept on disk.

Dequantizing a GGUF file costs most of its load (SmolLM2-135M Q4_1: ~10 CPU seconds of
`gguf.quants.dequantize`). The first load writes the converted weights -- the stacked
model's params in `config.dtype`, one `.npy` file each -- into

    <cache dir>/converted/<sha256 of the GGUF file>-<dtype>-v<FORMAT_VERSION>/

(cache dir: `PREFIXCACHE_CACHE_DIR`, else `~/.cache/prefixcache`), and later loads of the
same file bytes and dtype read them back instead (`prefixcache.model.gguf.load_gguf(...,
converted_cache=...)`).

A copy is written into a temporary directory beside its final name and renamed into
place once complete (a reader never sees a partial copy; of two processes converting
the same file at once, the first rename wins). `manifest.json` lists every file with its
shape, dtype and CRC-32; a copy whose manifest, files, shapes or checksums do not match
is removed and the weights are converted again (a corrupt copy is a miss, never wrong
weights).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prefixcache.model.config import ModelConfig
from prefixcache.model.llama import Transformer, abstract_transformer, set_layer_stack

__all__ = ["FORMAT_VERSION", "converted_dir", "default_cache_dir", "file_sha256",
           "load_converted", "save_converted"]

FORMAT_VERSION = 1
_log = logging.getLogger(__name__)


def default_cache_dir() -> str:
    """`PREFIXCACHE_CACHE_DIR` when set, else `~/.cache/prefixcache`."""
    env = os.environ.get("PREFIXCACHE_CACHE_DIR")
    return env if env else os.path.join(os.path.expanduser("~"), ".cache", "prefixcache")


def file_sha256(path: str) -> str:
    """Hex sha256 of a file's bytes (read in 8 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return h.hexdigest()


def converted_dir(cache_dir: str, sha256: str, dtype: str) -> str:
    """Where the copy of the file with this sha256, converted to `dtype`, lives."""
    return os.path.join(os.fspath(cache_dir), "converted",
                        f"{sha256}-{jnp.dtype(dtype).name}-v{FORMAT_VERSION}")


def _named_leaves(model: Transformer) -> dict[str, jax.Array]:
    """The stacked model's arrays by dotted path ("embedding", "layer_stack.attn.q_proj")."""
    state = nnx.state(model, nnx.Not(nnx.PathContains("layers")))
    return {_dotted(path): x for path, x in jax.tree_util.tree_leaves_with_path(state)}


def _bits(a: np.ndarray) -> np.ndarray:
    """`a` as plain numpy bytes .npy can write (bfloat16 as uint16, bit for bit)."""
    if a.dtype.kind == "V" or a.dtype.name == "bfloat16":
        return a.view(np.uint16)
    return a


def save_converted(model: Transformer, directory: str) -> bool:
    """Writes the stacked `model`'s params as a converted copy at `directory` (temp dir +
    rename). Returns False, logging why, when the copy could not be written (a full
    disk, no permission) or another process wrote it first; the model is unaffected.

    Raises:
      ValueError: a model that is not stacked.
    """
    if not model.stacked:
        raise ValueError("save_converted writes the stacked layout: stack_layers(model) first")
    parent = os.path.dirname(os.path.abspath(directory))
    tmp = os.path.join(parent, f".tmp-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        os.makedirs(tmp)
        files = {}
        for name, x in _named_leaves(model).items():
            a = np.ascontiguousarray(jax.device_get(x))
            raw = _bits(a)
            np.save(os.path.join(tmp, name + ".npy"), raw, allow_pickle=False)
            files[name] = {"shape": list(a.shape), "dtype": jnp.dtype(a.dtype).name,
                           "crc32": zlib.crc32(memoryview(raw).cast("B"))}
        manifest = {"format_version": FORMAT_VERSION, "config": repr(model.config),
                    "files": files}
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f)
        os.rename(tmp, directory)  # (fails when another process renamed first)
        return True
    except OSError as e:
        _log.warning("converted weights not written to %s (%s): the next load converts "
                     "again", directory, e)
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def load_converted(config: ModelConfig, directory: str) -> Transformer | None:
    """The stacked model from the converted copy at `directory`, or None when there is
    none or it fails a check (the broken copy is then removed, logged)."""
    manifest_file = os.path.join(directory, "manifest.json")
    if not os.path.isfile(manifest_file):
        return None
    model = abstract_transformer(config)
    try:
        with open(manifest_file) as f:
            manifest = json.load(f)
        if (manifest.get("format_version") != FORMAT_VERSION
                or manifest.get("config") != repr(config)):
            raise ValueError("another format version or model config")
        files = manifest["files"]
        dt = jnp.dtype(config.dtype)
        want = {n: (x.shape, x.dtype) for n, x in _abstract_named(model).items()}
        if set(files) != set(want):
            raise ValueError(f"params {sorted(set(files) ^ set(want))} differ")
        arrays = {}
        for name, (shape, dtype) in want.items():
            meta = files[name]
            if tuple(meta["shape"]) != tuple(shape) or meta["dtype"] != jnp.dtype(dtype).name:
                raise ValueError(f"{name}: {meta['dtype']}{meta['shape']} is not "
                                 f"{jnp.dtype(dtype).name}{list(shape)}")
            raw = np.load(os.path.join(directory, name + ".npy"), mmap_mode="r",
                          allow_pickle=False)
            if zlib.crc32(memoryview(np.ascontiguousarray(raw)).cast("B")) != meta["crc32"]:
                raise ValueError(f"{name}: checksum mismatch")
            a = raw.view(dt) if raw.dtype == np.uint16 and dt.name == "bfloat16" else raw
            if a.shape != tuple(shape) or a.dtype != dt:
                raise ValueError(f"{name}: file holds {a.dtype}{a.shape}")
            arrays[name] = jnp.asarray(a)
    except (OSError, ValueError, KeyError, TypeError) as e:
        _log.warning("converted weights at %s are unusable (%s): converting again",
                     directory, e)
        shutil.rmtree(directory, ignore_errors=True)
        return None
    rest = nnx.state(model, nnx.Not(nnx.PathContains("layers")))
    nnx.update(model, _fill(rest, arrays, ""))
    return set_layer_stack(model, _fill(nnx.state(model.layers[0]), arrays, "layer_stack."))


def _abstract_named(model: Transformer) -> dict[str, jax.ShapeDtypeStruct]:
    """`_named_leaves` of the stacked model `model` (abstract) would have: the shapes."""
    L = model.config.num_layers
    out = {}
    rest = nnx.state(model, nnx.Not(nnx.PathContains("layers")))
    for path, x in jax.tree_util.tree_leaves_with_path(rest):
        out[_dotted(path)] = x
    for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model.layers[0])):
        out["layer_stack." + _dotted(path)] = jax.ShapeDtypeStruct((L, *x.shape), x.dtype)
    return out


def _dotted(path) -> str:
    keys = [str(getattr(k, "key", "")) for k in path]
    return ".".join(k for k in keys if k and k != "value")


def _fill(state, arrays: dict, prefix: str):
    return jax.tree_util.tree_map_with_path(lambda p, _: arrays[prefix + _dotted(p)], state)
