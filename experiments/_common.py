"""Shared plumbing for the experiment scripts: provenance, work dirs, atomic output.

Every result an experiment publishes must be traceable to the run that made it
(STYLE habit 2): the resolved config, the seed, package versions, the git
revision (and whether the tree was dirty), the hash algorithm and the cache
state at the start of the measurement (cold or warm). ``provenance`` builds that
record; ``AtomicJsonlWriter`` attaches it to every line it writes and only makes
the output file appear once the run finished cleanly, so a crashed or rejected
run never leaves a complete-looking file behind.

Nothing here imports jax: versions are read from package metadata, so a
host-only experiment stays host-only.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import socket
import subprocess
import tempfile
from collections.abc import Mapping
from typing import Any

CACHE_STATES = ("cold", "warm")

# Packages whose versions are recorded; missing ones are recorded as None.
_VERSIONED_PACKAGES = ("numpy", "jax", "jaxlib", "flax", "xxhash", "cbor2", "prefixcache")

# The repository root (this file lives in <root>/experiments/).
_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def to_jsonable(obj: Any) -> Any:
    """Converts a config-like object into plain JSON types.

    Handles ``ml_collections.ConfigDict`` / ``FrozenConfigDict`` (anything with
    ``to_dict``), dataclasses, mappings, tuples/lists/sets, numpy scalars and
    arrays (via ``tolist``/``item``), ``pathlib.Path`` and non-finite floats
    (written as strings, since JSON has no NaN). Unknown objects become
    ``repr(obj)`` so provenance never fails a run.

    Args:
      obj: any value.

    Returns:
      A value made of dict/list/str/int/float/bool/None only.
    """
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if hasattr(obj, "to_dict") and callable(obj.to_dict):  # ConfigDict
        return to_jsonable(obj.to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((to_jsonable(v) for v in obj), key=repr)
    if isinstance(obj, (pathlib.PurePath, bytes)):
        return obj.hex() if isinstance(obj, bytes) else str(obj)
    if hasattr(obj, "tolist"):  # numpy arrays and scalars
        return to_jsonable(obj.tolist())
    if hasattr(obj, "item"):
        return to_jsonable(obj.item())
    return repr(obj)


def package_versions() -> dict[str, str | None]:
    """Versions of python and the packages results depend on (None if absent)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_revision(repo: str | os.PathLike | None = None) -> dict[str, Any]:
    """The git commit of ``repo`` (default: this checkout) and a dirty flag.

    Returns:
      ``{"revision": str | None, "dirty": bool | None}``; both None outside a git
      work tree or without git.
    """
    cwd = str(repo or _REPO_ROOT)
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
            timeout=10, check=True,
        ).stdout.strip()
        # NOTE: untracked files do not count as dirty: work dirs and caches live
        # in the tree; a modified tracked file does.
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {"revision": None, "dirty": None}
    return {"revision": rev or None, "dirty": bool(status.strip())}


