"""Faults around the experiments' outputs (issue 13, item 2): a result writer that fails
(disk full), SIGINT during a replay and during a sweep. A result file is then either
complete (an earlier run's, untouched) or absent -- never a truncated one -- and no
temporary file is left behind."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from experiments import _common
from experiments import replay as replay_exp
from prefixcache.sim.trace import write_trace

ROOT = pathlib.Path(__file__).resolve().parents[2]


class FullDisk:
    """A text file whose writes fail with ENOSPC after `ok` lines (or at flush)."""

    def __init__(self, f, ok: int, at_flush: bool = False):
        self._f, self.ok, self.at_flush, self.n = f, ok, at_flush, 0

    def write(self, s):
        if not self.at_flush and self.n >= self.ok:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.n += 1
        return self._f.write(s)

    def flush(self):
        if self.at_flush:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._f.flush()

    def fileno(self):
        return self._f.fileno()

    def close(self):
        self._f.close()

    @property
    def closed(self):
        return self._f.closed


@pytest.fixture
def full_disk(monkeypatch):
    """Makes every AtomicJsonlWriter's file fail like a full disk; returns the
    wrappers made (to check they were closed)."""
    made = []

    def install(ok, at_flush=False):
        enter = _common.AtomicJsonlWriter.__enter__

        def failing_enter(self):
            enter(self)
            self._file = FullDisk(self._file, ok, at_flush)
            made.append(self._file)
            return self

        monkeypatch.setattr(_common.AtomicJsonlWriter, "__enter__", failing_enter)
        return made

    return install


def leftovers(directory):
    return sorted(p.name for p in pathlib.Path(directory).iterdir()
                  if p.name.startswith("."))


@pytest.mark.parametrize("at_flush", [False, True], ids=["write", "flush"])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "over_old"])
def test_writer_on_a_full_disk(tmp_path, full_disk, at_flush, existing):
    out = tmp_path / "r.jsonl"
    if existing:
        out.write_text('{"old": 1}\n')
    made = full_disk(ok=3, at_flush=at_flush)
    with pytest.raises(OSError, match="No space left"):
        with _common.AtomicJsonlWriter(out) as w:
            for i in range(10):
                w.write({"i": i})
    assert (out.read_text() == '{"old": 1}\n') if existing else not out.exists()
    assert leftovers(tmp_path) == [] and all(f.closed for f in made)


def test_replay_with_a_failing_writer_leaves_no_output(tmp_path, full_disk):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [{"id": f"r{i}", "prompt": [1, 2, 3, i], "output_len": 2}
                        for i in range(50)])
    full_disk(ok=10)
    cfg = _config(trace=str(trace), out=str(tmp_path / "o.jsonl"),
                  workdir=str(tmp_path / "wd"))
    with pytest.raises(OSError, match="No space left"):
        replay_exp.run(cfg)
    assert not (tmp_path / "o.jsonl").exists()
    assert not (tmp_path / "wd" / "results.jsonl").exists()
    assert leftovers(tmp_path) == [] and leftovers(tmp_path / "wd") == []


def _config(**overrides):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_cfg_replay", ROOT / "configs" / "replay.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture(scope="module")
def long_trace(tmp_path_factory):
    """A trace whose replay takes minutes (long decodes), to be interrupted."""
    path = tmp_path_factory.mktemp("trace") / "long.jsonl"
    write_trace(path, [{"id": f"r{i}", "prompt": [1 + i % 5] * 48 + [i], "output_len": 400}
                       for i in range(20000)])
    return path


def was_interrupted(proc) -> bool:
    """A nonzero exit that reports the interrupt (a traceback, a message or the signal)."""
    return proc.returncode != 0 and (
        "interrupt" in proc.stderr_text.lower()
        or proc.returncode in (-signal.SIGINT, 128 + signal.SIGINT))


def interrupt(cmd, ready, timeout=60.0):
    """Starts `cmd`, waits until `ready()` (or fails), sends SIGINT; returns the process
    after it exited."""
    # NOTE: a shell runs background jobs with SIGINT ignored, and a child inherits that
    # (Python then installs no KeyboardInterrupt handler): restore the default first, so
    # the test behaves the same however CI was started.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never got going"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.stdout_text, proc.stderr_text = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc


@pytest.mark.parametrize("existing", [False, True], ids=["new", "over_old"])
def test_sigint_during_replay(tmp_path, long_trace, existing):
    out = tmp_path / "o.jsonl"
    if existing:
        out.write_text('{"old": 1}\n')

    def writing():  # the temp file has records in it: the replay is under way
        return any(p.stat().st_size > 0 for p in tmp_path.glob(".o.jsonl.*.partial"))

    proc = interrupt([sys.executable, "-m", "experiments.replay", f"--trace={long_trace}",
                      "--num_blocks=256", "--block_size=16", f"--out={out}",
                      "--noprogress"], writing)
    assert was_interrupted(proc), proc.stderr_text
    assert (out.read_text() == '{"old": 1}\n') if existing else not out.exists()
    assert leftovers(tmp_path) == []


def test_sigint_during_sweep(tmp_path, long_trace):
    workdir = tmp_path / "wd"
    workdir.mkdir()
    old = workdir / "results.jsonl"
    old.write_text('{"old": 1}\n')
    start = time.monotonic()

    def sweeping():  # started and past the trace reading (a sweep writes at its end)
        return time.monotonic() - start > 6

    proc = interrupt([sys.executable, "-m", "experiments.sweep_capacity",
                      f"--config.trace={long_trace}", "--config.capacities=(64, 128)",
                      "--config.warmup_requests=100", f"--workdir={workdir}",
                      "--noprogress"], sweeping)
    assert was_interrupted(proc), proc.stderr_text
    assert old.read_text() == '{"old": 1}\n'
    assert not (workdir / "sweep_capacity.png").exists()
    assert leftovers(workdir) == []
    assert json.loads(old.read_text()) == {"old": 1}
    # Besides the old results, only the resumable cell log (issue 25: an interrupted
    # run leaves its finished cells; every line of it is whole).
    rest = sorted(set(os.listdir(workdir)) - {"results.jsonl"})
    assert rest in ([], ["sweep_capacity.cells.jsonl"]), rest
    for name in rest:
        for line in (workdir / name).read_text().splitlines():
            json.loads(line)
