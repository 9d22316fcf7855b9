"""The one place where events become numbers: per-request stage timings and per-step stats.

Request stage timings are derived from the state events alone (time spent in each state), so
the scheduler never computes a latency. Times are this process's ``time.monotonic_ns()``;
consumers in another process receive durations, never raw monotonic readings to subtract.
"""

from __future__ import annotations

from collections import deque

import msgspec

from engine.request import Request, RequestState

S = RequestState
_STAGES = {
    "queue_ms": (S.QUEUED, S.DEGRADED),
    "prefill_ms": (S.RUNNABLE, S.PREFILLING),
    "decode_ms": (S.DECODING, S.BACKPRESSURED),
    "preempted_ms": (S.PREEMPTED, S.SWAPPED, S.RESUMED),
}


class RequestStats(msgspec.Struct, frozen=True):
    """Stage durations; ``e2e_ms == admit_ms + queue_ms + prefill_ms + decode_ms +
    preempted_ms`` holds exactly (every interval between events belongs to one stage).
    A msgspec struct: it crosses to the gateway as it is (``TokenDelta.stats``)."""

    admit_ms: float  # engine arrival -> admission decision (first event)
    queue_ms: float
    prefill_ms: float
    decode_ms: float
    preempted_ms: float
    preemptions: int
    ttft_ms: float | None  # engine arrival -> first token sampled
    e2e_ms: float  # engine arrival -> terminal state
    token_offsets_ms: tuple[float, ...]  # each generated token, relative to engine arrival
    cached_tokens: int = 0  # prompt tokens served by the prefix cache


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


def request_stats(req: Request) -> RequestStats:
    if not req.events:
        raise ValueError(f"request {req.request_id} has no events")
    in_state: dict[RequestState, int] = {}
    for ev, nxt in zip(req.events, req.events[1:], strict=False):
        in_state[ev.state] = in_state.get(ev.state, 0) + nxt.ts_ns - ev.ts_ns

    def ms(states: tuple[RequestState, ...]) -> float:
        return sum(in_state.get(s, 0) for s in states) / 1e6

    end = req.events[-1].ts_ns
    offsets = tuple((t - req.arrival_ns) / 1e6 for t in req.token_times_ns)
    return RequestStats(
        admit_ms=(req.events[0].ts_ns - req.arrival_ns) / 1e6,
        **{name: ms(states) for name, states in _STAGES.items()},
        preemptions=sum(1 for e in req.events if e.state in (S.PREEMPTED, S.SWAPPED)),
        ttft_ms=offsets[0] if offsets else None,
        e2e_ms=(end - req.arrival_ns) / 1e6,
        token_offsets_ms=offsets,
        cached_tokens=req.num_cached_tokens,
    )


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
