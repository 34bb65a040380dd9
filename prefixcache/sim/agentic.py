"""A generated agentic workload: coding-agent sessions of tool-call loops with sub-agents.

An agent session is one long loop: the client sends the system prompt, the tool
definitions and the conversation so far; the model answers with a short message and a
tool call; the client runs the tool and sends everything again with the tool's result
appended. The context grows by each step's output and tool result until the agent
compacts it (a summary replaces the history: the prefix breaks). Now and then the
main agent forks sub-agents (Claude Code's Task tool) that start from the parent's
system prompt and tools, run loops of their own, and return a result the parent
appends; the parent waits for them. Between steps: the model's time, the tool's time
and, sometimes, a human's.

``agentic_sessions`` generates such sessions deterministically (numpy
``default_rng([seed, stream])``) in the **AgentX / Weka trace format** (SemiAnalysis'
Claude Code traces, the schema AIPerf's ``weka_trace`` loader reads: one JSON object
per session ``{"id", "models", "block_size": 64, "hash_id_scope": "local",
"tool_tokens", "system_tokens", "requests": [...]}`` whose requests are normal calls
``{"t", "type": "n", "model", "in", "out", "hash_ids", "stop", "api_time",
"think_time"}`` and sub-agent markers ``{"t", "type": "subagent", "agent_id",
"subagent_type", "duration_ms", "total_tokens", "tool_use_count", "status",
"requests": [...], "models", "tool_tokens", "system_tokens"}``). Hash ids are
numbered per session (``"local"``: a sub-agent shares its parent's namespace, so the
blocks it forks from the parent are the parent's ids). ``write_agentx`` writes them
as JSONL; ``write_tracelab`` writes the same sessions as TraceLab's normalized round
rows (``prefixcache.sim.trace_formats``); ``agentic`` returns the requests
(``TraceRequest`` with lazy 64-token hash-id prompts, the ``agentx`` reader's output),
with or without retention hints.

Calibration (defaults; each a parameter):

* Steps per session: geometric, mean ``mean_steps=84`` -- TraceLab (UW SyFI, "TraceLab:
  Characterizing Coding Agent Workloads for LLM Serving", arXiv 2606.30560; public pool
  of 4,265 sessions and 357,161 agent steps: 83.7 steps per session).
* Output tokens per step: lognormal with mean ~520 -- TraceLab's 186.9M output tokens
  over 357,161 steps (523 per step; AgentX's replay reports a mean OSL of 736).
* Context growth per step: the step's output + a tool result, lognormal with median
  ``tool_result_median=700`` tokens and sigma 1.2 (mean ~1.4k; heavy-tailed tool
  results, TraceLab's "diverse and heavy-tailed tool calls"): ~2k tokens per step, so a
  session of the mean length reaches ~170k tokens -- the order of TraceLab's 153.7k
  input tokens per step (54.9B / 357,161) -- and compacts near ``compact_at=160_000``.
* System prompt + tools: ``system_tokens=3_000`` + ``tool_tokens=15_000`` (the size
  class of Claude Code's; the Weka format records both per session).
* Sub-agents: at each main step with probability ``subagent_prob=0.04`` (about 3.4
  fork points per mean-length session) the agent forks ``subagent_fanout=(1, 3)``
  sub-agents in parallel, each with geometric ``subagent_mean_steps=12`` steps; this
  fan-out is this module's choice (no public source gives a distribution).
* Timing: each step's model time ``api_time`` ~ 2 s + 1 s per 1k output tokens, a tool
  time lognormal with median 1.5 s, and with probability ``human_prob=0.08`` a human
  wait, exponential with mean ``human_mean_s=90`` s (TraceLab's human-paced gaps);
  sessions start uniformly in ``[0, start_window_s)``.

What the defaults give (seed 0, 8 sessions, 64-token blocks): an infinite-cache ("theoretical")
hit rate within the published AgentX range -- SemiAnalysis' InferenceX issue #1632
reports 96.8% (the first corpus) and 85.8% (v0.2) at 64-token blocks
(``theoretical_hit_rate`` computes it the way AIPerf does: a block hits when its id
was seen before in the session). Where the real corpora differ, tune the parameters
rather than read the defaults as measurements.

Host only: never imports jax.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from prefixcache.core.request import RetentionHints

BLOCK_TOKENS = 64  # the AgentX / Weka format's tokens per hash id
MAIN_MODEL = "claude-opus-4-7"
SUBAGENT_MODEL = "claude-haiku-4-5-20251001"
_STREAM = 202  # this generator's RNG stream (beside workloads._STREAMS)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _nonneg(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _prob(name: str, value: Any) -> float:
    v = _nonneg(name, value)
    if v > 1:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return v


class _Context:
    """A growing prompt as 64-token hash ids (the last block may be partial)."""

    __slots__ = ("ids", "length", "_mint")

    def __init__(self, ids: list[int], length: int, mint):
        self.ids, self.length, self._mint = ids, length, mint

    def extend(self, n: int) -> None:
        """Appends ``n`` fresh tokens: a partial last block becomes a new block (its
        content changed), then fresh ids up to the new length."""
        if n <= 0:
            return
        full = self.length // BLOCK_TOKENS
        self.length += n
        need = math.ceil(self.length / BLOCK_TOKENS)
        self.ids = self.ids[:full] + self._mint(need - full)

    def fork(self, keep_tokens: int) -> _Context:
        """A new context sharing this one's first ``keep_tokens`` tokens' full blocks."""
        keep = min(keep_tokens, self.length)
        full = keep // BLOCK_TOKENS
        ctx = _Context(self.ids[:full], full * BLOCK_TOKENS, self._mint)
        ctx.extend(keep - full * BLOCK_TOKENS)
        return ctx


def agentic_sessions(
    *,
    num_sessions: int = 8,
    mean_steps: float = 84.0,
    system_tokens: int = 3_000,
    tool_tokens: int = 15_000,
    first_user_tokens: Sequence[int] = (100, 2_000),
    tool_result_median: float = 700.0,
    tool_result_sigma: float = 1.2,
    output_mean: float = 520.0,
    compact_at: int = 160_000,
    summary_tokens: int = 6_000,
    subagent_prob: float = 0.04,
    subagent_fanout: Sequence[int] = (1, 3),
    subagent_mean_steps: float = 12.0,
    subagent_task_tokens: Sequence[int] = (200, 1_500),
    human_prob: float = 0.08,
    human_mean_s: float = 90.0,
    start_window_s: float = 600.0,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Generates agent sessions in the AgentX / Weka trace format (module docstring).

    Args:
      num_sessions: sessions (ids ``agent-SSS``).
      mean_steps: mean main-agent steps per session (geometric, >= 1).
      system_tokens, tool_tokens: the system prompt's and the tool definitions' tokens
        (the prefix every request of a session, and every sub-agent, starts with).
      first_user_tokens: inclusive range of the first user message's tokens.
      tool_result_median, tool_result_sigma: lognormal tool-result tokens per step.
      output_mean: mean output tokens per step (lognormal, sigma 0.8).
      compact_at: a context past this many tokens is compacted: the next request is the
        system prompt + tools + a ``summary_tokens`` summary (a prefix break).
      subagent_prob: probability that a main step forks sub-agents.
      subagent_fanout: inclusive range of sub-agents forked at once (run in parallel;
        the parent's next step waits for the last).
      subagent_mean_steps: mean steps of a sub-agent (geometric).
      subagent_task_tokens: inclusive range of a sub-agent's task prompt tokens.
      human_prob, human_mean_s: probability of a human wait before a main step and its
        mean (exponential) in seconds.
      start_window_s: sessions start uniformly in ``[0, start_window_s)`` seconds (the
        format's ``t`` is relative to the session; ``agentic`` adds the start).
      seed: RNG seed.

    Returns:
      One dict per session (JSON-serialisable), with ``"start_s"`` (the session's start,
      not part of the Weka format: ``write_agentx`` drops it) added.
    """
    num_sessions = _positive_int("num_sessions", num_sessions)
    for name, v in (("system_tokens", system_tokens), ("tool_tokens", tool_tokens),
                    ("compact_at", compact_at), ("summary_tokens", summary_tokens)):
        _positive_int(name, v)
    if compact_at <= system_tokens + tool_tokens + summary_tokens:
        raise ValueError("compact_at must exceed system_tokens + tool_tokens + summary_tokens")
    for name, v in (("mean_steps", mean_steps), ("subagent_mean_steps", subagent_mean_steps)):
        if _nonneg(name, v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v!r}")
    for name, v in (("tool_result_median", tool_result_median),
                    ("tool_result_sigma", tool_result_sigma), ("output_mean", output_mean),
                    ("human_mean_s", human_mean_s), ("start_window_s", start_window_s)):
        _nonneg(name, v)
    subagent_prob, human_prob = _prob("subagent_prob", subagent_prob), _prob("human_prob",
                                                                               human_prob)
    ranges = {}
    for name, v in (("first_user_tokens", first_user_tokens),
                    ("subagent_fanout", subagent_fanout),
                    ("subagent_task_tokens", subagent_task_tokens)):
        try:
            lo, hi = (int(x) for x in v)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be an inclusive (lo, hi) pair of ints, "
                             f"got {v!r}") from None
        if lo < 1 or hi < lo:
            raise ValueError(f"{name} must satisfy 1 <= lo <= hi, got {v!r}")
        ranges[name] = (lo, hi)
    rng = np.random.default_rng([int(seed), _STREAM])
    out_mu = math.log(max(output_mean, 1.0)) - 0.32  # lognormal sigma 0.8: mean = e^(mu+0.32)

    def draw(lo_hi):
        return int(rng.integers(lo_hi[0], lo_hi[1] + 1))

    def out_tokens() -> int:
        return max(1, int(rng.lognormal(out_mu, 0.8)))

    def tool_result() -> int:
        return max(1, int(rng.lognormal(math.log(max(tool_result_median, 1.0)),
                                        tool_result_sigma)))

    def steps(mean: float) -> int:
        return int(rng.geometric(1.0 / mean))

    def api_time(n_out: int) -> float:
        return round(2.0 + n_out / 1000.0 + float(rng.exponential(0.5)), 3)

    def tool_time() -> float:
        return float(rng.lognormal(math.log(1.5), 1.0))

    sessions = []
    base = system_tokens + tool_tokens
    for s in range(num_sessions):
        next_id = 0

        def mint(n: int) -> list[int]:
            nonlocal next_id
            ids = list(range(next_id, next_id + n))
            next_id += n
            return ids

        root = _Context([], 0, mint)
        root.extend(base)
        prefix = root.fork(base)  # (the same ids: fork shares full blocks, re-mints a tail)
        ctx = root
        ctx.extend(draw(ranges["first_user_tokens"]))
        t = 0.0
        requests: list[dict[str, Any]] = []
        n_main = steps(mean_steps)
        n_sub = 0
        for k in range(n_main):
            n_out = out_tokens()
            at = api_time(n_out)
            think = 0.0
            if k and human_prob and rng.random() < human_prob:
                think = float(rng.exponential(human_mean_s))
                t += think
            last = k == n_main - 1
            requests.append({"t": round(t, 3), "type": "n", "model": MAIN_MODEL,
                             "in": ctx.length, "out": n_out, "hash_ids": list(ctx.ids),
                             "stop": "end_turn" if last else "tool_use",
                             "api_time": at, "think_time": round(think, 3)})
            t += at
            if last:
                break
            ctx.extend(n_out)
            if subagent_prob and rng.random() < subagent_prob:
                end = t
                results = 0
                for _ in range(draw(ranges["subagent_fanout"])):
                    n_sub += 1
                    sub, sub_end, sub_out = _subagent(
                        rng, prefix, t, f"agent_{n_sub:03d}", steps(subagent_mean_steps),
                        draw(ranges["subagent_task_tokens"]), out_tokens, tool_result,
                        api_time, tool_time)
                    requests.append(sub)
                    end = max(end, sub_end)
                    results += sub_out
                t = end
                ctx.extend(results + tool_result() // 4)
            else:
                t += tool_time()
                ctx.extend(tool_result())
            if ctx.length > compact_at:
                ctx = prefix.fork(base)
                ctx.extend(summary_tokens)
        sessions.append({
            "id": f"agent-{s:03d}",
            "models": [MAIN_MODEL] + ([SUBAGENT_MODEL] if n_sub else []),
            "block_size": BLOCK_TOKENS,
            "hash_id_scope": "local",
            "tool_tokens": tool_tokens,
            "system_tokens": system_tokens,
            "requests": requests,
            "start_s": round(float(rng.uniform(0.0, start_window_s)), 3),
        })
    return sessions


def _subagent(rng, prefix: _Context, t0: float, agent_id: str, n_steps: int, task: int,
              out_tokens, tool_result, api_time, tool_time):
    """One sub-agent marker (Weka format), its end time and its result's tokens."""
    ctx = prefix.fork(prefix.length)
    ctx.extend(task)
    t = t0
    inner = []
    total = 0
    n_out = 0
    for k in range(n_steps):
        n_out = out_tokens()
        at = api_time(n_out)
        inner.append({"t": round(t, 3), "type": "n", "model": SUBAGENT_MODEL,
                      "in": ctx.length, "out": n_out, "hash_ids": list(ctx.ids),
                      "stop": "end_turn" if k == n_steps - 1 else "tool_use",
                      "api_time": at, "think_time": 0.0})
        total += ctx.length + n_out
        t += at
        if k < n_steps - 1:
            t += tool_time()
            ctx.extend(n_out + tool_result())
    marker = {"t": round(t0, 3), "type": "subagent", "agent_id": agent_id,
              "subagent_type": "general-purpose", "duration_ms": int(round((t - t0) * 1000)),
              "total_tokens": total, "tool_use_count": n_steps - 1, "status": "completed",
              "requests": inner, "models": [SUBAGENT_MODEL], "tool_tokens": 0,
              "system_tokens": 0}
    return marker, t, n_out


def write_agentx(path: str | os.PathLike, sessions: Iterable[dict[str, Any]]) -> int:
    """Writes sessions as AgentX / Weka JSONL (one session per line; ``start_s``, which
    the format does not have, is dropped). Returns the number of sessions."""
    n = 0
    with open(os.fspath(path), "w", encoding="utf-8") as f:
        for s in sessions:
            f.write(json.dumps({k: v for k, v in s.items() if k != "start_s"},
                               separators=(",", ":")) + "\n")
            n += 1
    return n


def _iso(seconds: float) -> str:
    """``seconds`` after 2026-01-01T00:00:00Z as an ISO-8601 UTC timestamp (microseconds)."""
    import datetime  # noqa: PLC0415

    t = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc) + datetime.timedelta(
        seconds=seconds)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def write_tracelab(path: str | os.PathLike, sessions: Iterable[dict[str, Any]]) -> int:
    """Writes sessions as TraceLab normalized round rows (JSONL, one LLM round per line;
    see ``prefixcache.sim.trace_formats.read_tracelab``): ``provider="claude"``,
    ``session_id`` (a sub-agent is a session of its own, ``<session>::<agent_id>``),
    ``round_index``, ``model``, ``input_tokens_total``, ``prefix_tokens`` (the tokens of
    the longest full-block prefix shared with the same session's previous round),
    ``newly_append_tokens``, ``output_tokens`` and ``timing_events`` (one
    ``user_message`` / ``tool_result`` event at the round's arrival). TraceLab has no
    hash ids: the reader rebuilds each session's context from the prefix split, so
    sharing *between* a sub-agent and its parent is not in this format. Returns the
    number of rows."""
    n = 0
    with open(os.fspath(path), "w", encoding="utf-8") as f:
        for s in sessions:
            start = float(s.get("start_s", 0.0))
            streams: list[tuple[str, list[dict]]] = [(s["id"], [])]
            for r in s["requests"]:
                if r["type"] == "subagent":
                    streams.append((f"{s['id']}::{r['agent_id']}", r["requests"]))
                else:
                    streams[0][1].append(r)
            for sid, reqs in streams:
                prev: list[int] = []
                for i, r in enumerate(reqs):
                    ids, n_in = r["hash_ids"], r["in"]
                    shared = 0
                    for a, b in zip(prev, ids):
                        if a != b:
                            break
                        shared += 1
                    prefix = min(shared * BLOCK_TOKENS, n_in)
                    row = {"provider": "claude", "session_id": sid, "round_index": i,
                           "model": r["model"], "input_tokens_total": n_in,
                           "prefix_tokens": prefix, "newly_append_tokens": n_in - prefix,
                           "output_tokens": r["out"],
                           "timing_events": [{
                               "event_type": "user_message" if i == 0 else "tool_result",
                               "timestamp": _iso(start + float(r["t"]))}]}
                    f.write(json.dumps(row, separators=(",", ":")) + "\n")
                    prev = ids[: n_in // BLOCK_TOKENS]
                    n += 1
    return n


def theoretical_hit_rate(sessions: Iterable[dict[str, Any]]) -> float:
    """Hit blocks / all blocks with an infinite cache, AIPerf's "theoretical prefix-cache
    hit rate": per session, in time order, a request's leading hash ids already seen in
    that session (parent and sub-agents share one seen-set) are hits."""
    hits = total = 0
    for s in sessions:
        seen: set[int] = set()
        flat = []
        for r in s["requests"]:
            if r["type"] == "subagent":
                flat.extend(r["requests"])
            else:
                flat.append(r)
        flat.sort(key=lambda r: r["t"])  # (stable: file order within a time)
        for r in flat:
            ids = r["hash_ids"]
            k = 0
            while k < len(ids) and ids[k] in seen:
                k += 1
            hits += k
            total += len(ids)
            seen.update(ids)
    return hits / total if total else 0.0


def agentic(*, hints: bool = False, ttl_s: float = 300.0, **kwargs: Any) -> list:
    """The generated sessions as requests in arrival order (the ``agentx`` reader's
    output: ``TraceRequest`` with lazy 64-token hash-id prompts, ids
    ``ax-<session>-<k>`` / ``ax-<session>-<agent_id>-<k>``).

    Args:
      hints: attach the retention hints the session structure gives
        (``trace_formats.agentx_hints``): keep a live loop's context for ``ttl_s``;
        a sub-agent's and the session's last request ends its session (its private
        blocks go first, the shared system prompt + tools are kept).
      ttl_s: the hints' TTL in seconds.
      **kwargs: ``agentic_sessions``'s arguments.
    """
    from prefixcache.sim.trace_formats import agentx_requests  # noqa: PLC0415

    return agentx_requests(agentic_sessions(**kwargs), hints=hints, ttl_s=ttl_s)


__all__ = ["BLOCK_TOKENS", "RetentionHints", "agentic", "agentic_sessions",
           "theoretical_hit_rate", "write_agentx", "write_tracelab"]
