"""Token-budget scheduler: continuous batching with chunked prefill and preemption
(docs/design/architecture.md).

There are no prefill/decode phases: each tick gives every running request its next tokens
(one for a decoding request, a chunk for a prefilling one) within ``max_batched_tokens`` and
``max_num_seqs``. By default (``budget_split: decode_first``) decodes are served first so a
long prompt cannot stall every stream's ITL (``prefill_first`` and ``decode_reserve`` trade
that for TTFT); then unfinished prefills continue; then waiting requests join in the order of
the scheduling policy (``engine.policy``; FCFS: arrival order, and preempted requests keep
their original arrival), refilling freed slots, the head of the queue waiting for capacity
with nobody overtaking it. The scheduler owns its waiting and running sets, reaches the KV
cache only through ``KVCacheManager``'s narrow API and only emits state transitions; timings
are derived elsewhere.

More: docs/design/engine-notes.md#enginescheduler."""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field

from engine.block_pool import BlockAccountingError
from engine.config import EngineConfig
from engine.kv_manager import KVCacheManager
from engine.policy import SchedulingPolicy, make_policy
from engine.request import Request, RequestState, WaitNote

S = RequestState


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int


@dataclass(frozen=True, slots=True)
class Preemption:
    request: Request
    mode: str  # "recompute" or "swap"
    blocks: int  # KV blocks it gave up (swap: copied to host memory)


@dataclass(slots=True)
class SchedulerOutput:
    decodes: list[ScheduledSeq] = field(default_factory=list)
    prefills: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Preemption] = field(default_factory=list)  # already carried out

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.prefills)

    @property
    def all(self) -> list[ScheduledSeq]:
        return self.decodes + self.prefills


def prefill_context(sched: SchedulerOutput) -> int:
    """The keys the step's prefill tokens attend to: each chunk's tokens x the context at the
    chunk's end (read before the step runs). The engine records it with the step and the
    what-if's step cost prices it: chunk k of a long prompt costs more than chunk 1."""
    return sum(s.num_new_tokens * (s.request.num_computed_tokens + s.num_new_tokens)
               for s in sched.prefills)


