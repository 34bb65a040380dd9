"""The quickstart workload: a shared system prompt, multi-turn chats, a few cold requests.

Library code behind `python -m experiments.quickstart` (a notebook can call the same
functions). Each request is submitted alone and run to completion, so its TTFT is the
time of its own scheduling + prefill, once with the prefix cache reset before every
request ("cold") and once with the cache kept ("warm"), side by side in one run and on
the same compiled programs (a warm-up pass over different random tokens compiles them
first).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import numpy as np

from prefixcache.engine.engine import Engine
from prefixcache.engine.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class ChatTurn:
    """One request of the workload (its prompt depends on earlier outputs).

    Attributes:
      kind: "first_turn" (system prompt + first user message), "follow_up" (the whole
        conversation so far + a new user message) or "cold" (unrelated prompt).
      user: conversation index (-1 for cold requests).
      turn: turn index within the conversation (0 for cold requests).
      new_tokens: the new user message (or the whole prompt of a cold request).
    """

    kind: str
    user: int
    turn: int
    new_tokens: tuple[int, ...]


def chat_workload(*, vocab_size: int, system_prompt_lens: tuple[int, ...], num_users: int,
                  num_turns: int, user_msg_len: int, num_cold: int, cold_prompt_len: int,
                  seed: int) -> tuple[list[list[int]], list[ChatTurn]]:
    """Builds the workload: turn t of every user, then one cold request, per round.

    User u starts from system prompt `u % len(system_prompt_lens)` (so cached prefixes of
    several lengths occur). Token ids are drawn uniformly from [1, vocab_size).

    Returns:
      (the system prompts' token ids, the requests in submission order).
    """
    rng = np.random.default_rng(seed)

    def draw(n):
        return tuple(int(x) for x in rng.integers(1, vocab_size, n))

    system = [list(draw(n)) for n in system_prompt_lens]
    turns: list[ChatTurn] = []
    cold_left = num_cold
    for t in range(num_turns):
        for u in range(num_users):
            turns.append(ChatTurn("first_turn" if t == 0 else "follow_up", u, t,
                                  draw(user_msg_len)))
        if cold_left:
            turns.append(ChatTurn("cold", -1, 0, draw(cold_prompt_len)))
            cold_left -= 1
    while cold_left:
        turns.append(ChatTurn("cold", -1, 0, draw(cold_prompt_len)))
        cold_left -= 1
    return system, turns


def run_chat(engine: Engine, system: list[list[int]], turns: list[ChatTurn],
             params: SamplingParams, *, cold: bool) -> list[dict[str, Any]]:
    """Runs the workload one request at a time.

    Args:
      engine: an idle engine.
      system: the shared system prompts (user u starts from `system[u % len(system)]`).
      turns: from `chat_workload`.
      params: sampling parameters of every request.
      cold: reset the prefix cache before every request.

    Returns:
      One record per request: kind, user, turn, num_prompt_tokens, num_cached_tokens,
      ttft_s, e2e_s, token_ids.
    """
    history: dict[int, list[int]] = {}
    rows = []
    for t in turns:
        if t.kind == "cold":
            prompt = list(t.new_tokens)
        else:
            start = list(system[t.user % len(system)])
            prompt = history.get(t.user, start) + list(t.new_tokens)
        if cold and not engine.kv_cache_manager.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache failed: the engine is not idle")
        (out,) = engine.generate([prompt], params)
        if out.error is not None:
            raise RuntimeError(f"request rejected: {out.error}")
        if t.kind != "cold":
            history[t.user] = prompt + list(out.token_ids)
        rows.append(dict(kind=t.kind, user=t.user, turn=t.turn,
                         num_prompt_tokens=out.metrics.num_prompt_tokens,
                         num_cached_tokens=out.metrics.num_cached_tokens,
                         ttft_s=out.metrics.ttft_s, e2e_s=out.metrics.e2e_s,
                         token_ids=list(out.token_ids)))
    return rows


PREFIX_BINS = (0, 1, 64, 128, 256, 384, 512, 640, 768, 1024, 2048, 1 << 30)


def _bin_label(lo: int, hi: int) -> str:
    if lo == 0 and hi == 1:
        return "0 (miss)"
    return f"{lo}-{hi - 1}" if hi < (1 << 30) else f">={lo}"


def ttft_table(cold_rows: list[dict], warm_rows: list[dict]) -> list[dict[str, Any]]:
    """Cold vs warm TTFT of the same requests, grouped by the warm cached-prefix length.

    Returns:
      One row per non-empty bin: bin, num_requests, mean prompt / cached tokens, median
      cold and warm TTFT (ms) and their ratio.
    """
    table = []
    for lo, hi in zip(PREFIX_BINS, PREFIX_BINS[1:]):
        idx = [i for i, r in enumerate(warm_rows) if lo <= r["num_cached_tokens"] < hi]
        if not idx:
            continue
        cold_ms = statistics.median(cold_rows[i]["ttft_s"] for i in idx) * 1e3
        warm_ms = statistics.median(warm_rows[i]["ttft_s"] for i in idx) * 1e3
        table.append(dict(
            cached_prefix=_bin_label(lo, hi), num_requests=len(idx),
            mean_prompt_tokens=statistics.fmean(warm_rows[i]["num_prompt_tokens"] for i in idx),
            mean_cached_tokens=statistics.fmean(warm_rows[i]["num_cached_tokens"] for i in idx),
            cold_ttft_ms=cold_ms, warm_ttft_ms=warm_ms, warm_over_cold=warm_ms / cold_ms))
    return table


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain fixed-width text table."""
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
