"""Scheduling policies: which waiting request goes next and which running one yields.

The scheduler (``engine.scheduler``) owns its waiting and running sets and asks its policy two
questions: the order of the waiting queue (``key``: smallest first; a preempted request goes
back into the queue at its key) and, when a running request needs a KV block and none is left,
which running request not yet scheduled this tick gives its blocks up (``victim``). The head of
the queue waits for capacity and nobody overtakes it.

A policy whose keys change while requests wait (``dynamic = True``: ``fair``) is also told
when a request arrives (``arrive``, with the tenants that already have work) and what every
scheduled request ran (``charge``, prefill and decode tokens), and says how much service a
request's tenant has had (``served``: the order of prefill work); the scheduler re-sorts its queue
before it reads it and after each admission, and notes a waiting request that a later arrival
of another tenant overtook as waiting for "other tenants' share" (``share``).

Policies (``EngineConfig.scheduling_policy``): ``fcfs``, ``priority``, ``sjf`` and ``fair``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.request import Request


class SchedulingPolicy(Protocol):
    name: str

    def key(self, req: Request) -> tuple:
        """Position in the waiting queue (smallest first)."""
        ...

    def victim(self, candidates: Sequence[Request]) -> Request:
        """The running request (one of ``candidates``, never empty) that gives way."""
        ...


class Fcfs:
    """First come, first served: the waiting queue in arrival order (a preempted request keeps
    its original arrival, so it resumes ahead of later ones), the latest arrival yields."""

    name = "fcfs"

    def key(self, req: Request) -> tuple:
        return (req.arrival_ns, req.seq)

    def victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=self.key)


class Priority:
    """Lower ``priority`` first (vLLM's convention), with aging: a request's place is its
    arrival time plus ``priority`` levels of ``aging_s`` each, so a priority-2 request queues as
    if it had arrived 2 aging periods later than it did. A constant stream of higher-priority
    requests therefore delays a lower one by at most (its priority - theirs) x ``aging_s``:
    nothing starves, and the key never changes while a request waits (the queue stays sorted).
    The running request that yields KV is the one with the largest key (lowest priority, then
    latest), and a request at the head of the queue that cannot get KV takes it from running
    requests behind it in this order (``preempts_to_admit``)."""

    name = "priority"
    preempts_to_admit = True

    def __init__(self, aging_s: float = 1.0) -> None:
        self.aging_ns = int(aging_s * 1e9)

    def key(self, req: Request) -> tuple:
        return (req.arrival_ns + req.params.priority * self.aging_ns, req.seq)

    def victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=self.key)


class ShortestJobFirst:
    """Shortest predicted job first, with aging: a request's place is its arrival time plus its
    expected output tokens (``SamplingParams.expected_tokens``: the gateway's running mean of
    its tenant's actual lengths on its endpoint, at most ``max_tokens``) at ``token_s`` each.
    A 500-token request therefore queues as if it had arrived 500 x ``token_s`` later, and a
    constant stream of short requests delays it by at most (its tokens - theirs) x ``token_s``:
    nothing starves, and the key never changes while a request waits. The running request
    that yields KV is the one with the largest key (the longest expected, then latest)."""

    name = "sjf"

    def __init__(self, token_s: float = 0.01) -> None:
        self.token_ns = int(token_s * 1e9)

    def key(self, req: Request) -> tuple:
        return (req.arrival_ns + req.params.expected_tokens * self.token_ns, req.seq)

    def victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=self.key)


class FairShare:
    """Per-tenant fair share of the engine's tokens: the Virtual Token Counter of Sheng et al.,
    "Fairness in Serving Large Language Models" (OSDI 2024). Each tenant has a counter of the
    service it got: every prefill token scheduled for it adds 1, every decode token
    ``decode_cost`` (the paper's w_q/w_p; decode tokens cost more per token on a GPU, and
    about as much on a CPU at small batch), divided by the tenant's ``weight`` (its share;
    ``SamplingParams.weight``, from the tenants file). The waiting queue is ordered by counter,
    then arrival: the tenant that got least goes next, and a tenant's own requests stay in
    arrival order. A tenant that had nothing waiting or running comes back at the lowest
    counter of those that do (at the highest of all when nobody does), so an idle tenant cannot
    bank credit and then flood. The running request that yields KV belongs to the tenant with
    the highest counter (then the latest arrival). Nothing starves: a waiting tenant's counter
    stands still while every served tenant's grows."""

    name = "fair"
    dynamic = True

    def __init__(self, decode_cost: float = 2.0) -> None:
        self.decode_cost = decode_cost
        self.counters: dict[str, float] = {}

    def served(self, req: Request) -> float:
        return self.counters.get(req.params.tenant, 0.0)

    def key(self, req: Request) -> tuple:
        return (self.served(req), req.arrival_ns, req.seq)

    def victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=self.key)

    def arrive(self, req: Request, active: set[str]) -> None:
        tenant = req.params.tenant
        if tenant in active:
            return
        floor = min((self.counters.get(t, 0.0) for t in active), default=None)
        if floor is None:
            floor = max(self.counters.values(), default=0.0)
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def charge(self, req: Request, prefill: int, decode: int) -> None:
        tenant = req.params.tenant
        self.counters[tenant] = self.counters.get(tenant, 0.0) + \
            (prefill + self.decode_cost * decode) / req.params.weight


POLICIES: dict[str, type] = {"fcfs": Fcfs, "priority": Priority, "sjf": ShortestJobFirst,
                             "fair": FairShare}


def make_policy(name: str, aging_s: float = 1.0, token_s: float = 0.01,
                decode_cost: float = 2.0) -> SchedulingPolicy:
    if name == "priority":
        return Priority(aging_s)
    if name == "sjf":
        return ShortestJobFirst(token_s)
    if name == "fair":
        return FairShare(decode_cost)
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; one of {', '.join(POLICIES)}") \
            from None
