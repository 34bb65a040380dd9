"""The converted-weights cache of GGUF loads (prefixcache.model.converted): the first
load writes the dequantized stacked weights, the next load of the same bytes and dtype
reads them without dequantizing; a corrupt or partial copy is converted again."""
import json
import os
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

gguf = pytest.importorskip("gguf", reason="the gguf package (extra [gguf]) is not installed")

from prefixcache.model import converted  # noqa: E402
from prefixcache.model.gguf import load_gguf  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
FILE = str(DATA / "tiny_gguf" / "tiny_llama_q4_1.gguf")


def _leaves(model):
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(nnx.state(model))
            if isinstance(x, jax.Array)]


@pytest.fixture
def count_dequantize(monkeypatch):
    calls = []
    real = gguf.quants.dequantize

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf.quants, "dequantize", counted)
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_second_load_reads_the_copy(tmp_path, count_dequantize, dtype):
    _, want = load_gguf(FILE, dtype=dtype, progress=False)
    _, first = load_gguf(FILE, dtype=dtype, progress=False, converted_cache=tmp_path)
    where = converted.converted_dir(tmp_path, converted.file_sha256(FILE), dtype)
    assert os.path.isfile(os.path.join(where, "manifest.json"))
    assert not [p for p in os.listdir(os.path.dirname(where)) if p.startswith(".tmp")]
    count_dequantize.clear()
    config, second = load_gguf(FILE, dtype=dtype, progress=False, converted_cache=tmp_path)
    assert count_dequantize == []  # read back, not converted
    assert second.stacked and config.dtype == dtype
    for a, b, c in zip(_leaves(want), _leaves(first), _leaves(second)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert {jax.numpy.dtype(x.dtype).name for x in jax.tree.leaves(
        nnx.state(second.layer_stack))} == {dtype}


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_a_damaged_copy_is_converted_again(tmp_path, count_dequantize, damage):
    _, want = load_gguf(FILE, progress=False, converted_cache=tmp_path)
    where = converted.converted_dir(tmp_path, converted.file_sha256(FILE), "float32")
    target = os.path.join(where, "layer_stack.mlp.up_proj.npy")
    if damage == "flip":  # one flipped bit in the data
        raw = bytearray(open(target, "rb").read())
        raw[-5] ^= 0x10
        open(target, "wb").write(bytes(raw))
    elif damage == "truncate":
        os.truncate(target, os.path.getsize(target) // 2)
    else:
        m = json.load(open(os.path.join(where, "manifest.json")))
        m["files"].pop("embedding")
        json.dump(m, open(os.path.join(where, "manifest.json"), "w"))
    count_dequantize.clear()
    _, again = load_gguf(FILE, progress=False, converted_cache=tmp_path)
    assert count_dequantize  # converted again ...
    for a, b in zip(_leaves(want), _leaves(again)):
        np.testing.assert_array_equal(a, b)
    count_dequantize.clear()  # ... and the rewritten copy serves the next load
    load_gguf(FILE, progress=False, converted_cache=tmp_path)
    assert count_dequantize == []


def test_default_dir_and_bad_argument(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path))
    assert converted.default_cache_dir() == str(tmp_path)
    monkeypatch.delenv("PREFIXCACHE_CACHE_DIR")
    assert converted.default_cache_dir().endswith(os.path.join(".cache", "prefixcache"))
    with pytest.raises(ValueError, match="converted_cache must be a bool or a directory"):
        load_gguf(FILE, progress=False, converted_cache=3)
