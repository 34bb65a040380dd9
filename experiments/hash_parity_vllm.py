"""Recompute the pinned block-hash vectors of tests/core/test_core_hashing.py with vLLM.

Runs under the vLLM peer's python (it imports vllm, not prefixcache) and prints one JSON
object: per algorithm, the chain root and the block hashes (hex) of each case in
``CASES``, computed by vLLM 0.33's own ``Request`` + ``get_request_block_hasher`` with
``PYTHONHASHSEED`` set to the seed. The test file pins these digests as literals;
rerun this script to regenerate them:

    PYTHONHASHSEED=1234 VLLM_LOGGING_STREAM=ext://sys.stderr \
        ~/.cache/prefixcache-peers/vllm-venv/bin/python experiments/hash_parity_vllm.py

Expected: a JSON line equal to the ``VLLM_VECTORS`` literal of the test (with seed
1234), plus ``default_roots`` (PYTHONHASHSEED unset semantics for the sha256 variants).

``--bench TRACE.jsonl [...]`` instead times block hashing of vLLM against
``prefixcache.core.hashing`` in this one process (same interpreter, interleaved
repetitions, digests checked equal first), on the traces of ``experiments/peers``:

    python3 experiments/peers/make_traces.py --out-dir /tmp/traces --seed 0
    PYTHONHASHSEED=0 VLLM_LOGGING_STREAM=ext://sys.stderr \
        ~/.cache/prefixcache-peers/vllm-venv/bin/python experiments/hash_parity_vllm.py \
        --bench /tmp/traces/*.jsonl --max-requests 300 --repeat 5

Two timings per trace and algorithm: ``prompt`` = the block hashes of every prompt
(vLLM's ``get_request_block_hasher`` closure on prebuilt requests vs
``BlockHasher.hash_token_blocks``); ``lifecycle`` = build the request, hash its prompt,
then decode ``output_len`` tokens one at a time reading the block hashes after each
(vLLM's ``Request`` vs ``prefixcache.core.request.Request``). Our hasher's caches
(the block-digest memo) are cleared before each repetition, so only prefix sharing
between the requests of one pass helps, as in a replay. Printed: CPU seconds
and the ratio vLLM / ours (> 1: ours faster), from the fastest of the interleaved
repetitions in CPU time (``time.process_time``).
"""

from __future__ import annotations

import json
import os
import sys

# The cases (tests/core/test_core_hashing.py imports them; its pinned digests are this
# script's output for them): token ids at every encoding
# width boundary of CBOR and pickle; extra keys with LoRA, two images in one block
# (pickle back-references the second "mm" label), an image spanning blocks (negative
# relative offset) and a salt.
BOUNDARY_TOKENS = [
    0, 1, 23, 24, 255, 256, 65535, 65536,
    2**31 - 1, 2**31, 2**32 - 1, 2**32, 7, 8, 9, 10, 11,
]
CASES = {
    "boundaries_bs4": dict(tokens=BOUNDARY_TOKENS, block_size=4),
    "extras_bs4": dict(
        tokens=list(range(100, 124)),
        block_size=4,
        lora=("lora-a", "/adapters/lora-a"),
        mm=[("img-A", 2, 5), ("img-B", 7, 6)],
        cache_salt="salt-1",
        output=[5, 6, 7, 8, 9],
    ),
    "salt_only_bs16": dict(
        tokens=[(i * 7919) % 50000 for i in range(40)],
        block_size=16,
        cache_salt="tenant-7",
        output=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    ),
}


