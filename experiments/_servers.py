"""Processes the serving experiments start, scrape and stop: `prefixcache serve` replicas,
sglang-router in front of them, and a streaming client that replays timed requests.

Everything binds 127.0.0.1 (a URL list given by the user may point anywhere), every wait
is bounded, and every process started here is stopped on exit (`Fleet` is a context
manager: SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

LOCALHOST = "127.0.0.1"
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$')


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (bind to port 0, read it, close)."""
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    """``(status, body)`` of a GET (status 0: no connection)."""
    import httpx  # noqa: PLC0415

    try:
        r = httpx.get(url, timeout=timeout)
        return r.status_code, r.text
    except httpx.HTTPError:
        return 0, ""


def post(url: str, body: Mapping | None = None, timeout: float = 30.0) -> int:
    import httpx  # noqa: PLC0415

    return httpx.post(url, json=dict(body or {}), timeout=timeout).status_code


def wait_healthy(url: str, *, timeout: float, proc: subprocess.Popen | None = None,
                 path: str = "/health") -> None:
    """Polls ``url + path`` until it answers 200; ``RuntimeError`` if ``proc`` exits first
    or ``timeout`` seconds pass (the message names the URL)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode} before "
                               f"{path} answered 200")
        if get(url + path, timeout=5.0)[0] == 200:
            return
        time.sleep(0.25)
    raise RuntimeError(f"{url}{path} did not answer 200 within {timeout:.0f} s")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{"name{labels}": value}`` (samples only, comments dropped)."""
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def metric_sum(samples: Mapping[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for key, v in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total


class Fleet(contextlib.AbstractContextManager):
    """The processes of one experiment: started by ``start``, all stopped on exit.

    Args:
        log_dir: where each process's stdout+stderr go (``<name>.log``).
        grace_s: seconds between SIGTERM and SIGKILL at exit.
    """

    def __init__(self, log_dir: str | os.PathLike, *, grace_s: float = 20.0):
        self.log_dir = os.fspath(log_dir)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per request else)
        self.grace_s = grace_s
        self._procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None
              ) -> subprocess.Popen:
        os.makedirs(self.log_dir, exist_ok=True)
        log = open(os.path.join(self.log_dir, f"{name}.log"), "ab")  # noqa: SIM115
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, **(env or {})})
        log.close()  # (the child holds its own descriptor)
        self._procs.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen) -> None:
        """SIGTERM the process group, SIGKILL after the grace period; waits."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self._procs = [(n, p) for n, p in self._procs if p is not proc]

    def __exit__(self, *exc) -> None:
        for _, proc in reversed(list(self._procs)):
            self.stop(proc)


def serve_argv(model: str, port: int, options: Mapping[str, Any]) -> list[str]:
    """``python -m prefixcache.serve MODEL --host 127.0.0.1 --port P --flag value ...``
    (an option ``x_y`` is the flag ``--x-y``; True: the bare flag; False/None/"": left out)."""
    argv = [sys.executable, "-m", "prefixcache.serve", model, "--host", LOCALHOST,
            "--port", str(port)]
    for key, v in options.items():
        if v is None or v is False or v == "":
            continue
        argv.append("--" + key.replace("_", "-"))
        if v is not True:
            argv.append(str(v))
    return argv


def router_argv(port: int, worker_urls: Sequence[str], policy: str) -> list[str]:
    """sglang-router (PyPI ``sglang-router``) in front of ``worker_urls``, routing each
    OpenAI request by ``policy`` (cache_aware, round_robin, power_of_two, random).

    NOTE: its default (SGLang) backend, not ``--backend openai``: the OpenAI backend
    discovers the one endpoint that serves a model name and applies no policy (every
    request for the model goes there; its /v1/completions answers 501). The default
    backend routes /v1/chat/completions and /v1/completions among the workers by the
    policy; it also probes SGLang's info endpoints (/get_server_info, /get_model_info),
    which answer 404 here, and carries on."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", LOCALHOST,
            "--port", str(port), "--policy", policy,
            "--worker-urls", *worker_urls, "--log-level", "warn"]


async def _one(client, url: str, body: dict, start_at: float, t0: float) -> dict:
    delay = t0 + start_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.perf_counter()
    first = None
    text_parts = []
    usage = None
    status = None
    error = None
    try:
        async with client.stream("POST", url, json=body) as r:
            status = r.status_code
            if status != 200:
                error = (await r.aread()).decode(errors="replace")[:300]
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for ch in chunk.get("choices", ()):
                        piece = ch.get("text") or (ch.get("delta") or {}).get("content")
                        if piece:
                            if first is None:
                                first = time.perf_counter()
                            text_parts.append(piece)
    except Exception as e:  # noqa: BLE001 - a failed request is a row, not a crash
        error = f"{type(e).__name__}: {e}"
    done = time.perf_counter()
    return {"sent_s": sent - t0, "ttft_s": None if first is None else first - sent,
            "e2e_s": done - sent, "status": status, "error": error, "usage": usage,
            "text": "".join(text_parts)}


async def _replay(url: str, bodies: Sequence[dict], start_at: Sequence[float],
                  timeout_s: float) -> list[dict]:
    import httpx  # noqa: PLC0415

    limits = httpx.Limits(max_connections=len(bodies) or 1)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        return await asyncio.gather(*(_one(client, url, b, s, t0)
                                      for b, s in zip(bodies, start_at)))


def replay_requests(url: str, bodies: Sequence[dict], start_at: Sequence[float], *,
                    timeout_s: float = 600.0) -> list[dict]:
    """POSTs each streaming ``body`` to ``url`` at its ``start_at`` seconds (open loop);
    per request: ``sent_s``, ``ttft_s`` (first text chunk), ``e2e_s``, ``status``,
    ``error``, ``usage`` (the final chunk's, with ``stream_options.include_usage``)."""
    return asyncio.run(_replay(url, bodies, start_at, timeout_s))
