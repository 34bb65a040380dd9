"""GGUF reading shared by the weights loader and the tokenizer (numpy only, no jax)."""

from __future__ import annotations

import numpy as np


def plain_array_reader(gguf):
    """A `gguf.GGUFReader` subclass whose file buffer is a plain ndarray view of the
    memory map.

    NOTE: the reader slices its buffer once per metadata value (SmolLM2's vocabulary
    and merges: ~250k slices), and every slice of an `np.memmap` runs the subclass's
    Python `__array_finalize__`: 4.8 s of its 7.6 s load here; a plain view of the same
    pages reads the header in 1.7 s. Tensor data stay views of the map (not read).
    """
    class PlainArrayReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = np.asarray(value)  # (a view: the memmap stays its base)

    return PlainArrayReader
