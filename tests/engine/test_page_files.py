"""The disk tier's KV page files: round trip, corruption, kill -9 mid-write, fingerprints."""

import os
import signal
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from prefixcache.engine.page_files import PageFiles, file_name, parse_file_name

KEY = 0x1234_5678_9ABC_DEF0_0FED_CBA9_8765_4321  # a 128-bit block key
PARTS = (((4, 2, 8), ml_dtypes.bfloat16), ((2,), np.float32))  # pages + scales
LAYERS = 3


def _store(tmp_path, fingerprint="model-a", **kw):
    return PageFiles(tmp_path, fingerprint=fingerprint, block_size=4, parts=PARTS,
                     num_layers=LAYERS, fsync=kw.pop("fsync", False), **kw)


def _page(seed):
    rng = np.random.default_rng(abs(seed))
    return (rng.standard_normal((LAYERS, 4, 2, 8)).astype(ml_dtypes.bfloat16),
            rng.standard_normal((LAYERS, 2)).astype(np.float32))


def _same(a, b):
    return all(x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8))
               for x, y in zip(a, b))


def test_file_names_round_trip():
    assert file_name(KEY, 0) == "123456789abcdef00fedcba987654321-g0.kvpage"
    assert file_name(5, 2) == "00000000000000000000000000000005-g2.kvpage"
    for key, group in [(KEY, 0), (5, 2), (-7, 1), (1 << 255, 0)]:
        assert parse_file_name(file_name(key, group)) == (key, group)
    assert parse_file_name(".tmp-1-ab-x.kvpage") is None


def test_round_trip_keys_and_bytes(tmp_path):
    store = _store(tmp_path, fsync=True)
    pages = {k: _page(k) for k in (KEY, 5, -9)}
    for k, p in pages.items():
        store.write(k, 0, p)
    assert store.keys() == sorted((k, 0) for k in pages)
    assert store.nbytes == sum(os.path.getsize(store.path(k)) for k in pages)
    assert store.nbytes > 3 * store.page_bytes
    for k, p in pages.items():
        assert _same(store.read(k, 0), p)
    assert store.read(KEY, 1) is None  # another group: no file, not corrupt
    assert store.num_corrupt == 0 and store.num_read == 3
    # A restart over the same directory finds the same pages (reuse).
    again = _store(tmp_path)
    assert again.keys() == store.keys() and again.nbytes == store.nbytes
    assert _same(again.read(5, 0), pages[5])
    assert again.discard(5, 0) and (5, 0) not in again and not os.path.exists(again.path(5))
    assert again.retain(lambda key, group: key == KEY) == 1  # -9 goes
    assert again.keys() == [(KEY, 0)] and again.nbytes == os.path.getsize(again.path(KEY))
    store.write(KEY, 0, _page(4))  # a rewrite replaces the file (bytes counted once)
    assert store.keys_oldest_first()[-1] == (KEY, 0)


def test_bad_write_is_refused_before_any_file(tmp_path):
    store = _store(tmp_path)
    with pytest.raises(ValueError, match="arrays"):
        store.write(KEY, 0, (_page(0)[0][:2], _page(0)[1]))
    assert os.listdir(tmp_path) == [] and store.keys() == []


@pytest.mark.parametrize("where", ["payload", "header", "truncate", "magic"])
def test_corrupt_file_is_a_counted_miss_and_deleted(tmp_path, where):
    store = _store(tmp_path)
    store.write(KEY, 0, _page(1))
    path = store.path(KEY)
    data = bytearray(open(path, "rb").read())
    if where == "payload":
        data[-3] ^= 0x40  # one bit of the last layer's scales
    elif where == "header":
        data[30] ^= 0x01
    elif where == "truncate":
        data = data[:-5]
    else:
        data[0:8] = b"NOTAPAGE"
    open(path, "wb").write(bytes(data))
    assert store.read(KEY, 0) is None
    assert store.num_corrupt == 1 and store.num_read == 0
    assert not os.path.exists(path) and store.keys() == [] and store.nbytes == 0


def test_file_renamed_under_another_key_is_refused(tmp_path):
    store = _store(tmp_path)
    store.write(KEY, 0, _page(1))
    os.replace(store.path(KEY), store.path(5))  # a valid page, under the wrong name
    assert store.read(5, 0) is None and store.num_corrupt == 1


def test_foreign_fingerprint_is_ignored(tmp_path):
    other = _store(tmp_path, fingerprint="model-b")
    other.write(KEY, 0, _page(1))
    other.write(5, 0, _page(2))
    mine = _store(tmp_path)
    assert mine.keys() == [] and mine.nbytes == 0  # listed for no restart of model-a
    assert mine.read(KEY, 0) is None  # never served; it sat under a name of ours
    assert mine.num_foreign == 1 and mine.num_corrupt == 0
    assert not os.path.exists(mine.path(KEY)) and os.path.exists(mine.path(5))
    # Same fingerprint, other layout (block size): not listed either.
    assert PageFiles(tmp_path, fingerprint="model-b", block_size=8, parts=PARTS,
                     num_layers=LAYERS).keys() == []


_CHILD = textwrap.dedent("""
    import importlib.util, os, sys, time
    import ml_dtypes, numpy as np
    spec = importlib.util.spec_from_file_location("page_files", sys.argv[1])
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    store = mod.PageFiles(sys.argv[2], fingerprint="model-a", block_size=4,
                          parts=(((4, 2, 8), ml_dtypes.bfloat16), ((2,), np.float32)),
                          num_layers=3, fsync=True)
    page = (np.ones((3, 4, 2, 8), ml_dtypes.bfloat16), np.ones((3, 2), np.float32))
    real_fsync = os.fsync
    def stall(fd):  # every byte is in the temporary file: stop before the rename
        real_fsync(fd)
        print("written", flush=True)
        time.sleep(600)
    os.fsync = stall
    store.write(int(sys.argv[3]), 0, page)
""")


def test_kill_9_mid_write_leaves_no_servable_page(tmp_path):
    import prefixcache.engine.page_files as pf

    store = _store(tmp_path)
    store.write(5, 0, _page(3))  # an older page survives the crash
    child = subprocess.Popen([sys.executable, "-c", _CHILD, pf.__file__, str(tmp_path),
                              str(KEY)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "written"
        tmp = [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
        assert len(tmp) == 1, os.listdir(tmp_path)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    after = _store(tmp_path)  # a restart over the directory
    assert after.keys() == [(5, 0)] and after.read(KEY, 0) is None
    assert after.num_stale_tmp == 1 and sorted(os.listdir(tmp_path)) == [file_name(5, 0)]
    assert _same(after.read(5, 0), _page(3))
