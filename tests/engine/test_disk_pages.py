"""The engine's disk-tier copies: `HostPages` with page files applies an ordered list
mixing `HostTransfer`s and `TierTransfer`s (device / host / disk) exactly as sequential
page copies would (a numpy reference walks them one by one), in one device_put and at
most one device_get per batch; a corrupt file is never loaded."""

from __future__ import annotations

import os
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest

from prefixcache.engine.host_pages import HostPages
from prefixcache.engine.page_files import PageFiles

L, NB, NH, PAGE = 2, 6, 3, (4, 2, 8)  # layers, device blocks, host slots, page shape
KEYS = (11, 12, 13, 14)


class TierTransfer(NamedTuple):  # the interface's fields, as the core's chain records them
    kind: str
    src: str
    src_id: int
    dst: str
    dst_id: int
    key: int
    group: int


def _kv(seed):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((NB + 1, *PAGE)).astype(np.float32))
            for _ in range(L)]


def _files(path):
    return PageFiles(path, fingerprint="test", block_size=PAGE[0],
                     parts=((PAGE, np.float32),), num_layers=L, fsync=False)


def _reference(dev, host, disk, transfers):
    """Sequential copies, one at a time. disk: key -> [L, *PAGE]."""
    dev, host = [d.copy() for d in dev], [h.copy() for h in host]
    disk = {k: v.copy() for k, v in disk.items()}
    for t in transfers:
        if len(t) == 3:
            kind, b, s = t
            t = (TierTransfer(kind, "device", b, "host", s, 0, 0) if kind == "store"
                 else TierTransfer(kind, "host", s, "device", b, 0, 0))
        src = {"device": lambda i: np.stack([d[i] for d in dev]),
               "host": lambda i: np.stack([h[i] for h in host]),
               "disk": lambda i: disk[i]}[t.src](t.src_id)
        if t.dst == "disk":
            disk[t.dst_id] = src
        else:
            for l, arr in enumerate(dev if t.dst == "device" else host):
                arr[t.dst_id] = src[l]
    return dev, host, disk


def _random_transfers(rng, n, on_disk):
    out = []
    on_disk = set(on_disk)
    for _ in range(n):
        r = rng.integers(5)
        b, s, k = int(rng.integers(NB)), int(rng.integers(NH)), int(rng.choice(KEYS))
        if r == 0:
            out.append(("store", b, s))  # a HostTransfer
        elif r == 1:
            out.append(TierTransfer("load", "host", s, "device", b, 0, 0))
        elif r == 2:
            out.append(TierTransfer("store", "host", s, "disk", k, k, 0))
            on_disk.add(k)
        elif r == 3:
            out.append(TierTransfer("store", "device", b, "disk", k, k, 0))
            on_disk.add(k)
        elif on_disk:
            k = int(rng.choice(sorted(on_disk)))
            out.append(TierTransfer("load", "disk", k, "device", b, k, 0))
    return out


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    files = _files(tmp_path_factory.mktemp("disk"))
    return HostPages(_kv(0), num_blocks=NB, num_host_blocks=NH, files=files)


@pytest.mark.parametrize("seed", range(24))
def test_batch_equals_sequential_copies(seed, shared):
    rng = np.random.default_rng(seed)
    pages, files = shared, shared.files
    files.clear()
    kv = _kv(seed)
    for p in pages.pages:
        p[:] = rng.standard_normal(p.shape)
    disk0 = {}
    for k in KEYS[:2]:
        disk0[k] = rng.standard_normal((L, *PAGE)).astype(np.float32)
        files.write(k, 0, [disk0[k]])
    dev0, host0 = [np.asarray(x) for x in kv], [p.copy() for p in pages.pages]
    transfers = _random_transfers(rng, int(rng.integers(1, 14)), disk0)
    want_dev, want_host, want_disk = _reference(dev0, host0, disk0, transfers)
    counts = (pages.num_h2d, pages.num_d2h)
    kv = pages.apply(kv, transfers)
    pages.finish()
    pages.flush_files()  # (the files are written on the writer thread)
    for l in range(L):
        np.testing.assert_array_equal(np.asarray(kv[l])[:NB], want_dev[l][:NB])
        np.testing.assert_array_equal(pages.pages[l], want_host[l])
    assert sorted(k for k, _ in files.keys()) == sorted(want_disk)
    for k, want in want_disk.items():
        np.testing.assert_array_equal(files.read(k, 0)[0], want)
    assert pages.num_h2d - counts[0] <= 1 and pages.num_d2h - counts[1] <= 1


def test_a_load_waits_for_the_write_of_its_page(tmp_path, monkeypatch):
    import threading

    kv = _kv(7)
    before = np.stack([np.asarray(x)[3] for x in kv])
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH, files=_files(tmp_path))
    gate, real = threading.Event(), pages.files.write

    def slow_write(*a):
        assert gate.wait(30)
        real(*a)

    monkeypatch.setattr(pages.files, "write", slow_write)
    kv = pages.apply(kv, [TierTransfer("store", "device", 3, "disk", 5, 5, 0)])
    pages.finish()  # returns with the write still held on the writer thread
    assert pages.files.keys() == [] and threading.active_count() > 1
    threading.Timer(0.2, gate.set).start()
    assert pages.validate(5)  # waits for the write, then reads it
    kv = pages.apply(kv, [TierTransfer("load", "disk", 5, "device", 0, 5, 0)])
    pages.finish()
    np.testing.assert_array_equal(np.stack([np.asarray(x)[0] for x in kv]), before)


