"""Scheduling policies: which waiting request goes next and which running one yields.

The scheduler (``engine.scheduler``) owns its waiting and running sets and asks its policy two
questions: the order of the waiting queue (``key``: smallest first; a preempted request goes
back into the queue at its key) and, when a running request needs a KV block and none is left,
which running request not yet scheduled this tick gives its blocks up (``victim``). The head of
the queue waits for capacity and nobody overtakes it.

Policies (``EngineConfig.scheduling_policy``): ``fcfs`` and ``priority``; shortest-job-first
and per-tenant fair share plug in here as further classes in ``POLICIES``.
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
    latest)."""

    name = "priority"

    def __init__(self, aging_s: float = 1.0) -> None:
        self.aging_ns = int(aging_s * 1e9)

    def key(self, req: Request) -> tuple:
        return (req.arrival_ns + req.params.priority * self.aging_ns, req.seq)

    def victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=self.key)


POLICIES: dict[str, type] = {"fcfs": Fcfs, "priority": Priority}


def make_policy(name: str, aging_s: float = 1.0) -> SchedulingPolicy:
    if name == "priority":
        return Priority(aging_s)
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; one of {', '.join(POLICIES)}") \
            from None
