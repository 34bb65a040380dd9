r"""KV bytes a long conversation holds on a sliding-window model vs an all-full-attention
layout of the same model.

  python -m experiments.kv_held --workdir=/tmp/kv_held
  python -m experiments.kv_held --workdir=/tmp/kv_held --config.model=gemma3

See configs/kv_held.py. One conversation grows turn by turn (random user token ids, then
greedy replies) to `target_tokens`, through an engine with the prefix cache on; after
every engine step the blocks the conversation's running request holds are read per KV
cache group from the manager (`num_held_blocks`). The all-full layout holds
ceil(tokens / block_size) blocks of every layer (one group, the model's layers all full
attention); its bytes are computed from the same token count.
"""

from __future__ import annotations

import math
import time

from experiments import _common


def _config(config):
    """(model config, model or None) for config.model."""
    from prefixcache.model import ModelConfig  # noqa: PLC0415

    if config.model == "gemma3_layout":
        # Gemma 3 270M's attention layout (18 layers, 5:1, window 512, one kv head of
        # 256) with a small MLP and vocabulary: the held blocks depend on the layout only.
        return ModelConfig.gemma3_270m(vocab_size=1024, d_model=64, mlp_dim=64,
                                       num_heads=1), None
    from experiments.chat import checkpoint_path  # noqa: PLC0415
    from prefixcache.model import load_pretrained  # noqa: PLC0415

    pre = load_pretrained(checkpoint_path(config.model), progress=False)
    return pre.config, pre.model


def run(config, *, progress: bool = False) -> dict:
    import numpy as np  # noqa: PLC0415

    from prefixcache.engine import Engine, SamplingParams  # noqa: PLC0415

    t0 = time.perf_counter()
    workdir = _common.prepare_workdir(config.workdir)
    cfg, model = _config(config)
    if cfg.sliding_window is None:
        raise ValueError(f"model {config.model!r} has no sliding-window layers")
    bs = config.block_size
    engine = Engine(cfg, model=model, num_blocks=config.num_blocks, block_size=bs,
                    max_model_len=config.target_tokens + config.turn_tokens
                    + config.max_tokens + bs, max_num_seqs=1,
                    max_num_batched_tokens=config.chunk_tokens,
                    token_buckets=(16, config.chunk_tokens), seq_buckets=(1,),
                    seed=config.seed)
    mgr = engine.kv_cache_manager
    rng = np.random.default_rng(config.seed)
    page_bytes = bs * 2 * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize
    block_bytes = cfg.kv_group_size * page_bytes  # a block id: one page of every array
    history: list[int] = []
    rows = []
    params = SamplingParams(max_tokens=config.max_tokens, stop_token_ids=())
    while len(history) + config.turn_tokens + config.max_tokens <= config.target_tokens:
        history += rng.integers(16, cfg.vocab_size, config.turn_tokens).tolist()
        rid = engine.add_request(list(history), params)
        peak = last = None
        out = None
        while engine.has_unfinished_requests():
            held = None
            outs = engine.step()
            if any(o.request_id == rid and o.finished for o in outs):
                out = next(o for o in outs if o.request_id == rid)
            else:
                held = mgr.num_held_blocks(rid)
            if held is not None:
                last = held
                peak = held if peak is None or sum(held) > sum(peak) else peak
        tokens = len(history) + len(out.token_ids) - 1  # (the last token's KV is never written)
        full_blocks = math.ceil(tokens / bs)
        row = dict(record="turn", turn=len(rows), prompt_tokens=len(history),
                   cached_tokens=out.metrics.num_cached_tokens, tokens=tokens,
                   held_blocks_per_group=list(last), peak_blocks_per_group=list(peak),
                   held_bytes=sum(last) * block_bytes, peak_bytes=sum(peak) * block_bytes,
                   all_full_bytes=full_blocks * cfg.num_layers * page_bytes)
        row["all_full_over_held"] = row["all_full_bytes"] / row["held_bytes"]
        rows.append(row)
        history += list(out.token_ids)
        if progress:
            print(row, flush=True)
    last = rows[-1]
    summary = dict(record="summary", model=config.model, num_layers=cfg.num_layers,
                   kv_groups=[[w, list(ls)] for w, ls in cfg.kv_groups],
                   block_size=bs, tokens=last["tokens"], held_bytes=last["held_bytes"],
                   peak_bytes=last["peak_bytes"], all_full_bytes=last["all_full_bytes"],
                   all_full_over_held=last["all_full_over_held"],
                   all_full_over_peak=last["all_full_bytes"] / last["peak_bytes"],
                   cached_tokens_per_turn=[r["cached_tokens"] for r in rows],
                   wall_s=time.perf_counter() - t0)
    prov = _common.provenance(config, seed=config.seed)
    with _common.AtomicJsonlWriter(workdir / "kv_held.jsonl", provenance=prov) as w:
        for r in rows:
            w.write(r)
        w.write(summary)
    return summary


def main() -> None:
    _common.run_cli(run, config_name="kv_held")


if __name__ == "__main__":
    main()
