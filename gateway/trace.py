"""Per-request tracing: ids, W3C ``traceparent``, timing boundaries and the one record.

``TraceMiddleware`` is a plain ASGI middleware (cheaper than Starlette's ``BaseHTTPMiddleware``
and able to see the end of a streamed body). For every request it

- takes the arrival time at the first ASGI call, before any body is read;
- assigns ``x-request-id`` (or keeps the caller's), a trace id (continuing the caller's
  ``traceparent`` when valid) and a new span id, and puts them on every response, errors too;
- refuses a body whose ``content-length`` is over the limit with 413 before anything is read;
- for API calls (``POST`` to one of the served ``/v1`` endpoints; any other path is a plain 404
  with no record and no metric label of its own) hands a ``RequestTrace`` to the endpoint through
  ``scope["state"]``, stamps the end of the response, and emits exactly one ``RequestRecord``
  when the exchange is over, whatever happened (success, error, disconnect, crash).

Boundaries (docs/design/record-contract.md): RECEIVED (arrival) -> ADMITTED (ingress gate
passed and body parsed) -> TOKENIZED (prompt ids known, parameters validated) -> ROUTED (sent
to a replica) -> engine states (the replica's offsets, placed after ROUTED) -> each content
flush -> END.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import Callable

from engine.observer import RequestStats
from tracing import timing
from tracing.record import RecordEvent, RequestRecord

log = logging.getLogger("tailscope.gateway")

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def parse_traceparent(value: str) -> tuple[str, str, str] | None:
    """(trace_id, parent_span_id, flags) of a valid W3C traceparent, else None."""
    m = TRACEPARENT.match(value.strip().lower())
    if m is None or m.group(1) == "0" * 32 or m.group(2) == "0" * 16:
        return None
    return m.group(1), m.group(2), m.group(3)


class RequestTrace:
    """Timing marks of one request on the gateway's monotonic clock, turned into a record."""

    def __init__(self, request_id: str, trace_id: str, span_id: str, parent_span_id: str,
                 endpoint: str) -> None:
        self.arrival_ns = time.monotonic_ns()
        self.arrival_wall_us = time.time_ns() // 1000
        self.record = RequestRecord(trace_id=trace_id, span_id=span_id, request_id=request_id,
                                    parent_span_id=parent_span_id, endpoint=endpoint,
                                    arrival_ts_us=self.arrival_wall_us)
        self.marks: dict[str, int] = {}
        self.flushes: list[int] = []
        self.end_ns: int | None = None
        self.engine_stats: RequestStats | None = None  # the replica's (its timeline), at the end
        # where the replica's offsets start on this clock (None: at ROUTED); see TokenDelta
        self.engine_anchor_ns: int | None = None
        self.route_note = ""  # why this side of a mixed pool (ahead of the router's reason)
        self.keep_first: set[str] = set()  # marks a second attempt does not move
        self.earlier_tries = 0  # failed elsewhere first (a mixed pool's backend)
        # the other prompts of a /v1/completions batch: a record each (``sibling``)
        self.siblings: list[RequestTrace] = []
        self.client_trace = False  # the trace id is the client's (its traceparent)

    def sibling(self, prompt_index: int) -> RequestTrace:
        """The trace of prompt ``prompt_index`` of this request's batch: the same arrival,
        marks so far, request id, caller's span, bench run, tenant (its key, its rows' TTL),
        end user and metadata, its own trace and span ids; the middleware ends it with this one
        and emits its record."""
        r = self.record
        t = RequestTrace(r.request_id, secrets.token_hex(16), secrets.token_hex(8),
                         r.parent_span_id, r.endpoint)
        t.arrival_ns, t.arrival_wall_us = self.arrival_ns, self.arrival_wall_us
        for name in ("arrival_ts_us", "bench_run", "tenant", "api_key_id", "ttl_days",
                     "end_user", "metadata"):
            setattr(t.record, name, getattr(r, name))
        t.record.prompt_index = prompt_index
        t.marks = dict(self.marks)
        self.siblings.append(t)
        return t

    def mark(self, stage: str, at_ns: int | None = None) -> None:
        if stage in self.keep_first and stage in self.marks:
            return
        self.marks[stage] = time.monotonic_ns() if at_ns is None else at_ns

    def flush(self) -> None:
        """A chunk carrying content was handed to the server (the client can read it)."""
        self.flushes.append(time.monotonic_ns())

    def fail(self, final_state: str, finish_reason: str, error_type: str, message: str) -> None:
        r = self.record
        r.final_state, r.finish_reason = final_state, finish_reason
        r.error_type, r.error_message = error_type, message

    def _wall(self, ns: int) -> int:
        return self.arrival_wall_us + (ns - self.arrival_ns) // 1000

    def finish(self, status: int, batch: RequestTrace | None = None) -> RequestRecord:
        """The record, ended with ``status``; a batch's sibling also takes the batch's end
        and, when it did not end on its own account, the batch's failure."""
        r = self.record
        if batch is not None:
            self.end_ns = batch.end_ns
            if not r.final_state and batch.record.final_state not in ("", "FINISHED"):
                b = batch.record
                self.fail(b.final_state, b.finish_reason, b.error_type, b.error_message)
        end = self.end_ns or time.monotonic_ns()
        r.http_status = status
        if not r.final_state:  # never reached the serving code's bookkeeping
            if status < 400:
                r.final_state, r.finish_reason = "FINISHED", r.finish_reason or "stop"
            elif status >= 500 and status not in (503, 504):
                r.final_state, r.finish_reason = "FAILED", "error"
            elif status == 504:
                r.final_state, r.finish_reason = "TIMED_OUT", "timeout"
            else:
                r.final_state, r.finish_reason = "REJECTED", "rejected"

        m = self.marks
        c = timing.client_timings(self.arrival_ns, self.flushes, end)
        r.ttft_ms, r.itl_ms, r.tpot_ms, r.tail_ms, r.e2e_ms = (
            c.ttft_ms, c.itl_ms, c.tpot_ms, c.tail_ms, c.e2e_ms)
        s = self.engine_stats
        if s is not None:
            r.cached_tokens = s.cached_tokens
        r.timing_source = r.timing_source or ("engine" if s is not None else "gateway")
        events = [RecordEvent(self.arrival_wall_us, "RECEIVED")]
        events += [RecordEvent(self._wall(ns), stage) for stage, ns in
                   sorted(m.items(), key=lambda kv: kv[1])]
        routed = m.get("ROUTED")
        if routed is not None and s is not None:
            # the replica's offsets, from its arrival: not before ROUTED, and no later than
            # any delta's receipt allows (from ROUTED to there it waited for the replica to
            # read its inbox: the step in progress)
            at = routed if self.engine_anchor_ns is None else max(routed, self.engine_anchor_ns)
            events += [RecordEvent(self._wall(at + int(e.at_ms * 1e6)), e.state, e.detail)
                       for e in s.events]
        if self.flushes:
            events.append(RecordEvent(self._wall(self.flushes[0]), "FIRST_FLUSH"))
        events.append(RecordEvent(self._wall(end), "END", r.final_state))
        events.sort(key=lambda e: e.ts_us)
        r.events = events
        return timing.apply(r)  # every stage column, from the timeline


