r"""Where miss accounting's cost goes on an eviction-heavy trace: the per-eviction record.

  python -m experiments.bench_eviction_record --mooncake=<conversation_trace.jsonl>
  python -m experiments.bench_eviction_record            # (a generated multi_turn trace)

``replay(miss_reasons=True)`` pays twice: ``classify`` per admission and, per eviction,
the pool's ``evicted_by`` hook (one dict store: the accountant must later know the key
was ever cached). On the Mooncake conversation trace at 4000 blocks there are about 650
evictions per admission, so the record dominates. This measures, side by side in ONE
process (rounds alternate the order), the replay's ``loop_s`` with miss accounting:

* ``off``: miss accounting off (the baseline);
* ``on``: on, as shipped;
* ``record_dict``: on, ``classify`` answering nothing: the cost of today's record alone;
* ``record_list``: the same with the record replaced by a list append: the floor of any
  record kept by Python code (an exact index of evicted keys costs more: a set or a
  numpy fingerprint table built from the list measured worse than the dict);
* ``record_none``: the same with no record at all (the accountant's other calls).

The replacements patch ``BlockPool._evict`` for the measurement only (restored after);
they give no reasons. Last stdout line: one JSON record with provenance.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics

from absl import flags

from experiments import _common

_MOONCAKE = flags.DEFINE_string(
    "mooncake", "", "A local copy of the Mooncake conversation trace ('' : a generated "
    "multi_turn trace instead).")
_N = flags.DEFINE_integer("requests", 1500, "Mooncake requests replayed.")
_BLOCKS = flags.DEFINE_integer("num_blocks", 4000, "Allocatable blocks.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed rounds (each variant once a round).")

VARIANTS = ("off", "on", "record_dict", "record_list", "record_none")


def _evict_with(record):
    """A ``BlockPool._evict`` for one-group pools without events (this benchmark's
    replay) whose hook is ``record(pool, hash)``."""

    def _evict(self, block):
        h = block.block_hash
        del self.cached_block_hash_to_block[h]
        block.block_hash = None
        self.num_evictions += 1
        if self.evicted_by is not None:
            record(self, h)

    return _evict


def main(argv):
    del argv
    from prefixcache.core.block_pool import BlockPool  # noqa: PLC0415
    from prefixcache.sim import misses, workloads  # noqa: PLC0415
    from prefixcache.sim.replay import replay  # noqa: PLC0415
    from prefixcache.sim.trace import read_trace  # noqa: PLC0415

    path = _MOONCAKE.value
    if path and os.path.exists(path):
        trace = list(itertools.islice(read_trace(path, mooncake_tokens="lazy"), _N.value))
        cell = "mooncake_conversation"
    else:
        trace = workloads.generate("multi_turn", seed=0, num_conversations=40)
        cell = "multi_turn"
    kw = dict(num_blocks=_BLOCKS.value, block_size=16, hash_algo="sha256_cbor",
              free_order="unhashed_first", concurrency=4, hash_seed="0")
    shipped_evict, shipped_classify = BlockPool._evict, misses.MissAccountant.classify
    logs: dict[int, list] = {}

    def store(pool, h):
        pool.evicted_by[h] = "device"

    def append(pool, h):
        logs.setdefault(id(pool), []).append(h)

    patches = {
        "record_dict": _evict_with(store),
        "record_list": _evict_with(append),
        "record_none": _evict_with(lambda pool, h: None),
    }
    times = {v: [] for v in VARIANTS}
    evictions = None
    try:
        for rnd in range(_ROUNDS.value + 1):  # round 0: warm-up
            order = VARIANTS if rnd % 2 else VARIANTS[::-1]
            for v in order:
                logs.clear()
                BlockPool._evict = patches.get(v, shipped_evict)
                misses.MissAccountant.classify = (
                    shipped_classify if v in ("off", "on") else (lambda self, r, n: {}))
                s = replay(trace, miss_reasons=v != "off", **kw)
                if v == "off":
                    evictions = s["evictions"]
                if rnd:
                    times[v].append(s["timing"]["loop_s"])
    finally:
        BlockPool._evict, misses.MissAccountant.classify = shipped_evict, shipped_classify
    base = min(times["off"])
    base_med = statistics.median(times["off"])
    rows = []
    for v in VARIANTS:
        r = {"variant": v, "loop_s_min": min(times[v]),
             "loop_s_median": statistics.median(times[v]),
             "ratio_min": min(times[v]) / base,
             "ratio_median": statistics.median(times[v]) / base_med}
        rows.append(r)
        print(f"{v:>12}: {r['loop_s_min']:.3f}/{r['loop_s_median']:.3f} s (min/median) "
              f"-> /off {r['ratio_min']:.3f} min, {r['ratio_median']:.3f} median", flush=True)
    print(json.dumps(_common.to_jsonable({
        "benchmark": "bench_eviction_record", "cell": cell, "requests": len(trace),
        "num_evictions": evictions, "rounds": _ROUNDS.value, "settings": kw,
        "results": rows, "provenance": _common.provenance(None, seed=0),
    })))


if __name__ == "__main__":
    _common.run_app(main)
