r"""Soak and memory pressure: long random runs of the manager and the engine.

  python -m experiments.soak --config=configs/soak.py --workdir=/tmp/soak          # short (CI)
  python -m experiments.soak --config=configs/soak.py --workdir=/tmp/soak \
      --config.long=True                                                           # 10^6 ops

Two parts, both written to ``results.jsonl`` (provenance on every line) with
``soak_rss.png`` (resident memory over the manager soak) in ``--workdir``:

* manager soak (``manager_soak``): ``num_ops`` random operations on one
  ``KVCacheManager`` (events on) driving every public call -- admissions
  (``get_computed_blocks`` + ``allocate_slots`` with the hit), prefill chunks and
  decode steps, lookahead slots, preemption (free + re-admission of the same
  ``Request`` with ``num_preemptions`` raised), frees, ``reset_prefix_cache`` (refused
  while blocks are held, done after a drain), every inspection call, stats/events
  intervals, and calls that must raise ``ValueError`` and change nothing -- over
  requests with salts (vLLM's and ``cache_salt_offset``), LoRA adapters, multimodal
  items and shared prefixes (so hits happen). ``check_invariants`` runs every
  ``check_every`` operations, where the process RSS is sampled too; after the warm-up
  (``warmup_fraction`` of the run) the RSS peak may exceed the warm-up's peak by less
  than ``rss_growth_limit`` (relative; enforced for runs of ``rss_min_ops`` or more: the hasher's bounded caches
  fill during the first ~150k operations). At the end everything is freed: all blocks
  free again.
* engine soak (``engine_soak``): ``num_requests`` requests through the tiny model's
  engine with ``inflight`` of them unfinished at a time on a pool of
  ``pool_fraction`` of their demand (inflight x mean blocks per request, never less
  than the largest request), so preemption is routine; random aborts, salts,
  LoRA (cache key only), multimodal prompts with embedding rows, stop tokens, and
  requests that must be rejected (too long, token id outside the vocabulary). Every
  request must come back exactly once -- finished ("length"/"stop"), aborted, or
  rejected with a reason -- and the pool must be whole again (every block free, no
  block table row held, invariants hold).

A broken check raises (``SoakError`` or the manager's ``InvariantError``): the run
fails loudly and writes no results. The printed summary holds both parts' figures.
"""

from __future__ import annotations

import math
import os
import random
import time
from typing import Any

import numpy as np

from experiments import _common


class SoakError(AssertionError):
    """A soak check failed (a leak, a lost request, RSS growth)."""


