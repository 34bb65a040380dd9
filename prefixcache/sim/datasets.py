"""Public request traces by name: download once, verify, reuse.

A dataset is a named public trace with its upstream URL and the SHA-256 of its bytes.
``path_of(name)`` returns a local, checksum-verified copy:

1. ``local_path`` given: that file, verified against the registry's checksum (nothing
   is copied or downloaded);
2. else ``<data_dir>/<name>/<file name>`` when it exists (a previous download, or a
   copy placed there by hand), verified;
3. else the file is downloaded from its URL (a tqdm bar with the size when the server
   sends it) into a temporary file beside the destination, verified, and only then
   renamed into place -- an interrupted or corrupt download never looks complete.

``data_dir()`` is ``$PREFIXCACHE_DATA`` when set, else ``$XDG_CACHE_HOME/prefixcache``
(``~/.cache/prefixcache`` by default). Tests and CI never download: they point
``$PREFIXCACHE_DATA`` (or ``local_path``) at local copies and go through the same
checks.

Known datasets (``DATASETS``):

* ``mooncake_conversation``: the Mooncake FAST'25 conversation trace (12,031 requests,
  ~12k input tokens, real arrival times over one hour).
* ``mooncake_synthetic``: the Mooncake FAST'25 synthetic trace (3,993 requests, ~15k
  input tokens, Poisson arrivals).

Both are Apache-2.0, from kvcache-ai/Mooncake ``FAST25-release/traces/`` (Qin et al.,
"Mooncake: A KVCache-centric Disaggregated Architecture for LLM Serving", FAST'25),
Mooncake format (``prefixcache.sim.trace``), pinned to one upstream commit.

NOTE: the release's third trace (``toolagent_trace.jsonl``, tool and agent traffic) is
not registered: a dataset needs its checksum recorded here, and no copy of that file
was available when this registry was written. Add it with its SHA-256 once one is.

Command line (prefetch, e.g. before going offline; or install a local copy)::

    python -m prefixcache.sim.datasets list
    python -m prefixcache.sim.datasets fetch mooncake_conversation [--path FILE]

``fetch NAME --path FILE`` verifies FILE and installs it (``install``: copied to
``<data_dir>/<name>/<file name>``), so every experiment that names the dataset then
finds it without a download.

Host only: nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import tempfile
import types
import urllib.error
import urllib.request
from typing import Callable, Mapping

ENV_VAR = "PREFIXCACHE_DATA"

# The Mooncake commit the URLs are pinned to (the files' bytes cannot change under it).
_MOONCAKE_COMMIT = "3b5a594133958449a1feaf1c9e0fc1b553e34a28"
_MOONCAKE_RAW = (f"https://raw.githubusercontent.com/kvcache-ai/Mooncake/{_MOONCAKE_COMMIT}"
                 "/FAST25-release/traces")


@dataclasses.dataclass(frozen=True)
class Dataset:
    """One public trace.

    Attributes:
      name: registry key (what configs name).
      url: where its bytes come from (``https://`` or ``file://``).
      sha256: hex SHA-256 of the file's bytes.
      filename: the file name in the data directory.
      trace_format: how ``prefixcache.sim.trace.read_trace`` reads it.
      num_requests: requests (non-blank lines) in the file.
      description: one line for listings.
    """

    name: str
    url: str
    sha256: str
    filename: str
    trace_format: str
    num_requests: int
    description: str

    def __post_init__(self):
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"dataset {self.name!r}: sha256 must be 64 lowercase hex digits")


def _registry(*datasets: Dataset) -> Mapping[str, Dataset]:
    return types.MappingProxyType({d.name: d for d in datasets})


# NOTE: read-only (a mappingproxy of frozen records): no module-level mutable state.
# Checksums computed from the files at the pinned commit (identical to the copies the
# repository's tests use).
DATASETS: Mapping[str, Dataset] = _registry(
    Dataset(
        name="mooncake_conversation",
        url=f"{_MOONCAKE_RAW}/conversation_trace.jsonl",
        sha256="b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
        filename="conversation_trace.jsonl", trace_format="mooncake", num_requests=12031,
        description="Mooncake FAST'25 conversation trace: 12,031 requests, ~12k input "
                    "tokens, real arrivals (1 h)"),
    Dataset(
        name="mooncake_synthetic",
        url=f"{_MOONCAKE_RAW}/synthetic_trace.jsonl",
        sha256="bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
        filename="synthetic_trace.jsonl", trace_format="mooncake", num_requests=3993,
        description="Mooncake FAST'25 synthetic trace: 3,993 requests, ~15k input "
                    "tokens, Poisson arrivals"),
)

_CHUNK = 1 << 20


class DatasetError(ValueError):
    """A dataset cannot be provided (unknown name, bad checksum, no network)."""


def get(name: str, registry: Mapping[str, Dataset] | None = None) -> Dataset:
    """The registry entry of ``name``.

    Args:
      name: a dataset name.
      registry: default ``DATASETS``.

    Returns:
      The ``Dataset``.

    Raises:
      DatasetError: unknown name (the message lists the known ones).
    """
    registry = DATASETS if registry is None else registry
    if name not in registry:
        raise DatasetError(f"unknown dataset {name!r}; known: {', '.join(sorted(registry))}")
    return registry[name]


def data_dir(environ: Mapping[str, str] | None = None) -> pathlib.Path:
    """Where datasets are cached: ``$PREFIXCACHE_DATA``, else the user's cache dir.

    Args:
      environ: default ``os.environ``.

    Returns:
      ``$PREFIXCACHE_DATA``, or ``$XDG_CACHE_HOME/prefixcache``, or
      ``~/.cache/prefixcache`` (not created here).
    """
    environ = os.environ if environ is None else environ
    if environ.get(ENV_VAR):
        return pathlib.Path(environ[ENV_VAR]).expanduser()
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "prefixcache"


def sha256_of(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify(path: str | os.PathLike, dataset: Dataset) -> pathlib.Path:
    """Checks that ``path`` holds exactly ``dataset``'s bytes.

    Returns:
      ``path`` as a ``Path``.

    Raises:
      FileNotFoundError: no such file. DatasetError: checksum mismatch (the message
      names the file, both digests and the URL to fetch a good copy from).
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {dataset.name!r}: no file at {str(path)!r}")
    got = sha256_of(path)
    if got != dataset.sha256:
        raise DatasetError(
            f"dataset {dataset.name!r}: {str(path)!r} has sha256 {got}, expected "
            f"{dataset.sha256} (a different or damaged file; the original is at "
            f"{dataset.url})")
    return path


def path_of(name: str, *, local_path: str | os.PathLike | None = None,
            root: str | os.PathLike | None = None, download: bool = True,
            progress: bool = True, registry: Mapping[str, Dataset] | None = None,
            urlopen: Callable = urllib.request.urlopen) -> pathlib.Path:
    """A local, checksum-verified copy of the dataset ``name`` (see the module doc).

    Args:
      name: a dataset name (``DATASETS``).
      local_path: use (and verify) this file instead of the data directory.
      root: the data directory (default ``data_dir()``).
      download: fetch from the URL when there is no local copy; False -> error.
      progress: a tqdm bar while downloading.
      registry: default ``DATASETS`` (tests pass their own).
      urlopen: ``urllib.request.urlopen``-compatible opener (tests pass a fake).

    Returns:
      The file's path.

    Raises:
      DatasetError: unknown name, checksum mismatch, or no local copy and the
        download failed / was not allowed (the message names the URL, the expected
        location and ``$PREFIXCACHE_DATA``).
      FileNotFoundError: ``local_path`` does not exist.
    """
    dataset = get(name, registry)
    if local_path is not None:
        return verify(local_path, dataset)
    dest = pathlib.Path(root if root is not None else data_dir()) / dataset.name / dataset.filename
    if dest.is_file():
        return verify(dest, dataset)
    how = (f"download it from {dataset.url} to {str(dest)!r}, or set ${ENV_VAR} to a "
           f"directory holding {dataset.name}/{dataset.filename}")
    if not download:
        raise DatasetError(f"dataset {dataset.name!r} is not present locally; {how}")
    try:
        _download(dataset, dest, progress=progress, urlopen=urlopen)
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", None) or e
        raise DatasetError(
            f"dataset {dataset.name!r}: cannot download {dataset.url} ({reason}); {how}"
        ) from e
    return dest


def install(name: str, path: str | os.PathLike, *, root: str | os.PathLike | None = None,
            registry: Mapping[str, Dataset] | None = None) -> pathlib.Path:
    """Verifies a local copy of dataset ``name`` and installs it into the data directory.

    The file is copied (through a temporary file and a rename: never a half-written
    copy) to ``<root>/<name>/<file name>``, where ``path_of`` looks first. Nothing is
    copied when that file already is ``path`` or already holds the verified bytes.

    Args:
      name: a dataset name (``DATASETS``).
      path: the local copy.
      root: the data directory (default ``data_dir()``).
      registry: default ``DATASETS``.

    Returns:
      The installed file's path.

    Raises:
      DatasetError: unknown name or a checksum mismatch (nothing is installed).
      FileNotFoundError: ``path`` does not exist.
    """
    import shutil  # noqa: PLC0415

    dataset = get(name, registry)
    src = verify(path, dataset)
    dest = pathlib.Path(root if root is not None else data_dir()) / dataset.name / dataset.filename
    if dest.is_file() and (dest.samefile(src) or sha256_of(dest) == dataset.sha256):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out, open(src, "rb") as f:
            shutil.copyfileobj(f, out, _CHUNK)
        if sha256_of(tmp) != dataset.sha256:  # pragma: no cover - changed while copied
            raise DatasetError(f"dataset {name!r}: {str(src)!r} changed while it was copied")
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
        tmp = None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def _download(dataset: Dataset, dest: pathlib.Path, *, progress: bool,
              urlopen: Callable) -> None:
    """Downloads ``dataset`` to ``dest`` via a verified temporary file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, urlopen(dataset.url, timeout=60) as resp:
            size = resp.headers.get("Content-Length") if hasattr(resp, "headers") else None
            bar = None
            if progress:
                from tqdm.auto import tqdm  # noqa: PLC0415

                bar = tqdm(total=int(size) if size else None, unit="B", unit_scale=True,
                           unit_divisor=1024, desc=f"download {dataset.name}")
            try:
                while chunk := resp.read(_CHUNK):
                    out.write(chunk)
                    h.update(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
            finally:
                if bar is not None:
                    bar.close()
        if h.hexdigest() != dataset.sha256:
            raise DatasetError(
                f"dataset {dataset.name!r}: the download from {dataset.url} has sha256 "
                f"{h.hexdigest()}, expected {dataset.sha256}; nothing was kept")
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
        tmp = None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def main(argv: list[str] | None = None) -> int:
    """``list`` the datasets, or ``fetch NAME [--path FILE]`` (prints the local path;
    ``--path``: verify FILE and install it into the data directory).

    Returns:
      The exit status (errors: ``error: ...`` on stderr, status 1).
    """
    import argparse  # noqa: PLC0415
    import sys  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="python -m prefixcache.sim.datasets",
                                 description="Public request traces: list, fetch, verify.")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the known datasets and where they are cached")
    fetch = sub.add_parser("fetch", help="download (once) and verify; print the local path")
    fetch.add_argument("name", help="dataset name (see `list`)")
    fetch.add_argument("--path", default=None, help=f"verify this local copy instead and "
                       f"install it into the data directory (${ENV_VAR})")
    fetch.add_argument("--noprogress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if args.command == "list":
        print(f"data directory: {data_dir()} (${ENV_VAR})")
        for d in DATASETS.values():
            print(f"{d.name}: {d.description}\n  {d.url}\n  sha256 {d.sha256}")
        return 0
    try:
        if args.path is not None:
            print(install(args.name, args.path))
        else:
            print(path_of(args.name, progress=not args.noprogress))
    except (DatasetError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