def _bench(paths: list[str], max_requests: int, repeat: int, block_size: int) -> None:
    import gc
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from prefixcache.core.hashing import BlockHasher
    from prefixcache.core.request import LoRARequest as PLoRA
    from prefixcache.core.request import MultiModalFeature as PMM
    from prefixcache.core.request import Request as PRequest

    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    algos = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
    print(f"{'trace':22s} {'algo':12s} {'what':10s} {'vllm_s':>9s} {'ours_s':>9s} {'ratio':>6s}")
    for path in paths:
        with open(path) as f:
            entries = [json.loads(line) for line, _ in zip(f, range(max_requests))]
        lora_ids: dict = {}

        def vllm_kwargs(e):
            lora = None
            if e.get("lora"):
                name, lpath = e["lora"]
                lora = LoRARequest(
                    lora_name=name,
                    lora_int_id=lora_ids.setdefault(name, len(lora_ids) + 1),
                    lora_path=lpath,
                )
            mm = [
                MultiModalFeatureSpec(
                    data=None, modality="image", identifier=i,
                    mm_position=PlaceholderRange(offset=o, length=n), mm_hash=i,
                )
                for i, o, n in sorted(e.get("mm") or [], key=lambda x: x[1])
            ]
            return dict(
                request_id=e["id"], prompt_token_ids=e["prompt"],
                sampling_params=SamplingParams(max_tokens=max(1, e["output_len"])),
                pooling_params=None, arrival_time=0.0, mm_features=mm or None,
                lora_request=lora, cache_salt=e.get("cache_salt"),
            )

        ours_in = [
            (
                e["prompt"],
                dict(
                    lora=PLoRA(*e["lora"]) if e.get("lora") else None,
                    mm_features=[PMM(*m) for m in e.get("mm") or []],
                    cache_salt=e.get("cache_salt"),
                ),
                e["output_len"],
            )
            for e in entries
        ]
        vkw = [vllm_kwargs(e) for e in entries]
        name = os.path.basename(path).removesuffix(".jsonl")
        for algo in algos:
            hash_fn = get_hash_fn_by_name(algo)
            kv_cache_utils.init_none_hash(hash_fn)
            vfn = kv_cache_utils.get_request_block_hasher(block_size, hash_fn)
            hasher = BlockHasher(algo)  # same PYTHONHASHSEED -> same root
            assert hasher.root == kv_cache_utils.NONE_HASH, "set PYTHONHASHSEED"
            vreqs = [Request(block_hasher=None, **kw) for kw in vkw]
            for vr, (prompt, kw, _) in zip(vreqs, ours_in):  # parity on the real trace
                assert vfn(vr) == hasher.hash_token_blocks(prompt, block_size, **kw)
            hasher.clear_caches()
            for vr, (prompt, kw, _) in zip(vreqs, ours_in):  # again from cold caches
                assert vfn(vr) == hasher.hash_token_blocks(prompt, block_size, **kw)

            def vllm_prompt():
                for vr in vreqs:
                    vfn(vr)

            def ours_prompt():
                # NOTE: cold caches every repetition: only sharing between the requests
                # of one pass (as in a real replay) helps; vLLM has no such memo.
                hasher.clear_caches()
                for prompt, kw, _ in ours_in:
                    hasher.hash_token_blocks(prompt, block_size, **kw)

            def vllm_life():
                for kw in vkw:
                    r = Request(block_hasher=vfn, **kw)
                    for t in range(kw["sampling_params"].max_tokens):
                        r.append_output_token_ids(1 + t)
                        r.block_hashes

            def ours_life():
                hasher.clear_caches()
                for prompt, kw, out_len in ours_in:
                    r = PRequest(0, prompt, hasher=hasher, block_size=block_size, **kw)
                    r.block_hashes
                    for t in range(max(1, out_len)):
                        r.append_output_token_ids(1 + t)
                        r.block_hashes

            for what, fv, fo in (("prompt", vllm_prompt, ours_prompt),
                                 ("lifecycle", vllm_life, ours_life)):
                tv, to = [], []
                gc.collect()
                gc.disable()
                try:
                    for _ in range(repeat):  # interleaved
                        # NOTE: CPU time of this process: on a shared machine the
                        # wall clock mostly measures the neighbours.
                        t0 = time.process_time()
                        fv()
                        t1 = time.process_time()
                        fo()
                        t2 = time.process_time()
                        tv.append(t1 - t0)
                        to.append(t2 - t1)
                finally:
                    gc.enable()
                ratio = min(tv) / min(to)
                print(
                    f"{name:22s} {algo:12s} {what:10s} {min(tv):9.4f} "
                    f"{min(to):9.4f} {ratio:6.2f}",
                    flush=True,
                )


def main(argv: list[str] | None = None) -> None:
    """Prints the vectors (default) or, with ``--bench``, the timings (module doc).

    Args:
      argv: the command line without the program name; default ``sys.argv[1:]``.
    """
    import argparse  # noqa: PLC0415

    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Run with the vLLM peer venv's python and PYTHONHASHSEED set.")
    ap.add_argument("--bench", nargs="+", metavar="TRACE",
                    help="time hashing on these peer traces instead of printing vectors")
    ap.add_argument("--max-requests", type=int, default=300,
                    help="requests per trace in --bench")
    ap.add_argument("--repeat", type=int, default=5,
                    help="interleaved repetitions in --bench (fastest reported)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block in --bench")
    a = ap.parse_args(argv)
    if a.bench:
        if os.environ.get("PYTHONHASHSEED") is None:
            sys.exit("error: set PYTHONHASHSEED (both sides must share the xxhash roots)")
        _bench(a.bench, a.max_requests, a.repeat, a.block_size)
        return
    if os.environ.get("PYTHONHASHSEED") is None:
        sys.exit("error: set PYTHONHASHSEED (the seed the vectors are pinned with)")
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    out: dict = {"seed": os.environ["PYTHONHASHSEED"], "algos": {}}
    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        hash_fn = get_hash_fn_by_name(algo)
        kv_cache_utils.init_none_hash(hash_fn)
        res = {"root": kv_cache_utils.NONE_HASH.hex()}
        for name, case in CASES.items():
            lora = None
            if case.get("lora"):
                lname, lpath = case["lora"]
                lora = LoRARequest(lora_name=lname, lora_int_id=1, lora_path=lpath)
            mm = [
                MultiModalFeatureSpec(
                    data=None,
                    modality="image",
                    identifier=ident,
                    mm_position=PlaceholderRange(offset=off, length=length),
                    mm_hash=ident,
                )
                for ident, off, length in sorted(case.get("mm", []), key=lambda x: x[1])
            ]
            req = Request(
                request_id=name,
                prompt_token_ids=list(case["tokens"]),
                sampling_params=SamplingParams(max_tokens=16),
                pooling_params=None,
                arrival_time=0.0,
                mm_features=mm or None,
                lora_request=lora,
                cache_salt=case.get("cache_salt"),
                block_hasher=kv_cache_utils.get_request_block_hasher(
                    case["block_size"], hash_fn
                ),
            )
            if case.get("output"):
                req.append_output_token_ids(list(case["output"]))
            res[name] = [bytes(h).hex() for h in req.block_hashes]
        out["algos"][algo] = res
    default = {}
    for algo in ("sha256", "sha256_cbor"):
        default[algo] = get_hash_fn_by_name(algo)(
            kv_cache_utils.DEFAULT_NONE_HASH_SEED
        ).hex()
    out["default_roots"] = default
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
