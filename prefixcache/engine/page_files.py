"""KV page files of the disk tier: one file per (block key, KV cache group) in a directory.

A file holds one block's page in every KV array (layer) of the engine, plus the page's
scales where the KV dtype is quantized, behind a header that names what it is:

    magic  b"PCKVPAGE"                      8 bytes
    version                                 u32 little endian (`FORMAT_VERSION`)
    header length                           u32
    header crc32                            u32 (of the header bytes)
    header                                  JSON (utf-8): fingerprint, block_size, key, group,
                                            parts [{dtype, shape}], num_layers,
                                            payload_bytes, payload_crc32
    payload                                 for each part (pages, then scales), for each
                                            layer: the page's bytes (C order)

The file name comes from the key alone (`file_name`): a block's key is its content
hash, so a page written by one run is found by the next run of the same model, block
size and hash algorithm (`keys()` + the core disk tier's preload: option `reuse`).

Durability: a page is written to a temporary file in the same directory, fsync'd, then
renamed onto its name (`os.replace`, atomic on POSIX): a process killed mid-write leaves
at most a temporary file (never served; removed by the next `PageFiles` over the
directory once its writer is gone), never a partial page under a page's name.

Reads verify everything: magic, version, header checksum, fingerprint (model, KV dtype,
block size, hash algorithm: `engine_fingerprint`), shapes and dtypes, payload length and
checksum. A file failing any check is never served: `read` returns None, counts it
(`num_corrupt`, or `num_foreign` for a well-formed page of another fingerprint) and
deletes it (it sits under a name this store owns).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import threading
import zlib
from typing import Sequence

import numpy as np

MAGIC = b"PCKVPAGE"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIII")  # magic, version, header length, header crc32
_SUFFIX = ".kvpage"
_TMP = ".tmp-"
_NAME = re.compile(r"^(n?)([0-9a-f]{32,})-g(\d+)\.kvpage$")
# Payloads are checksummed in slices of this many bytes (zlib.crc32 chains them).
_CRC_CHUNK = 1 << 24


def file_name(key: int, group: int = 0) -> str:
    """The file name of block `key`'s page of KV cache group `group`.

    `key` is the block's cache key as an int (its content hash); at least 32 hex digits
    (128-bit keys), more for wider keys; a negative key gets an ``n`` prefix.
    """
    key, group = int(key), int(group)
    sign = "n" if key < 0 else ""
    return f"{sign}{abs(key):032x}-g{group}{_SUFFIX}"


def parse_file_name(name: str) -> tuple[int, int] | None:
    """(key, group) of a page file's name, or None for any other name."""
    m = _NAME.match(name)
    if m is None:
        return None
    key = int(m.group(2), 16)
    return (-key if m.group(1) else key), int(m.group(3))


def engine_fingerprint(*parts) -> str:
    """A stable hex digest of what makes a page's bytes reusable (the caller passes
    the model identity, KV dtype, block size, hash algorithm and seed, as strings)."""
    h = hashlib.sha256()
    for p in parts:
        b = str(p).encode()
        h.update(struct.pack("<Q", len(b)))
        h.update(b)
    return h.hexdigest()