def current_rss_mib() -> float:
    """Resident memory of this process now, MiB (``/proc/self/statm``; elsewhere the
    peak, ``ru_maxrss``, which also grows when the current RSS does)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return _common.peak_rss_mib()


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


# ----------------------------------------------------------------------------
# manager soak
# ----------------------------------------------------------------------------


class _RequestFactory:
    """Random requests with shared prefixes, salts, LoRA adapters and multimodal items."""

    def __init__(self, rng: random.Random, *, block_size: int, max_prompt_len: int,
                 vocab: int = 32000):
        from prefixcache.core import LoRARequest  # noqa: PLC0415

        self.rng = rng
        self.bs = block_size
        self.max_prompt_len = max_prompt_len
        nprng = np.random.default_rng(rng.getrandbits(32))
        # Token source: prompts are windows of one array (cheap) after a shared prefix.
        self.pool = nprng.integers(1, vocab, 1 << 16).tolist()
        self.prefixes = [nprng.integers(1, vocab, int(n)).tolist()
                         for n in nprng.integers(1, max_prompt_len // 2 + 2, 8)]
        self.salts = ["tenant-a", "tenant-b", "tenant-c"]
        self.loras = [LoRARequest("ad1", "/ad1", 1), LoRARequest("ad2", "/ad2", 2)]
        self.images = ["img-0", "img-1", "img-2", "img-3"]
        self.num_made = 0

    def tokens(self, n: int) -> list[int]:
        i = self.rng.randrange(len(self.pool) - n)
        return self.pool[i:i + n]

    def prompt(self) -> list[int]:
        rng = self.rng
        n = rng.randint(1, self.max_prompt_len)
        if rng.random() < 0.6:
            p = rng.choice(self.prefixes)[: n]
            return p + self.tokens(n - len(p)) if n > len(p) else list(p)
        return self.tokens(n)

    def features(self, n: int) -> dict[str, Any]:
        """Random salt / LoRA / multimodal kwargs for an n-token prompt."""
        from prefixcache.core import MultiModalFeature  # noqa: PLC0415

        rng = self.rng
        kw: dict[str, Any] = {}
        if rng.random() < 0.3:
            kw["cache_salt"] = rng.choice(self.salts)
            if rng.random() < 0.3 and n > 1:
                kw["cache_salt_offset"] = rng.randrange(n)
        if rng.random() < 0.2:
            kw["lora"] = rng.choice(self.loras)
        if rng.random() < 0.25 and n >= 4:
            feats, pos = [], rng.randrange(n // 2)
            for _ in range(rng.randint(1, 2)):
                if pos >= n - 1:
                    break
                length = rng.randint(1, min(3 * self.bs, n - pos))
                feats.append(MultiModalFeature(rng.choice(self.images), pos, length))
                pos += length + rng.randint(0, self.bs)
            kw["mm_features"] = tuple(feats)
        return kw

    def make(self):
        from prefixcache.core import Request  # noqa: PLC0415

        prompt = self.prompt()
        self.num_made += 1
        return Request(f"m{self.num_made}", prompt, **self.features(len(prompt)))


def check_manager_config(mc) -> None:
    """ValueError on a bad ``config.manager`` block (before anything runs)."""
    for name in ("num_ops", "check_every", "block_size", "max_model_len", "num_blocks",
                 "max_running"):
        _positive(f"manager.{name}", mc[name])
    if mc.max_model_len < 2:
        raise ValueError(f"manager.max_model_len must be >= 2, got {mc.max_model_len}")
    if not 0 <= mc.warmup_fraction < 1:
        raise ValueError(f"manager.warmup_fraction must be in [0, 1), got {mc.warmup_fraction}")
    if not mc.rss_growth_limit > 0:
        raise ValueError(f"manager.rss_growth_limit must be > 0, got {mc.rss_growth_limit}")


def check_engine_config(ec) -> None:
    """ValueError on a bad ``config.engine`` block (before anything runs)."""
    for name in ("num_requests", "inflight", "block_size", "max_model_len", "max_prompt_len",
                 "max_tokens", "max_num_seqs", "max_num_batched_tokens", "check_every"):
        _positive(f"engine.{name}", ec[name])
    if not 0 < ec.pool_fraction <= 1:
        raise ValueError(f"engine.pool_fraction must be in (0, 1], got {ec.pool_fraction}")
    if ec.max_prompt_len + ec.max_tokens > ec.max_model_len:
        raise ValueError(f"engine: max_prompt_len + max_tokens ({ec.max_prompt_len} + "
                         f"{ec.max_tokens}) exceeds max_model_len={ec.max_model_len}")
    for name in ("abort_prob", "reject_prob", "salt_prob", "mm_prob", "lora_prob"):
        if not 0 <= ec[name] <= 1:
            raise ValueError(f"engine.{name} must be in [0, 1], got {ec[name]}")


_MANAGER_OPS = (  # (name, weight)
    ("admit", 22), ("step", 45), ("finish", 9), ("lookahead", 3), ("inspect", 10),
    ("stats", 3), ("bad_call", 3), ("preempt", 3), ("reset", 0.05),
)


def manager_soak(mc, *, seed: int, progress: bool = False) -> dict[str, Any]:
    """``mc.num_ops`` random manager operations; see the module docstring.

    Args:
      mc: the ``config.manager`` block: ``num_ops``, ``check_every``, ``num_blocks``,
        ``block_size``, ``max_model_len``, ``max_running``, ``hash_algo``,
        ``warmup_fraction``, ``rss_growth_limit``, ``rss_min_ops``.
      seed: the run's seed.

    Returns:
      The summary: op counts, invariant checks, hits, evictions, preemptions, resets,
      RSS samples ``[(ops, MiB)]``, the RSS growth after warm-up, seconds.

    Raises:
      SoakError, InvariantError: a check failed.
    """
    from prefixcache.core import KVCacheManager  # noqa: PLC0415

    check_manager_config(mc)
    num_ops, check_every = mc.num_ops, mc.check_every
    bs, max_len = mc.block_size, mc.max_model_len
    mgr = KVCacheManager(mc.num_blocks, bs, hash_algo=mc.hash_algo, enable_events=True,
                         max_model_len=max_len)
    rng = random.Random(seed)
    factory = _RequestFactory(rng, block_size=bs, max_prompt_len=max_len // 2)
    running: dict[str, Any] = {}  # request id -> Request holding blocks
    waiting: list = []  # preempted (or not admitted) requests: no blocks
    counts = {name: 0 for name, _ in _MANAGER_OPS}
    tally = {"admitted": 0, "readmitted": 0, "admit_refused": 0, "preempted": 0,
             "finished": 0, "resets_done": 0, "resets_refused": 0, "events": 0,
             "bad_calls_rejected": 0, "invariant_checks": 0, "decode_tokens": 0}
    names = [n for n, _ in _MANAGER_OPS]
    weights = [w for _, w in _MANAGER_OPS]

    def chunk(req) -> int:
        return min(req.num_tokens - req.num_computed_tokens, rng.choice((7, 64, 512)))

    def preempt(req) -> None:
        mgr.free(req)
        del running[req.request_id]
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        tally["preempted"] += 1
        waiting.append(req)
        if len(waiting) > 4 * mc.max_running:
            waiting.pop(0)  # dropped for good (holds no blocks)

    def finish(req) -> None:
        mgr.free(req if rng.random() < 0.5 else req.request_id)  # both forms are public
        del running[req.request_id]
        tally["finished"] += 1

    def admit() -> None:
        if len(running) >= mc.max_running:
            finish(running[rng.choice(list(running))])
            return
        readmit = waiting and rng.random() < 0.5
        req = waiting.pop(rng.randrange(len(waiting))) if readmit else factory.make()
        blocks, hit = mgr.get_computed_blocks(req)
        n = min(req.num_tokens - hit, rng.choice((16, 128, 1 << 20)))
        if mgr.allocate_slots(req, n, hit, blocks) is None:
            tally["admit_refused"] += 1
            waiting.append(req)
            return
        req.num_computed_tokens = hit + n
        running[req.request_id] = req
        tally["readmitted" if readmit else "admitted"] += 1

    def step(req) -> None:
        if req.num_computed_tokens == req.num_tokens:  # decode: the sampled token
            if req.num_tokens >= max_len:
                finish(req)
                return
            req.append_output_token_ids(rng.randrange(1, 32000))
            tally["decode_tokens"] += 1
        n = chunk(req)
        if mgr.allocate_slots(req, n) is None:
            preempt(running[rng.choice(list(running))])  # maybe itself
            return
        req.num_computed_tokens += n

    def lookahead(req) -> None:
        if req.num_computed_tokens < req.num_tokens:
            step(req)
            return
        k = rng.randint(1, 8)
        room = max_len - req.num_tokens
        if room < 1:
            finish(req)
            return
        req.append_output_token_ids(rng.randrange(1, 32000))
        if mgr.allocate_slots(req, 1, num_lookahead_tokens=min(k, room)) is None:
            preempt(req)
            return
        req.num_computed_tokens += 1

    def inspect() -> None:
        which = rng.randrange(8)
        if which == 0 and running:
            rid = rng.choice(list(running))
            ids = mgr.get_block_ids(rid)
            blocks = mgr.get_blocks(rid)
            if ids != [b.block_id for b in blocks]:
                raise SoakError(f"get_block_ids({rid!r}) != get_blocks ids")
        elif which == 1:
            if not 0.0 <= mgr.usage <= 1.0:
                raise SoakError(f"usage {mgr.usage}")
        elif which == 2:
            if len(mgr.free_block_ids()) != mgr.num_free_blocks:
                raise SoakError("free_block_ids() and num_free_blocks disagree")
        elif which == 3:
            mgr.cached_block_ids()
        elif which == 4:
            if sorted(mgr.running_request_ids) != sorted(running):
                raise SoakError("running_request_ids differ from the soak's running set")
        elif which == 5:
            mgr.counters()
        elif which == 6:
            mgr.num_evictions  # noqa: B018
        else:
            req = waiting[-1] if waiting else factory.make()
            mgr.get_computed_blocks(req)  # a lookup that changes no block state

    def bad_call() -> None:
        before = (mgr.num_free_blocks, len(mgr.running_request_ids), mgr.free_block_ids()[:4])
        which = rng.randrange(4)
        try:
            if which == 0:
                mgr.free(f"nobody-{rng.random()}")
            elif which == 1 and running:
                mgr.allocate_slots(running[rng.choice(list(running))], -1)
            elif which == 2 and running:
                req = running[rng.choice(list(running))]
                mgr.allocate_slots(req, 1, 16, [])  # hit tokens without hit blocks
            else:
                mgr.get_block_ids(f"nobody-{rng.random()}")
        except ValueError:
            tally["bad_calls_rejected"] += 1
        else:
            if which in (0, 3) or running:
                raise SoakError(f"bad call #{which} did not raise ValueError")
        after = (mgr.num_free_blocks, len(mgr.running_request_ids), mgr.free_block_ids()[:4])
        if after != before:
            raise SoakError(f"a rejected call changed state: {before} -> {after}")

    def reset() -> None:
        if running and rng.random() < 0.5:
            if mgr.reset_prefix_cache():
                raise SoakError("reset_prefix_cache succeeded while blocks are held")
            tally["resets_refused"] += 1
            return
        for rid in list(running):
            preempt(running[rid])
        if not mgr.reset_prefix_cache():
            raise SoakError("reset_prefix_cache refused with every request freed")
        if mgr.cached_block_ids():
            raise SoakError("blocks still cached after reset_prefix_cache")
        tally["resets_done"] += 1

    def check(ops_done: int) -> None:
        mgr.check_invariants()
        tally["invariant_checks"] += 1
        tally["events"] += len(mgr.take_events())
        rss.append((ops_done, current_rss_mib()))

    rss: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        bar = tqdm(total=num_ops, desc="manager soak", unit="op", mininterval=1.0)
    check(0)
    ops = rng.choices(range(len(names)), weights, k=num_ops)
    for i, op in enumerate(ops, 1):
        name = names[op]
        counts[name] += 1
        if name == "admit":
            admit()
        elif name in ("step", "finish", "lookahead", "preempt"):
            if not running:
                admit()
            else:
                req = running[rng.choice(list(running))]
                {"step": step, "finish": finish, "lookahead": lookahead,
                 "preempt": preempt}[name](req)
        elif name == "inspect":
            inspect()
        elif name == "stats":
            mgr.make_prefix_cache_stats()
            tally["events"] += len(mgr.take_events())
        elif name == "bad_call":
            bad_call()
        else:
            reset()
        if i % check_every == 0:
            check(i)
            if bar is not None:
                bar.update(check_every)
    if bar is not None:
        bar.close()
    for rid in list(running):
        finish(running[rid])
    check(num_ops)
    if mgr.num_free_blocks != mgr.num_blocks:
        raise SoakError(f"{mgr.num_blocks - mgr.num_free_blocks} blocks leaked after the "
                        "last free")
    seconds = time.perf_counter() - t0
    growth = rss_growth(rss, mc.warmup_fraction * num_ops)
    # NOTE: the hasher's memo (32K blocks) and plan caches fill during the first
    # ~150k operations (measured: RSS 53 -> 80 MiB, then flat within 0.2%), so a short
    # run reports its growth but only a run of rss_min_ops or more is held to the limit.
    rss_checked = num_ops >= mc.rss_min_ops and growth is not None
    if rss_checked and growth > mc.rss_growth_limit:
        raise SoakError(f"RSS grew by {growth:.1%} after warm-up (limit "
                        f"{mc.rss_growth_limit:.0%}): {rss}")
    c = mgr.counters()
    return {"part": "manager", "num_ops": num_ops, "op_counts": counts, **tally,
            "hit_tokens": c["hit_tokens"], "lookup_tokens": c["lookup_tokens"],
            "evictions": c["evictions"], "failed_allocations": c["failed_allocations"],
            "rss_mib": rss, "rss_growth_after_warmup": growth, "rss_checked": rss_checked,
            "seconds": seconds,
            "ops_per_s": num_ops / seconds}


def rss_growth(samples: list[tuple[int, float]], warmup_ops: float) -> float | None:
    """How far the RSS peak after the warm-up exceeds the peak up to its end (relative).

    NOTE: peak against peak, not against the sample at the warm-up's end: the hasher's
    memo is cleared whenever it reaches its bound, so the RSS saws between ~79 and
    ~81.5 MiB after the warm-up, and a single sample may land in a trough (3.2% then,
    for the same run that is 1.8% peak to peak). A leak still pushes the later peak
    up: 5% of ~80 MiB over 700k operations is ~6 bytes per operation.

    Args:
      samples: ``(operations done, RSS MiB)`` in order.
      warmup_ops: the operations of the warm-up.

    Returns:
      ``max(after) / max(up to warmup_ops) - 1``; None without samples on both sides.
    """
    before = [m for ops, m in samples if ops <= warmup_ops]
    after = [m for ops, m in samples if ops > warmup_ops]
    if not before or not after:
        return None
    return max(after) / max(before) - 1.0


# ----------------------------------------------------------------------------
# engine soak
# ----------------------------------------------------------------------------


def engine_soak(ec, *, seed: int, progress: bool = False) -> dict[str, Any]:
    """``ec.num_requests`` random requests through the tiny model's engine.

    Args:
      ec: the ``config.engine`` block: ``num_requests``, ``inflight``,
        ``pool_fraction``, ``block_size``, ``max_model_len``, ``max_prompt_len``,
        ``max_tokens``, ``max_num_seqs``, ``max_num_batched_tokens``, ``abort_prob``,
        ``reject_prob``, ``salt_prob``, ``mm_prob``, ``lora_prob``, ``check_every``.
      seed: the run's seed.

    Returns:
      The summary: outcomes by finish reason, preemptions, aborts, hit rate, pool and
      demand in blocks, steps, seconds.

    Raises:
      SoakError: a request lost or answered twice, a bad outcome, a leaked block.
    """
    from prefixcache.core import LoRARequest, MultiModalFeature, Request  # noqa: PLC0415
    from prefixcache.engine import Engine, SamplingParams  # noqa: PLC0415
    from prefixcache.model import ModelConfig  # noqa: PLC0415

    check_engine_config(ec)
    n_req, inflight = ec.num_requests, ec.inflight
    bs, max_len = ec.block_size, ec.max_model_len
    model_config = ModelConfig.tiny()
    vocab, d_model = model_config.vocab_size, model_config.d_model
    # Demand: the KV of `inflight` unfinished requests of mean size.
    mean_blocks = ((1 + ec.max_prompt_len) / 2 + (1 + ec.max_tokens) / 2) / bs
    demand = math.ceil(inflight * mean_blocks)
    largest = -(-(ec.max_prompt_len + ec.max_tokens) // bs)
    pool = max(math.ceil(ec.pool_fraction * demand), largest)
    engine = Engine(model_config, num_blocks=pool, block_size=bs, seed=seed,
                    max_num_seqs=ec.max_num_seqs,
                    max_num_batched_tokens=ec.max_num_batched_tokens, max_model_len=max_len,
                    lora_cache_key_only=True, token_buckets=tuple(ec.token_buckets) or None,
                    seq_buckets=(ec.max_num_seqs,), page_buckets=(-(-max_len // bs),))
    mgr = engine.kv_cache_manager
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    prefixes = [nprng.integers(1, vocab, int(n)).tolist()
                for n in nprng.integers(1, ec.max_prompt_len + 1, 6)]
    salts = ["t0", "t1", "t2"]
    loras = [LoRARequest("ad1", "/ad1", 1)]
    embeds = {f"img-{i}": nprng.standard_normal((3 * bs, d_model)).astype(np.float32)
              for i in range(3)}
    expect: dict[str, dict[str, Any]] = {}  # request id -> what it was sent with
    outcomes: dict[str, int] = {}
    seen: set[str] = set()
    aborts_sent = 0
    steps = 0

    def submit(i: int) -> None:
        rid = f"s{i}"
        n = rng.randint(1, ec.max_prompt_len)
        if rng.random() < 0.5:
            p = rng.choice(prefixes)[:n]
            prompt = p + nprng.integers(1, vocab, n - len(p)).tolist()
        else:
            prompt = nprng.integers(1, vocab, n).tolist()
        kw: dict[str, Any] = {}
        mm = None
        reject = None
        if rng.random() < ec.reject_prob:
            if rng.random() < 0.5:
                prompt = nprng.integers(1, vocab, max_len + 1).tolist()
                reject = "longer than max_model_len"
            else:
                prompt[rng.randrange(len(prompt))] = vocab + rng.randrange(100)
                reject = "outside the vocabulary"
        if rng.random() < ec.salt_prob:
            kw["cache_salt"] = rng.choice(salts)
            if rng.random() < 0.3 and len(prompt) > 1:
                kw["cache_salt_offset"] = rng.randrange(len(prompt))
        if rng.random() < ec.lora_prob:
            kw["lora"] = loras[0]
        if rng.random() < ec.mm_prob and len(prompt) >= 4 and reject is None:
            ident = rng.choice(sorted(embeds))
            length = rng.randint(1, min(3 * bs, len(prompt) - 1))
            off = rng.randrange(len(prompt) - length + 1)
            kw["mm_features"] = (MultiModalFeature(ident, off, length),)
            mm = {ident: embeds[ident][:length]}
        max_tokens = rng.randint(1, ec.max_tokens)
        stop = (rng.randrange(vocab),) if rng.random() < 0.2 else ()
        req = Request(rid, prompt, **kw)
        engine.add_request(req, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                               stop_token_ids=stop), mm_embeddings=mm)
        expect[rid] = {"max_tokens": max_tokens, "stop": stop, "reject": reject,
                       "prompt_len": len(prompt)}

    def take(out) -> None:
        rid = out.request_id
        if rid in seen:
            raise SoakError(f"request {rid} answered twice")
        seen.add(rid)
        e = expect.pop(rid)
        reason = out.finish_reason
        outcomes[reason] = outcomes.get(reason, 0) + 1
        if e["reject"] is not None:
            if reason != "error" or e["reject"] not in (out.error or ""):
                raise SoakError(f"{rid} should be rejected ({e['reject']}), got {reason!r}: "
                                f"{out.error!r}")
            return
        if reason == "error" or out.error is not None:
            raise SoakError(f"{rid} failed: {out.error!r}")
        n_out = len(out.token_ids)
        if reason == "length":
            if n_out != e["max_tokens"] and e["prompt_len"] + n_out != max_len:
                raise SoakError(f"{rid}: 'length' after {n_out} of {e['max_tokens']} tokens")
        elif reason == "stop":
            if not out.token_ids or out.token_ids[-1] not in e["stop"]:
                raise SoakError(f"{rid}: 'stop' without its stop token")
        elif reason != "abort":
            raise SoakError(f"{rid}: unknown finish reason {reason!r}")

    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        bar = tqdm(total=n_req, desc="engine soak", unit="req", mininterval=1.0)
    nxt = 0
    while nxt < n_req or engine.has_unfinished_requests():
        while nxt < n_req and len(expect) < inflight:
            submit(nxt)
            nxt += 1
        unfinished = engine.scheduler.requests
        if unfinished and rng.random() < ec.abort_prob:
            engine.abort_request(rng.choice(list(unfinished)))
            aborts_sent += 1
        for out in engine.step():
            take(out)
            if bar is not None:
                bar.update(1)
        steps += 1
        if steps % ec.check_every == 0:
            mgr.check_invariants()
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    if expect or len(seen) != n_req:
        raise SoakError(f"{len(expect)} requests never came back: {sorted(expect)[:10]}")
    mgr.check_invariants()
    held = engine.scheduler.block_tables.num_rows_in_use
    if mgr.num_free_blocks != pool or mgr.running_request_ids or held:
        raise SoakError(f"leak after the soak: {pool - mgr.num_free_blocks} blocks held, "
                        f"running {mgr.running_request_ids}, {held} block-table rows")
    m = engine.metrics()
    return {"part": "engine", "num_requests": n_req, "outcomes": outcomes,
            "aborts_sent": aborts_sent, "preemptions": m.num_preemptions,
            "evictions": m.num_evictions, "token_hit_rate": m.token_hit_rate,
            "peak_usage": m.peak_usage, "pool_blocks": pool, "demand_blocks": demand,
            "inflight": inflight, "steps": steps, "num_compiled_programs":
            m.num_compiled_programs, "seconds": seconds}


# ----------------------------------------------------------------------------
# plot + run
# ----------------------------------------------------------------------------


def plot(manager: dict | None, path, *, title: str) -> None:
    """RSS (MiB) over the manager soak's operations, warm-up end marked."""
    fig, axes = _common.new_figure(1, 1, figsize=(6, 3.5), squeeze=False)
    ax = axes[0][0]
    if manager is not None:
        ops, mib = zip(*manager["rss_mib"])
        ax.plot(ops, mib, ".-")
        ax.set_xlabel("manager operations")
        ax.set_ylabel("RSS (MiB)")
        ax.grid(alpha=0.3)
        g = manager["rss_growth_after_warmup"]
        ax.set_title(f"manager soak: {manager['num_ops']} ops, RSS growth after warm-up "
                     f"{'n/a' if g is None else f'{g:.1%}'}", fontsize=8)
    else:
        ax.set_title("manager soak not run", fontsize=8)
    fig.suptitle(title, fontsize=9)
    _common.save_plot(fig, path)