def provenance(
    config: Any,
    *,
    seed: int | None,
    hash_algo: str | None = None,
    cache_state: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The provenance record attached to every published result.

    Args:
      config: the resolved config (ConfigDict, dataclass, mapping or None).
      seed: the run's seed (None when the run has no randomness).
      hash_algo: the block hash algorithm used, if any.
      cache_state: the prefix cache state at the start of the measurement,
        ``"cold"`` or ``"warm"`` (None when not applicable).
      extra: further JSON-able fields (e.g. the trace path); they may not
        shadow the standard keys.

    Returns:
      A JSON-able dict with keys ``config``, ``seed``, ``versions``, ``git``,
      ``hostname``, ``timestamp`` (UTC ISO 8601), ``hash_algo``, ``cache_state``,
      ``jax`` (``{"backend", "device_kind", "device_count"}`` when this process
      imported jax, else None: host-only runs stay host-only), ``trace_checksum``
      (``trace_checksum``: the dataset or trace file and its sha256; None for a
      generated workload) and the ``extra`` keys.

    Raises:
      ValueError: ``cache_state`` is not cold/warm/None, or ``extra`` shadows a
        standard key.
    """
    if cache_state is not None and cache_state not in CACHE_STATES:
        raise ValueError(f"cache_state must be one of {CACHE_STATES} or None, got {cache_state!r}")
    record: dict[str, Any] = {
        "config": to_jsonable(config),
        "seed": None if seed is None else int(seed),
        "versions": package_versions(),
        "git": git_revision(),
        "hostname": socket.gethostname(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hash_algo": hash_algo,
        "cache_state": cache_state,
        "jax": jax_devices(),
        "trace_checksum": trace_checksum(config) if config is not None else None,
    }
    for key, value in (extra or {}).items():
        if key in record:
            raise ValueError(f"extra provenance key {key!r} shadows a standard key")
        record[key] = to_jsonable(value)
    return record


def jax_devices() -> dict[str, Any] | None:
    """The JAX backend and device kind, when this process uses jax (else None).

    NOTE: never imports jax: a host-only experiment that did not import it records None.
    """
    import sys  # noqa: PLC0415

    jax = sys.modules.get("jax")
    if jax is None:
        return None
    try:
        devices = jax.devices()
        return {"backend": jax.default_backend(), "device_kind": devices[0].device_kind,
                "device_count": len(devices)}
    except Exception as e:  # noqa: BLE001 - provenance never fails a run
        return {"backend": None, "device_kind": None, "error": repr(e)}


def prepare_workdir(path: str | os.PathLike) -> pathlib.Path:
    """Creates (if needed) and returns the experiment's output directory.

    Raises:
      ValueError: ``path`` is empty, exists and is not a directory, cannot be
        created, or is not writable (checked by creating a file in it: permission
        bits alone say nothing for root or on read-only mounts).
    """
    if not str(path):
        raise ValueError("a workdir is needed (--workdir or config.workdir)")
    p = pathlib.Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"workdir {str(p)!r} exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise ValueError(f"workdir {str(p)!r} is not writable: "
                         f"{e.strerror or e}") from e
    return p


def _publish(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Renames a finished temp file over ``path`` with the usual file mode.

    NOTE: ``mkstemp`` creates files 0600; results are meant to be shared, so the
    mode becomes 0666 minus the process umask, as ``open(path, "w")`` would give.
    """
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


def dumps_line(record: Mapping[str, Any]) -> str:
    """One compact JSON line (the byte format of ``experiments/peers`` outputs)."""
    return json.dumps(record, separators=(",", ":")) + "\n"


class AtomicJsonlWriter:
    """Writes a JSONL file that appears only when the writer exits cleanly.

    Lines go to a temporary file in the destination's directory; on a clean
    ``__exit__`` it is flushed, fsynced and renamed over ``path`` (atomic on
    POSIX). On an exception the temporary file is deleted and ``path`` is left
    exactly as it was (absent, or the previous complete output).

    Invariant: a file at ``path`` written by this class is always complete.

    Args:
      path: destination file.
      provenance: if given, every line is ``{**record, "provenance": provenance}``
        so each line can be traced back on its own. Leave it None for outputs
        that must be byte-identical across runs (e.g. replay's per-request file).
      provenance_once: write ``provenance`` once, as the first line ``{"record":
        "provenance", "provenance_id": ID, "provenance": {...}}``, and give every
        other line ``"provenance_id": ID`` instead of the full record (for files of
        many small rows, e.g. audit_timing's probes). ``write``'s per-line
        ``provenance`` then gets its own header line the first time it is used.
    """

    def __init__(self, path: str | os.PathLike, provenance: Mapping[str, Any] | None = None,
                 *, provenance_once: bool = False):
        self._once = bool(provenance_once)
        self._ids: dict[str, str] = {}
        self.path = pathlib.Path(path)
        if not str(path) or self.path.is_dir():
            raise ValueError(f"output path {str(path)!r} is empty or a directory")
        self._provenance = None if provenance is None else to_jsonable(provenance)
        self._file = None
        self._tmp_path: pathlib.Path | None = None
        self.num_lines = 0

    def __enter__(self) -> "AtomicJsonlWriter":
        directory = self.path.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".partial",
                                       dir=directory)
        except OSError as e:
            raise ValueError(f"cannot write {str(self.path)!r}: {e.strerror or e}") from e
        self._tmp_path = pathlib.Path(tmp)
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        return self

    def write(self, record: Mapping[str, Any], provenance: Mapping[str, Any] | None = None) -> None:
        """Appends one record as a JSON line.

        Args:
          record: JSON-able mapping.
          provenance: this line's provenance (e.g. another cache state); default:
            the writer's.
        """
        if self._file is None:
            raise ValueError("AtomicJsonlWriter.write called outside its `with` block")
        prov = self._provenance if provenance is None else to_jsonable(provenance)
        if prov is not None:
            if "provenance" in record or "provenance_id" in record:
                raise ValueError("record already has a 'provenance' key")
            if self._once:
                record = {**record, "provenance_id": self._header(prov)}
            else:
                record = {**record, "provenance": prov}
        self._file.write(dumps_line(record))
        self.num_lines += 1

    def _header(self, prov: Any) -> str:
        """The id of ``prov``, writing its header line the first time it is seen."""
        import hashlib  # noqa: PLC0415

        blob = json.dumps(prov, sort_keys=True, separators=(",", ":"))
        pid = self._ids.get(blob)
        if pid is None:
            pid = self._ids[blob] = hashlib.sha256(blob.encode()).hexdigest()[:16]
            self._file.write(dumps_line({"record": "provenance", "provenance_id": pid,
                                         "provenance": prov}))
        return pid

    def __exit__(self, exc_type, exc, tb) -> bool:
        f, tmp = self._file, self._tmp_path
        self._file = self._tmp_path = None
        try:
            if exc_type is None:
                # A full disk may only show here (buffered lines): then the error
                # propagates, the file is closed and the temp file removed below.
                f.flush()
                os.fsync(f.fileno())
                f.close()
                _publish(tmp, self.path)
                tmp = None
        finally:
            if not f.closed:
                try:
                    f.close()
                except OSError:
                    # NOTE: closing flushes the buffer, which fails again on a full
                    # disk; the error already in flight is the one to report.
                    pass
            if tmp is not None and tmp.exists():
                tmp.unlink()
        return False  # never swallow the exception


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Writes one JSON document atomically (temp file + rename)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(to_jsonable(obj), f, indent=1, sort_keys=True)
            f.write("\n")
        _publish(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, MiB (``ru_maxrss``; KiB on Linux)."""
    import resource  # noqa: PLC0415
    import sys  # noqa: PLC0415

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


# ----------------------------------------------------------------------------
# Requests from a config: a trace file or a generated workload
# ----------------------------------------------------------------------------


def cache_config(config, **overrides):
    """The ``prefixcache.CacheConfig`` an experiment config names (its fields of the same
    names; ``""`` / ``0`` mean unset, see ``CacheConfig.from_config_dict``), with
    ``overrides`` (a sweep cell's ``num_blocks=``, ...): the one path from a config to
    every driver (``replay``, ``des.simulate``, ``simulate_cluster``, ``Engine``)."""
    from prefixcache.core.cache_config import CacheConfig  # noqa: PLC0415

    return CacheConfig.from_config_dict(config, **overrides)


def cost_model(config, **overrides):
    """The ``CostModel`` an experiment config names (``CostModel.from_config``)."""
    from prefixcache.cost_model import CostModel  # noqa: PLC0415

    return CostModel.from_config(config, **overrides)


def requests_from_config(config, workdir: str | os.PathLike | None = None, *,
                         progress: bool = False):
    """The requests an experiment runs on, as described by its config.

    Config fields used:
      dataset: a public trace by name (``prefixcache.sim.datasets``; a local,
        checksum-verified copy, downloaded into ``$PREFIXCACHE_DATA`` on first use).
      trace: path of a trace file (our JSONL or Mooncake lines).
        Neither set -> generate the workload; both set -> error.
      trace_format: "auto" | "jsonl" | "mooncake" ("auto" with a dataset: the
        registry's format).
      max_requests: 0 for all, N for only the first N requests.
      seed: seed of the generated workload.
      workload.name / workload.kwargs: a generator of ``prefixcache.sim.workloads``
        (``WORKLOADS``), or ``"mooncake_scale"``: the Mooncake-format trace is
        written to ``workload.path`` (default
        ``<workdir>/mooncake_scale-<digest of seed+kwargs>.jsonl``, reused if it
        exists) and streamed from there.

    Args:
      config: the experiment's config (the fields above).
      workdir: where a generated mooncake_scale trace goes by default.
      progress: tqdm bars while a dataset downloads or a mooncake_scale trace is
        written.

    Returns:
      An iterator of ``TraceRequest`` (streamed for files: memory O(1) in the trace).

    Raises:
      ValueError: unknown workload or dataset, bad generator arguments, negative
        max_requests, both trace and dataset set, no requests at all (an empty
        trace must not pass for an empty result).
      FileNotFoundError: the trace file does not exist.
    """
    return load_requests(config, workdir, progress=progress)[0]


def load_requests(config, workdir: str | os.PathLike | None = None, *,
                  progress: bool = False):
    """``requests_from_config`` plus how many requests it will yield.

    NOTE: a trace file's lines are counted first (one pass over its bytes, no JSON
    parsing) so that progress bars can show a total and an ETA.

    Returns:
      ``(iterator of TraceRequest, total)``; ``total`` is exact for generated
      workloads and an upper bound for files (their non-empty lines, capped by
      ``max_requests``).

    Raises:
      as ``requests_from_config``.
    """
    import itertools  # noqa: PLC0415

    from prefixcache.sim import workloads  # noqa: PLC0415
    from prefixcache.sim.trace import read_trace  # noqa: PLC0415

    limit = int(config.max_requests)
    if limit < 0:
        raise ValueError(f"max_requests must be >= 0, got {limit}")
    path = trace_path(config, progress=progress)
    if path:
        fmt = config.trace_format
        if config.get("dataset") and fmt == "auto":
            from prefixcache.sim import datasets  # noqa: PLC0415

            fmt = datasets.get(config.dataset).trace_format
        # NOTE: trace_tokens="lazy": hash-id prompts stay hash ids (the replay keys
        # blocks by them; same results, no token expansion); configs without the
        # field read expanded tokens, as before.
        reqs = read_trace(path, format=fmt,
                          mooncake_tokens=config.get("trace_tokens", "expand"))
        total = count_lines(path)
    else:
        name = config.workload.name
        kwargs = to_jsonable(config.workload.kwargs)
        if name == "mooncake_scale":
            # NOTE: the default file name carries a digest of (seed, kwargs), so a
            # changed config never reuses a stale trace.
            key = json.dumps([int(config.seed), kwargs], sort_keys=True).encode()
            digest = __import__("hashlib").sha1(key).hexdigest()[:10]
            path = config.workload.get("path") or os.path.join(
                os.fspath(workdir or tempfile.gettempdir()), f"mooncake_scale-{digest}.jsonl")
            if not os.path.isfile(path):
                lines = workloads.mooncake_scale(seed=config.seed, **_tuples(kwargs))
                if progress:
                    from tqdm.auto import tqdm  # noqa: PLC0415

                    lines = tqdm(lines, total=kwargs.get("num_requests"), unit="req",
                                 desc="writing mooncake_scale trace")
                workloads.write_mooncake_trace(path, lines)
            reqs = read_trace(path, format="mooncake")
            total = count_lines(path)
        else:
            generated = workloads.generate(name, seed=config.seed, **_tuples(kwargs))
            reqs, total = iter(generated), len(generated)
    first = next(reqs, None)
    if first is None:
        raise ValueError(f"{source_name(config)} has no requests")
    reqs = itertools.chain([first], reqs)
    if limit:
        return itertools.islice(reqs, limit), min(total, limit)
    return reqs, total


def check_dataset_block_size(config) -> None:
    """A replay of a registered hash-id dataset (``config.dataset``) uses its tokens per
    hash id as ``config.block_size`` (``prefixcache.sim.datasets.check_block_size``:
    ``DatasetError``, a ``ValueError``, before anything is read); a trace given as a
    file (``config.trace``) is not checked (the token path at any block size; both
    set is ``trace_path``'s error)."""
    if config.get("dataset") and not config.get("trace"):
        from prefixcache.sim import datasets  # noqa: PLC0415

        datasets.check_block_size(config.dataset, config.block_size)


def trace_path(config, *, progress: bool = False) -> str:
    """The trace file the config names: its ``trace``, or its ``dataset``'s local copy.

    Returns:
      The path, or "" when the config generates its workload.

    Raises:
      ValueError: both set; unknown dataset; a bad or unobtainable copy (the message
        names the URL and ``$PREFIXCACHE_DATA``). FileNotFoundError: no such trace.
    """
    dataset = config.get("dataset", "")
    if dataset and config.trace:
        raise ValueError(f"set either trace ({config.trace!r}) or dataset ({dataset!r}), "
                         "not both (--trace=FILE alone replaces the config's dataset)")
    if dataset:
        from prefixcache.sim import datasets  # noqa: PLC0415

        return str(datasets.path_of(dataset, progress=progress))
    if config.trace and not os.path.isfile(config.trace):
        raise FileNotFoundError(f"trace file {config.trace!r} does not exist")
    return config.trace


def source_name(config) -> str:
    """What a run's requests came from, for summaries and plot titles."""
    if config.get("dataset"):
        return f"dataset:{config.dataset}"
    return config.trace or f"workload:{config.workload.name}"


def source_label(config) -> str:
    """``source_name`` for a plot title: a trace file by its name, not its whole path."""
    if config.trace:
        label = os.path.basename(config.trace)
    elif config.get("dataset"):
        label = f"dataset {config.dataset}"
    else:
        label = f"workload {config.workload.name}"
    n = config.get("max_requests", 0)
    return f"{label} (first {n:,} requests)" if n else label


def count_lines(path: str | os.PathLike) -> int:
    """Non-empty lines of a text file (gzip when named ``*.gz``): a trace's requests."""
    import gzip  # noqa: PLC0415

    opener = gzip.open if os.fspath(path).endswith(".gz") else open
    n = 0
    with opener(path, "rb") as f:
        for line in f:
            n += bool(line.strip())
    return n


def _tuples(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Config lists -> tuples (generator range arguments)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}


def config_path(name: str) -> str:
    """Absolute path of ``configs/<name>.py`` in this checkout (a script's default)."""
    return str(_REPO_ROOT / "configs" / f"{name}.py")


def apply_flag_overrides(config, fields: Mapping[str, Any]) -> None:
    """Sets ``config.<name>`` from each absl flag that was given on the command line.

    Args:
      config: the (locked) ConfigDict; only existing fields can be set.
      fields: config field name -> absl ``FlagHolder``.
    """
    for name, holder in fields.items():
        if holder.present:
            setattr(config, name, holder.value)
    # A trace file on the command line replaces the config's dataset (e.g. a local copy
    # of it): --trace=FILE alone is enough. Both flags given -> trace_path's error.
    trace, dataset = fields.get("trace"), fields.get("dataset")
    if (trace is not None and trace.present and trace.value and "dataset" in config
            and not (dataset is not None and dataset.present)):
        config.dataset = ""


def progress_bar(iterable=None, *, enabled: bool, total: int | None = None,
                 desc: str | None = None, unit: str = "it"):
    """A tqdm progress bar on stderr; a silent pass-through when not ``enabled``.

    Args:
      iterable: what to iterate (its ``len`` is the total when it has one).
      enabled: the script's ``--[no]progress``.
      total: units of work when known in advance (the bar shows an ETA).
      desc: the bar's label.
      unit: the unit's name.

    Returns:
      A ``tqdm`` object (iterate it, or ``update``/``close`` it / use it in ``with``).
    """
    from tqdm.auto import tqdm  # noqa: PLC0415

    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not enabled)


def define_progress_flag():
    """``--[no]progress`` for a script that defines its flags at module level."""
    from absl import flags  # noqa: PLC0415

    return flags.DEFINE_bool("progress", True, "Show a tqdm progress bar on stderr "
                             "(--noprogress: none).")


# absl's help flags (``-?`` is --help's short name).
_HELP_FLAGS = frozenset({"help", "helpshort", "helpfull", "helpxml", "?"})


def _asks_for_help(args) -> bool:
    """Whether a command line carries one of absl's help flags."""
    return any(a.startswith("-") and a.lstrip("-").split("=", 1)[0] in _HELP_FLAGS
               for a in list(args)[1:])


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (multi-line messages joined with '; ')."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def fail(message: str) -> None:
    """Ends the program: ``error: <message>`` on stderr, exit status 1, no traceback."""
    import sys  # noqa: PLC0415

    sys.exit(f"error: {message}")


def run_app(main, argv: list[str] | None = None, *, key_flags=()) -> None:
    """``absl.app.run`` with this project's command-line conventions.

    * ``--help`` / ``--helpshort`` / ``-?`` list the script's own flags (its module's
      and ``key_flags``) with their help; ``--helpfull`` all flags; all exit 0.
    * A bad flag value, an unknown flag or a stray argument -> ``error: ...`` naming
      it, on one line, exit status 1 (absl prints its usage text and ``FATAL``).

    NOTE: absl's help flags print the help and exit with status 1 from inside flag
    parsing; the parser here turns exactly that exit (a help flag on the command
    line, status 1, raised while parsing) into status 0.

    Args:
      main: ``main(argv)`` as for ``app.run``.
      argv: the command line; default ``sys.argv``.
      key_flags: names of flags defined elsewhere (``run_cli``'s) that ``--help``
        lists as the script's own.
    """
    import sys  # noqa: PLC0415

    from absl import app, flags  # noqa: PLC0415

    for name in key_flags:
        # NOTE: --help lists the key flags of the module named sys.argv[0] (absl's
        # notion of the main module); flags defined in this module are not among them.
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])

    def parse(args):
        try:
            return flags.FLAGS(args)
        except flags.Error as e:
            fail(_one_line(e))
        except SystemExit as e:
            if e.code == 1 and _asks_for_help(args):
                raise SystemExit(0) from None
            raise

    def checked_main(args):
        try:
            return main(args)
        except app.UsageError as e:
            fail(_one_line(e))

    app.run(checked_main, argv=argv, flags_parser=parse)


