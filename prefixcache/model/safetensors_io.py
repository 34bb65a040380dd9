"""Reading .safetensors files into numpy (bf16 too): shared by the checkpoint loader
(`prefixcache.model.loading`) and the LoRA adapter reader (`prefixcache.model.lora`).

NOTE: its own module, importing neither the model nor the loader, so that
`llama -> lora -> loading -> llama` is not an import cycle.
"""
from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import safetensors.numpy

__all__ = ["read_safetensors"]

# NOTE: safetensors.numpy has no bfloat16 (numpy lacks it); we read such files through
# their header ourselves and view the bytes as ml_dtypes.bfloat16.
_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors(filename: str) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as numpy arrays (bf16 as ml_dtypes.bfloat16).

    Raises:
      ValueError: unreadable header or an unknown dtype (named).
    """
    with open(filename, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{filename}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > os.fstat(f.fileno()).st_size - 8:  # (read(n) would allocate n bytes)
            raise ValueError(f"{filename}: bad safetensors header: its length {n} exceeds "
                             "the file")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{filename}: bad safetensors header: {e}") from None
    if not isinstance(header, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("dtype"), str)
            for k, v in header.items() if k != "__metadata__"):
        raise ValueError(f"{filename}: bad safetensors header: not an object of tensor "
                         "entries with a 'dtype' string")
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    if "BF16" not in dtypes:
        try:
            return dict(safetensors.numpy.load_file(filename))
        except safetensors.SafetensorError as e:
            raise ValueError(f"{filename}: bad safetensors file: {e}") from None
    unknown = dtypes - set(_ST_DTYPES)
    if unknown:
        raise ValueError(f"{filename}: unsupported safetensors dtypes {sorted(unknown)}")
    data = np.memmap(filename, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            out[name] = np.array(data[start:end]).view(_ST_DTYPES[info["dtype"]]).reshape(
                info["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{filename}: bad safetensors entry {name!r}: {e!r}") from None
    return out
