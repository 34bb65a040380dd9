r"""Launch the engine as a multi-process JAX job on this machine and check it.

  python -m experiments.launch_multiprocess --config=configs/launch_multiprocess.py \
      --workdir=/tmp/mp

Starts ``num_processes`` workers on 127.0.0.1 (process 0 is JAX's coordinator), each
with ``devices_per_process`` simulated CPU devices; each initializes
``jax.distributed`` (``prefixcache.engine.distributed``), builds one mesh over all
devices, runs the same requests through the same deterministic scheduler and manager,
and checks at every step that all processes built identical inputs. Then the same
requests run in ONE process on one device. Every process's log is in the workdir
(``process_<i>.log``), its tokens and per-step input digests in ``process_<i>.json``.

The launcher always cleans up: a worker that fails or a run past ``timeout_s`` ends
every worker (their process groups are killed) and raises an error naming the
process and the end of its log. The last stdout line is a JSON summary:
``tokens_identical`` (every process == the single-process run), ``inputs_identical``
(every step's inputs digest equal across processes and to the single-process run),
``mesh_devices``, ``local_devices`` per process, ``wall_s``.

Worker mode (run by the launcher): ``--worker --spec=SPEC.json --process_id=I``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

from experiments import _common

_REPO = pathlib.Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(spec: dict) -> list[list[int]]:
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(spec["seed"])
    prefix = rng.integers(1, spec["vocab_size"], spec["prefix_len"]).tolist()
    return [prefix + rng.integers(1, spec["vocab_size"], 3 + 5 * i).tolist()
            for i in range(spec["num_requests"])]


def worker(spec: dict, process_id: int) -> dict:
    """One process of the job (or the single-process reference when num_processes=1)."""
    from prefixcache.engine import distributed  # noqa: PLC0415

    n = spec["num_processes"]
    if n > 1:
        distributed.initialize(spec["coordinator"], num_processes=n, process_id=process_id,
                               timeout_s=spec["timeout_s"])
    import jax  # noqa: PLC0415

    from prefixcache.engine import Engine, SamplingParams  # noqa: PLC0415
    from prefixcache.model import ModelConfig  # noqa: PLC0415

    config = ModelConfig.tiny(num_heads=16, num_kv_heads=8)
    mesh = distributed.global_mesh() if spec["mesh"] else None
    engine = Engine(config, mesh=mesh, num_blocks=spec["num_blocks"],
                    block_size=spec["block_size"], seed=spec["seed"],
                    hash_seed=spec["hash_seed"], max_num_seqs=4, max_num_batched_tokens=128,
                    max_model_len=512, token_buckets=(128,), seq_buckets=(4,),
                    page_buckets=(32,))
    digests: list[str] = []
    distributed.check_identical_inputs(engine, record=digests)
    outs = engine.generate(prompts({**spec, "vocab_size": config.vocab_size}),
                           SamplingParams(max_tokens=spec["max_tokens"]))
    return {
        "process_id": process_id, "process_count": jax.process_count(),
        "mesh_devices": len(mesh.devices.flat) if mesh is not None else 1,
        "local_devices": jax.local_device_count(),
        "tokens": [o.token_ids for o in outs], "errors": [o.error for o in outs],
        "cached_tokens": [o.metrics.num_cached_tokens for o in outs], "digests": digests,
    }


def _spawn(spec_path: pathlib.Path, process_id: int, devices: int, log: pathlib.Path):
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "experiments.launch_multiprocess", "--worker",
             f"--spec={spec_path}", f"--process_id={process_id}"],
            cwd=_REPO, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)  # its own process group: killed as a whole


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not block
            pass


def _tail(path: pathlib.Path, n: int = 8) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines()
                 if ln.strip() and not ln.lstrip().startswith("@")]
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


def run_group(spec: dict, workdir: pathlib.Path, tag: str) -> list[dict]:
    """Runs ``spec['num_processes']`` workers to completion (or kills them all)."""
    spec_path = workdir / f"{tag}_spec.json"
    spec_path.write_text(json.dumps(spec))
    n = spec["num_processes"]
    logs = [workdir / f"{tag}_process_{i}.log" for i in range(n)]
    outs = [workdir / f"{tag}_process_{i}.json" for i in range(n)]
    for p in outs:
        p.unlink(missing_ok=True)
    procs = []
    deadline = time.monotonic() + spec["timeout_s"]
    try:
        for i in range(n):
            procs.append(_spawn(spec_path, i, spec["devices_per_process"], logs[i]))
        while True:
            codes = [p.poll() for p in procs]
            bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                i = bad[0]
                raise RuntimeError(f"{tag} process {i} exited with status {codes[i]}; end of "
                                   f"{logs[i]}:\n{_tail(logs[i])}")
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                alive = [i for i, c in enumerate(codes) if c is None]
                raise TimeoutError(f"{tag}: processes {alive} still running after "
                                   f"{spec['timeout_s']:g} s; killed. End of {logs[alive[0]]}:"
                                   f"\n{_tail(logs[alive[0]])}")
            time.sleep(0.2)
    finally:
        _kill(procs)
    return [json.loads(p.read_text()) for p in outs]


def run(config, *, progress: bool = False) -> dict:
    """Runs the multi-process job and the single-process reference; compares them."""
    for name in ("num_processes", "devices_per_process", "num_requests", "max_tokens"):
        v = config[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not config.timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {config.timeout_s}")
    workdir = _common.prepare_workdir(config.workdir)
    t0 = time.perf_counter()
    port = config.port or free_port()
    base = {"timeout_s": float(config.timeout_s), "num_requests": config.num_requests,
            "prefix_len": config.prefix_len, "max_tokens": config.max_tokens,
            "num_blocks": config.num_blocks, "block_size": config.block_size,
            "seed": config.seed, "hash_seed": config.hash_seed}
    multi = run_group({**base, "num_processes": config.num_processes,
                       "devices_per_process": config.devices_per_process,
                       "coordinator": f"127.0.0.1:{port}", "mesh": True}, workdir, "multi")
    single = run_group({**base, "num_processes": 1, "devices_per_process": 1,
                        "coordinator": "", "mesh": False}, workdir, "single")[0]
    for r in multi:
        if any(r["errors"]):
            raise RuntimeError(f"process {r['process_id']}: request errors {r['errors']}")
    summary = {
        "processes": config.num_processes,
        "mesh_devices": multi[0]["mesh_devices"],
        "local_devices": [r["local_devices"] for r in multi],
        "tokens_identical": all(r["tokens"] == single["tokens"] for r in multi),
        "inputs_identical": all(r["digests"] == single["digests"] for r in multi),
        "steps": len(single["digests"]),
        "cached_tokens": single["cached_tokens"],
        "wall_s": time.perf_counter() - t0,
        "workdir": str(workdir),
    }
    prov = _common.provenance(config, seed=config.seed, hash_algo="sha256", cache_state="cold")
    with _common.AtomicJsonlWriter(workdir / "results.jsonl", provenance=prov) as w:
        w.write({"record": "multiprocess", **summary})
    return summary


def _worker_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="launch_multiprocess --worker")
    ap.add_argument("--worker", action="store_true", help="run one worker process")
    ap.add_argument("--spec", required=True, help="the job spec JSON the launcher wrote")
    ap.add_argument("--process_id", type=int, required=True, help="this process's rank")
    a = ap.parse_args(argv)
    spec = json.loads(pathlib.Path(a.spec).read_text())
    try:
        out = worker(spec, a.process_id)
    except (TimeoutError, ValueError) as e:
        sys.exit(f"error: process {a.process_id}: {e}")
    tag = pathlib.Path(a.spec).name.replace("_spec.json", "")
    path = pathlib.Path(a.spec).parent / f"{tag}_process_{a.process_id}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(path)


def main() -> None:
    if "--worker" in sys.argv[1:]:
        _worker_main(sys.argv[1:])
        return
    _common.run_cli(run, config_name="launch_multiprocess")


if __name__ == "__main__":
    main()
