"""One entry point for real checkpoints by path: an HF directory or a GGUF file.

    from prefixcache.model import load_pretrained
    pre = load_pretrained(".../SmolLM2-135M-Instruct.Q4_1.gguf")
    pre.config, pre.model, pre.format, pre.tokenizer_path
"""
from __future__ import annotations

import dataclasses
import os
from typing import Literal

from prefixcache.model.config import ModelConfig
from prefixcache.model.llama import Transformer

__all__ = ["Pretrained", "load_pretrained"]

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """A loaded checkpoint.

    Attributes:
      config: the model's `ModelConfig`.
      model: the `Transformer` with the checkpoint's weights.
      source: the path it was loaded from (as given, `os.fspath`).
      format: "hf" (config.json + safetensors directory) or "gguf".
      tokenizer_path: where its tokenizer is (`prefixcache.text.Tokenizer.from_pretrained`
        takes it): the directory when it has tokenizer.json / tokenizer_config.json /
        tokenizer.model, the .gguf file when its metadata has `tokenizer.ggml.tokens`;
        None when there is none.
    """

    config: ModelConfig
    model: Transformer
    source: str
    format: Literal["hf", "gguf"]
    tokenizer_path: str | None


def load_pretrained(path: str | os.PathLike, *, dtype: str | None = None,
                    progress: bool = True, stacked: bool = True,
                    converted_cache: bool | str | os.PathLike = True) -> Pretrained:
    """Loads a checkpoint by path.

    Args:
      path: an HF checkpoint directory (config.json + *.safetensors, read by
        `load_hf_checkpoint`) or a `.gguf` file (`prefixcache.model.gguf.load_gguf`; any
        file whose first bytes are the GGUF magic counts, whatever its name).
      dtype: "float32" / "bfloat16" override (default: the checkpoint's for HF: bf16 for
        bf16/f16 checkpoints; float32 for GGUF, i.e. the dequantized values exactly).
      progress: a progress bar while converting a GGUF file's tensors.
      stacked: the layers' params in the stacked layout (`Transformer.stacked`: held
        once, as the default scanned step reads them), or False: one array per layer.
      converted_cache: GGUF files: keep the dequantized stacked weights on disk, keyed
        by the file's sha256 and the dtype, and read them back on the next load
        (`prefixcache.model.converted`; True: in `PREFIXCACHE_CACHE_DIR` or
        ~/.cache/prefixcache; a directory; False: convert every time).

    Raises:
      ValueError: a path that does not exist, a file that is not GGUF, or any error of
        the two loaders (named).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"checkpoint path must be a str or path, got {type(path).__name__}")
    src = os.fspath(path)
    if os.path.isdir(src):
        from prefixcache.model.loading import load_hf_checkpoint  # noqa: PLC0415

        config, model = load_hf_checkpoint(src, dtype=dtype, stacked=stacked)
        has_tok = any(os.path.isfile(os.path.join(src, f)) for f in _HF_TOKENIZER_FILES)
        return Pretrained(config, model, src, "hf", src if has_tok else None)
    if not os.path.isfile(src):
        raise ValueError(f"{src}: no such checkpoint (expected an HF directory or a .gguf "
                         "file)")
    from prefixcache.model.gguf import load_gguf_reader, read_gguf  # noqa: PLC0415

    reader = read_gguf(src)
    has_tok = "tokenizer.ggml.tokens" in reader.fields
    config, model = load_gguf_reader(reader, src, dtype=dtype, progress=progress,
                                     stacked=stacked, converted_cache=converted_cache)
    return Pretrained(config, model, src, "gguf", src if has_tok else None)
