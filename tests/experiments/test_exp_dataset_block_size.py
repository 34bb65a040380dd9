"""A registered hash-id dataset is replayed at its own tokens per hash id: every
experiment that replays one refuses another block size before it reads anything, and
every shipped config that names a dataset uses its block size."""

from __future__ import annotations

import importlib
import pathlib

import pytest

from experiments import _common
from prefixcache.sim import datasets

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def _bad(module: str):
    c = importlib.import_module(f"configs.{module}").get_config()
    c.dataset = "mooncake_synthetic"  # (512-token hash ids)
    c.trace = ""
    c.block_size = 16
    c.workdir = ""
    return c


def _replay(c):
    from experiments import replay

    replay.run(c)


def _route(c):
    from experiments import route

    route.check_config(c)


def _host_tier(c):
    from experiments import host_tier

    host_tier.resolve(c)


def _sweep(c):
    from experiments import sweep_capacity

    sweep_capacity.run(c)


def _compare(c):
    from experiments import compare_policies

    compare_policies.resolve_grid(c)


@pytest.mark.parametrize("module,call", [
    ("replay", _replay), ("route", _route), ("host_tier", _host_tier),
    ("sweep_capacity", _sweep), ("compare_policies", _compare)])
def test_another_block_size_is_refused_before_anything_is_read(module, call, tmp_path,
                                                              monkeypatch):
    monkeypatch.setenv("PREFIXCACHE_DATA", str(tmp_path / "data"))  # (nothing there)
    c = _bad(module)
    with pytest.raises(datasets.DatasetError, match="512-token blocks.*block_size=512"):
        call(c)
    assert not (tmp_path / "data").exists()  # (no download was started)


def test_every_shipped_dataset_config_uses_its_block_size():
    checked = 0
    for path in sorted(CONFIGS.glob("*.py")):
        if path.name.startswith("_") or path.stem.startswith("latency_by_prefix"):
            continue  # (latency_by_prefix drives the engine on expanded tokens)
        c = importlib.import_module(f"configs.{path.stem}").get_config()
        if "dataset" in c and c.dataset and "block_size" in c:
            _common.check_dataset_block_size(c)
            checked += 1
    assert checked >= 10


def test_a_file_trace_is_not_checked():
    c = _bad("replay")
    c.dataset = ""
    _common.check_dataset_block_size(c)  # (the token path at any block size)
