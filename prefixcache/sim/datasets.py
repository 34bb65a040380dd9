"""Public request traces by name: download once, verify, reuse.

A dataset is a named public trace with its upstream URL, its format (the reader) and
block size (tokens per hash id: a replay of it uses that block size), and the SHA-256
of its bytes where one is known. ``path_of(name)`` returns a local, checksum-verified
copy:

1. ``local_path`` given: that file, verified against the expected checksum (nothing
   is copied or downloaded);
2. else ``<data_dir>/<name>/<file name>`` when it exists (a previous download, or a
   copy placed there by hand), verified;
3. else the file is downloaded from its URL (a tqdm bar with the size when the server
   sends it) into a temporary file beside the destination, verified, and only then
   renamed into place -- an interrupted or corrupt download never looks complete.

The expected checksum is the registry's (``sha256``) when it has one: it always wins.
A dataset registered without one (no copy was at hand to compute it: ``sha256=None``)
is **trusted on first use**: the first download (or the first copy found or installed
in the data directory) records its SHA-256 beside the file, in
``<data_dir>/<name>/<file name>.sha256`` (``sha256sum`` format, written through a
temporary file and a rename), and every later use verifies against that record -- a
changed or damaged copy, or an upstream file that changed under the URL, is refused.
A ``local_path`` outside the data directory is verified against the registered or
recorded checksum when either exists, else used as it is (``fetch NAME --path FILE``
installs it and records its checksum).

``data_dir()`` is ``$PREFIXCACHE_DATA`` when set, else ``$XDG_CACHE_HOME/prefixcache``
(``~/.cache/prefixcache`` by default). Tests and CI never download: they point
``$PREFIXCACHE_DATA`` (or ``local_path``) at local copies and go through the same
checks.

Known datasets (``DATASETS``; block size in tokens per hash id):

* ``mooncake_conversation`` (512): the Mooncake FAST'25 conversation trace (12,031
  requests, ~12k input tokens, real arrival times over one hour).
* ``mooncake_synthetic`` (512): the Mooncake FAST'25 synthetic trace (3,993 requests,
  ~15k input tokens, Poisson arrivals).
* ``mooncake_toolagent`` (512): the same release's tool-and-agent trace (23,608
  requests; trust on first use).

  The three are Apache-2.0, from kvcache-ai/Mooncake ``FAST25-release/traces/`` (Qin
  et al., "Mooncake: A KVCache-centric Disaggregated Architecture for LLM Serving",
  FAST'25), Mooncake format (``prefixcache.sim.trace``), pinned to one upstream commit.
* ``bailian_to_c``, ``bailian_to_b``, ``bailian_thinking``, ``bailian_coder`` (16):
  Alibaba's Qwen-Bailian usage traces (alibaba-edu/qwen-bailian-usagetraces-anon,
  Apache-2.0; Wang et al., "KVCache Cache in the Wild", USENIX ATC'25):
  ``qwen_traceA_blksz_16.jsonl`` (to-C, chat), ``qwen_traceB_blksz_16.jsonl`` (to-B,
  API calls), ``qwen_thinking_blksz_16.jsonl``, ``qwen_coder_blksz_16.jsonl``; Bailian
  format (``prefixcache.sim.trace_formats``). Git LFS objects, fetched through
  GitHub's ``/raw/<commit>/`` (which serves LFS content). The thinking and coder
  checksums are the LFS pointers' ``oid sha256`` at the pinned commit; to-C and to-B:
  trust on first use.
* ``claude_code_subagents``, ``claude_code_no_subagents`` (64): SemiAnalysis' Claude
  Code agent traces (Hugging Face ``semianalysisai/cc-traces-weka-with-subagents-060826``
  and ``semianalysisai/cc-traces-weka-no-subagents-051226``, ``traces.jsonl``: one
  session per line, sub-agent requests among them); Claude Code format; trust on first
  use (the URL follows the dataset's main revision: the recorded checksum then refuses
  a changed file).

* ``agentx``, ``agentx_256k`` (64): SemiAnalysis' AgentX corpus for InferenceX
  (Hugging Face ``semianalysisai/cc-traces-weka-062126`` and its ``-256k`` cap,
  Apache-2.0, ``traces.jsonl``: one Weka-format session per line, sub-agents nested in
  their parent's request list); AgentX format (``prefixcache.sim.trace_formats``); trust
  on first use (no published checksum; the 256k file name is assumed to follow the
  uncapped set's).
* ``tracelab`` (64, rebuilt): TraceLab's public release (uw-syfi/TraceLab, release
  ``v2026-06-08-syfi-trace``, CC BY 4.0; arXiv 2606.30560):
  ``syfi_coding_trace.jsonl.gz``, the normalized round JSONL, with the SHA-256 the
  project's README publishes. The release's other asset, a DuckDB database, holds the
  same rows (not read here: it would need ``duckdb``). TraceLab has no block hashes:
  the reader rebuilds 64-token hash ids from each round's cached-prefix split.

None of these files can be fetched from the machine this project is developed on (no
network); the readers are tested on small files written in each format
(``tests/data/``), and the generated agentic workload (``prefixcache.sim.agentic``) is
written in the AgentX and TraceLab formats for the quick configs.

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

from prefixcache._validate import ArgumentTypeError

ENV_VAR = "PREFIXCACHE_DATA"

# The Mooncake commit the URLs are pinned to (the files' bytes cannot change under it).
_MOONCAKE_COMMIT = "3b5a594133958449a1feaf1c9e0fc1b553e34a28"
_MOONCAKE_RAW = (f"https://raw.githubusercontent.com/kvcache-ai/Mooncake/{_MOONCAKE_COMMIT}"
                 "/FAST25-release/traces")
# Qwen-Bailian: Git LFS files; github.com/<repo>/raw/<commit>/<file> serves their content
# (raw.githubusercontent.com would serve the LFS pointer). The thinking and coder files
# at this commit are LFS pointers whose oid is the sha256 registered below.
_BAILIAN_REPO = "https://github.com/alibaba-edu/qwen-bailian-usagetraces-anon/raw"
_BAILIAN_COMMIT = "0b4273a1d8a83935b9d9356e78f95c31f2ac64cf"
# The to-C / to-B files at the upstream revision other projects pin them to.
_BAILIAN_AB_COMMIT = "5f7439c51ec248a0c585f7d90a41a6f57773b912"
_HF = "https://huggingface.co/datasets/semianalysisai"
# Tokens per hash id of each format (a replay of a dataset uses its format's).
FORMAT_BLOCK_SIZE = types.MappingProxyType({"mooncake": 512, "bailian": 16, "claude_code": 64,
                                           "agentx": 64, "tracelab": 64})
# TraceLab's public release (uw-syfi/TraceLab, tag v2026-06-08-syfi-trace): the normalized
# JSONL asset and the SHA-256 its README publishes.
_TRACELAB_URL = ("https://github.com/uw-syfi/TraceLab/releases/download/v2026-06-08-syfi-trace"
                 "/syfi_coding_trace.jsonl.gz")


@dataclasses.dataclass(frozen=True)
class Dataset:
    """One public trace.

    Attributes:
      name: registry key (what configs name).
      url: where its bytes come from (``https://`` or ``file://``).
      sha256: hex SHA-256 of the file's bytes, or ``None``: trust on first use (the
        first copy's checksum is recorded beside it; see the module docstring).
      filename: the file name in the data directory.
      trace_format: how ``prefixcache.sim.trace.read_trace`` reads it (its reader).
      num_requests: requests in the file (``None``: not known before a copy is read).
      description: one line for listings.
      block_size: tokens per hash id (``None``: the format's, ``FORMAT_BLOCK_SIZE``;
        stays ``None`` for a format without hash ids, e.g. our ``jsonl``); a replay of
        the dataset uses it (``check_block_size``).
    """

    name: str
    url: str
    sha256: str | None
    filename: str
    trace_format: str
    num_requests: int | None
    description: str
    block_size: int | None = None

    def __post_init__(self):
        if self.sha256 is not None and (
                len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256)):
            raise ValueError(f"dataset {self.name!r}: sha256 must be 64 lowercase hex digits "
                             "(or None: trust on first use)")
        if self.block_size is None:
            object.__setattr__(self, "block_size", FORMAT_BLOCK_SIZE.get(self.trace_format))
        elif isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or self.block_size <= 0:
            raise ValueError(f"dataset {self.name!r}: block_size must be a positive int")


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
    Dataset(
        name="mooncake_toolagent",
        url=f"{_MOONCAKE_RAW}/toolagent_trace.jsonl", sha256=None,
        filename="toolagent_trace.jsonl", trace_format="mooncake", num_requests=23608,
        description="Mooncake FAST'25 tool-and-agent trace: 23,608 requests (trust on "
                    "first use)"),
    Dataset(
        name="bailian_to_c",
        url=f"{_BAILIAN_REPO}/{_BAILIAN_AB_COMMIT}/qwen_traceA_blksz_16.jsonl", sha256=None,
        filename="qwen_traceA_blksz_16.jsonl", trace_format="bailian", num_requests=None,
        description="Qwen-Bailian to-C trace (chat service), 16-token hash ids (trust on "
                    "first use)"),
    Dataset(
        name="bailian_to_b",
        url=f"{_BAILIAN_REPO}/{_BAILIAN_AB_COMMIT}/qwen_traceB_blksz_16.jsonl", sha256=None,
        filename="qwen_traceB_blksz_16.jsonl", trace_format="bailian", num_requests=None,
        description="Qwen-Bailian to-B trace (API calls, task automation), 16-token hash "
                    "ids (trust on first use)"),
    Dataset(
        name="bailian_thinking",
        url=f"{_BAILIAN_REPO}/{_BAILIAN_COMMIT}/qwen_thinking_blksz_16.jsonl",
        sha256="41ac36d9d1b54d084eeb6b05e9d142ba9d02f8bf79cfc9fff418d8ab7cdee906",
        filename="qwen_thinking_blksz_16.jsonl", trace_format="bailian", num_requests=None,
        description="Qwen-Bailian thinking-model trace, 16-token hash ids (27.9 MB)"),
    Dataset(
        name="bailian_coder",
        url=f"{_BAILIAN_REPO}/{_BAILIAN_COMMIT}/qwen_coder_blksz_16.jsonl",
        sha256="3d74974cebb7bccb69b1ca6ea210a44d9a3033443c0271ed015327284dea1aff",
        filename="qwen_coder_blksz_16.jsonl", trace_format="bailian", num_requests=None,
        description="Qwen-Bailian coder-model trace, 16-token hash ids (132 MB)"),
    Dataset(
        name="claude_code_subagents",
        url=f"{_HF}/cc-traces-weka-with-subagents-060826/resolve/main/traces.jsonl",
        sha256=None, filename="traces.jsonl", trace_format="claude_code", num_requests=None,
        description="Claude Code agent sessions with sub-agents (SemiAnalysis), 64-token "
                    "hash ids, one session per line (trust on first use)"),
    Dataset(
        name="claude_code_no_subagents",
        url=f"{_HF}/cc-traces-weka-no-subagents-051226/resolve/main/traces.jsonl",
        sha256=None, filename="traces.jsonl", trace_format="claude_code", num_requests=None,
        description="Claude Code agent sessions without sub-agents (SemiAnalysis), "
                    "64-token hash ids, one session per line (trust on first use)"),
    Dataset(
        name="agentx",
        url=f"{_HF}/cc-traces-weka-062126/resolve/main/traces.jsonl",
        sha256=None, filename="traces.jsonl", trace_format="agentx", num_requests=None,
        description="SemiAnalysis AgentX corpus (InferenceX): 393 Claude Code sessions "
                    "with nested sub-agents, Weka format, 64-token hash ids (trust on "
                    "first use)"),
    Dataset(
        name="agentx_256k",
        url=f"{_HF}/cc-traces-weka-062126-256k/resolve/main/traces.jsonl",
        sha256=None, filename="traces.jsonl", trace_format="agentx", num_requests=None,
        description="The AgentX corpus capped for 256k-context models (trust on first "
                    "use; the file name follows the uncapped set's)"),
    Dataset(
        name="tracelab",
        url=_TRACELAB_URL,
        sha256="9d265eae69a31cae203848bea936f018148eed7ca8bf56050c5abe96da0b4e6b",
        filename="syfi_coding_trace.jsonl.gz", trace_format="tracelab", num_requests=357161,
        description="TraceLab (UW SyFI, arXiv 2606.30560): 357,161 Claude Code / Codex "
                    "LLM rounds of 4,265 sessions, normalized JSONL (no hash ids: the "
                    "reader rebuilds 64-token blocks from the prefix split)"),
)

SUM_SUFFIX = ".sha256"  # the recorded checksum of a trust-on-first-use copy, beside it

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
      TypeError: ``name`` is not a str (a list, a path object, ...): an
        ``ArgumentTypeError``, also a ValueError.
      DatasetError: unknown name (the message lists the known ones).
    """
    registry = DATASETS if registry is None else registry
    if not isinstance(name, str):
        raise ArgumentTypeError(
            f"dataset name must be a str (one of {', '.join(sorted(registry))}), got "
            f"{type(name).__name__} {name!r}")
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


def verify(path: str | os.PathLike, dataset: Dataset, expected: str | None = None,
           *, source: str = "the registry") -> pathlib.Path:
    """Checks that ``path`` holds exactly ``dataset``'s bytes.

    Args:
      path: the file.
      dataset: its registry entry.
      expected: the hex digest to match (default ``dataset.sha256``; for a
        trust-on-first-use dataset, the recorded one).
      source: where ``expected`` comes from, for the message.

    Returns:
      ``path`` as a ``Path``.

    Raises:
      FileNotFoundError: no such file. DatasetError: checksum mismatch (the message
      names the file, both digests and the URL to fetch a good copy from).
      ValueError: nothing to verify against (no registered or given checksum).
    """
    path = pathlib.Path(path)
    expected = dataset.sha256 if expected is None else expected
    if expected is None:
        raise ValueError(f"dataset {dataset.name!r} has no registered checksum: pass the "
                         "recorded one (see recorded_sha256)")
    if not path.is_file():
        raise FileNotFoundError(f"dataset {dataset.name!r}: no file at {str(path)!r}")
    got = sha256_of(path)
    if got != expected:
        raise DatasetError(
            f"dataset {dataset.name!r}: {str(path)!r} has sha256 {got}, expected "
            f"{expected} from {source} (a different or damaged file; the original is at "
            f"{dataset.url})")
    return path


def sum_path(dest: str | os.PathLike) -> pathlib.Path:
    """Where the recorded checksum of the data-directory copy ``dest`` lives."""
    dest = pathlib.Path(dest)
    return dest.with_name(dest.name + SUM_SUFFIX)


def recorded_sha256(dest: str | os.PathLike) -> str | None:
    """The checksum recorded beside ``dest`` on first use, or ``None``.

    Raises:
      DatasetError: the record is not a sha256 line for this file name.
    """
    p = sum_path(dest)
    if not p.is_file():
        return None
    text = p.read_text().split()
    if (len(text) != 2 or len(text[0]) != 64 or any(c not in "0123456789abcdef" for c in text[0])
            or text[1] != pathlib.Path(dest).name):
        raise DatasetError(f"{str(p)!r} is not a checksum record of {pathlib.Path(dest).name!r} "
                           "('<sha256>  <file name>'); delete it to trust the copy anew")
    return text[0]


def _record_sha256(dest: pathlib.Path, digest: str) -> None:
    """Writes ``dest``'s checksum record atomically (temporary file + rename)."""
    p = sum_path(dest)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".partial", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{digest}  {dest.name}\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
        tmp = None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def expected_sha256(dataset: Dataset, dest: str | os.PathLike) -> tuple[str | None, str]:
    """``(digest, source)`` a copy at ``dest`` must match: the registered checksum (it
    wins), else the one recorded beside ``dest``, else ``(None, ...)`` (first use)."""
    if dataset.sha256 is not None:
        return dataset.sha256, "the registry"
    rec = recorded_sha256(dest)
    return rec, f"the checksum recorded on first use ({str(sum_path(dest))!r})"


def known_sha256(name: str, *, root: str | os.PathLike | None = None,
                 registry: Mapping[str, Dataset] | None = None) -> str | None:
    """Dataset ``name``'s checksum: the registered one, else the one recorded on first
    use beside its data-directory copy, else ``None`` (never used yet)."""
    d = get(name, registry)
    dest = pathlib.Path(root if root is not None else data_dir()) / d.name / d.filename
    return expected_sha256(d, dest)[0]


def check_block_size(name: str, block_size: int,
                     registry: Mapping[str, Dataset] | None = None) -> None:
    """Raises ``DatasetError`` unless ``block_size`` is dataset ``name``'s (a replay of
    a hash-id trace uses the tokens per hash id: a larger block never matches more, a
    smaller one only splits ids)."""
    d = get(name, registry)
    if d.block_size is not None and block_size != d.block_size:
        raise DatasetError(
            f"dataset {name!r} has {d.block_size}-token blocks (one hash id each); a replay "
            f"of it must use block_size={d.block_size}, not {block_size!r}")


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
    dest = pathlib.Path(root if root is not None else data_dir()) / dataset.name / dataset.filename
    expected, source = expected_sha256(dataset, dest)
    if local_path is not None:
        if expected is None:  # nothing known yet: used as it is (install() records it)
            if not pathlib.Path(local_path).is_file():
                raise FileNotFoundError(f"dataset {dataset.name!r}: no file at "
                                        f"{str(local_path)!r}")
            return pathlib.Path(local_path)
        return verify(local_path, dataset, expected, source=source)
    if dest.is_file():
        if expected is None:  # a copy placed by hand: trust it now, verify it from now on
            _record_sha256(dest, sha256_of(dest))
            return dest
        return verify(dest, dataset, expected, source=source)
    how = (f"download it from {dataset.url} to {str(dest)!r}, or set ${ENV_VAR} to a "
           f"directory holding {dataset.name}/{dataset.filename}")
    if not download:
        raise DatasetError(f"dataset {dataset.name!r} is not present locally; {how}")
    try:
        _download(dataset, dest, progress=progress, urlopen=urlopen, expected=expected,
                  source=source)
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
    dest = pathlib.Path(root if root is not None else data_dir()) / dataset.name / dataset.filename
    expected, source = expected_sha256(dataset, dest)
    if expected is None:  # first use: this copy's checksum becomes the record
        if not pathlib.Path(path).is_file():
            raise FileNotFoundError(f"dataset {dataset.name!r}: no file at {str(path)!r}")
        src = pathlib.Path(path)
        expected = sha256_of(src)
        if dest.is_file() and dest.samefile(src):
            _record_sha256(dest, expected)
            return dest
    else:
        src = verify(path, dataset, expected, source=source)
    if dest.is_file() and (dest.samefile(src) or sha256_of(dest) == expected):
        if dataset.sha256 is None and recorded_sha256(dest) is None:
            _record_sha256(dest, expected)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out, open(src, "rb") as f:
            shutil.copyfileobj(f, out, _CHUNK)
        if sha256_of(tmp) != expected:  # pragma: no cover - changed while copied
            raise DatasetError(f"dataset {name!r}: {str(src)!r} changed while it was copied")
        if dataset.sha256 is None:  # (recorded before the file appears: see _download)
            _record_sha256(dest, expected)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
        tmp = None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def _download(dataset: Dataset, dest: pathlib.Path, *, progress: bool,
              urlopen: Callable, expected: str | None = None,
              source: str = "the registry") -> None:
    """Downloads ``dataset`` to ``dest`` via a verified temporary file.

    ``expected``: the digest to match (``None``: first use -- the download's own digest
    is recorded beside ``dest`` before the file is renamed into place, so a copy in the
    data directory always has its record).
    """
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
        if expected is None:
            _record_sha256(dest, h.hexdigest())  # trust on first use
        elif h.hexdigest() != expected:
            raise DatasetError(
                f"dataset {dataset.name!r}: the download from {dataset.url} has sha256 "
                f"{h.hexdigest()}, expected {expected} from {source}; nothing was kept")
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
            dest = data_dir() / d.name / d.filename
            digest = d.sha256 or (f"{recorded_sha256(dest)} (recorded on first use)"
                                  if recorded_sha256(dest) else "none yet (trust on first use)")
            print(f"{d.name}: {d.description}\n  {d.url}\n  {d.trace_format} format, "
                  f"{d.block_size}-token blocks\n  sha256 {digest}")
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
