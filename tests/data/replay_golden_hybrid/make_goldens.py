#!/usr/bin/env python3
"""Regenerate the hybrid (full + sliding-window) replay goldens from the REAL vLLM 0.33.

Not run by the tests (CI has no vLLM): the committed outputs are the oracle. Reads the
trace cuts of ``tests/data/replay_golden/`` (made by its ``make_goldens.py`` from
``experiments/peers/make_traces.py --seed 0``) and, for each configuration in
``CONFIGS``, runs ``experiments/peers/vllm_replay.py --kv-groups ...`` -- vLLM's own
``KVCacheManager`` with a ``HybridKVCacheCoordinator`` (a ``UnitaryKVCacheCoordinator``
for a single group), ``FullAttentionManager`` / ``SlidingWindowManager`` and one
``BlockPool`` -- storing its per-request output verbatim as
``<name>.N<num_blocks>.C<concurrency>.<algo>.<kv_groups>.vllm.jsonl`` (vLLM's block ids:
ours + 1, its null block 0 = our ``num_blocks``) plus ``manifest.json``. From the
repository root::

    VLLM_PY=$(bash experiments/peers/setup_vllm_env.sh | tail -1)
    python3 tests/data/replay_golden_hybrid/make_goldens.py --vllm-python $VLLM_PY

Pools are small so that evictions, early finishes and failed admissions happen; the
layouts cover a plain hybrid (one pass of the coordinator loop), a window that is not a
multiple of the block, two sliding windows (the loop runs until all groups agree), two
groups of one spec (looked up together), two full-attention groups and a
sliding-window-only model (unitary).
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
    ("multi_turn", 120, 3, "sha256", "full,sw32"),
    ("multi_turn", 200, 4, "xxhash", "full,sw64"),
    ("multi_turn", 160, 3, "sha256", "full,sw32,sw64"),
    ("multi_turn", 100, 2, "sha256", "sw48"),
    ("multi_turn", 43, 1, "sha256", "full,sw32"),  # failures and a truncated decode
    ("multi_turn", 120, 3, "sha256", "full,full"),
    # W = 1 (mod block): a hit needs ceil((W - 1) / block) blocks, not ceil(W / block).
    ("multi_turn", 120, 3, "sha256", "full,sw33"),
    ("few_shot", 400, 2, "sha256", "full,sw17"),
    ("shared_system_prompt", 200, 2, "sha256", "full,sw32"),
    ("shared_system_prompt", 250, 2, "sha256_cbor", "sw64,full,sw64"),
    ("few_shot", 400, 2, "sha256", "full,sw64"),
    ("few_shot", 700, 3, "xxhash_cbor", "full,sw40,sw32"),
    ("mm_salt", 100, 2, "sha256", "full,sw32"),
    ("mm_salt", 120, 1, "sha256", "full,sw16"),
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
    for name, n, c, algo, groups in CONFIGS:
        trace = os.path.join(TRACES, f"{name}.trace.jsonl.gz")
        plain = f"/tmp/{name}.hybrid_golden.jsonl"
        with gzip.open(trace, "rb") as g, open(plain, "wb") as f:
            f.write(g.read())
        out = f"{name}.N{n}.C{c}.{algo}.{groups.replace(',', '-')}.vllm.jsonl"
        env = dict(os.environ, PYTHONHASHSEED="0")
        res = subprocess.run(
            [args.vllm_python, os.path.join(args.peers, "vllm_replay.py"),
             "--trace", plain, "--num-blocks", str(n), "--block-size", str(BLOCK_SIZE),
             "--hash-algo", algo, "--concurrency", str(c), "--events",
             "--kv-groups", groups, "--out", os.path.join(args.out, out)],
            check=True, capture_output=True, text=True, env=env,
        )
        s = json.loads(res.stdout.strip().splitlines()[-1])
        keep = ("requests", "admitted", "failed_admissions", "decode_truncated",
                "early_finishes", "prompt_tokens", "hit_tokens", "evictions",
                "blocks_stored", "vllm_version")
        manifest["runs"].append(
            dict(trace=f"{name}.trace.jsonl.gz", vllm_out=out, num_blocks_vllm=n,
                 concurrency=c, hash_algo=algo, kv_groups=groups,
                 **{k: s[k] for k in keep})
        )
        print(out, {k: s[k] for k in keep}, flush=True)
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
