r"""Cost of miss accounting: ``replay(miss_reasons=True)`` against the same replay off.

  python -m experiments.bench_miss_accounting --rounds=7
  python -m experiments.bench_miss_accounting --workloads=multi_turn --index=radix
  python -m experiments.bench_miss_accounting --workloads=multi_turn,mm_salt --kv_groups=full,sw32

Side by side in ONE process (on a shared machine timings drift by tens of percent over
seconds; only a ratio of interleaved runs means anything): each round replays every
cell off and on, back to back, alternating which goes first. Per cell it prints the
min and median ``loop_s`` of both and the on/off ratios (issue 26's target: within
1.05 on; "off" is the unchanged replay, checked with cachegrind, not here). Cells:
the generated workloads (``prefixcache.sim.workloads``) and, where the file exists,
the first ``--mooncake_requests`` requests of the Mooncake conversation trace
(``--mooncake``; hash ids as block keys, 16-token blocks). Also checks that the
summaries off and on agree outside ``miss_reasons``. ``--kv_groups=full,sw32``
replays a sliding-window / hybrid layout (``kv_groups.parse_kv_groups``; default: one
full-attention group). Last stdout line: one JSON
record with provenance.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics

from absl import flags

from experiments import _common

_WORKLOADS = flags.DEFINE_list("workloads", ["multi_turn", "mm_salt", "shared_system_prompt"],
                               "Workload generators (prefixcache.sim.workloads names).")
_MOONCAKE = flags.DEFINE_string(
    "mooncake", "",
    "A local copy of the Mooncake conversation trace (the dataset mooncake_conversation: "
    "conversation_trace.jsonl); '' (default) skips it.")
_MOONCAKE_N = flags.DEFINE_integer("mooncake_requests", 2000, "Mooncake requests replayed.")
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Timed rounds (each cell off and on).")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 300, "Allocatable blocks (workloads).")
_MOONCAKE_BLOCKS = flags.DEFINE_integer("mooncake_blocks", 4000, "Allocatable blocks (Mooncake).")
_NUM_HOST = flags.DEFINE_integer("num_host_blocks", 0, "Host tier blocks (0: none).")
_INDEX = flags.DEFINE_string("index", "hash", "Prefix index.")
_EVICTION = flags.DEFINE_string("eviction", "lru", "Eviction policy.")
_ALGO = flags.DEFINE_string("hash_algo", "sha256_cbor", "Hash algorithm.")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed.")
_KV_GROUPS = flags.DEFINE_string(
    "kv_groups", "", "KV cache group layout (kv_groups.parse_kv_groups, e.g. full,sw32); "
    "'' (default): one full-attention group.")


def _cells():
    from prefixcache.sim import workloads  # noqa: PLC0415
    from prefixcache.sim.trace import read_trace  # noqa: PLC0415

    sizes = {"multi_turn": dict(num_conversations=40), "mm_salt": dict(num_requests=200)}
    for w in _WORKLOADS.value:
        trace = workloads.generate(w, seed=_SEED.value, **sizes.get(w, {}))
        yield w, trace, dict(num_blocks=_NUM_BLOCKS.value, block_size=16)
    path = _MOONCAKE.value
    if path and os.path.exists(path):
        trace = list(itertools.islice(read_trace(path, mooncake_tokens="lazy"),
                                      _MOONCAKE_N.value))
        yield "mooncake_conversation", trace, dict(num_blocks=_MOONCAKE_BLOCKS.value,
                                                   block_size=16)


def main(argv):
    del argv
    from prefixcache.core.kv_groups import parse_kv_groups  # noqa: PLC0415
    from prefixcache.sim.replay import replay  # noqa: PLC0415

    common = dict(hash_algo=_ALGO.value, free_order="unhashed_first", concurrency=4,
                  index=_INDEX.value, eviction=_EVICTION.value,
                  num_host_blocks=_NUM_HOST.value, hash_seed="0")
    groups = parse_kv_groups(_KV_GROUPS.value) if _KV_GROUPS.value else None
    results = []
    for name, trace, kw in _cells():
        times = {False: [], True: []}
        agree = True
        ref = None
        for rnd in range(_ROUNDS.value + 1):  # round 0: warm-up (untimed)
            for on in ((False, True) if rnd % 2 else (True, False)):
                s = replay(trace, miss_reasons=on, kv_cache_groups=groups, **kw, **common)
                if rnd:
                    times[on].append(s["timing"]["loop_s"])
                key = {k: v for k, v in s.items()
                       if k not in ("timing", "requests_per_s", "prompt_tokens_per_s",
                                    "miss_reasons")}
                if ref is None:
                    ref = key
                agree = agree and key == ref
        off, on = times[False], times[True]
        r = {
            "cell": name,
            "off_loop_s_min": min(off), "off_loop_s_median": statistics.median(off),
            "on_loop_s_min": min(on), "on_loop_s_median": statistics.median(on),
            "ratio_min": min(on) / min(off),
            "ratio_median": statistics.median(on) / statistics.median(off),
            "summaries_agree": agree,
            **kw,
        }
        results.append(r)
        print(f"{name:>22}: off {r['off_loop_s_min']:.4f}/{r['off_loop_s_median']:.4f} on "
              f"{r['on_loop_s_min']:.4f}/{r['on_loop_s_median']:.4f} s (min/median) -> on/off "
              f"{r['ratio_min']:.3f} min, {r['ratio_median']:.3f} median | summaries agree: "
              f"{agree}", flush=True)
    print(json.dumps(_common.to_jsonable({
        "benchmark": "bench_miss_accounting",
        "rounds": _ROUNDS.value,
        "settings": {**common, "kv_groups": _KV_GROUPS.value or None},
        "results": results,
        "provenance": _common.provenance(None, seed=_SEED.value),
    })))


if __name__ == "__main__":
    _common.run_app(main)
