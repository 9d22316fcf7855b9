"""Token-budget scheduler: continuous batching with chunked prefill (DESIGN.md §3).

There are no prefill/decode phases: each tick gives every running request its next tokens
(one for a decoding request, a chunk for a prefilling one) within ``max_batched_tokens`` and
``max_num_seqs``. Decodes are served first so a long prompt cannot stall every stream's ITL;
then unfinished prefills continue; then waiting requests join FCFS, refilling freed slots. The
scheduler reaches the KV cache only through ``KVCacheManager``'s narrow API and only emits
state transitions; timings are derived elsewhere.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_pool import BlockAccountingError
from engine.config import EngineConfig
from engine.kv_manager import KVCacheManager
from engine.request import Request, RequestState


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

    def add(self, request: Request) -> None:
        """Queue an admitted request and reserve its KV if it fits now (FCFS: nobody reserves
        ahead of an earlier request that is still waiting for capacity)."""
        self.waiting.append(request)
        self._reserve_waiting()

    def remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def has_work(self) -> bool:
        """Anything a tick could schedule (BACKPRESSURED requests wait for their consumer)."""
        return bool(self.waiting) or any(
            r.state != RequestState.BACKPRESSURED for r in self.running)

    def _reserve_waiting(self) -> None:
        for req in self.waiting:
            if self.kv.has_reservation(req.request_id):
                continue
            if not self.kv.reserve(req.request_id, req.max_total_tokens):
                return

    def _allocate(self, req: Request, num_new: int) -> bool:
        return self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new) is not None

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_batched_tokens
        for req in self.running:
            if req.state == RequestState.DECODING and budget > 0:
                if not self._allocate(req, 1):
                    raise BlockAccountingError(f"no block for reserved request {req.request_id}")
                out.decodes.append(ScheduledSeq(req, 1))
                budget -= 1
        for req in self.running:  # BACKPRESSURED requests hold their KV but get no tokens
            if req.state in (RequestState.RUNNABLE, RequestState.PREFILLING) and budget > 0:
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                if not self._allocate(req, n):
                    raise BlockAccountingError(f"no block for reserved request {req.request_id}")
                out.prefills.append(ScheduledSeq(req, n))
                budget -= n
        self._reserve_waiting()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self.kv.has_reservation(req.request_id):
                break  # FCFS: the head waits for capacity, nobody overtakes it
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate(req, n):
                break
            self.waiting.popleft()
            self.running.append(req)
            req.transition(RequestState.RUNNABLE)
            out.prefills.append(ScheduledSeq(req, n))
            budget -= n
        return out
