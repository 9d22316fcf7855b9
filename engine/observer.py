"""What the engine reports: a finished request's state timeline and each step's stats.

The scheduler never computes a latency: it records state events, and the gateway's timing
owner (``tracing.timing``) turns the timeline into stage durations. Times are this process's
``time.monotonic_ns()``; consumers in another process receive offsets and durations, never raw
monotonic readings to subtract.
"""

from __future__ import annotations

from collections import deque

import msgspec

from engine.request import Request


class TimelineEvent(msgspec.Struct, frozen=True, array_like=True):
    """One state transition of a request, as it crosses to the gateway."""

    state: str  # RequestState name, or WAIT: a marker (why it waited; detail: the cause)
    at_ms: float  # since the request's engine arrival
    detail: str = ""
    holders: tuple[str, ...] = ()  # WAIT: the engine request ids it waited on


class RequestStats(msgspec.Struct, frozen=True):
    """A finished request's timeline and the facts it cannot show. Stage durations are not
    computed here: the gateway's one timing owner (``tracing.timing``) derives every stage
    from these events once they are placed on its clock. A msgspec struct: it crosses to the
    gateway as it is (``TokenDelta.stats``)."""

    events: tuple[TimelineEvent, ...]
    token_offsets_ms: tuple[float, ...]  # each generated token, relative to engine arrival
    cached_tokens: int = 0  # prompt tokens served by the prefix cache


class StepMember(msgspec.Struct, frozen=True, array_like=True):
    """One request's share of a step: its prefill chunk and/or its decode token."""

    request_id: str
    prefill_tokens: int
    decode_tokens: int


class StepStats(msgspec.Struct, frozen=True):
    """One engine tick; crosses to the gateway as it is (``StepReport.stats``)."""

    step: int
    wall_ns: int  # wall-clock timestamp of the step start (for records)
    duration_ms: float
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    forward_ms: float
    sample_ms: float
    host_ms: float
    # during this step: prompt tokens looked up in the prefix cache, tokens it served, cached
    # blocks evicted, requests preempted
    prefix_queries: int = 0
    prefix_hits: int = 0
    evictions: int = 0
    preemptions: int = 0
    members: tuple[StepMember, ...] = ()  # who ran in this step, and with how many tokens
    # the keys its prefill tokens attend to: each chunk's tokens x its context length at the
    # chunk's end (``prefill_context``): what a chunk costs beyond its token count grows with
    # the prompt already computed before it (the what-if's step cost reads it)
    prefill_context: int = 0


def request_stats(req: Request) -> RequestStats:
    if not req.events:
        raise ValueError(f"request {req.request_id} has no events")
    events = [TimelineEvent(e.state.name, (e.ts_ns - req.arrival_ns) / 1e6, e.detail)
              for e in req.events]
    if req.waits:  # markers between the transitions, in time order (ties: after them)
        events += [TimelineEvent("WAIT", (w.ts_ns - req.arrival_ns) / 1e6,
                                 f"{w.cause}: {w.detail}" if w.detail else w.cause, w.holders)
                   for w in req.waits]
        events.sort(key=lambda e: e.at_ms)
    return RequestStats(
        events=tuple(events),
        token_offsets_ms=tuple((t - req.arrival_ns) / 1e6 for t in req.token_times_ns),
        cached_tokens=req.num_cached_tokens)


class OutputObserver:
    """Collects step stats (bounded history) and finished requests' stats. Sinks (records,
    metrics) subscribe by subclassing or wrapping; the engine only calls these two hooks."""

    def __init__(self, history: int = 4096) -> None:
        self.steps: deque[StepStats] = deque(maxlen=history)
        self.finished: deque[tuple[str, RequestStats]] = deque(maxlen=history)

    def on_step(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def on_request_end(self, req: Request) -> RequestStats:
        stats = request_stats(req)
        self.finished.append((req.request_id, stats))
        return stats
