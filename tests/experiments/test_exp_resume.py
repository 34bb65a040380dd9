"""Long experiments leave their finished cells behind and resume from them.

An interrupted-and-resumed run gives the same rows as an uninterrupted one; a workdir
holding another config's cells is refused; a torn last line is run again.
"""

import importlib
import importlib.util
import json
import pathlib

import pytest

from experiments import _common
from experiments import compare_policies as cp
from prefixcache.sim import compare
from prefixcache.sim import workloads as wl
from prefixcache.sim.trace import write_trace

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name, arg=None):
    spec = importlib.util.spec_from_file_location(f"_cfg_{name}", ROOT / "configs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config() if arg is None else mod.get_config(arg)


def _strip(rows):
    drop = {"provenance", *compare.TIMING_FIELDS}
    return [{k: v for k, v in r.items() if k not in drop} for r in rows]


def _read(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


@pytest.fixture
def config(tmp_path):
    trace = tmp_path / "rag.jsonl"
    write_trace(trace, wl.rag(num_requests=24, num_documents=6, doc_len=(20, 80),
                              system_len=32, output_len=(2, 6), seed=4))
    cfg = _load("compare_policies")
    cfg.trace, cfg.workdir = str(trace), str(tmp_path / "whole")
    cfg.block_size, cfg.capacities, cfg.concurrency, cfg.workers = 8, "40,80,400", 2, 1
    cfg.policies, cfg.indexes, cfg.belady_bound = "lru,fifo", "hash", False
    return cfg


class _Interrupt:
    """Patches CellLog.add to raise KeyboardInterrupt once `after` cells are logged."""

    def __init__(self, monkeypatch, after):
        self.calls = 0
        real = _common.CellLog.add

        def add(log, key, row):
            if self.calls == after:
                raise KeyboardInterrupt
            self.calls += 1
            real(log, key, row)

        monkeypatch.setattr(_common.CellLog, "add", add)


def test_interrupted_and_resumed_compare_policies_gives_the_same_rows(config, tmp_path,
                                                                       monkeypatch):
    whole = _read(cp.run(config)["rows"])
    assert len(whole) == 2 * 3 + 1  # 2 policies x 3 capacities + the ideal
    config.workdir = str(tmp_path / "cut")
    with monkeypatch.context() as m:
        _Interrupt(m, after=3)
        with pytest.raises(KeyboardInterrupt):
            cp.run(config)
    cut = pathlib.Path(config.workdir)
    assert not (cut / cp.ROWS_FILE).exists()  # the final file only once all cells ran
    log = _read(cut / "compare_policies.cells.jsonl")
    assert [r["record"] for r in log] == ["run", "cell", "cell", "cell"]  # 3 survived
    resumed = _read(cp.run(config)["rows"])
    assert _strip(resumed) == _strip(whole)
    assert len(_read(cut / "compare_policies.cells.jsonl")) == 1 + 7
    # A rerun of the finished workdir runs nothing and rewrites the same rows.
    again = _read(cp.run(config)["rows"])
    assert _strip(again) == _strip(whole)


def test_a_workdir_of_another_config_is_refused(config):
    cp.run(config)
    config.capacities = "40,80"
    with pytest.raises(ValueError, match="another run.*config_sha256.*delete"):
        cp.run(config)
    config.capacities, config.workers = "40,80,400", 2  # how it runs: not a new config
    cp.run(config)


def test_a_different_trace_under_the_same_path_is_refused(config):
    cp.run(config)
    write_trace(config.trace, wl.rag(num_requests=20, num_documents=6, doc_len=(20, 80),
                                     system_len=32, output_len=(2, 6), seed=5))
    with pytest.raises(ValueError, match="trace_sha256"):
        cp.run(config)


def test_a_torn_last_line_is_run_again(tmp_path):
    fp = {"config_sha256": "x", "seed": 0, "trace_sha256": None}
    log = _common.CellLog(tmp_path, "t", fp)
    log.add("a", {"v": 1})
    with open(log.path, "a") as f:
        f.write('{"record": "cell", "key": "b", "ro')  # killed mid-write
    again = _common.CellLog(tmp_path, "t", fp)
    assert "a" in again and "b" not in again and again.resumed == 1
    again.add("b", {"v": 2})
    third = _common.CellLog(tmp_path, "t", fp)
    assert third.get("b") == {"v": 2} and len(third) == 2


@pytest.mark.parametrize("module, name, rows_file", [
    ("route", "route", "route.jsonl"),
    ("sweep_capacity", "sweep_capacity", "results.jsonl"),
])
def test_in_process_grids_resume_with_the_same_rows(module, name, rows_file, tmp_path,
                                                    monkeypatch):
    exp = importlib.import_module(f"experiments.{module}")

    def config(work):
        c = _load(name, "quick")
        c.workdir = str(tmp_path / work)
        if module == "route":
            c.workload.kwargs.num_requests, c.policies = 60, "round_robin,kv_events"
        else:
            c.workload.kwargs.num_requests, c.warmup_requests = 60, 30
            c.capacities = (128, 512)
        return c

    def rows(work):
        drop = {"provenance", "route_us", "route_hash_us", "sim_s", "wall_s"}
        return [{k: v for k, v in r.items() if k not in drop}
                for r in _read(tmp_path / work / rows_file)]

    exp.run(config("whole"))
    with monkeypatch.context() as m:
        _Interrupt(m, after=2)
        with pytest.raises(KeyboardInterrupt):
            exp.run(config("cut"))
    assert not (tmp_path / "cut" / rows_file).exists()
    assert len(_read(tmp_path / "cut" / f"{name}.cells.jsonl")) == 1 + 2
    exp.run(config("cut"))
    a, b = rows("cut"), rows("whole")
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if v != y.get(k)} == {}, x["policy"]