def _bytes_of(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, writable when it is (ml_dtypes' bfloat16 /
    float8 have no buffer format of their own: viewed as uint8)."""
    return memoryview(a.reshape(-1).view(np.uint8))


def _crc(buffers) -> int:
    crc = 0
    for b in buffers:
        mv = _bytes_of(b)
        for i in range(0, len(mv), _CRC_CHUNK):
            crc = zlib.crc32(mv[i:i + _CRC_CHUNK], crc)
    return crc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PageFiles:
    """A directory of KV page files (see the module doc) and its byte accounting.

    Invariants:
      - `_sizes` maps the name of every page file this store wrote or found at open
        with a well-formed header of its fingerprint to its size in bytes; `nbytes` is
        their sum. A file of that map that later fails its checksum is removed from it
        (and from the directory) when read;
      - a name in `_sizes` is only ever created by rename of a complete, fsync'd file.

    Args:
      directory: where the files live (created if missing).
      fingerprint: the identity of the pages' bytes (`engine_fingerprint`): files of
        another fingerprint are never served.
      block_size: tokens per page (checked in the header too).
      parts: per part of a layer's page (the pages; and the scales for a quantized KV):
        (page shape, dtype), e.g. ((page, 2K, H), bfloat16) and ((2K,), float32).
      num_layers: KV arrays (layers) per page file.
      fsync: fsync each file before its rename (True: a power loss cannot leave a
        renamed but empty page; tests of logic alone may turn it off).

    Attributes:
      num_written, num_read: pages written / read and verified.
      num_corrupt: files that failed a check (bad magic, header, length or checksum).
      num_foreign: well-formed pages of another fingerprint found under a read name.
      num_stale_tmp: temporary files of dead writers removed at open.
    """

    def __init__(self, directory, *, fingerprint: str, block_size: int,
                 parts: Sequence[tuple[Sequence[int], object]], num_layers: int,
                 fsync: bool = True):
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError(f"fingerprint must be a non-empty str, got {fingerprint!r}")
        if isinstance(block_size, bool) or int(block_size) <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if isinstance(num_layers, bool) or int(num_layers) <= 0:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if not parts:
            raise ValueError("parts must name at least one (shape, dtype)")
        self.directory = os.fspath(directory)
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ValueError(f"disk_dir {self.directory!r} exists and is not a directory")
        os.makedirs(self.directory, exist_ok=True)
        self.fingerprint = fingerprint
        self.block_size = int(block_size)
        self.num_layers = int(num_layers)
        self.parts = tuple((tuple(int(d) for d in shape), np.dtype(dtype))
                           for shape, dtype in parts)
        self.fsync = bool(fsync)
        self.page_bytes = self.num_layers * sum(
            int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for shape, dtype in self.parts)
        self.num_written = self.num_read = 0
        self.num_corrupt = self.num_foreign = self.num_stale_tmp = 0
        self._sizes: dict[str, int] = {}
        self._nbytes = 0
        # NOTE: `write` may run on a writer thread while the engine thread reads,
        # discards or lists: `_sizes` and `_nbytes` change under this lock only.
        self._lock = threading.Lock()
        self._scan()

    # -- the header -------------------------------------------------------------------

    def _header(self, key: int, group: int, crc: int) -> bytes:
        return json.dumps({
            "fingerprint": self.fingerprint, "block_size": self.block_size,
            "key": str(int(key)), "group": int(group), "num_layers": self.num_layers,
            "parts": [{"dtype": d.name, "shape": list(s)} for s, d in self.parts],
            "payload_bytes": self.page_bytes, "payload_crc32": crc,
        }, sort_keys=True).encode()

    def _read_header(self, f) -> dict | None:
        """The parsed header of an open page file, or None if it is malformed (the
        prefix, the header's checksum, its JSON)."""
        prefix = f.read(_PREFIX.size)
        if len(prefix) != _PREFIX.size:
            return None
        magic, version, length, crc = _PREFIX.unpack(prefix)
        if magic != MAGIC or version != FORMAT_VERSION or length > 1 << 20:
            return None
        raw = f.read(length)
        if len(raw) != length or zlib.crc32(raw) != crc:
            return None
        try:
            header = json.loads(raw)
        except ValueError:
            return None
        return header if isinstance(header, dict) else None

    def _matches(self, header: dict, key: int, group: int) -> bool:
        """Whether a well-formed header of this fingerprint describes page (key, group)
        in this store's layout."""
        return (header.get("block_size") == self.block_size
                and header.get("key") == str(int(key)) and header.get("group") == group
                and header.get("num_layers") == self.num_layers
                and header.get("payload_bytes") == self.page_bytes
                and header.get("parts") == [{"dtype": d.name, "shape": list(s)}
                                            for s, d in self.parts])

    # -- the directory ----------------------------------------------------------------

    def _scan(self) -> None:
        """Indexes the directory: page files of this fingerprint (header checked, the
        payload's checksum is verified at read) and removes temporary files whose
        writer process is gone."""
        for entry in os.scandir(self.directory):
            name = entry.name
            if name.startswith(_TMP):
                pid = name[len(_TMP):].split("-", 1)[0]
                if not pid.isdigit() or not _pid_alive(int(pid)):
                    try:
                        os.unlink(entry.path)
                        self.num_stale_tmp += 1
                    except FileNotFoundError:
                        pass
                continue
            parsed = parse_file_name(name)
            if parsed is None or not entry.is_file():
                continue
            try:
                with open(entry.path, "rb") as f:
                    header = self._read_header(f)
                    size = os.fstat(f.fileno()).st_size
            except OSError:
                continue
            if (header is not None and header.get("fingerprint") == self.fingerprint
                    and self._matches(header, *parsed)):
                self._sizes[name] = size
                self._nbytes += size

    def keys(self) -> list[tuple[int, int]]:
        """(key, group) of the pages of this fingerprint in the directory (found at open
        or written since), sorted: what a restart preloads into the disk tier."""
        with self._lock:
            names = list(self._sizes)
        return sorted(parse_file_name(n) for n in names)

    def __contains__(self, key_group) -> bool:
        return file_name(*key_group) in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def nbytes(self) -> int:
        """Bytes of this store's page files (headers included)."""
        return self._nbytes

    def path(self, key: int, group: int = 0) -> str:
        return os.path.join(self.directory, file_name(key, group))

    # -- pages ------------------------------------------------------------------------

    def write(self, key: int, group: int, arrays: Sequence[np.ndarray]) -> None:
        """Writes block `key`'s page of group `group` (replacing any file of that name).

        Args:
          arrays: one array per part: [num_layers, *page shape] of the part's dtype
            (the pages; then the scales for a quantized KV).

        Raises:
          ValueError: an array of the wrong shape or dtype (nothing is written).
        """
        if len(arrays) != len(self.parts):
            raise ValueError(f"arrays: {len(arrays)} parts given, the store has "
                             f"{len(self.parts)}")
        bufs = []
        for a, (shape, dtype) in zip(arrays, self.parts):
            a = np.asarray(a)
            if a.shape != (self.num_layers, *shape) or a.dtype != dtype:
                raise ValueError(f"arrays: a part of shape {a.shape} {a.dtype}, expected "
                                 f"{(self.num_layers, *shape)} {dtype}")
            bufs.append(np.ascontiguousarray(a))
        header = self._header(key, group, _crc(bufs))
        name = file_name(key, group)
        tmp = os.path.join(self.directory,
                           f"{_TMP}{os.getpid()}-{os.urandom(4).hex()}-{name}")
        try:
            with open(tmp, "wb") as f:
                f.write(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), zlib.crc32(header)))
                f.write(header)
                for b in bufs:
                    f.write(_bytes_of(b))
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
                size = f.tell()
            os.replace(tmp, os.path.join(self.directory, name))
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        with self._lock:
            self._nbytes += size - self._sizes.get(name, 0)
            self._sizes[name] = size
            self.num_written += 1

    def read(self, key: int, group: int = 0) -> tuple[np.ndarray, ...] | None:
        """Block `key`'s page of group `group`: one array per part, [num_layers, *page
        shape], verified; None when there is no such file or it fails a check (then it
        is counted and deleted: a miss, never wrong KV)."""
        name = file_name(key, group)
        path = os.path.join(self.directory, name)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            with self._lock:
                self._nbytes -= self._sizes.pop(name, 0)
            return None
        with f:
            header = self._read_header(f)
            foreign = header is not None and header.get("fingerprint") != self.fingerprint
            ok = header is not None and self._matches(header, key, group)
            out = None
            if ok and not foreign:
                out = []
                for shape, dtype in self.parts:
                    a = np.empty((self.num_layers, *shape), dtype)
                    n = f.readinto(_bytes_of(a))
                    if n != a.nbytes:
                        out = None
                        break
                    out.append(a)
                if out is not None and (f.read(1) or _crc(out) != header.get("payload_crc32")):
                    out = None
        if out is None:
            if foreign:
                self.num_foreign += 1
            else:
                self.num_corrupt += 1
            self.discard(key, group)
            return None
        self.num_read += 1
        return tuple(out)

    def discard(self, key: int, group: int = 0) -> bool:
        """Deletes block `key`'s page of group `group`; whether a file was there."""
        name = file_name(key, group)
        with self._lock:
            self._nbytes -= self._sizes.pop(name, 0)
        try:
            os.unlink(os.path.join(self.directory, name))
        except FileNotFoundError:
            return False
        return True

    def clear(self) -> None:
        """Deletes every page file of this store (those of other fingerprints stay)."""
        self.retain(lambda key, group: False)

    def retain(self, keep) -> int:
        """Deletes the page files whose `keep(key, group)` is False; how many."""
        with self._lock:
            names = list(self._sizes)
        gone = [kg for kg in map(parse_file_name, names) if not keep(*kg)]
        for kg in gone:
            self.discard(*kg)
        return len(gone)

    def keys_oldest_first(self) -> list[tuple[int, int]]:
        """`keys()` by modification time, oldest first (ties by key): the order a
        restart preloads them in, so the disk tier's policy evicts the oldest first."""
        def age(kg):
            try:
                return os.stat(self.path(*kg)).st_mtime_ns, kg
            except FileNotFoundError:
                return 0, kg
        return sorted(self.keys(), key=age)