def _config_override_error(exc: BaseException, args) -> str:
    """The message for a ``--config.<field>`` override the config does not have."""
    # NOTE: ml_collections wraps the KeyError that carries the field name and its
    # "Did you mean" hint in an AttributeError holding its repr: use the KeyError.
    cause = exc
    while cause is not None and not isinstance(cause, KeyError):
        cause = cause.__context__
    text = _one_line(cause if cause is not None else exc)
    field = text.split(";")[0].strip().strip("'\"")
    given = [a.split("=", 1)[0] for a in args if a.startswith("--config.")]
    named = [a for a in given if field and field in a[len("--config."):].split(".")]
    return (f"{', '.join(named or given) or '--config'}: no such config field "
            f"{field!r}" + (f" ({text.split(';', 1)[1].strip()})" if ";" in text else ""))


def run_cli(run_fn, *, config_name: str, extra_flags: Mapping[str, tuple[str, str]] | None = None,
            argv: list[str] | None = None) -> None:
    """The whole command-line front end of an experiment script.

    Defines ``--config`` (default ``configs/<config_name>.py``, locked, dotted
    overrides), ``--workdir``, ``--[no]progress`` and ``extra_flags`` on absl's
    global flags, then runs ``run_fn(config, progress=...)`` and prints its result as
    the last stdout line (JSON). Flags given on the command line override the
    config fields of the same name. ``--help`` lists these flags and exits 0.
    Bad input -- a bad flag value, a misspelled ``--config.<field>``, a missing
    config file, an unusable workdir, ``ValueError`` / ``OSError`` from the run
    (bad trace, unknown dataset, empty trace) -> ``error: ...`` on stderr, one line,
    exit status 1, no traceback.

    NOTE: flags are defined here, not at import, so several experiment modules can
    be imported into one process (a notebook, the tests).

    Args:
      run_fn: ``(config, *, progress) -> JSON-able summary``.
      config_name: the default config's file stem.
      extra_flags: flag name -> (``"string"`` | ``"integer"`` | ``"float"``, help); each
        overrides ``config.<name>`` when given.
      argv: for tests; default ``sys.argv``.
    """
    import sys  # noqa: PLC0415

    from absl import flags  # noqa: PLC0415
    from ml_collections import config_flags  # noqa: PLC0415

    args = list(sys.argv if argv is None else argv)
    try:
        # NOTE: ml_collections applies --config.<field> overrides of the default
        # config while defining the flag: a misspelled field fails here.
        config_flag = config_flags.DEFINE_config_file(
            "config", config_path(config_name),
            f"Config file (default configs/{config_name}.py); override its fields as "
            "--config.<field>=value.", lock_config=True)
    except (KeyError, AttributeError) as e:
        fail(_config_override_error(e, args))
    holders = {"workdir": flags.DEFINE_string("workdir", None, "Output directory "
                                              "(overrides config.workdir).")}
    progress = flags.DEFINE_bool("progress", True, "Show tqdm progress bars on stderr "
                                 "(--noprogress: none).")
    for name, (kind, help_) in (extra_flags or {}).items():
        define = {"string": flags.DEFINE_string, "integer": flags.DEFINE_integer,
                  "float": flags.DEFINE_float}[kind]
        holders[name] = define(name, None, f"{help_} (overrides config.{name}).")

    def main(main_args):
        if len(main_args) > 1:
            fail(f"unexpected arguments: {' '.join(main_args[1:])}")
        filename = flags.FLAGS["config"].config_filename.split(":", 1)[0]
        if not os.path.isfile(filename):
            fail(f"--config: no such config file {filename!r}")
        try:
            config = config_flag.value
            config.get("workdir")  # a config that failed to load raises on first use
        except (KeyError, AttributeError) as e:
            fail(_config_override_error(e, args))
        except OSError as e:
            fail(f"--config: cannot load {filename!r}: {_one_line(e).split('; ')[-1]}")
        try:
            apply_flag_overrides(config, holders)
            summary = run_fn(config, progress=progress.value)
        except (ValueError, OSError) as e:
            fail(_one_line(e))
        print(json.dumps(to_jsonable(summary)), flush=True)

    run_app(main, argv=args, key_flags=("config", "progress", *holders))


