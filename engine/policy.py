"""Scheduling policies: which waiting request goes next and which running one yields.

The scheduler (``engine.scheduler``) owns its waiting and running sets and asks its policy two
questions: the order of the waiting queue (``key``: smallest first; a preempted request goes
back into the queue at its key) and, when a running request needs a KV block and none is left,
which running request not yet scheduled this tick gives its blocks up (``victim``). The head of
the queue waits for capacity and nobody overtakes it.

A policy whose keys change while requests wait (``dynamic = True``: ``fair``) is also told
when a request arrives (``arrive``, with the tenants that already have work) and what every
scheduled request ran (``charge``, prefill and decode tokens), and says how much service a
request's tenant has had (``served``: the order of prefill work); the scheduler re-sorts its
queue before it reads it and after each admission, when the policy's ``version`` moved, and
notes the first waiting request of a tenant that a later arrival of another tenant overtook as
waiting for "other tenants' share" (``share``). A policy with ``preempts_to_admit`` names the
running requests the head of the queue may preempt for a seat or KV (``yielding``).

Policies (``EngineConfig.scheduling_policy``): ``fcfs``, ``priority``, ``sjf`` and ``fair``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.request import Request


class SchedulingPolicy(Protocol):
    """Everything the scheduler asks of a policy, and what the gateway may ask of its class
    (``takes_priority``, ``predicts_length``) instead of branching on its name."""

    name: str
    dynamic: bool  # keys change while requests wait: ``arrive``, ``charge``, ``version``
    preempts_to_admit: bool  # the head of the queue may preempt ``yielding`` requests
    takes_priority: bool  # orders by a request's ``priority`` (the API field means something)
    predicts_length: bool  # orders by ``expected_tokens`` (the gateway predicts them)
    version: int  # moves whenever the queue's order may have changed (``dynamic``)

    def key(self, req: Request) -> tuple:
        """Position in the waiting queue (smallest first)."""
        ...

    def victim(self, candidates: Sequence[Request]) -> Request:
        """The running request (one of ``candidates``, never empty) that gives way."""
        ...

    def yielding(self, head: Request, running: Sequence[Request]) -> list[Request]:
        """The running requests the head of the queue may preempt for a seat or KV."""
        ...

    def arrive(self, req: Request, active: set[str]) -> None:
        """``req`` arrived while ``active`` tenants had work."""
        ...

    def charge(self, req: Request, prefill: int, decode: int) -> None:
        """``req`` was scheduled for these tokens this tick."""
        ...

    def served(self, req: Request) -> float:
        """The service ``req``'s tenant has had (the order of prefill work when dynamic)."""
        ...


class Policy:
    """What a policy does when it does not say otherwise: a static order, nobody preempted to
    admit, no accounting. Every policy below is one."""

    name = ""
    dynamic = False
    preempts_to_admit = False
    takes_priority = False
    predicts_length = False
    version = 0

    def key(self, req: Request) -> tuple:
        raise NotImplementedError

    def victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=self.key)

    def yielding(self, head: Request, running: Sequence[Request]) -> list[Request]:
        return []

    def arrive(self, req: Request, active: set[str]) -> None:
        pass

    def charge(self, req: Request, prefill: int, decode: int) -> None:
        pass

    def served(self, req: Request) -> float:
        return 0.0


class Fcfs(Policy):
    """First come, first served: the waiting queue in arrival order (a preempted request keeps
    its original arrival, so it resumes ahead of later ones), the latest arrival yields."""

    name = "fcfs"

    def key(self, req: Request) -> tuple:
        return (req.arrival_ns, req.seq)


class Priority(Policy):
    """Lower ``priority`` first (vLLM's convention), with aging: a request's place is its
    arrival time plus ``priority`` levels of ``aging_s`` each, so a priority-2 request queues as
    if it had arrived 2 aging periods later than it did. A constant stream of higher-priority
    requests therefore delays a lower one by at most (its priority - theirs) x ``aging_s``:
    nothing starves, and the key never changes while a request waits (the queue stays sorted).
    The running request that yields KV is the one with the largest key (lowest priority, then
    latest), and a request at the head of the queue that has no seat or cannot get KV takes
    them from running requests behind it in this order (``preempts_to_admit``)."""

    name = "priority"
    preempts_to_admit = True
    takes_priority = True

    def __init__(self, aging_s: float = 1.0) -> None:
        self.aging_ns = int(aging_s * 1e9)

    def key(self, req: Request) -> tuple:
        return (req.arrival_ns + req.params.priority * self.aging_ns, req.seq)

    def yielding(self, head: Request, running: Sequence[Request]) -> list[Request]:
        """The running requests the head of the queue may preempt: those behind it."""
        key = self.key(head)
        return [r for r in running if self.key(r) > key]


