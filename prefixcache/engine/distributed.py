"""Multi-process JAX (one process per host): JAX's own multi-controller runtime.

Every process runs the same deterministic host side -- scheduler, ``KVCacheManager``
(with a seeded hash root), metadata -- on the same requests, so every process builds
the same step inputs and feeds its local devices; the mesh spans the devices of all
processes and XLA's collectives (gloo on CPU, NCCL on GPU, ICI on TPU) do the rest.
There is no RPC of our own: ``jax.distributed`` is the runtime.

    initialize("10.0.0.1:1234", num_processes=2, process_id=rank)
    mesh = global_mesh()                          # all devices, axis "model"
    engine = Engine(config, mesh=mesh, hash_seed=0, ...)
    check_identical_inputs(engine)                # optional: verify step inputs agree

On this machine: 2 CPU processes on 127.0.0.1 with 4 simulated devices each
(``XLA_FLAGS=--xla_force_host_platform_device_count=4`` set before jax is imported),
one 8-device mesh; ``python -m experiments.launch_multiprocess`` starts and checks them.
"""

from __future__ import annotations

import hashlib
import socket
import time

import numpy as np


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; ``ValueError`` naming the address otherwise."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator address must be host:port, got {address!r}")
    return host, int(port)


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Block until ``address`` accepts TCP connections, or raise ``TimeoutError``.

    NOTE: JAX's client aborts the whole process (SIGABRT from C++) when the coordinator
    cannot be reached in time; probing first turns that into a Python error that names
    the address.
    """
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"could not reach the JAX coordinator at {address} within {timeout_s:g} s: "
                    "is process 0 running and listening there?") from None
            time.sleep(0.1)


def initialize(coordinator_address: str, *, num_processes: int, process_id: int,
               timeout_s: float = 60.0) -> None:
    """``jax.distributed.initialize`` with argument checks and a bounded, clear wait.

    Call it before anything else touches jax's backends. On CPU, cross-process
    collectives use gloo.

    Args:
      coordinator_address: ``host:port`` of process 0 (which serves there).
      num_processes: processes in the job (>= 1).
      process_id: this process's rank, ``0 .. num_processes - 1``.
      timeout_s: how long to wait for the coordinator / the other processes.

    Raises:
      ValueError: bad arguments.
      TimeoutError: a process other than 0 cannot reach the coordinator in time.
    """
    parse_address(coordinator_address)
    for name, v, lo in (("num_processes", num_processes, 1), ("process_id", process_id, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if process_id >= num_processes:
        raise ValueError(f"process_id {process_id} >= num_processes {num_processes}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if process_id != 0:
        wait_for_coordinator(coordinator_address, timeout_s)
    import jax  # noqa: PLC0415

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=max(1, int(timeout_s)))


def global_mesh(axis: str = "model"):
    """A 1-D ``Mesh`` over every device of every process (tensor parallel axis)."""
    import jax  # noqa: PLC0415
    from jax.sharding import Mesh  # noqa: PLC0415

    return Mesh(np.array(jax.devices()), (axis,))


def inputs_digest(prepared) -> bytes:
    """SHA-256 over every host array of a ``PreparedStep`` (shapes, dtypes, bytes)."""
    import jax  # noqa: PLC0415

    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(prepared.inputs):
        a = np.ascontiguousarray(leaf)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    h.update(f"{prepared.num_seqs},{prepared.all_greedy}".encode())
    return h.digest()


def check_identical_inputs(engine, *, record: list | None = None) -> None:
    """Make ``engine`` verify, every step, that all processes built identical inputs.

    Wraps this engine's ``runner.prepare``: after building a step it compares the
    inputs' digest across processes (``multihost_utils.assert_equal``, a collective),
    and raises ``AssertionError`` on the first step where they differ. ``record``
    collects the hex digests (for a launcher to compare with a single-process run).
    """
    from jax.experimental import multihost_utils  # noqa: PLC0415

    prepare = engine.runner.prepare

    def checked(*args, **kwargs):
        prepared = prepare(*args, **kwargs)
        digest = inputs_digest(prepared)
        multihost_utils.assert_equal(
            np.frombuffer(digest, np.uint8),
            f"processes built different step inputs at step {engine.scheduler.num_steps}")
        if record is not None:
            record.append(digest.hex())
        return prepared

    engine.runner.prepare = checked
