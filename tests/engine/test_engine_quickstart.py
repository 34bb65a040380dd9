"""The main job (experiments/quickstart.py) end to end on a shrunken config."""

from __future__ import annotations

import json

from configs import quickstart as quickstart_config
from experiments import quickstart
from experiments import _chat_bench as chat_bench


def test_chat_workload_structure():
    system, turns = chat_bench.chat_workload(
        vocab_size=50, system_prompt_lens=(8, 12), num_users=3, num_turns=2,
        user_msg_len=4, num_cold=3, cold_prompt_len=6, seed=0)
    assert [len(s) for s in system] == [8, 12]
    assert [(t.kind, t.user, t.turn) for t in turns] == [
        ("first_turn", 0, 0), ("first_turn", 1, 0), ("first_turn", 2, 0), ("cold", -1, 0),
        ("follow_up", 0, 1), ("follow_up", 1, 1), ("follow_up", 2, 1), ("cold", -1, 0),
        ("cold", -1, 0)]
    again = chat_bench.chat_workload(
        vocab_size=50, system_prompt_lens=(8, 12), num_users=3, num_turns=2,
        user_msg_len=4, num_cold=3, cold_prompt_len=6, seed=0)
    assert again == (system, turns)


def test_quickstart_runs_and_writes_results(tmp_path, capsys):
    config = quickstart_config.get_config()
    config.unlock()
    config.update(dict(num_blocks=24, system_prompt_lens=(32, 48), num_users=2, num_turns=2,
                       user_msg_len=8, num_cold=1, cold_prompt_len=40, max_tokens=3,
                       max_num_batched_tokens=128, workdir=str(tmp_path)))
    config.lock()
    summary = quickstart.run(config)
    assert summary["outputs_identical_cold_warm"]
    assert summary["reused_tokens"] > 0 and 0 < summary["token_hit_rate"] < 1
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 5 + 1
    assert all("provenance" in x for x in lines)
    # Every row names its pass's cache state and the JAX device it ran on.
    assert all(x["provenance"]["cache_state"] == x.get("cache_state", "warm") for x in lines)
    assert all(x["provenance"]["jax"]["backend"] == "cpu" for x in lines)
    assert lines[-1]["record"] == "summary"
    warm = [x for x in lines if x.get("cache_state") == "warm"]
    # Follow-up turns hit their conversation so far.
    assert all(x["num_cached_tokens"] > 0 for x in warm if x["kind"] == "follow_up")
    assert (tmp_path / "ttft_vs_cached_prefix.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "warm_ttft_ms" in out and "token_hit_rate" in out
