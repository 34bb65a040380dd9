"""Run independent cells of an experiment in parallel: local processes or a Ray cluster.

``map_cells(fn, cells, executor=...)`` calls ``fn(cell)`` for every cell and returns the
results in the cells' order, whichever executor ran them:

* ``local``: a ``concurrent.futures.ProcessPoolExecutor`` of ``workers`` processes
  (``spawn``ed: a fresh interpreter each, safe beside threads such as Ray's);
* ``ray``: one Ray task per cell (``num_cpus=1``) on the cluster at ``ray_address``
  ("": a local instance of ``workers`` CPUs, shut down afterwards; an already
  initialised Ray is used as it is). Ray is an optional extra: ``pip install -e ".[ray]"``.

``fn`` must be an importable module-level function and each cell a picklable value (a
plain dict): workers receive the cell, never objects of the driver. On a remote cluster
the same revision of this package must be importable on every node, and any file a cell
names (a trace) readable at the same path.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import Any

EXECUTORS = ("local", "ray")
RAY_INSTALL = 'pip install -e ".[ray]"'


def default_workers() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def check_executor(executor: str, workers: int = 0) -> None:
    """Raises ``ValueError`` for an unknown executor, bad ``workers`` or Ray missing."""
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; expected one of {EXECUTORS}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers must be an int >= 0 (0: one per CPU), got {workers!r}")
    if executor == "ray":
        try:
            import ray  # noqa: F401, PLC0415
        except ImportError:
            raise ValueError(f"--executor=ray needs Ray, which is not installed: "
                             f"{RAY_INSTALL}") from None


def map_cells(fn: Callable[[Any], Any], cells: Sequence[Any], *, executor: str = "local",
              workers: int = 0, ray_address: str = "", progress: bool = False,
              desc: str = "cells",
              on_result: Callable[[int, Any], None] | None = None) -> list[Any]:
    """``[fn(c) for c in cells]``, computed in parallel; see the module docstring.

    Args:
        fn: an importable module-level function of one cell.
        cells: picklable cells.
        executor: ``"local"`` or ``"ray"``.
        workers: local processes / CPUs of a local Ray instance (0: one per CPU).
        ray_address: the Ray cluster ("": start a local instance).
        progress: a tqdm bar of finished cells.
        on_result: called in this process as ``on_result(i, result)`` as soon as cell
            ``i`` finishes (in completion order), e.g. to save it before the rest end.

    Returns:
        The results, in the order of ``cells``. The first exception a cell raised is
        re-raised (local: the remaining cells are cancelled).
    """
    check_executor(executor, workers)
    cells = list(cells)
    if not cells:
        return []
    workers = min(workers or default_workers(), len(cells))
    bar = None
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        bar = tqdm(total=len(cells), desc=desc, unit="cell")
    try:
        if executor == "local":
            return _map_local(fn, cells, workers, bar, on_result)
        return _map_ray(fn, cells, workers, ray_address, bar, on_result)
    finally:
        if bar is not None:
            bar.close()


def _map_local(fn, cells, workers, bar, on_result=None) -> list:
    results: list = [None] * len(cells)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = {pool.submit(fn, cell): i for i, cell in enumerate(cells)}
        try:
            for fut in concurrent.futures.as_completed(futures):
                i = futures[fut]
                results[i] = fut.result()
                if on_result is not None:
                    on_result(i, results[i])
                if bar is not None:
                    bar.update(1)
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
    return results


def _map_ray(fn, cells, workers, ray_address, bar, on_result=None) -> list:
    import ray  # noqa: PLC0415

    started = not ray.is_initialized()
    if started:
        if ray_address:
            ray.init(address=ray_address)
        else:
            ray.init(num_cpus=workers, include_dashboard=False)
    try:
        task = ray.remote(num_cpus=1)(fn)
        refs = [task.remote(cell) for cell in cells]
        index = {ref: i for i, ref in enumerate(refs)}
        results: list = [None] * len(cells)
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    i = index[ref]
                    results[i] = ray.get(ref)  # re-raises the cell's exception
                    if on_result is not None:
                        on_result(i, results[i])
                    if bar is not None:
                        bar.update(1)
        except BaseException:
            for ref in pending:
                ray.cancel(ref)
            raise
        return results
    finally:
        if started:
            ray.shutdown()
