"""Token-budget scheduler: continuous batching with chunked prefill and preemption
(DESIGN.md §3; the seed tutorial §4).

There are no prefill/decode phases: each tick gives every running request its next tokens
(one for a decoding request, a chunk for a prefilling one) within ``max_batched_tokens`` and
``max_num_seqs``. Decodes are served first so a long prompt cannot stall every stream's ITL;
then unfinished prefills continue; then waiting requests join in arrival order (preempted ones
are waiting requests too, and keep their original arrival), refilling freed slots. The scheduler
reaches the KV cache only through ``KVCacheManager``'s narrow API and only emits state
transitions; timings are derived elsewhere.

Preemption. Unless ``preemption="off"`` (admission then reserves prompt + max_tokens, so a
running request can always grow), admission reserves only a request's prompt, and a running
request that needs a block when none is unpromised takes one from the lowest-priority request
not yet scheduled this tick: the latest arrival (possibly itself, which then sits the tick out
and is preempted). The victim is preempted by

- recompute: its blocks are freed (its full blocks stay in the prefix cache, so the re-prefill
  is mostly cache hits unless they were evicted meanwhile) and it re-prefills prompt + output;
- swap: its computed blocks are copied to host memory and freed, and copied back into fresh
  blocks when it resumes, with nothing recomputed;
- auto: recompute when the tokens to redo fit in one tick's budget (``max_batched_tokens``: one
  forward, at most as costly as the tick it was going to get anyway), swap otherwise (a copy of
  ``2 x layers x tokens x kv_heads x head_dim`` elements each way, far cheaper than a
  multi-tick re-prefill).

Admission leaves a watermark of free blocks (1% of the pool, at least one) while anything is
running, so new arrivals do not take the blocks the running requests are about to need.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_pool import BlockAccountingError
from engine.config import EngineConfig
from engine.kv_manager import KVCacheManager
from engine.request import Request, RequestState

S = RequestState


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    decodes: list[ScheduledSeq] = field(default_factory=list)
    prefills: list[ScheduledSeq] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.prefills)

    @property
    def all(self) -> list[ScheduledSeq]:
        return self.decodes + self.prefills


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.watermark = max(1, kv.pool.num_blocks // 100)
        # set by the engine: preempt a victim (state, KV copies) / copy a swapped one back in
        self.on_preempt: Callable[[Request], None] | None = None
        self.on_swap_in: Callable[[Request, list[int]], None] | None = None

    def add(self, request: Request) -> None:
        """Queue an admitted request and reserve its KV if it fits now (FCFS: nobody reserves
        ahead of an earlier request that is still waiting for capacity)."""
        self.waiting.append(request)
        self._reserve_waiting()

    def requeue(self, request: Request) -> None:
        """A preempted request waits again, in arrival order (ahead of later arrivals)."""
        self.running.remove(request)
        i = 0
        while i < len(self.waiting) and self.waiting[i].arrival_ns <= request.arrival_ns:
            i += 1
        self.waiting.insert(i, request)

    def remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def has_work(self) -> bool:
        """Anything a tick could schedule (BACKPRESSURED requests wait for their consumer)."""
        return bool(self.waiting) or any(
            r.state != RequestState.BACKPRESSURED for r in self.running)

    def _reserve_tokens(self, req: Request) -> int:
        if self.config.preemption == "off":
            return req.max_total_tokens
        return req.num_tokens

    def _reserve_waiting(self) -> None:
        for i, req in enumerate(self.waiting):
            if self.kv.has_reservation(req.request_id):
                continue
            if self._admit(req):
                continue
            # FCFS: a preempted request requeued ahead of later arrivals that already hold
            # reservations would wait on them forever; they give theirs back (their cached
            # blocks stay in the prefix cache) and queue behind it.
            later = [r for r in list(self.waiting)[i + 1:]
                     if self.kv.has_reservation(r.request_id) and r.state != S.SWAPPED]
            for r in later:
                self.kv.free(r.request_id)
                r.num_computed_tokens = 0
            if later and self._admit(req):
                continue
            return

    def _admit(self, req: Request) -> bool:
        headroom = self.watermark if self.running and self.config.preemption != "off" else 0
        if req.state == S.SWAPPED:
            table = self.kv.admit_blocks(req.request_id, req.swapped_blocks,
                                         self._reserve_tokens(req), headroom)
            if table is None:
                return False
            self.on_swap_in(req, table.blocks)
            return True
        if req.branch_parent is not None:
            return False  # a branch is forked from its parent, never admitted on its own
        cached = self.kv.admit(req.request_id, req.all_token_ids, self._reserve_tokens(req),
                               req.cache_salt, headroom=headroom)
        if cached is None:
            return False
        req.num_computed_tokens = cached
        if req.state == S.QUEUED:
            req.num_cached_tokens = cached
        return True

    def _allocate(self, req: Request, num_new: int, scheduled: set[str]) -> bool:
        """Slots for ``num_new`` more tokens, preempting lower-priority requests not scheduled
        this tick if needed. False when ``req`` itself had to give way."""
        while self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new) is None:
            if self.config.preemption == "off":
                raise BlockAccountingError(f"no block for reserved request {req.request_id}")
            if req not in self.running:
                return False  # a waiting request waits; it never preempts a running one
            victims = [r for r in self.running if r.request_id not in scheduled]
            victim = max(victims, key=lambda r: (r.arrival_ns, r.request_id))
            self.on_preempt(victim)
            if victim is req:
                return False
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_batched_tokens
        scheduled: set[str] = set()
        for req in list(self.running):
            if req.state == S.DECODING and budget > 0 and req in self.running:
                if self._allocate(req, 1, scheduled):
                    out.decodes.append(ScheduledSeq(req, 1))
                    scheduled.add(req.request_id)
                    budget -= 1
        for req in list(self.running):  # BACKPRESSURED requests hold their KV, get no tokens
            if req.state in (S.RUNNABLE, S.PREFILLING, S.RESUMED) and budget > 0 \
                    and req in self.running and req.request_id not in scheduled:
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                if self._allocate(req, n, scheduled):
                    out.prefills.append(ScheduledSeq(req, n))
                    scheduled.add(req.request_id)
                    budget -= n
        self._reserve_waiting()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self.kv.has_reservation(req.request_id):
                break  # FCFS: the head waits for capacity, nobody overtakes it
            if req.state == S.SWAPPED:  # copied back in: runs from the next tick on
                self.waiting.popleft()
                self.running.append(req)
                req.transition(S.RESUMED, "swapped in")
                if req.output_token_ids:  # else it was mid-prefill: RESUMED -> PREFILLING
                    req.transition(S.DECODING)
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate(req, n, scheduled):
                break
            self.waiting.popleft()
            self.running.append(req)
            req.transition(S.RESUMED if req.state == S.PREEMPTED else S.RUNNABLE)
            out.prefills.append(ScheduledSeq(req, n))
            scheduled.add(req.request_id)
            budget -= n
        return out