class TraceMiddleware:
    def __init__(self, app, *, max_body_bytes: int,
                 on_record: Callable[[RequestRecord], None],
                 traced_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.traced_paths = traced_paths
        self.max_body_bytes = max_body_bytes
        self.on_record = on_record

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128] \
            or f"req-{uuid.uuid4().hex}"
        parent = parse_traceparent(headers.get(b"traceparent", b"").decode("latin-1"))
        trace_id, parent_span, flags = parent or (secrets.token_hex(16), "", "01")
        span_id = secrets.token_hex(8)
        traced = scope["method"] == "POST" and scope["path"] in self.traced_paths
        trace = RequestTrace(request_id, trace_id, span_id, parent_span, scope["path"]) \
            if traced else None
        if trace is not None:
            trace.record.bench_run = headers.get(b"x-tailscope-bench-run", b"").decode(
                "latin-1")[:64]
            trace.client_trace = parent is not None
        state = scope.setdefault("state", {})
        state.update(request_id=request_id, trace_id=trace_id, trace=trace)
        status = 0

        async def send_with_ids(message) -> None:
            nonlocal status, trace_id
            if message["type"] == "http.response.start":
                status = message["status"]
                if trace is not None:  # the gateway may have given it another (a collision)
                    trace_id = trace.record.trace_id
                extra = [(b"x-request-id", request_id.encode("latin-1")),
                         (b"x-tailscope-trace-id", trace_id.encode()),
                         (b"traceparent", f"00-{trace_id}-{span_id}-{flags}".encode())]
                routed = [(b"x-tailscope-replica", trace.record.replica.encode("latin-1",
                                                                              "replace"))
                          ] if trace is not None and trace.record.replica else []
                if trace is not None and trace.record.degraded:  # degraded admission
                    routed.append((b"x-tailscope-degraded", trace.record.degraded.encode()))
                if trace is not None and trace.siblings:  # a batch: every prompt's trace
                    routed.append((b"x-tailscope-trace-ids", ",".join(
                        [trace_id, *(t.record.trace_id for t in trace.siblings)]).encode()))
                message = {**message, "headers": [*message.get("headers", []), *extra,
                                                  *routed]}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                if trace is not None:
                    for t in (trace, *trace.siblings):
                        if not t.flushes and status == 200 and not t.record.stream:
                            t.flush()  # a JSON body is the response's one content flush
                    trace.end_ns = time.monotonic_ns()
            await send(message)

        try:
            length = headers.get(b"content-length", b"")
            if length.isdigit() and int(length) > self.max_body_bytes:
                await _send_json(send_with_ids, 413, {"error": {
                    "message": f"request body of {int(length)} bytes exceeds the limit of "
                               f"{self.max_body_bytes}", "type": "invalid_request_error",
                    "param": None, "code": "body_too_large"}})
                if trace is not None:
                    trace.fail("REJECTED", "rejected", "body_too_large", "request body too large")
            else:
                await self.app(scope, receive, send_with_ids)
        except Exception as exc:  # an unexpected bug: an OpenAI-style 500, never a bare crash
            log.exception("unhandled error for %s %s", scope["method"], scope["path"])
            if trace is not None and not trace.record.final_state:
                trace.fail("FAILED", "error", "internal_error", f"{type(exc).__name__}: {exc}")
            if status == 0:
                await _send_json(send_with_ids, 500, {"error": {
                    "message": "internal error in the gateway; see its log for trace "
                               f"{trace_id}", "type": "server_error", "param": None,
                    "code": "internal_error"}})
        finally:
            if trace is not None:
                self.on_record(trace.finish(status or 500))
                for sibling in trace.siblings:
                    self.on_record(sibling.finish(status or 500, batch=trace))


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
