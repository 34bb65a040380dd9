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
"""

from __future__ import annotations

import json
import os
import sys

# The cases, shared verbatim with the test (keep in sync): token ids at every encoding
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


def main() -> None:
    if os.environ.get("PYTHONHASHSEED") is None:
        sys.exit("set PYTHONHASHSEED (the seed the vectors are pinned with)")
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