class MemoryPages:
    """The KV pages of a lower tier the engine keeps in host memory (a tier of one's
    own, a remote store): the page store interface of `PageFiles` over a dict.

    One `MemoryPages` may serve several engines that share a tier object (a remote
    store shared by replicas in one process): it is kept on the tier (`for_tier`).

    Args:
      parts, num_layers: as `PageFiles` (the layout every page must have).

    Attributes:
      num_written, num_read: pages written / read.
    """

    def __init__(self, *, parts: Sequence[tuple[Sequence[int], object]], num_layers: int):
        self.parts = tuple((tuple(int(d) for d in shape), np.dtype(dtype))
                           for shape, dtype in parts)
        self.num_layers = int(num_layers)
        self.page_bytes = self.num_layers * sum(
            int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for shape, dtype in self.parts)
        self._pages: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}
        self.num_written = self.num_read = 0

    @classmethod
    def for_tier(cls, tier, *, parts, num_layers: int) -> "MemoryPages":
        """The pages kept on `tier` (its attribute ``engine_pages``), made on first use;
        ValueError when another engine's pages there have another layout."""
        pages = getattr(tier, "engine_pages", None)
        if pages is None:
            pages = cls(parts=parts, num_layers=num_layers)
            tier.engine_pages = pages
        elif pages.parts != tuple((tuple(s), np.dtype(d)) for s, d in parts) or \
                pages.num_layers != num_layers:
            raise ValueError(f"the {tier.name} tier already holds pages of another layout "
                             f"({pages.num_layers} x {pages.parts}): engines sharing a tier "
                             "must run the same model and KV dtype")
        return pages

    def write(self, key: int, group: int, arrays: Sequence[np.ndarray]) -> None:
        got = tuple(np.asarray(a) for a in arrays)
        if len(got) != len(self.parts) or any(
                a.shape != (self.num_layers, *s) or a.dtype != d
                for a, (s, d) in zip(got, self.parts)):
            raise ValueError(f"arrays: parts {[(a.shape, a.dtype) for a in got]}, expected "
                             f"{[((self.num_layers, *s), d) for s, d in self.parts]}")
        self._pages[(int(key), int(group))] = got
        self.num_written += 1

    def read(self, key: int, group: int = 0) -> tuple[np.ndarray, ...] | None:
        got = self._pages.get((int(key), int(group)))
        if got is not None:
            self.num_read += 1
        return got

    def discard(self, key: int, group: int = 0) -> bool:
        return self._pages.pop((int(key), int(group)), None) is not None

    def retain(self, keep) -> int:
        gone = [kg for kg in list(self._pages) if not keep(*kg)]
        for kg in gone:
            del self._pages[kg]
        return len(gone)

    def keys(self) -> list[tuple[int, int]]:
        return sorted(self._pages)

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def nbytes(self) -> int:
        return len(self._pages) * self.page_bytes
