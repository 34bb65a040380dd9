"""The scheduler: decides which tokens of which requests run in the next step.

It drives the `KVCacheManager` exactly the way vLLM's v1 scheduler does
(`vllm/v1/core/sched/scheduler.py`, FCFS policy, no speculative decoding, no KV
connector):

1. Running requests first, in admission order. Each gets
   `min(num_tokens - num_computed_tokens, token_budget)` tokens (chunked prefill for
   long prompts, one token per decode step). If `allocate_slots` returns None, the
   newest running request is preempted by recompute (blocks freed, num_computed_tokens
   reset to 0, put back at the *front* of the waiting queue) and the allocation is
   retried, until it fits or the request has preempted itself.
2. Then, only if nothing was preempted in this step, waiting requests in the order of
   the scheduling policy (`prefixcache.scheduling`: FCFS by default, or longest cached
   prefix first, ...) while the budget and `max_num_seqs` allow: a prefix lookup
   (`get_computed_blocks`) for requests with no computed tokens, then
   `allocate_slots(req, num_new_tokens, num_hit_tokens, hit_blocks)`. The first one that
   does not fit stops admission for this step.
3. At the end of `schedule()` every scheduled request's `num_computed_tokens` is
   advanced by its scheduled count (the manager never advances it).

A request that cannot fit even with the whole pool to itself (it does not fit while no
other request holds a block) is finished with an error; the others go on.

The scheduler never touches the pool's internals: it only uses the manager's public
methods (`get_computed_blocks`, `allocate_slots`, `free`).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from prefixcache.core.eviction import policy_clock, reads_waiting_queue
from prefixcache.core.kv_groups import is_hybrid
from prefixcache.engine.block_table import BlockTables
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.scheduling import WaitingPolicy, make_scheduling_policy

if TYPE_CHECKING:  # pragma: no cover
    from prefixcache.core import KVCacheManager, Request


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Finish reasons (vLLM's strings, plus "error" for rejected requests).
FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_ERROR = "error"
FINISH_ABORT = "abort"


@dataclasses.dataclass(eq=False)
class EngineRequest:
    """Engine-side state of one request: the core `Request` plus decoding state.

    Invariants:
      - `status == RUNNING` iff the request is in the scheduler's running list (and then
        it holds KV blocks in the manager); `WAITING` iff it is in the waiting queue
        (holding no blocks); `FINISHED` once it left both for good.
      - `num_cached_tokens` is the prefix-cache hit of the request's *first* admission
        (vLLM's `num_cached_tokens`); re-admissions after preemption do not change it.

    Attributes:
      request: the core request (prompt, output tokens, block hashes,
        num_computed_tokens).
      params: its sampling parameters.
      seed: the sampling seed actually used (params.seed or one derived by the engine).
      mm_embeddings: identifier -> f32[length, d_model] embedding rows of each
        multimodal item of the request (the core's `MultiModalFeature` carries
        identifier, offset, length only).
      status, finish_reason, error: lifecycle; error is set for finish_reason "error".
      arrival_time, first_scheduled_time, first_token_time, finish_time:
        `time.perf_counter()` stamps (None until they happen).
      num_cached_tokens: prefix hit of the first admission.
      num_preemptions: times it was preempted by recompute.
      admitted: whether it was ever scheduled.
      block_row: its row in the scheduler's `BlockTables` while it is running (None
        otherwise).
      text: the engine's text state of a request with stop strings (None otherwise; the
        scheduler never reads it).
      miss_reasons: reason -> missed blocks, summed over its admissions (first and
        after each preemption), when the engine accounts misses (None otherwise).
    """

    request: "Request"
    params: SamplingParams
    seed: int
    mm_embeddings: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    admitted: bool = False
    block_row: int | None = None
    text: Any = None
    miss_reasons: dict | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_tokens - self.request.num_prompt_tokens


@dataclasses.dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
      state: the request.
      num_computed_tokens: tokens with KV before this step (cache hit included).
      num_new_tokens: tokens scheduled in this step (the query length).
      new_block_ids: block ids newly allocated for it in this step (prefix-hit blocks
        excluded; the full table is `Scheduler.block_ids` or
        `KVCacheManager.get_block_ids`); with KV cache groups (a hybrid manager) a
        tuple of such lists, one per group.
      num_cached_tokens: prefix-cache hit counted at this admission (0 for a request
        that was already running).
    """

    state: EngineRequest
    num_computed_tokens: int
    num_new_tokens: int
    new_block_ids: list[int]
    num_cached_tokens: int = 0

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def completes_sequence(self) -> bool:
        """True when this step computes the request's last known token (so it samples)."""
        return (self.num_computed_tokens + self.num_new_tokens
                == self.state.request.num_tokens)


