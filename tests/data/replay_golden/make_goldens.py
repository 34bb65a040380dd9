#!/usr/bin/env python3
"""Regenerate the replay goldens in this directory from the REAL vLLM 0.33 manager.

Not run by the tests (CI has no vLLM): the committed outputs are the oracle. Needs the
peer tools (``experiments/peers``) and the vLLM venv their installer makes; from the
repository root::

    VLLM_PY=$(bash experiments/peers/setup_vllm_env.sh | tail -1)
    python3 experiments/peers/make_traces.py --out-dir /tmp/traces --seed 0
    python3 tests/data/replay_golden/make_goldens.py --traces /tmp/traces --vllm-python $VLLM_PY

For each of the four peer traces it cuts a few dozen requests (``CUTS``), writes them as
``<name>.trace.jsonl.gz`` and, for each configuration in ``CONFIGS``, runs
``vllm_replay.py`` on the cut and stores vLLM's per-request output verbatim as
``<name>.N<num_blocks>.C<concurrency>.<algo>.vllm.jsonl`` (vLLM's block ids, i.e. ours + 1)
plus ``manifest.json``. Pools are small so that evictions, early finishes, failed
admissions and truncated decodes happen.
"""

import argparse
import gzip
import json
import os
import subprocess

CUTS = {
    # name: (source trace, selector)
    "shared_system_prompt": ("shared_system_prompt", lambda rs: rs[:30]),
    # Whole conversations (all 6 turns) 0..5, in arrival order.
    "multi_turn": (
        "multi_turn",
        lambda rs: [r for r in rs if int(r["id"].split("-")[1][1:]) < 6],
    ),
    # Headers 0..2, the first 24 requests in (shuffled) arrival order.
    "few_shot": ("few_shot", lambda rs: [r for r in rs if r["id"][4] in "012"][:24]),
    "mm_salt": ("mm_salt", lambda rs: rs[:40]),
}

# (name, num_blocks incl. vLLM's null block, concurrency, hash algo)
CONFIGS = [
    ("shared_system_prompt", 200, 2, "sha256"),
    ("shared_system_prompt", 100, 2, "sha256_cbor"),
    ("shared_system_prompt", 90, 2, "xxhash_cbor"),  # prompts of > 89 blocks fail
    ("multi_turn", 300, 4, "sha256"),
    ("multi_turn", 120, 3, "xxhash"),
    ("few_shot", 400, 2, "sha256"),
    ("few_shot", 250, 3, "xxhash_cbor"),
    ("mm_salt", 200, 3, "sha256"),
    ("mm_salt", 100, 2, "sha256"),
    ("mm_salt", 50, 1, "sha256_cbor"),  # prompts of > 49 blocks fail
]
BLOCK_SIZE = 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", required=True)
    ap.add_argument("--peers", default=os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))), "experiments", "peers"),
        help="directory of vllm_replay.py (default: the repository's experiments/peers)")
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    manifest = {"block_size": BLOCK_SIZE, "free_order": "unhashed_first", "runs": []}
    for name, (src, select) in CUTS.items():
        with open(os.path.join(args.traces, f"{src}.jsonl")) as f:
            rs = select([json.loads(line) for line in f])
        path = os.path.join(args.out, f"{name}.trace.jsonl.gz")
        with gzip.GzipFile(path, "wb", mtime=0) as g:
            for r in rs:
                g.write((json.dumps(r, separators=(",", ":")) + "\n").encode())
    for name, n, c, algo in CONFIGS:
        trace = os.path.join(args.out, f"{name}.trace.jsonl.gz")
        plain = f"/tmp/{name}.golden.jsonl"
        with gzip.open(trace, "rb") as g, open(plain, "wb") as f:
            f.write(g.read())
        out = f"{name}.N{n}.C{c}.{algo}.vllm.jsonl"
        env = dict(os.environ, PYTHONHASHSEED="0")
        res = subprocess.run(
            [args.vllm_python, os.path.join(args.peers, "vllm_replay.py"),
             "--trace", plain, "--num-blocks", str(n), "--block-size", str(BLOCK_SIZE),
             "--hash-algo", algo, "--concurrency", str(c), "--events",
             "--out", os.path.join(args.out, out)],
            check=True, capture_output=True, text=True, env=env,
        )
        s = json.loads(res.stdout.strip().splitlines()[-1])
        keep = ("requests", "admitted", "failed_admissions", "decode_truncated",
                "early_finishes", "prompt_tokens", "hit_tokens", "evictions",
                "blocks_stored", "vllm_version")
        manifest["runs"].append(
            dict(trace=f"{name}.trace.jsonl.gz", vllm_out=out, num_blocks_vllm=n,
                 concurrency=c, hash_algo=algo, **{k: s[k] for k in keep})
        )
        print(out, {k: s[k] for k in keep})
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