class Scheduler:
    """Owns the waiting queue (in its policy's order) and the running set; ``schedule`` returns
    what runs this tick and which requests it preempted (their KV already released or queued
    for a copy to host memory: ``KVCacheManager.swap_out``)."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 policy: SchedulingPolicy | None = None) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy or make_policy(config.scheduling_policy, config.priority_aging_s,
                                            config.sjf_token_s, config.fair_decode_cost,
                                            config.max_num_seqs)
        self.dynamic = self.policy.dynamic  # keys change while waiting
        self._sorted = -1  # the policy version the queue was last sorted at
        self.waiting: list[Request] = []  # in policy.key order
        self.running: list[Request] = []
        self.watermark = max(1, kv.pool.num_blocks // 100)
        self._seq = itertools.count()

    # ---- the sets (the engine changes them only through these) ----------------------------
    def add(self, request: Request) -> None:
        """Queue an admitted request and reserve its KV if it fits now (with a head-of-line
        policy, nobody reserves ahead of an earlier request still waiting for capacity)."""
        request.seq = next(self._seq)
        self._arrive(request)
        self._wait(request)
        self._reserve_waiting()

    def add_running(self, request: Request) -> None:
        """A request that already holds its KV (a forked branch) joins the running set."""
        request.seq = next(self._seq)
        self.running.append(request)

    def add_waiting(self, request: Request) -> None:
        """A request that must wait for KV without a reservation attempt now (a branch that
        did not fit: PREEMPTED, it recomputes when admitted)."""
        request.seq = next(self._seq)
        self._arrive(request)
        self._wait(request)

    def remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _wait(self, request: Request) -> None:
        bisect.insort_right(self.waiting, request, key=self.policy.key)

    def _arrive(self, request: Request) -> None:
        """A dynamic policy hears of an arrival with the tenants that already have work."""
        if self.dynamic:
            self.policy.arrive(request, {r.params.tenant
                                         for r in (*self.waiting, *self.running)})

    def _order(self) -> None:
        """Re-sort the queue where the policy's keys move while requests wait, if they moved
        since the last sort (``policy.version``; stable: ties keep their order)."""
        if self.dynamic and self._sorted != self.policy.version:
            self.waiting.sort(key=self.policy.key)
            self._sorted = self.policy.version

    def _ran(self, req: Request, n: int, decode: bool, scheduled: set[str],
             out: SchedulerOutput) -> None:
        """``req`` runs ``n`` tokens this tick: in the output, and charged to its tenant."""
        (out.decodes if decode else out.prefills).append(ScheduledSeq(req, n))
        scheduled.add(req.request_id)
        if self.dynamic:
            self.policy.charge(req, 0 if decode else n, n if decode else 0)

    def has_work(self) -> bool:
        """Anything a tick could schedule (BACKPRESSURED requests wait for their consumer)."""
        return bool(self.waiting) or any(
            r.state != RequestState.BACKPRESSURED for r in self.running)

    def _reserve_tokens(self, req: Request) -> int:
        if self.config.preemption == "off":
            return req.max_total_tokens
        return req.num_tokens

    def _reserve_waiting(self) -> None:
        self._order()
        # holders no running request accounts for: waiting ones (and any other holder, which
        # only makes the scan below run when it need not); 0 skips that scan, which would
        # otherwise read the whole queue every tick that KV is short
        others = self.kv.num_holders - sum(
            1 for r in self.running if self.kv.has_reservation(r.request_id))
        for i, req in enumerate(self.waiting):
            if self.kv.has_reservation(req.request_id):
                others -= 1
                continue
            if self._admit(req):  # one holder more, and it is this one: others as it was
                continue
            if others <= 0:
                return
            # FCFS: a preempted request requeued ahead of later arrivals that already hold
            # reservations would wait on them forever; they give theirs back (their cached
            # blocks stay in the prefix cache) and queue behind it.
            later = [r for r in self.waiting[i + 1:]
                     if self.kv.has_reservation(r.request_id) and r.state != S.SWAPPED]
            for r in later:
                self.kv.free(r.request_id)
                r.num_computed_tokens = 0
            others -= len(later)
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
            self.kv.swap_in(req.request_id, req.swapped_kv)  # copied back before the forward
            req.swapped_kv, req.swapped_blocks = None, 0
            return True
        if req.branch_parent is not None:
            return False  # a branch is forked from its parent, never admitted on its own
        cached = self.kv.admit(req.request_id, req.all_token_ids, self._reserve_tokens(req),
                               req.cache_salt, headroom=headroom,
                               use_cache=req.params.prompt_logprobs is None)
        if cached is None:
            return False
        req.num_computed_tokens = cached
        if req.state in (S.QUEUED, S.DEGRADED):
            req.num_cached_tokens = cached
        return True

    def _allocate(self, req: Request, num_new: int, scheduled: set[str],
                  out: SchedulerOutput) -> bool:
        """Slots for ``num_new`` more tokens, preempting requests not scheduled this tick (the
        policy's choice) if needed. False when ``req`` itself had to give way."""
        while self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new) is None:
            if self.config.preemption == "off":
                raise BlockAccountingError(f"no block for reserved request {req.request_id}")
            if req not in self.running:
                return False  # a waiting request waits; it never preempts a running one
            victim = self.policy.victim(
                [r for r in self.running if r.request_id not in scheduled])
            out.preempted.append(self._preempt(victim))
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> Preemption:
        """Release a running request's KV so another can grow; it waits again at its place."""
        mode = self.config.preemption
        if mode == "auto":
            mode = "recompute" if req.num_computed_tokens <= self.config.max_batched_tokens \
                else "swap"
        if mode == "swap" and req.state in (S.PREFILLING, S.DECODING, S.BACKPRESSURED,
                                            S.RESUMED) and req.num_computed_tokens:
            n = self.kv.blocks_needed(req.num_computed_tokens)
            req.swapped_kv, req.swapped_blocks = self.kv.swap_out(req.request_id, n), n
            req.transition(S.SWAPPED, f"{n} blocks to host memory")
        else:
            mode, n = "recompute", len(self.kv.block_table(req.request_id).blocks)
            self.kv.free(req.request_id)
            req.transition(S.PREEMPTED, f"recompute {req.num_tokens} tokens")
            req.num_computed_tokens = 0
        self.running.remove(req)
        self._wait(req)
        return Preemption(req, mode, n)

    def schedule(self) -> SchedulerOutput:
        """One tick. The budget split (``EngineConfig.budget_split``) decides who gets the
        token budget first: ``decode_first`` (every decoding request's next token, then the
        running prefills' chunks, then admissions), ``prefill_first`` (running prefills and
        admissions, then decodes with what is left: better TTFT, worse ITL under load) or
        ``decode_reserve`` (prefill first, but ``decode_reserve_tokens`` of the budget are kept
        for decodes)."""
        out = SchedulerOutput()
        budget = self.config.max_batched_tokens
        scheduled: set[str] = set()
        self._order()
        self._make_room_for_head(out)
        split = self.config.budget_split
        if split == "decode_first":
            budget = self._decodes(budget, scheduled, out)
            budget, blocked = self._prefill_phase(budget, scheduled, out)
        else:
            decoding = sum(r.state == S.DECODING for r in self.running)
            reserve = 0 if split == "prefill_first" else min(
                self.config.decode_reserve_tokens, decoding, budget)
            budget, blocked = self._prefill_phase(budget - reserve, scheduled, out)
            budget = self._decodes(budget + reserve, scheduled, out)
        if self.waiting and self.config.step_detail:
            self._note_waits(blocked or ("budget" if budget <= 0 else "seqs"), out)
        return out

    def _make_room_for_head(self, out: SchedulerOutput) -> None:
        """Under a policy that says so (``preempts_to_admit``: priority, fair), the head of
        the queue that has no seat (``max_num_seqs`` running) or cannot get KV takes them from
        running requests the policy lets it preempt (``yielding``: behind it in its order),
        the policy's victim first, before anything is scheduled this tick (they wait again at
        their place: behind it)."""
        if not self.policy.preempts_to_admit or not self.waiting \
                or self.config.preemption == "off":
            return
        head = self.waiting[0]
        if head.state == S.SWAPPED or head.branch_parent is not None:
            return
        while len(self.running) >= self.config.max_num_seqs or not (
                self.kv.has_reservation(head.request_id) or self._admit(head)):
            behind = self.policy.yielding(head, self.running)
            if not behind:
                return
            out.preempted.append(self._preempt(self.policy.victim(behind)))

    def _decodes(self, budget: int, scheduled: set[str], out: SchedulerOutput) -> int:
        for req in list(self.running):
            if req.state == S.DECODING and budget > 0 and req in self.running:
                if self._allocate(req, 1, scheduled, out):
                    self._ran(req, 1, True, scheduled, out)
                    budget -= 1
        return budget

    def _prefill_phase(self, budget: int, scheduled: set[str], out: SchedulerOutput
                       ) -> tuple[int, str]:
        """The running prefills' chunks, then waiting requests join in the policy's order.
        Under a dynamic policy (fair) the two are merged in the policy's order instead: a
        tenant below its share joins ahead of the chunks of a long prompt of a tenant above
        it (and at an equal share a waiting request joins before a running prompt's next
        chunk), so the prefill budget is shared fairly too. Returns the budget left and why the
        head of the queue stays (``kv``, or "" when it was the budget or the seats)."""
        if not self.dynamic:
            for req in list(self.running):
                if budget <= 0:
                    break
                budget = self._prefill(req, budget, scheduled, out)
            return self._join(budget, scheduled, out)
        self._reserve_waiting()
        pending = [r for r in self.running if self._prefilling(r, scheduled)]
        blocked = None
        while budget > 0:
            pending = [r for r in pending if self._prefilling(r, scheduled)]
            nxt = min(pending, key=self.policy.key, default=None)
            if self.waiting and blocked is None and (  # at an equal share, a new one first
                    nxt is None or self.policy.served(self.waiting[0]) <= self.policy.served(nxt)):
                budget, blocked = self._join_head(budget, scheduled, out)
            elif nxt is not None:
                budget = self._prefill(nxt, budget, scheduled, out)
                pending.remove(nxt)
            else:
                break
        return budget, "kv" if blocked == "kv" else ""

    def _prefilling(self, req: Request, scheduled: set[str]) -> bool:
        """A running request with prompt (or recomputed) tokens to go, not scheduled yet
        (BACKPRESSURED requests hold their KV and get no tokens)."""
        return req.state in (S.RUNNABLE, S.PREFILLING, S.RESUMED) and req in self.running \
            and req.request_id not in scheduled

    def _prefill(self, req: Request, budget: int, scheduled: set[str],
                 out: SchedulerOutput) -> int:
        """A running request's next prefill chunk, if it is one that has any."""
        if self._prefilling(req, scheduled):
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self._allocate(req, n, scheduled, out):
                self._ran(req, n, False, scheduled, out)
                budget -= n
        return budget

    def _join(self, budget: int, scheduled: set[str], out: SchedulerOutput
              ) -> tuple[int, str]:
        """Waiting requests join in the policy's order; returns the budget left and why the
        head of the queue stays (``kv``, or "" when it was the budget or the seats)."""
        self._reserve_waiting()
        while self.waiting and budget > 0:
            budget, blocked = self._join_head(budget, scheduled, out)
            if blocked is not None:
                return budget, "kv" if blocked == "kv" else ""
        return budget, ""

    def _join_head(self, budget: int, scheduled: set[str], out: SchedulerOutput
                   ) -> tuple[int, str | None]:
        """The head of the queue joins the running set if it can; returns the budget left
        and None, or why it stays: ``seqs`` (no seat) or ``kv`` (FCFS: the head waits for
        capacity, nobody overtakes it)."""
        if len(self.running) >= self.config.max_num_seqs:
            return budget, "seqs"
        req = self.waiting[0]
        if not self.kv.has_reservation(req.request_id):
            return budget, "kv"
        if req.state == S.SWAPPED:  # copied back in: runs from the next tick on
            self.waiting.pop(0)
            self.running.append(req)
            req.transition(S.RESUMED, "swapped in")
            if self.config.step_detail:
                self._note(req, "step", "copied back in; runs from the next tick")
            if req.output_token_ids:  # else it was mid-prefill: RESUMED -> PREFILLING
                req.transition(S.DECODING)
            return budget, None
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if not self._allocate(req, n, scheduled, out):
            return budget, "kv"
        self.waiting.pop(0)
        self.running.append(req)
        req.wait_cause = None
        req.transition(S.RESUMED if req.state == S.PREEMPTED else S.RUNNABLE)
        self._ran(req, n, False, scheduled, out)
        self._order()  # its tenant was charged: its other requests may fall back
        return budget - n, None

    # ---- why the waiting requests wait --------------------------------------------------
    def _note(self, req: Request, cause: str, detail: str = "",
              holders: tuple[str, ...] = (), now: int | None = None) -> None:
        req.wait_cause = cause
        req.waits.append(WaitNote(time.monotonic_ns() if now is None else now, cause, detail,
                                  holders))

    def _note_waits(self, head: str, out: SchedulerOutput) -> None:
        """A note for each waiting request whose binding constraint changed this tick: the
        head's (``head``) for everyone, except that behind a head waiting for KV the others
        wait on the head (head of line), and that under a dynamic policy (fair) the first
        waiting request of a tenant that a later arrival of another tenant overtook (it runs,
        or waits ahead of it) waits for "other tenants' share"; the rest of that tenant's
        queue waits behind its own first request, on the head's cause. (Noting every one of a
        flooding tenant's queued requests each time a light tenant's request passed them would
        flip hundreds of notes per tick for no more insight.) Details and holders are worked
        out once per tick, only when some request needs them."""
        now = time.monotonic_ns()
        why: dict[str, tuple[str, tuple[str, ...]]] = {}
        first = self.waiting[0]
        rest = head if head != "kv" else "hol"  # the cause of all but the head and the firsts
        running: dict[str, int] = {}  # tenant -> latest arrival running
        ahead: dict[str, int] = {}  # tenant -> latest arrival ahead in the queue
        if self.dynamic:
            for r in self.running:
                t = r.params.tenant
                running[t] = max(running.get(t, r.arrival_ns), r.arrival_ns)
        # this loop runs every tick over the whole queue (hundreds under a flood): it reads
        # each request once, and only a tenant's first waiting request compares arrivals (a
        # tenant's own queue is in arrival order, so its latest arrival ahead is its last one)
        for i, req in enumerate(self.waiting):
            cause = head if i == 0 else rest
            if self.dynamic:
                tenant, arrival = req.params.tenant, req.arrival_ns
                if tenant not in ahead and (
                        any(a > arrival for t, a in ahead.items() if t != tenant)
                        or any(a > arrival for t, a in running.items() if t != tenant)):
                    cause = "share"
                ahead[tenant] = arrival
            if cause == req.wait_cause:
                continue
            if cause == "share":
                self._note(req, cause, *self._overtaken_by(req, i), now=now)
                continue
            if cause not in why:
                why[cause] = self._why(cause, out, first)
            self._note(req, cause, *why[cause], now=now)

    def _overtaken_by(self, req: Request, i: int) -> tuple[str, tuple[str, ...]]:
        later = [r for r in (*self.running, *self.waiting[:i])
                 if r.arrival_ns > req.arrival_ns and r.params.tenant != req.params.tenant]
        tenants = sorted({r.params.tenant or "(none)" for r in later})
        return (f"{len(later)} later requests of tenants {', '.join(tenants[:3])} run or wait "
                "ahead of it by fair share", tuple(r.request_id for r in later[:3]))

    def _why(self, cause: str, out: SchedulerOutput, head: Request
             ) -> tuple[str, tuple[str, ...]]:
        if cause == "budget":
            top = sorted(out.all, key=lambda s: -s.num_new_tokens)[:3]
            return (f"{self.config.max_batched_tokens} tokens went to {len(out.all)} requests "
                    f"({out.num_prefill_tokens} prefill, {len(out.decodes)} decode)",
                    tuple(s.request.request_id for s in top))
        if cause == "kv":
            usage = self.kv.usage()
            held = sorted(((len(self.kv.block_table(r.request_id).blocks), r.request_id)
                           for r in self.running), reverse=True)[:3]
            return (f"{usage.blocks_total - usage.blocks_used} of {usage.blocks_total} KV "
                    f"blocks free, {len(self.running)} running", tuple(r for _, r in held))
        if cause == "seqs":
            return f"max_num_seqs ({self.config.max_num_seqs}) requests running", ()
        return "behind the head of the queue, which waits for KV", (head.request_id,)
