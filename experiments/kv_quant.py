r"""Accuracy and bytes of quantized KV pages, per KV dtype (CPU is enough).

  python -m experiments.kv_quant --config=configs/kv_quant.py --workdir=/tmp/kv_quant

For each KV dtype (``prefixcache.kv_dtypes.KV_DTYPES``) and each attention case
(decode rows over long contexts, a fresh prefill, a chunk over a cached prefix; GQA
group 4, head_dim 64, 16-token pages), K/V drawn standard-normal are written into a
paged cache of that dtype with ``kernels.write_kv`` -- once per case in one call
(``write: "prefill"``) and token by token (``write: "decode"``: fp8/int8 pages then
grow their scale and are requantized) -- and the attention of ``--backend`` over them
is compared with a float64 dense attention over the unquantized K/V:
``rel_error = max |out - ref| / max |ref|`` (the error relative to the output
scale) and ``mean_rel_error = mean |out - ref| / mean |ref|``. Bytes: KV bytes per
cached token of each model preset (``prefixcache.kv_dtypes.kv_bytes_per_block`` /
block size: values + fp8/int8 scales).

Writes ``results.jsonl`` (``record: "accuracy"`` per dtype, case and write mode;
``record: "bytes"`` per model preset and dtype; with provenance) into ``--workdir``;
prints the summary JSON (the largest rel_error per dtype, bytes per token).
"""

from __future__ import annotations

import math

from experiments import _common

CASES = {  # name -> [(q_len, kv_len)] of the sequences of one call
    "decode": [(1, 200), (1, 77), (1, 513), (1, 16)],
    "prefill": [(96, 96), (40, 40)],
    "chunk_over_prefix": [(48, 300), (17, 65)],
}