def save_plot(fig, path: str | os.PathLike, *, dpi: int = 120) -> pathlib.Path:
    """Saves a matplotlib figure as PNG atomically and closes it.

    Callers create figures with ``new_figure`` (Agg backend, no display needed).

    Returns:
      The path written.
    """
    import matplotlib.pyplot as plt  # noqa: PLC0415 (matplotlib is slow to import)

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=dpi, format="png", bbox_inches="tight")
        _publish(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        plt.close(fig)
    return path


def new_figure(*args, **kwargs):
    """``plt.subplots`` on the non-interactive Agg backend (headless-safe).

    NOTE: selects Agg only when no backend has been chosen by the caller
    (e.g. a notebook's inline backend is left alone).
    """
    import matplotlib  # noqa: PLC0415

    if "MPLBACKEND" not in os.environ and "matplotlib.pyplot" not in __import__("sys").modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt.subplots(*args, **kwargs)


# ----------------------------------------------------------------------------
# Resumable runs: finished cells survive an interruption
# ----------------------------------------------------------------------------

# Config fields that say how a run is executed, not what it computes: a rerun may change
# them and still resume the same cells.
RUN_ONLY_FIELDS = ("workdir", "executor", "workers", "ray_address")


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes (streamed)."""
    import hashlib  # noqa: PLC0415

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def trace_checksum(config) -> dict[str, Any] | None:
    """What the run's requests were read from, with its checksum; None for generated ones.

    A ``dataset`` copy is verified against the registry's sha256 when it is read, so
    that value is recorded; a ``trace`` file is hashed here.

    Returns:
      ``{"dataset": name | None, "trace": path | None, "sha256": hex}`` or None.
    """
    trace = config.get("trace", "") if hasattr(config, "get") else ""
    dataset = config.get("dataset", "") if hasattr(config, "get") else ""
    if trace:
        if not os.path.isfile(trace):
            return None
        from prefixcache.sim import datasets  # noqa: PLC0415

        digest = file_sha256(trace)
        # A local copy of a public trace is named as that dataset.
        same = [d.name for d in datasets.DATASETS.values() if d.sha256 == digest]
        return {"dataset": same[0] if same else None, "trace": str(trace), "sha256": digest}
    if dataset:
        from prefixcache.sim import datasets  # noqa: PLC0415

        # (registered, or recorded on the dataset's first use: trust on first use)
        return {"dataset": dataset, "trace": None, "sha256": datasets.known_sha256(dataset)}
    return None


def run_fingerprint(config, *, seed: int | None = None) -> dict[str, Any]:
    """What identifies a run's results: its config (hash), seed and trace checksum.

    Fields in ``RUN_ONLY_FIELDS`` are left out of the config hash (where a run writes,
    how many workers it uses do not change a row).
    """
    import hashlib  # noqa: PLC0415

    cfg = to_jsonable(config)
    if isinstance(cfg, dict):
        cfg = {k: v for k, v in cfg.items() if k not in RUN_ONLY_FIELDS}
    blob = json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()
    trace = trace_checksum(config) if config is not None else None
    return {"config_sha256": hashlib.sha256(blob).hexdigest(),
            "seed": None if seed is None else int(seed),
            "trace_sha256": None if trace is None else trace["sha256"]}


def cell_key(cell: Mapping[str, Any]) -> str:
    """A cell's identity as one canonical JSON string: its fields but ``config`` (the
    config is the ``CellLog``'s fingerprint, checked once per run)."""
    return json.dumps(to_jsonable({k: v for k, v in cell.items() if k != "config"}),
                      sort_keys=True, separators=(",", ":"))


class CellLog:
    """An append-only, fsynced log of finished cells that a rerun resumes from.

    ``<workdir>/<name>.cells.jsonl``: a header line ``{"record": "run", "fingerprint":
    {...}}`` (``run_fingerprint``), then one line ``{"record": "cell", "key": ...,
    "row": ...}`` per finished cell, each written with one ``write`` + flush + fsync
    as the cell finishes, so an interruption (Ctrl-C, a time limit, a crash) loses at
    most the cells still running. A rerun with the same workdir skips the cells the
    log holds (``get``); a torn last line (the process killed mid-write) is ignored and
    its cell run again.

    Invariant: every cell line in the log belongs to the fingerprint in its header.

    Raises (constructor):
      ValueError: the log exists and was written by a run of another config, seed or
        trace (the message names both fingerprints' differing fields and the file).
    """

    SUFFIX = ".cells.jsonl"

    def __init__(self, workdir: str | os.PathLike, name: str, fingerprint: Mapping[str, Any]):
        self.path = pathlib.Path(workdir) / f"{name}{self.SUFFIX}"
        self.fingerprint = dict(fingerprint)
        self._rows: dict[str, Any] = {}
        if self.path.exists():
            self._load()
        else:
            self._append({"record": "run", "fingerprint": self.fingerprint})
        self.resumed = len(self._rows)

    def _load(self) -> None:
        text = self.path.read_text(encoding="utf-8")
        if text and not text.endswith("\n"):
            # A torn last line (killed mid-write): cut it off; that cell runs again.
            keep = text.rfind("\n") + 1
            with open(self.path, "r+b") as f:
                f.truncate(len(text[:keep].encode("utf-8")))
            text = text[:keep]
        lines = text.split("\n")
        try:
            header = json.loads(lines[0]) if lines[0] else None
        except json.JSONDecodeError:
            header = None
        if header is None and not text.strip():  # killed before its header was written
            self._append({"record": "run", "fingerprint": self.fingerprint})
            return
        if not isinstance(header, dict) or header.get("record") != "run":
            raise ValueError(f"{str(self.path)!r} is not a cell log of this project "
                             "(no header line); move it away or use another --workdir")
        theirs = header.get("fingerprint", {})
        if theirs != self.fingerprint:
            diff = ", ".join(f"{k} {theirs.get(k)!r} there, {v!r} now"
                             for k, v in self.fingerprint.items() if theirs.get(k) != v)
            raise ValueError(
                f"workdir {str(self.path.parent)!r} holds cells of another run ({diff}); "
                f"refusing to mix them: use another --workdir, or delete "
                f"{str(self.path)!r} to start over")
        body = lines[1:]
        for i, line in enumerate(body):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                self._rows[rec["key"]] = rec["row"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{str(self.path)!r} line {i + 2} is not a cell record; "
                                 "move the file away or use another --workdir") from None

    def _append(self, record: Mapping[str, Any]) -> None:
        # NOTE: one write of a whole line, then fsync: a line is either all there or
        # torn at the end of the file (which _load ignores).
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(dumps_line(record))
            f.flush()
            os.fsync(f.fileno())

    def __contains__(self, key: str) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: str) -> Any:
        """The finished cell's row (KeyError when not finished)."""
        return self._rows[key]

    def add(self, key: str, row: Any) -> None:
        """Records a finished cell (durably, before returning)."""
        row = to_jsonable(row)
        self._append({"record": "cell", "key": key, "row": row})
        self._rows[key] = row


