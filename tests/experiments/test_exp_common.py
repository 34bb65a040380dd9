"""Tests for experiments/_common.py: provenance, atomic JSONL output, plots."""

import json
import os

import ml_collections
import pytest

from experiments import _common


def test_provenance_records_config_seed_versions_git():
    cfg = ml_collections.ConfigDict({"num_blocks": 8, "sizes": (1, 2), "nested": {"a": 1.5}})
    prov = _common.provenance(cfg, seed=3, hash_algo="sha256", cache_state="cold",
                              extra={"trace": "t.jsonl"})
    assert prov["config"] == {"num_blocks": 8, "sizes": [1, 2], "nested": {"a": 1.5}}
    assert prov["seed"] == 3 and prov["hash_algo"] == "sha256" and prov["cache_state"] == "cold"
    assert prov["trace"] == "t.jsonl"
    assert prov["versions"]["python"] and prov["versions"]["numpy"]
    assert "prefixcache" in prov["versions"]
    assert set(prov["git"]) == {"revision", "dirty"}
    json.dumps(prov)  # JSON-able


def test_provenance_rejects_bad_cache_state_and_shadowing():
    with pytest.raises(ValueError, match="cache_state"):
        _common.provenance({}, seed=0, cache_state="lukewarm")
    with pytest.raises(ValueError, match="shadows"):
        _common.provenance({}, seed=0, extra={"seed": 1})


def test_atomic_writer_clean_exit_adds_provenance(tmp_path):
    out = tmp_path / "sub" / "r.jsonl"
    with _common.AtomicJsonlWriter(out, provenance={"seed": 1}) as w:
        w.write({"x": 1})
        w.write({"x": 2})
        assert not out.exists()  # nothing visible until the clean exit
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    assert lines == [{"x": 1, "provenance": {"seed": 1}}, {"x": 2, "provenance": {"seed": 1}}]
    assert list(out.parent.iterdir()) == [out]  # no temp file left
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600


def test_atomic_writer_error_leaves_previous_file_and_no_temp(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text("old\n")
    with pytest.raises(RuntimeError):
        with _common.AtomicJsonlWriter(out) as w:
            w.write({"x": 1})
            raise RuntimeError("boom")
    assert out.read_text() == "old\n"
    assert list(tmp_path.iterdir()) == [out]


def test_prepare_workdir_and_save_plot(tmp_path):
    wd = _common.prepare_workdir(tmp_path / "a" / "b")
    assert wd.is_dir()
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        _common.prepare_workdir(tmp_path / "f")
    fig, ax = _common.new_figure()
    ax.plot([0, 1], [1, 0])
    p = _common.save_plot(fig, wd / "p.png")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