def test_disk_without_a_host_tier_round_trips_a_page(tmp_path):
    kv = _kv(1)
    before = np.stack([np.asarray(x)[2] for x in kv])
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=0, files=_files(tmp_path))
    assert pages.pages[0].shape == (0, *PAGE) and pages.nbytes == 0
    kv = pages.apply(kv, [TierTransfer("store", "device", 2, "disk", 99, 99, 0)])
    assert pages.files.keys() == []  # written after the step's dispatch ...
    pages.finish()
    pages.flush_files()  # ... by finish, on the writer thread
    assert pages.files.keys() == [(99, 0)] and pages.num_disk_stored == 1
    assert pages.validate(99)
    kv = pages.apply(kv, [TierTransfer("load", "disk", 99, "device", 5, 99, 0)])
    pages.finish()
    assert pages.files.num_read == 1  # validated at lookup, read once for the load
    np.testing.assert_array_equal(np.stack([np.asarray(x)[5] for x in kv]), before)
    # The disk copies ran through the host tier's copy programs: no program of its own.
    assert pages.compiled_shapes == {(4, 0, 0), (0, 4, 4)}


def test_corrupt_page_fails_validation_and_is_never_loaded(tmp_path):
    kv = _kv(2)
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH, files=_files(tmp_path))
    pages.files.write(7, 0, [np.ones((L, *PAGE), np.float32)])
    with open(pages.files.path(7), "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x01")
    assert not pages.validate(7)  # the core tier counts it corrupt: a miss
    assert pages.files.num_corrupt == 1 and pages.files.keys() == []
    with pytest.raises(RuntimeError, match="gone or corrupt"):  # a manager bug: loud
        pages.apply(kv, [TierTransfer("load", "disk", 7, "device", 0, 7, 0)])


def test_files_of_another_layout_are_refused(tmp_path):
    files = PageFiles(tmp_path, fingerprint="test", block_size=4,
                      parts=(((4, 2, 4), np.float32),), num_layers=L)
    with pytest.raises(ValueError, match="files"):
        HostPages(_kv(3), num_blocks=NB, num_host_blocks=NH, files=files)


def test_remote_transfers_are_refused(tmp_path):
    pages = HostPages(_kv(4), num_blocks=NB, num_host_blocks=NH, files=_files(tmp_path))
    with pytest.raises(ValueError, match="device, host and disk"):
        pages.apply(_kv(4), [TierTransfer("load", "remote", 3, "device", 0, 3, 0)])


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_quantized_pages_keep_values_and_scales_through_a_file(kv_dtype, tmp_path):
    dtype = jnp.dtype(kv_dtype)
    rng = np.random.default_rng(5)
    kv = []
    for _ in range(L):  # (pages, scales f32[pages, 2K]) per layer, arbitrary bits
        pages = rng.integers(0, 256, (NB + 1, *PAGE), dtype=np.uint8).view(dtype)
        kv.append((jnp.asarray(pages), jnp.asarray(
            rng.standard_normal((NB + 1, PAGE[1])).astype(np.float32))))
    want = [(np.asarray(p)[1].tobytes(), np.asarray(s)[1].tobytes()) for p, s in kv]
    files = PageFiles(tmp_path, fingerprint="q", block_size=PAGE[0],
                      parts=((PAGE, dtype), ((PAGE[1],), np.float32)), num_layers=L,
                      fsync=False)
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH, files=files)
    kv = pages.apply(kv, [TierTransfer("store", "device", 1, "host", 0, 0, 0),
                          TierTransfer("store", "host", 0, "disk", 42, 42, 0)])
    pages.finish()
    kv = pages.apply(kv, [TierTransfer("load", "disk", 42, "device", 4, 42, 0)])
    pages.finish()
    got = [(np.asarray(p)[4].tobytes(), np.asarray(s)[4].tobytes()) for p, s in kv]
    assert got == want


def test_a_failed_page_write_is_a_later_miss_not_an_error(tmp_path, monkeypatch):
    import errno

    kv = _kv(6)
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH, files=_files(tmp_path))
    real = pages.files.write

    def full_disk(key, group, arrays):
        if key == 8:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(key, group, arrays)

    monkeypatch.setattr(pages.files, "write", full_disk)
    kv = pages.apply(kv, [TierTransfer("store", "device", 1, "disk", 8, 8, 0),
                          TierTransfer("store", "device", 2, "disk", 9, 9, 0)])
    pages.finish()  # no exception: the step goes on
    pages.flush_files()
    assert (pages.num_disk_stored, pages.num_disk_write_errors) == (1, 1)
    assert not pages.validate(8) and pages.validate(9)
    assert os.listdir(tmp_path) == [pages.files.path(9).rsplit("/", 1)[1]]