def oracle(q, ks, vs, seqs, sm_scale):
    """float64 causal attention per sequence over contiguous K/V (GQA by repetition)."""
    import numpy as np  # noqa: PLC0415

    out = np.zeros(q.shape, np.float64)
    start = 0
    for (q_len, kv_len), k, v in zip(seqs, ks, vs):
        group = q.shape[1] // k.shape[1]
        k, v = np.repeat(k, group, 1), np.repeat(v, group, 1)
        qs = q[start:start + q_len].astype(np.float64)
        logits = np.einsum("qhd,lhd->hql", qs, k) * sm_scale
        pos = kv_len - q_len + np.arange(q_len)
        logits = np.where(np.arange(kv_len)[None, None, :] <= pos[None, :, None], logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        out[start:start + q_len] = np.einsum("hql,lhd->qhd", w, v)
        start += q_len
    return out


def measure(kv_dtype: str, case: str, write: str, *, backend: str, interpret: bool,
            seed: int, page_size: int = 16, num_kv_heads: int = 2, group: int = 4,
            head_dim: int = 64) -> dict:
    """One accuracy row (see the module docstring)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    import prefixcache_kernels as kernels  # noqa: PLC0415
    from prefixcache.kv_dtypes import is_quantized  # noqa: PLC0415

    seqs = CASES[case]
    rng = np.random.default_rng(seed)
    pages_per_seq = [-(-kv // page_size) for _, kv in seqs]
    num_pages = sum(pages_per_seq) + 1
    perm = rng.permutation(num_pages - 1)
    table = np.full((len(seqs), max(pages_per_seq)), num_pages - 1, np.int32)
    ks, vs, slots = [], [], []
    nxt = 0
    for s, (_, kv_len) in enumerate(seqs):
        table[s, :pages_per_seq[s]] = perm[nxt:nxt + pages_per_seq[s]]
        nxt += pages_per_seq[s]
        ks.append(rng.standard_normal((kv_len, num_kv_heads, head_dim)).astype(np.float32))
        vs.append(rng.standard_normal((kv_len, num_kv_heads, head_dim)).astype(np.float32))
        slots += [table[s, t // page_size] * page_size + t % page_size for t in range(kv_len)]
    k_all, v_all = np.concatenate(ks), np.concatenate(vs)
    shape = (num_pages, page_size, 2 * num_kv_heads, head_dim)
    pages = jnp.zeros(shape, kv_dtype)
    scales = jnp.zeros((num_pages, 2 * num_kv_heads), jnp.float32) if is_quantized(kv_dtype) \
        else None
    write_fn = jax.jit(kernels.write_kv)
    if write == "prefill":
        groups = [np.arange(len(slots))]
    else:  # token by token, the sequences interleaved as in decode steps
        order = np.argsort(np.concatenate([np.arange(kv) for _, kv in seqs]), kind="stable")
        groups = [order[i:i + len(seqs)] for i in range(0, len(order), len(seqs))]
    slots = np.asarray(slots, np.int32)
    for idx in groups:
        args = (pages, jnp.asarray(k_all[idx]), jnp.asarray(v_all[idx]), jnp.asarray(slots[idx]))
        if scales is None:
            pages = write_fn(*args)
        else:
            pages, scales = write_fn(*args, kv_scales=scales)
    q_lens = [q for q, _ in seqs]
    q = rng.standard_normal((sum(q_lens), num_kv_heads * group, head_dim)).astype(np.float32)
    sm_scale = 1.0 / math.sqrt(head_dim)
    out = kernels.paged_attention(
        jnp.asarray(q), pages, jnp.asarray([kv for _, kv in seqs], jnp.int32), jnp.asarray(table),
        jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        jnp.asarray([len(seqs)], jnp.int32), sm_scale=sm_scale, backend=backend,
        interpret=interpret, kv_scales=scales)
    ref = oracle(q, ks, vs, seqs, sm_scale)
    err = np.abs(np.asarray(out, np.float64) - ref)
    return {"kv_dtype": kv_dtype, "case": case, "write": write, "backend": backend,
            "interpret": interpret, "tokens": int(sum(q_lens)),
            "rel_error": float(err.max() / np.abs(ref).max()),
            "mean_rel_error": float(err.mean() / np.abs(ref).mean())}


def bytes_rows(models, kv_dtypes, block_size: int) -> list[dict]:
    """KV bytes per cached token of each model preset and dtype."""
    from prefixcache.kv_dtypes import kv_bytes_per_block  # noqa: PLC0415
    from prefixcache.sim.cost_model import ModelShape  # noqa: PLC0415

    rows = []
    for model in models:
        shape = ModelShape.preset(model)
        for dt in kv_dtypes:
            per_block = kv_bytes_per_block(num_layers=shape.num_layers,
                                           num_kv_heads=shape.num_kv_heads,
                                           head_dim=shape.head_dim, block_size=block_size,
                                           kv_dtype=dt)
            rows.append({"model": model, "kv_dtype": dt, "block_size": block_size,
                         "bytes_per_block": per_block, "bytes_per_token": per_block / block_size})
    return rows


def run(config, *, progress: bool = False) -> dict:
    """Measures every (dtype, case, write mode); writes results.jsonl."""
    from experiments._kv_budget import parse_kv_dtypes  # noqa: PLC0415

    import prefixcache_kernels as kernels  # noqa: PLC0415

    dtypes = parse_kv_dtypes(config.kv_dtypes)
    kernels.resolve_backend(config.backend, config.interpret)  # bad backend: before anything
    cases = [c.strip() for c in config.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown or not cases:
        raise ValueError(f"unknown cases {unknown or config.cases!r}; expected some of "
                         f"{sorted(CASES)}")
    models = [m.strip() for m in config.models.split(",") if m.strip()]
    byte_rows = bytes_rows(models, dtypes, config.block_size)  # unknown model: before
    workdir = _common.prepare_workdir(config.workdir)
    items = [(dt, c, w) for dt in dtypes for c in cases for w in ("prefill", "decode")]
    acc = [measure(dt, c, w, backend=config.backend, interpret=config.interpret,
                   seed=config.seed, page_size=config.block_size)
           for dt, c, w in _common.progress_bar(items, enabled=progress, desc="kv_quant")]
    prov = _common.provenance(config, seed=config.seed)
    with _common.AtomicJsonlWriter(workdir / "results.jsonl", provenance=prov) as w:
        for row in acc:
            w.write({"record": "accuracy", **row})
        for row in byte_rows:
            w.write({"record": "bytes", **row})
    worst = {dt: max(r["rel_error"] for r in acc if r["kv_dtype"] == dt) for dt in dtypes}
    return {"max_rel_error": worst,
            "bytes_per_token": {f"{r['model']}/{r['kv_dtype']}": r["bytes_per_token"]
                                for r in byte_rows}}


def main() -> None:
    _common.run_cli(run, config_name="kv_quant", extra_flags={
        "kv_dtypes": ("string", "Comma-separated KV dtypes"),
        "backend": ("string", "kernels.paged_attention backend"),
        "models": ("string", "Comma-separated model presets for bytes per token"),
    })


if __name__ == "__main__":
    main()
