"""The one owner of request timing: a request's timeline in, every stage duration out.

A request's timeline is its list of ``RecordEvent`` (gateway boundaries RECEIVED, ADMITTED,
TOKENIZED, ROUTED; the replica's engine states placed after ROUTED; the FIRST_FLUSH marker; END).
Every interval between two consecutive timeline points belongs to exactly one stage, the stage
opened by the earlier point, so the stages of a record add up to its ``e2e_ms`` (the
``streaming`` stage being the time after the engine finished). Nothing else computes a stage:

- the gateway's record (``apply``: the stage columns of ``tracing.record.RequestRecord``),
- the OpenTelemetry child spans (``windows``: one span per window, so spans and columns agree),
- the Prometheus histograms (read the record's columns),
- ``tracing.seed``'s synthetic records (build a timeline, then ``apply``),
- the query library's stage breakdowns and the Grafana stacked panel (``STAGES``, ``TTFT_STAGES``).

The client-side timings (TTFT, ITL, TPOT, tail) come from the content flushes
(``client_timings``), and the SLO rule is written once here too (``Slo`` for Python, ``slo_sql``
for SQL). Adding an engine-derived stage is one ``Stage`` here, one record field and one store
migration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tracing.record import RecordEvent, RequestRecord


@dataclass(frozen=True)
class Stage:
    column: str  # the record's (and the requests table's) column, in ms
    label: str  # the name people read (drill-down, Grafana legend)
    span: str  # the OpenTelemetry child span's name
    opened_by: tuple[str, ...]  # timeline states that start this stage
    ttft: bool = False  # part of the time to first token


# In path order. Their sum plus "streaming" (engine done -> end of response) is e2e_ms.
STAGES: tuple[Stage, ...] = (
    Stage("ingress_ms", "ingress", "ingress", ("RECEIVED",), ttft=True),
    Stage("tokenize_ms", "tokenize", "tokenize", ("ADMITTED",), ttft=True),
    Stage("route_ms", "routing", "route", ("TOKENIZED",), ttft=True),
    # ROUTED -> the engine's first event is its admission decision: waiting, too
    Stage("engine_queue_ms", "engine queue time", "queue", ("ROUTED", "QUEUED", "DEGRADED"),
          ttft=True),
    Stage("prefill_ms", "prefill", "prefill", ("RUNNABLE", "PREFILLING"), ttft=True),
    Stage("decode_ms", "decode", "decode", ("DECODING", "BACKPRESSURED")),
    Stage("preempted_ms", "preemption", "preempted", ("PREEMPTED", "SWAPPED", "RESUMED")),
)
# The engine ended the request: what is left is getting the last bytes to the client.
STREAMING = Stage("", "streaming", "streaming",
                  ("FINISHED", "CANCELLED", "TIMED_OUT", "FAILED", "REJECTED"))
# Parts of a stage, stored as columns of their own.
SUBSTAGES: tuple[Stage, ...] = (
    Stage("backpressured_ms", "paused by a slow client", "backpressured", ("BACKPRESSURED",)),
)
# Sent to a replica whose timeline never came back (the client left first): unattributed.
IN_ENGINE = Stage("", "in the engine (no timeline)", "engine", ("ROUTED",))
PREEMPTING = ("PREEMPTED", "SWAPPED")  # each one counts as a preemption
END = "END"
# A marker from the engine's scheduler: why a waiting request did not run at a tick (the
# detail starts with the cause). The queue and preempted time is split by these notes into one
# column per cause, so for the bundled engine the causes add up to exactly
# engine_queue_ms + preempted_ms. Before the first note of a spell of waiting the request waits
# for the step in progress (and, from ROUTED, for its message to reach the replica).
WAIT = "WAIT"
CAUSES: tuple[Stage, ...] = (
    Stage("wait_step_ms", "the step in progress", "wait.step", ("step",)),
    Stage("wait_budget_ms", "token budget used by others", "wait.budget", ("budget",)),
    Stage("wait_kv_ms", "no free KV blocks", "wait.kv", ("kv",)),
    Stage("wait_seqs_ms", "max_num_seqs reached", "wait.seqs", ("seqs",)),
    Stage("wait_hol_ms", "behind the head of the queue", "wait.hol", ("hol",)),
    Stage("wait_share_ms", "other tenants' fair share", "wait.share", ("share",)),
)
_CAUSE = {c.opened_by[0]: c for c in CAUSES}
WAITING = frozenset({"engine_queue_ms", "preempted_ms"})  # the columns causes split

E2E_STAGES: tuple[str, ...] = tuple(s.column for s in STAGES)
TTFT_STAGES: tuple[str, ...] = tuple(s.column for s in STAGES if s.ttft)
LABELS: dict[str, str] = {s.column: s.label for s in (*STAGES, *SUBSTAGES, *CAUSES)}
_OPENS = {state: s for s in (*STAGES, STREAMING) for state in s.opened_by}
_ENGINE_STATES = frozenset(_OPENS) - {"RECEIVED", "ADMITTED", "TOKENIZED", "ROUTED"}


@dataclass(frozen=True, slots=True)
class Window:
    stage: Stage
    start_us: int
    end_us: int

    @property
    def ms(self) -> float:
        return (self.end_us - self.start_us) / 1e3


def _spans(events: Sequence[RecordEvent], opens: dict[str, Stage | None]) -> list[Window]:
    """Contiguous windows of the stages ``opens`` maps states to (None: no stage of interest);
    any other point (FIRST_FLUSH, UPSTREAM_HEADERS: markers) changes nothing; END closes the
    last window."""
    out: list[Window] = []
    current: Stage | None = None
    start = 0
    for e in sorted(events, key=lambda e: e.ts_us):  # stable: ties keep their order
        if e.state == END or e.state in opens:
            nxt = None if e.state == END else opens[e.state]
            if nxt is not current:
                if current is not None and e.ts_us > start:
                    out.append(Window(current, start, e.ts_us))
                current, start = nxt, e.ts_us
            if e.state == END:
                break
    return out


def _opens(events: Sequence[RecordEvent]) -> dict[str, Stage]:
    engine_states = _ENGINE_STATES.intersection(e.state for e in events)
    return _OPENS if engine_states else _OPENS | {"ROUTED": IN_ENGINE}


def windows(events: Sequence[RecordEvent]) -> list[Window]:
    """The request's stage windows in time order (adjacent windows of one stage merged)."""
    return _spans(events, _opens(events))