def map_cells_resumable(fn, cells, *, log: CellLog, key=cell_key, progress: bool = False,
                        desc: str = "cells", **map_kwargs) -> list:
    """``_parallel.map_cells`` that skips the cells ``log`` holds and logs each new one.

    Args:
      fn, cells, map_kwargs: as ``_parallel.map_cells``.
      log: the run's ``CellLog``.
      key: a cell's key in the log (default ``cell_key`` of the whole cell).

    Returns:
      Every cell's row, in the order of ``cells`` (resumed ones from the log). The
      rows are the log's JSON form (what a resumed run would read back), so an
      interrupted-and-resumed run gives the same rows as an uninterrupted one.
    """
    from experiments import _parallel  # noqa: PLC0415

    cells = list(cells)
    keys = [key(c) for c in cells]
    todo = [i for i, k in enumerate(keys) if k not in log]
    if progress and len(todo) < len(cells):
        import sys  # noqa: PLC0415

        print(f"{desc}: resuming {str(log.path)!r}: {len(cells) - len(todo)} of "
              f"{len(cells)} cells already done", file=sys.stderr, flush=True)

    def done(j: int, row) -> None:
        log.add(keys[todo[j]], row)

    _parallel.map_cells(fn, [cells[i] for i in todo], progress=progress, desc=desc,
                        on_result=done, **map_kwargs)
    return [log.get(k) for k in keys]
