r"""Host-side cost of building one step's index arrays (prefixcache.metadata).

Command:
  python -m experiments.bench_metadata
Expected (2-core CPU): 256 sequences build in well under 1 ms of CPU time; block
tables passed as int32 numpy arrays (the engine's fast path) about 2x faster than
Python lists. Prints one line per case, then (last line) a JSON object.

Timings are CPU time (``time.process_time``), min and median over --repeat runs of
--number builds each, so a loaded machine distorts them less than wall time.
"""
from __future__ import annotations

import json
import time
import timeit

from absl import app, flags
import numpy as np

from experiments import _common
from experiments._common import provenance
from prefixcache.metadata import MetadataBuilder, ScheduledSeq

_PROGRESS = _common.define_progress_flag()
_SEED = flags.DEFINE_integer("seed", 0, "RNG seed of the synthetic schedules.")
_NUMBER = flags.DEFINE_integer("number", 200, "Builds per timed run.")
_REPEAT = flags.DEFINE_integer("repeat", 7, "Timed runs per case.")
_NUM_SEQS = flags.DEFINE_integer("num_seqs", 256, "Sequences per step.")


def make_schedule(rng: np.random.Generator, num_seqs: int, ctx_lo: int, ctx_hi: int,
                  num_prefill: int, *, block_size: int = 16, num_blocks: int = 8192,
                  chunk: int = 64) -> list[ScheduledSeq]:
  """``num_seqs`` sequences: decodes, then ``num_prefill`` chunks of ``chunk`` tokens."""
  seqs = []
  for i in range(num_seqs):
    computed = int(rng.integers(ctx_lo, ctx_hi))
    q = chunk if i >= num_seqs - num_prefill else 1
    pages = -(-(computed + q) // block_size)
    seqs.append(ScheduledSeq(rng.integers(0, num_blocks, pages).tolist(), computed,
                             rng.integers(0, 1000, q).tolist()))
  return seqs


def time_build(builder: MetadataBuilder, seqs, number: int, repeat: int) -> dict:
  """CPU seconds per ``builder.build(seqs)``: min and median over ``repeat`` runs."""
  runs = timeit.repeat(lambda: builder.build(seqs), number=number, repeat=repeat,
                       timer=time.process_time)
  per = sorted(t / number for t in runs)
  return {"min_us": per[0] * 1e6, "median_us": per[len(per) // 2] * 1e6}


def main(argv):
  del argv
  rng = np.random.default_rng(_SEED.value)
  n = _NUM_SEQS.value
  builder = MetadataBuilder(block_size=16, num_blocks=8192, max_num_seqs=max(n, 4),
                            max_num_tokens=2048, max_pages_per_seq=128)
  cases = {
      f"{n} decodes, 512-token context": make_schedule(rng, n, 511, 512, 0),
      f"{n - 16} decodes + 16 x 64-token chunks": make_schedule(rng, n, 0, 1500, 16),
  }
  records = []
  bar = _common.progress_bar(enabled=_PROGRESS.value, desc="bench_metadata", unit="case",
                             total=2 * len(cases))
  for name, seqs in cases.items():
    arrays = [ScheduledSeq(np.asarray(s.block_ids, np.int32), s.num_computed_tokens,
                           s.token_ids) for s in seqs]
    for kind, ss in (("lists", seqs), ("int32 arrays", arrays)):
      rec = {"case": name, "block_tables": kind,
             **time_build(builder, ss, _NUMBER.value, _REPEAT.value)}
      records.append(rec)
      bar.update(1)
      print(f"{name:<40} {kind:<13} min {rec['min_us']:7.1f} us  "
            f"median {rec['median_us']:7.1f} us", flush=True)
  bar.close()
  print(json.dumps({
      "cases": records,
      "max_median_us": max(r["median_us"] for r in records),
      "provenance": provenance({"num_seqs": n, "number": _NUMBER.value,
                                "repeat": _REPEAT.value}, seed=_SEED.value),
  }))


if __name__ == "__main__":
  _common.run_app(main)