class ShortestJobFirst(Policy):
    """Shortest predicted job first, with aging: a request's place is its arrival time plus its
    expected output tokens (``SamplingParams.expected_tokens``: the gateway's running mean of
    its tenant's actual lengths on its endpoint, at most ``max_tokens``) at ``token_s`` each.
    A 500-token request therefore queues as if it had arrived 500 x ``token_s`` later, and a
    constant stream of short requests delays it by at most (its tokens - theirs) x ``token_s``:
    nothing starves, and the key never changes while a request waits. The running request
    that yields KV is the one with the largest key (the longest expected, then latest)."""

    name = "sjf"
    predicts_length = True

    def __init__(self, token_s: float = 0.01) -> None:
        self.token_ns = int(token_s * 1e9)

    def key(self, req: Request) -> tuple:
        return (req.arrival_ns + req.params.expected_tokens * self.token_ns, req.seq)


class FairShare(Policy):
    """Per-tenant fair share of the engine's tokens: the Virtual Token Counter of Sheng et al.,
    "Fairness in Serving Large Language Models" (OSDI 2024). Each tenant has a counter of the
    service it got: every prefill token scheduled for it adds 1, every decode token ``decode_cost``
    (the paper's w_q/w_p, 2 by default: a decode token holds a sequence in the batch for a whole
    step, more than a token of a batched prefill costs), divided by the tenant's ``weight`` (its
    share; ``SamplingParams.weight``, from the tenants file). The waiting queue is ordered by
    counter, then arrival: the tenant that got least goes next, and a tenant's own requests stay in
    arrival order. A tenant that had nothing waiting or running comes back one token below the
    lowest counter of those that do (so its request goes next, ahead of the earlier arrivals of a
    tenant at that counter; at the highest of all counters when nobody has work), so an idle tenant
    cannot bank credit and then flood, and a light tenant's occasional request is not queued behind
    a flood. The running request that yields KV belongs to the tenant with the highest counter (then
    the latest arrival). Nothing starves: a waiting tenant's counter stands still while every served
    tenant's grows.

    More: docs/design/engine-notes.md#enginepolicyfairshare."""

    name = "fair"
    dynamic = True
    preempts_to_admit = True

    def __init__(self, decode_cost: float = 2.0, seats: int = 64) -> None:
        self.decode_cost = decode_cost
        self.seats = seats  # max_num_seqs
        self.counters: dict[str, float] = {}
        self.version = 0  # bumped whenever the queue's order may have changed

    def served(self, req: Request) -> float:
        return self.counters.get(req.params.tenant, 0.0)

    def key(self, req: Request) -> tuple:
        return (self.served(req), req.arrival_ns, req.seq)

    def yielding(self, head: Request, running: Sequence[Request]) -> list[Request]:
        """Running requests of tenants above their share of the seats, if the head's tenant
        is below its own."""
        held: dict[str, int] = {}
        weight: dict[str, float] = {head.params.tenant: head.params.weight}
        for r in running:
            held[r.params.tenant] = held.get(r.params.tenant, 0) + 1
            weight[r.params.tenant] = r.params.weight
        total = sum(weight.values())

        def share(t: str) -> float:
            return self.seats * weight[t] / total

        if held.get(head.params.tenant, 0) + 1 > share(head.params.tenant):
            return []
        return [r for r in running if held[r.params.tenant] > share(r.params.tenant)]

    def arrive(self, req: Request, active: set[str]) -> None:
        tenant = req.params.tenant
        self.counters.setdefault(tenant, 0.0)  # a counter ``charge`` compares others' with
        if tenant in active:
            return
        if active:
            floor = min(self.counters.get(t, 0.0) for t in active) - 1.0
        else:
            floor = max(self.counters.values(), default=0.0)
        if floor > self.counters.get(tenant, 0.0):
            self.counters[tenant] = floor
            self.version += 1

    def charge(self, req: Request, prefill: int, decode: int) -> None:
        """Add the tokens to the tenant's counter. The queue's order (counter, then arrival)
        changes only where the counter reaches or passes another tenant's (a tenant's own
        requests keep their order), so only then does ``version`` move: under a flood the
        scheduler would otherwise re-sort hundreds of waiting requests every tick (~70 us a
        tick with 300 waiting, a few percent of a small model's step)."""
        tenant = req.params.tenant
        old = self.counters.get(tenant, 0.0)
        new = old + (prefill + self.decode_cost * decode) / req.params.weight
        self.counters[tenant] = new
        if new > old and any(old <= c <= new for t, c in self.counters.items() if t != tenant):
            self.version += 1


POLICIES: dict[str, type[Policy]] = {"fcfs": Fcfs, "priority": Priority, "sjf": ShortestJobFirst,
                             "fair": FairShare}


def make_policy(name: str, aging_s: float = 1.0, token_s: float = 0.01,
                decode_cost: float = 2.0, seats: int = 64) -> SchedulingPolicy:
    if name == "priority":
        return Priority(aging_s)
    if name == "sjf":
        return ShortestJobFirst(token_s)
    if name == "fair":
        return FairShare(decode_cost, seats)
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; one of {', '.join(POLICIES)}") \
            from None
