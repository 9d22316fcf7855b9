"""Scheduling policies: which waiting request goes next and which running one yields.

The scheduler (``engine.scheduler``) owns its waiting and running sets and asks its policy two
questions: the order of the waiting queue (``key``: smallest first; a preempted request goes
back into the queue at its key) and, when a running request needs a KV block and none is left,
which running request not yet scheduled this tick gives its blocks up (``victim``). The head of
the queue waits for capacity and nobody overtakes it.

Only ``fcfs`` exists today (``EngineConfig.scheduling_policy``); priority, shortest-job-first
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


POLICIES: dict[str, type[SchedulingPolicy]] = {"fcfs": Fcfs}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; one of {', '.join(POLICIES)}") \
            from None