def sub_windows(events: Sequence[RecordEvent]) -> list[Window]:
    """Windows of the sub-stages (e.g. paused by a slow client, inside decode)."""
    opens: dict[str, Stage | None] = dict.fromkeys(_opens(events))
    for sub in SUBSTAGES:
        opens.update(dict.fromkeys(sub.opened_by, sub))
    return _spans(events, opens)


def cause_windows(events: Sequence[RecordEvent]) -> list[Window]:
    """The queue and preempted windows split by the scheduler's wait notes (``WAIT``): each
    part belongs to the cause noted last in its spell of waiting (``step`` before any)."""
    notes = sorted((e.ts_us, e.detail.split(":", 1)[0].strip()) for e in events
                   if e.state == WAIT)
    out: list[Window] = []
    j, last_end, cause = 0, None, _CAUSE["step"]
    for w in windows(events):
        if w.stage.column not in WAITING:
            continue
        if w.start_us != last_end:  # a new spell of waiting
            cause = _CAUSE["step"]
        while j < len(notes) and notes[j][0] < w.start_us:
            j += 1  # (not inside a waiting window: nothing to split)
        t = w.start_us
        while j < len(notes) and notes[j][0] < w.end_us:
            ts, name = notes[j]
            if ts > t:
                out.append(Window(cause, t, ts))
            cause, t = _CAUSE.get(name, cause), max(t, ts)
            j += 1
        out.append(Window(cause, t, w.end_us))
        last_end = w.end_us
    return out


def durations(events: Sequence[RecordEvent], causes: bool = True) -> dict[str, float]:
    """Milliseconds per stage, sub-stage and (``causes``) wait-cause column (every one
    present, zeros included)."""
    out = dict.fromkeys((*E2E_STAGES, *(s.column for s in (*SUBSTAGES, *CAUSES))), 0.0)
    parts = cause_windows(events) if causes else []
    for w in (*windows(events), *sub_windows(events), *parts):
        if w.stage.column:
            out[w.stage.column] += w.ms
    return out


def apply(record: RequestRecord) -> RequestRecord:
    """Set the record's stage columns and preemption count from its own timeline (the wait
    causes only for the bundled engine's timelines: an upstream's queue has no causes)."""
    for column, ms in durations(record.events, record.timing_source == "engine").items():
        setattr(record, column, ms)
    record.preemptions = sum(1 for e in record.events if e.state in PREEMPTING)
    return record


@dataclass(frozen=True, slots=True)
class ClientTimings:
    ttft_ms: float | None
    itl_ms: list[float]
    tpot_ms: float | None
    tail_ms: float
    e2e_ms: float


def client_timings(arrival_ns: int, flushes_ns: Sequence[int], end_ns: int) -> ClientTimings:
    """What the client saw, from the content flushes: ``e2e = ttft + sum(itl) + tail`` exactly
    (one clock, integer nanoseconds). No flush: no TTFT, no gaps, the tail is the whole."""
    def ms(a: int, b: int) -> float:
        return (b - a) / 1e6

    e2e = ms(arrival_ns, end_ns)
    f = flushes_ns
    if not f:
        return ClientTimings(None, [], None, e2e, e2e)
    return ClientTimings(
        ttft_ms=ms(arrival_ns, f[0]),
        itl_ms=[ms(a, b) for a, b in zip(f, f[1:], strict=False)],
        tpot_ms=ms(f[0], f[-1]) / (len(f) - 1) if len(f) > 1 else None,
        tail_ms=ms(f[-1], end_ns), e2e_ms=e2e)


# ---- the SLO rule ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Slo:
    """A request meets the SLO when it finished and its TTFT and TPOT are within the limits;
    a request with one token has no TPOT and meets that part; a missing limit is no limit."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, finished: bool, ttft_ms: float | None, tpot_ms: float | None) -> bool:
        return (finished
                and (self.ttft_ms is None or (ttft_ms is not None and ttft_ms <= self.ttft_ms))
                and (self.tpot_ms is None or tpot_ms is None or tpot_ms <= self.tpot_ms))


def slo_sql(ttft: str, tpot: str) -> str:
    """The same rule over ``tailscope.requests``; ``ttft`` and ``tpot`` are SQL expressions for
    the limits (bound parameters or dashboard variables, never raw user text)."""
    return (f"final_state = 'FINISHED' AND ttft_ms <= {ttft} AND "
            f"(tpot_ms IS NULL OR tpot_ms <= {tpot})")
