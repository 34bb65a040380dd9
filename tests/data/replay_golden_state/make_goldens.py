#!/usr/bin/env python3
"""Regenerate the state-space (Mamba) replay goldens from the REAL vLLM 0.33.

Not run by the tests (CI has no vLLM): the committed outputs are the oracle. Reads the
trace cuts of ``tests/data/replay_golden/`` (made by its ``make_goldens.py`` from
``experiments/peers/make_traces.py --seed 0``) and, for each configuration in
``CONFIGS``, runs ``experiments/peers/vllm_replay.py --kv-groups ...`` with ``mamba``
groups -- vLLM's own ``KVCacheManager`` with a ``HybridKVCacheCoordinator``
(``UnitaryKVCacheCoordinator`` for a Mamba-only model), ``MambaManager``
(``mamba_cache_mode="align"``), ``FullAttentionManager`` / ``SlidingWindowManager`` and
one ``BlockPool``; prompts split by the scheduler's own ``_mamba_block_aligned_split``
-- storing its per-request output verbatim as
``<name>.N<num_blocks>.C<concurrency>.<algo>.<kv_groups>.vllm.jsonl`` (vLLM's block ids:
ours + 1, its null block 0 = our ``num_blocks``) plus ``manifest.json``. From the
repository root::

    VLLM_PY=$(bash experiments/peers/setup_vllm_env.sh | tail -1)
    python3 tests/data/replay_golden_state/make_goldens.py --vllm-python $VLLM_PY

The layouts cover full + Mamba (one pass of the coordinator loop), a Mamba-only model
(unitary), full + sliding window + Mamba (the loop runs until all agree), two Mamba
groups (looked up together) and Mamba listed first; pools small enough that
evictions, early finishes, failed admissions and truncated prefills and decodes happen.
Runs with a sixth field pass ``--retention-interval`` (vLLM's
``prefix_cache_retention_interval``; 0: only the replay boundary's and the junction's
states are cached -- ours ``MambaSpec(retention_interval=0)``), stored as ``*.r0.vllm.jsonl``.
"""

import argparse
import gzip
import json
import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
TRACES = os.path.join(os.path.dirname(HERE), "replay_golden")

# (trace cut, num_blocks incl. vLLM's null block, concurrency, hash algo, kv groups)
CONFIGS = [
    ("multi_turn", 120, 3, "sha256", "full,mamba"),
    ("multi_turn", 43, 1, "sha256", "full,mamba"),  # failures and truncations
    ("multi_turn", 100, 2, "sha256", "mamba"),
    ("multi_turn", 160, 3, "sha256", "full,sw32,mamba"),
    ("shared_system_prompt", 200, 2, "sha256_cbor", "mamba,full"),
    ("few_shot", 400, 2, "xxhash", "full,mamba"),
    ("few_shot", 250, 3, "sha256", "full,mamba,mamba"),
    ("few_shot", 194, 1, "sha256", "full,mamba"),  # truncated prefills and decodes
    # vLLM's prefix_cache_retention_interval=0 (ours: MambaSpec(retention_interval=0)):
    # only the replay boundary's and the junction's states are cached.
    ("multi_turn", 120, 3, "sha256", "full,mamba", 0),
    ("multi_turn", 43, 1, "sha256", "full,mamba", 0),
    ("shared_system_prompt", 200, 2, "sha256", "full,mamba", 0),
    ("few_shot", 400, 2, "xxhash", "mamba", 0),
]
BLOCK_SIZE = 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", default=os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(HERE))), "experiments", "peers"),
        help="directory of vllm_replay.py (default: the repository's experiments/peers)")
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--out", default=HERE)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    manifest = {"block_size": BLOCK_SIZE, "free_order": "unhashed_first",
                "traces": "../replay_golden", "runs": []}
    for name, n, c, algo, groups, *rest in CONFIGS:
        retention = rest[0] if rest else None
        trace = os.path.join(TRACES, f"{name}.trace.jsonl.gz")
        plain = f"/tmp/{name}.hybrid_golden.jsonl"
        with gzip.open(trace, "rb") as g, open(plain, "wb") as f:
            f.write(g.read())
        out = (f"{name}.N{n}.C{c}.{algo}.{groups.replace(',', '-')}"
               + ("" if retention is None else f".r{retention}") + ".vllm.jsonl")
        env = dict(os.environ, PYTHONHASHSEED="0")
        res = subprocess.run(
            [args.vllm_python, os.path.join(args.peers, "vllm_replay.py"),
             "--trace", plain, "--num-blocks", str(n), "--block-size", str(BLOCK_SIZE),
             "--hash-algo", algo, "--concurrency", str(c), "--events",
             "--kv-groups", groups, "--out", os.path.join(args.out, out)]
            + ([] if retention is None else ["--retention-interval", str(retention)]),
            check=True, capture_output=True, text=True, env=env,
        )
        s = json.loads(res.stdout.strip().splitlines()[-1])
        with open(os.path.join(args.out, out)) as f:
            recs = [json.loads(line) for line in f]
        s["prefill_split"] = sum(1 for r in recs if "prefill_chunks" in r)
        s["prefill_truncated"] = sum(1 for r in recs if "prefill_truncated_at" in r)
        keep = ("requests", "admitted", "failed_admissions", "decode_truncated",
                "early_finishes", "prompt_tokens", "hit_tokens", "evictions",
                "blocks_stored", "prefill_split", "prefill_truncated", "vllm_version")
        manifest["runs"].append(
            dict(trace=f"{name}.trace.jsonl.gz", vllm_out=out, num_blocks_vllm=n,
                 concurrency=c, hash_algo=algo, kv_groups=groups,
                 retention_interval=retention,
                 **{k: s[k] for k in keep})
        )
        print(out, {k: s[k] for k in keep}, flush=True)
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