def run(config, *, progress: bool = False) -> dict:
    """Runs the enabled parts (long sizes with ``config.long``); writes results + PNG."""
    mc, ec = config.manager, config.engine
    if config.long:
        mc.num_ops, ec.num_requests = mc.long_num_ops, ec.long_num_requests
    if not (mc.enable or ec.enable):
        raise ValueError("nothing to run: manager.enable and engine.enable are both off")
    if mc.enable:
        check_manager_config(mc)
    if ec.enable:
        check_engine_config(ec)
    workdir = _common.prepare_workdir(config.workdir)
    # NOTE: provenance (git revision, dirty flag) taken before the run: the code that ran.
    prov = _common.provenance(config, seed=config.seed, hash_algo=mc.hash_algo)
    summary: dict[str, Any] = {"long": bool(config.long)}
    rows = []
    if mc.enable:
        summary["manager"] = manager_soak(mc, seed=config.seed, progress=progress)
        rows.append(summary["manager"])
    if ec.enable:
        summary["engine"] = engine_soak(ec, seed=config.seed, progress=progress)
        rows.append(summary["engine"])
    with _common.AtomicJsonlWriter(workdir / "results.jsonl", prov) as w:
        for r in rows:
            w.write({"record": "soak", **r})
    plot(summary.get("manager"), workdir / "soak_rss.png",
         title=f"soak ({'long' if config.long else 'short'}), seed {config.seed}")
    return summary


def main() -> None:
    _common.run_cli(run, config_name="soak")


if __name__ == "__main__":
    main()
