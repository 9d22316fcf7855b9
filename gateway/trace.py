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

from gateway.records import RequestTrace
from tracing.record import RequestRecord

__all__ = ["RequestTrace", "TraceMiddleware", "parse_traceparent"]

log = logging.getLogger("tailscope.gateway")

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def parse_traceparent(value: str) -> tuple[str, str, str] | None:
    """(trace_id, parent_span_id, flags) of a valid W3C traceparent, else None."""
    m = TRACEPARENT.match(value.strip().lower())
    if m is None or m.group(1) == "0" * 32 or m.group(2) == "0" * 16:
        return None
    return m.group(1), m.group(2), m.group(3)


class TraceMiddleware:
    def __init__(self, app, *, max_body_bytes: int,
                 on_record: Callable[[RequestRecord], None],
                 traced_paths: frozenset[str] = frozenset(), instance: str = "") -> None:
        self.app = app
        self.instance = instance  # this gateway's id, on every record
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
        trace = RequestTrace(request_id, trace_id, span_id, parent_span, scope["path"],
                             self.instance) if traced else None
        if trace is not None:
            trace.from_client(headers.get(b"x-tailscope-bench-run", b"").decode("latin-1"),
                              parent is not None)
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