@dataclasses.dataclass
class SchedulerOutput:
    """What one `schedule()` call decided.

    Attributes:
      scheduled: running requests first (in running order), then new admissions.
      preempted_request_ids: requests preempted (by recompute) in this step.
      finished: requests finished by the scheduler itself in this step (errors).
    """

    scheduled: list[ScheduledRequest]
    preempted_request_ids: list[str]
    finished: list[EngineRequest]

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_new_tokens for s in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def new_block_ids(self) -> dict[str, list[int]]:
        return {s.request_id: s.new_block_ids for s in self.scheduled}

    @property
    def num_cached_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_cached_tokens for s in self.scheduled}


def _core_request(state: "EngineRequest") -> "Request":
    return state.request


class Scheduler:
    """Scheduler with chunked prefill, prefix lookup and preemption by recompute.

    Invariants:
      - `running` is in admission order; the newest running request is `running[-1]`
        and is the first preemption victim.
      - `waiting` is FCFS; preempted requests go back to its front. The policy only
        changes the order in which it is admitted from (FCFS: unchanged).
      - Every running request holds its blocks in the manager; no waiting request does.
      - A step schedules at most `max_num_batched_tokens` tokens and at most
        `max_num_seqs` requests are running.
      - `block_tables` row `state.block_row` of every running request equals the
        manager's `get_block_ids(request_id)` (kept from what `allocate_slots` and
        `get_computed_blocks` return; released on preemption and finish).
      - With KV cache groups (a manager with `kv_cache_groups`: sliding-window or
        hybrid models), `kv_group_tables[g]` holds group g's tables, all groups' rows
        at the same index (`block_tables` is `kv_group_tables[0]`), and row
        `state.block_row` of group g equals `get_block_ids(request_id)[g]`: a
        sliding-window group's slots before the window of the next token hold the
        padding page id (the manager's null slots, released to the cache).

    Args:
      kv_cache_manager: the block manager (`prefixcache.core.KVCacheManager`).
      max_num_seqs: the most requests running at once (>= 1).
      max_num_batched_tokens: the token budget of one step (>= 1).
      max_model_len: a request stops (finish reason "length") once it holds this many
        tokens.
      scheduling_policy: the waiting queue's admission order, a name of
        ``prefixcache.scheduling`` (``fcfs``: vLLM's, the default; ``lpm``;
        ``dfs_weight``) or a ``WaitingPolicy``.
      max_loras: None (no LoRA limit, the default), or the most distinct LoRA adapters
        among the running requests (the engine's adapter slots, as vLLM's max_loras): a
        waiting request whose adapter would exceed it is skipped this step (it keeps its
        place; later requests may be admitted).
    """

    def __init__(self, kv_cache_manager: "KVCacheManager", *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 scheduling_policy: "str | WaitingPolicy" = "fcfs",
                 max_loras: int | None = None):
        for name, value in (("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.policy = (scheduling_policy if isinstance(scheduling_policy, WaitingPolicy)
                       else make_scheduling_policy(scheduling_policy))
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        if max_loras is not None and (not isinstance(max_loras, int)
                                      or isinstance(max_loras, bool) or max_loras < 1):
            raise ValueError(f"max_loras must be None or a positive int, got {max_loras!r}")
        self.max_loras = max_loras
        self.waiting: collections.deque[EngineRequest] = collections.deque()
        self.running: list[EngineRequest] = []
        # An eviction policy that reads the waiting queue (queue_aware): the manager
        # hears of each request joining it (admission drops it there); None otherwise.
        self._queue_watch = None
        # (a layout whose manager has no waiting hooks is refused with such a policy by
        # the composition rule, prefixcache.core.indexes, before the manager is built)
        # (the device's policy or the host tier's: eviction.reads_waiting_queue)
        if reads_waiting_queue(kv_cache_manager):
            self._queue_watch = kv_cache_manager
        # A time-varying eviction policy (ttl_lru): told the wall clock (seconds since
        # this scheduler started, time.monotonic) and the steps so far before each step
        # schedules. None: no clock.
        self._set_time = policy_clock(kv_cache_manager)
        self._t0 = time.monotonic()
        # Block residency (``prefixcache.core.residency.ManagerResidency``, set by the
        # engine; None: off, no cost): fed at admissions, frees and each step's start.
        self.residency = None
        self.requests: dict[str, EngineRequest] = {}
        self.num_preemptions = 0
        self.num_steps = 0
        # Miss accounting (``prefixcache.core.misses.MissAccountant``; None: off, no cost)
        self.miss_accountant = None
        # NOTE: engine-side int32 block tables, appended from allocate_slots' new blocks,
        # so a step never rebuilds whole tables from the manager (see block_table.py).
        self.block_tables = BlockTables(max_num_seqs, pad_id=kv_cache_manager.num_blocks)
        # KV cache groups (hybrid manager): one BlockTables per group, and each group's
        # sliding window (None: full attention). None for the plain manager.
        groups = kv_cache_manager.kv_cache_groups
        self.kv_group_tables: tuple[BlockTables, ...] | None = None
        self._group_windows: tuple[int | None, ...] = ()
        if is_hybrid(groups):
            self._group_windows = tuple(g.spec.sliding_window for g in groups)
            self.kv_group_tables = (self.block_tables,) + tuple(
                BlockTables(max_num_seqs, pad_id=kv_cache_manager.num_blocks)
                for _ in groups[1:])

    # -- queue management -------------------------------------------------------------

    def add_request(self, state: EngineRequest) -> None:
        """Queues a request at the back of the waiting queue.

        Raises:
          ValueError: a request with this id is already unfinished in the scheduler.
        """
        rid = state.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in the scheduler")
        if state.status is not RequestStatus.WAITING:
            raise ValueError(f"request {rid!r} has status {state.status}, expected WAITING")
        self.requests[rid] = state
        self.waiting.append(state)
        if self._queue_watch is not None:
            self._announce_waiting(state.request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish_request(self, state: EngineRequest, reason: str,
                       error: str | None = None) -> None:
        """Finishes a request: leaves the queues and frees its blocks (they stay cached)."""
        if state.status is RequestStatus.FINISHED:
            return
        if state.status is RequestStatus.RUNNING:
            self.running.remove(state)
            self._free(state.request)
            self._release_row(state)
        else:
            self.waiting.remove(state)
            self.policy.forget(state.request)
            if self._queue_watch is not None:
                self._queue_watch.drop_waiting(state.request_id)
        state.status = RequestStatus.FINISHED
        state.finish_reason = reason
        state.error = error
        state.finish_time = time.perf_counter()
        del self.requests[state.request_id]

    def _free(self, req) -> None:
        """The manager's ``free``, and the release reported to the residency feed."""
        res = self.residency
        if res is None:
            self.kv_cache_manager.free(req)
            return
        keys = res.release_keys(req)
        self.kv_cache_manager.free(req)
        res.released(keys, time.monotonic() - self._t0)

    def abort_request(self, request_id: str) -> EngineRequest:
        """Finishes an unfinished request with reason "abort".

        Raises:
          ValueError: no unfinished request has this id.
        """
        if request_id not in self.requests:
            raise ValueError(f"no unfinished request with id {request_id!r}")
        state = self.requests[request_id]
        self.finish_request(state, FINISH_ABORT)
        return state

    def _preempt(self, state: EngineRequest) -> None:
        # NOTE: preemption by recompute, as vLLM: the blocks go back to the free queue
        # (still cached, so re-admission usually hits its own prefix again).
        assert state.status is RequestStatus.RUNNING, state.request_id
        if self.miss_accountant is not None:  # (its computed blocks, before the free)
            self.miss_accountant.preempted(state.request)
        self._free(state.request)
        self._release_row(state)
        state.request.num_computed_tokens = 0
        # The core request's count makes the manager file its next prefix lookup under
        # the preempted stats (vLLM's PrefixCacheStats.preempted_*).
        state.request.num_preemptions += 1
        state.status = RequestStatus.WAITING
        state.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(state)
        if self._queue_watch is not None:
            self._announce_waiting(state.request)

    def _announce_waiting(self, req) -> None:
        """Tell the manager's queue-aware policy the blocks ``req`` can hit."""
        mgr = self._queue_watch
        req.bind_hasher(mgr.hasher, mgr.block_size)
        mgr.on_waiting(req.request_id,
                       req.block_hashes[: (req.num_tokens - 1) // mgr.block_size])

    def _release_row(self, state: EngineRequest) -> None:
        if state.block_row is not None:
            if self.kv_group_tables is None:
                self.block_tables.release(state.block_row)
            else:
                for t in self.kv_group_tables:
                    t.release(state.block_row)
            state.block_row = None

    def _add_group_rows(self, hit_blocks, new_blocks, num_computed: int) -> tuple[int, tuple]:
        """Hybrid manager: a new row in every group's table (hit + new block ids);
        returns (row, the new ids per group)."""
        row = None
        for g, t in enumerate(self.kv_group_tables):
            hit = [b.block_id for b in hit_blocks.blocks[g]] if hit_blocks is not None else []
            r = t.add_row(hit)
            assert row is None or r == row, (r, row)  # the groups' rows move in lockstep
            row = r
        return row, self._append_group_blocks(row, new_blocks, num_computed)

    def _append_group_blocks(self, row: int, new_blocks, num_computed: int) -> tuple:
        """Hybrid manager: appends each group's new blocks to its row and nulls the
        sliding-window slots the manager released in that `allocate_slots` call (the
        blocks wholly before the window of token `num_computed`: vLLM's
        `remove_skipped_blocks`, `num_computed - W + 1` tokens, whole blocks only)."""
        ids = tuple([b.block_id for b in blocks] for blocks in new_blocks.blocks)
        bs = self.kv_cache_manager.block_size
        for t, w, new in zip(self.kv_group_tables, self._group_windows, ids):
            if new:
                t.append(row, new)
            if w is not None and num_computed >= w:
                skipped = min((num_computed - w + 1) // bs, int(t.lengths[row]))
                t.table[row, :skipped] = t.pad_id
        return ids

    def block_ids(self, request_id: str) -> list[int]:
        """A running request's block table from `block_tables` (inspection and tests).

        Raises:
          ValueError: no running request has this id.
        """
        state = self.requests.get(request_id)
        if state is None or state.block_row is None:
            raise ValueError(f"no running request with id {request_id!r}")
        if self.kv_group_tables is not None:  # one list per KV cache group
            return tuple(t.block_ids(state.block_row) for t in self.kv_group_tables)
        return self.block_tables.block_ids(state.block_row)

    def _too_large_error(self, state: EngineRequest, num_tokens: int) -> str:
        mgr = self.kv_cache_manager
        return (f"request {state.request_id!r} needs KV for {num_tokens} tokens "
                f"({-(-num_tokens // mgr.block_size)} blocks of {mgr.block_size}) but "
                f"the whole pool has {mgr.num_blocks} blocks")

    # -- scheduling ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decides the next step (see the module docstring for the policy).

        Returns:
          The step's SchedulerOutput; the scheduled requests' num_computed_tokens are
          already advanced when it returns.
        """
        mgr = self.kv_cache_manager
        if self._set_time is not None:
            self._set_time(time.monotonic() - self._t0, self.num_steps)
        if self.residency is not None:  # (the last step's decode blocks, at this time)
            self.residency.drain(time.monotonic() - self._t0)
        tables = self.block_tables
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        finished: list[EngineRequest] = []

        # 1. Running requests.
        running = self.running
        allocate = mgr.allocate_slots
        grouped = self.kv_group_tables is not None
        i = 0
        while i < len(running) and budget > 0:
            state = running[i]
            req = state.request
            num_computed = req.num_computed_tokens
            num_new = req.num_tokens - num_computed
            if num_new > budget:
                num_new = budget
            assert num_new > 0, (state.request_id, req.num_tokens, num_computed)
            new_blocks = allocate(req, num_new)
            while new_blocks is None:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is state:
                    break
                new_blocks = allocate(req, num_new)
            if new_blocks is None:
                if not self.running:
                    # Nothing else holds a block: it can never fit.
                    self.finish_request(state, FINISH_ERROR,
                                        self._too_large_error(state, num_computed + num_new))
                    finished.append(state)
                break
            if grouped:
                new_ids = self._append_group_blocks(state.block_row, new_blocks, num_computed)
            elif new_blocks.blocks[0]:
                new_ids = [b.block_id for b in new_blocks.blocks[0]]
                tables.append(state.block_row, new_ids)
            else:
                new_ids = []
            scheduled.append(ScheduledRequest(state, num_computed, num_new, new_ids))
            budget -= num_new
            i += 1

        # 2. Waiting requests (not in a step that preempted, as vLLM), in the waiting
        # policy's order (FCFS: the queue itself).
        if not preempted and self.waiting:
            policy = self.policy
            if policy.is_fcfs and self.max_loras is None:
                while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                    left = self._admit(self.waiting[0], budget, scheduled, finished)
                    if left is None:
                        break
                    budget = left
            else:
                budget = self._admit_in_order(budget, scheduled, finished)

        # 3. Advance num_computed_tokens (the manager never does).
        for s in scheduled:
            s.state.request.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
        assert budget >= 0
        assert len(self.running) <= self.max_num_seqs
        self.num_steps += 1
        return SchedulerOutput(scheduled, preempted, finished)

    def _admit_in_order(self, budget: int, scheduled: list, finished: list) -> int:
        """Admission in the waiting policy's order (the plain FCFS queue without LoRA
        limits takes the loop in `schedule`). With `max_loras`, a request whose adapter
        would make more than `max_loras` distinct adapters run at once is skipped (vLLM's
        scheduler skips them the same way); the first request that does not fit stops
        admission. Returns the budget left."""
        limit = self.max_loras
        active = None if limit is None else {
            (r.request.lora.name, r.request.lora.path) for r in self.running
            if r.request.lora is not None}
        policy = self.policy
        fcfs = list(self.waiting)
        order = fcfs if policy.is_fcfs else policy.order(fcfs, _core_request,
                                                         self.kv_cache_manager)
        admitted = []
        for state in order:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            key = None
            if limit is not None and state.request.lora is not None:
                lora = state.request.lora
                key = (lora.name, lora.path)
                if key not in active and len(active) >= limit:
                    continue  # no adapter slot this step: it waits
            n_running = len(self.running)
            left = self._admit(state, budget, scheduled, finished)
            if left is None:
                break
            if len(self.running) > n_running:
                admitted.append(state)
                if key is not None:
                    active.add(key)
            budget = left
        if not policy.is_fcfs:
            policy.after_admission(fcfs, admitted, _core_request)
        return budget

    def _admit(self, state: EngineRequest, budget: int, scheduled: list,
               finished: list) -> int | None:
        """Tries to admit the waiting ``state`` with ``budget`` tokens left.

        Returns:
          The budget left (unchanged when the request was finished with an error
          because it can never fit), or ``None`` when it does not fit now (admission
          stops for this step).
        """
        mgr = self.kv_cache_manager
        req = state.request
        if req.num_computed_tokens == 0:
            hit_blocks, num_hit = mgr.get_computed_blocks(req)
        else:  # pragma: no cover - waiting requests never keep computed tokens
            hit_blocks, num_hit = None, req.num_computed_tokens
        acct = self.miss_accountant
        if acct is not None:  # (before the allocation changes the cache)
            reasons = acct.lookup(req, num_hit)
        num_new = min(req.num_tokens - num_hit, budget)
        assert num_new > 0, (state.request_id, req.num_tokens, num_hit)
        res = self.residency
        if res is not None:
            host_before = res.host_hit_tokens()
        new_blocks = mgr.allocate_slots(
            req, num_new, num_new_computed_tokens=num_hit,
            new_computed_blocks=hit_blocks)
        if new_blocks is None:
            if not self.running:
                # The whole pool is free (or evictable) and it still does not fit.
                self.finish_request(state, FINISH_ERROR,
                                    self._too_large_error(state, num_hit + num_new))
                finished.append(state)
                return budget
            return None
        self.waiting.remove(state)
        self.running.append(state)
        state.status = RequestStatus.RUNNING
        if res is not None:
            res.admitted(req, num_hit, time.monotonic() - self._t0, host_before,
                         hit_blocks)
        req.num_computed_tokens = num_hit
        if acct is not None:
            acct.admit(req, num_hit, reasons)
            if state.miss_reasons is None:
                state.miss_reasons = {}
            mr = state.miss_reasons
            for r, v in reasons.items():
                mr[r] = mr.get(r, 0) + v
        if not state.admitted:
            state.admitted = True
            state.num_cached_tokens = num_hit
            state.first_scheduled_time = time.perf_counter()
        if self.kv_group_tables is not None:
            state.block_row, new_ids = self._add_group_rows(hit_blocks, new_blocks, num_hit)
            scheduled.append(ScheduledRequest(state, num_hit, num_new, new_ids, num_hit))
            return budget - num_new
        new_ids = [b.block_id for b in new_blocks.blocks[0]]
        hit = hit_blocks.blocks[0] if hit_blocks is not None else ()
        state.block_row = self.block_tables.add_row(
            [b.block_id for b in hit] + new_ids if hit else new_ids)
        scheduled.append(ScheduledRequest(state, num_hit, num_new, new_ids, num_hit))
        return budget - num_new

    def update_from_output(self, output: SchedulerOutput,
                           sampled_token_ids: dict[str, int]) -> list[EngineRequest]:
        """Appends sampled tokens and finishes requests that stop.

        Args:
          output: the SchedulerOutput the step ran.
          sampled_token_ids: request id -> sampled token, for every scheduled request
            whose step completed its sequence (`completes_sequence`); others are ignored.

        Returns:
          The requests that finished in this update (in scheduled order).
        """
        now = time.perf_counter()
        finished = []
        running = RequestStatus.RUNNING
        max_model_len = self.max_model_len
        for s in output.scheduled:
            state = s.state
            req = state.request
            num_tokens = req.num_tokens
            if (state.status is not running
                    or s.num_computed_tokens + s.num_new_tokens != num_tokens):
                continue  # mid-prefill chunk: its logits are not a next-token prediction
            token = int(sampled_token_ids[req.request_id])
            req.append_output_token_ids(token)
            num_tokens += 1
            if state.first_token_time is None:
                state.first_token_time = now
            # NOTE: the order follows vLLM's check_stop: stop tokens, then length.
            params = state.params
            if token in params.stop_token_ids:
                reason = FINISH_STOP
            elif (num_tokens >= max_model_len
                  or num_tokens - req.num_prompt_tokens >= params.max_tokens):
                reason = FINISH_LENGTH
            else:
                continue
            self.finish_request(state, reason)
            finished.append(state)
        return finished

    def stats(self) -> dict[str, Any]:
        return {"num_preemptions": self.num_preemptions, "num_steps": self.num_steps,
                "num_running": len(self.running), "num_waiting": len(self.waiting)}

    def preempt_all_running(self) -> list[str]:
        """Preempts every running request by recompute (the engine's recovery after a
        failed model step); newest first, so the waiting queue's front keeps their
        admission order. Returns their ids in that order."""
        ids = []
        while self.running:
            state = self.running.pop()
            self._preempt(state)
            ids.append(state.request_id)
        return ids
