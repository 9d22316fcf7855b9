"""OpenTelemetry: one span per request, built from its finished record, exported over OTLP.

``OtelSink`` is a ``RecordSink``. For each record it starts and ends, with the record's real
timestamps, a span named ``{operation} {model}`` (GenAI semantic conventions: ``chat`` or
``text_completion``) whose trace id is the record's and whose span id is the record's
``span_id`` (the one the gateway returned in ``traceparent``), parented to the caller's span when
one was sent; and one child span per stage window of ``tracing.timing`` (``ingress``,
``tokenize``, ``route``, ``queue``, ``prefill``, ``decode``, ``preempted``, ``streaming``, and
``backpressured`` inside decode), so the children named after a stage add up to the record's
column for it, preempted and backpressured time included. The SDK's batch processor exports
them (OTLP over HTTP/protobuf or gRPC) from its own thread, so the request path only builds
spans.

Spans are made after the fact because a record is complete only at the end of the response; the
ids are forced through a small ``IdGenerator`` so that the span a client sees in ``traceparent``
is the span the collector receives.
"""

from __future__ import annotations

import json
import threading

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from tracing import timing
from tracing.record import RequestRecord

OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}


class _ForcedIds(IdGenerator):
    """Hands out the ids set for the next span, then random ones (children)."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self._local = threading.local()

    def force(self, trace_id: int | None, span_id: int | None) -> None:
        self._local.trace_id, self._local.span_id = trace_id, span_id

    def generate_trace_id(self) -> int:
        tid = getattr(self._local, "trace_id", None)
        self._local.trace_id = None
        return tid or self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        sid = getattr(self._local, "span_id", None)
        self._local.span_id = None
        return sid or self._random.generate_span_id()


def make_exporter(endpoint: str, protocol: str = "http/protobuf") -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    if protocol != "http/protobuf":
        raise ValueError(f"OTLP protocol must be 'http/protobuf' or 'grpc', not {protocol!r}")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    url = endpoint.rstrip("/")
    if not url.endswith("/v1/traces"):
        url += "/v1/traces"
    return OTLPSpanExporter(endpoint=url)


class OtelSink:
    def __init__(self, exporter: SpanExporter, service_name: str = "tailscope-gateway") -> None:
        self._ids = _ForcedIds()
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                       id_generator=self._ids)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("tailscope.gateway")

    def emit(self, r: RequestRecord) -> None:
        operation = OPERATIONS.get(r.endpoint, "text_completion")
        parent = None
        if r.parent_span_id:
            parent = trace.set_span_in_context(NonRecordingSpan(SpanContext(
                int(r.trace_id, 16), int(r.parent_span_id, 16), is_remote=True,
                trace_flags=TraceFlags(TraceFlags.SAMPLED))))
        self._ids.force(int(r.trace_id, 16), int(r.span_id, 16))
        start = r.arrival_ts_us * 1000
        end = start + int(r.e2e_ms * 1e6)
        attrs = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "tailscope",
            "gen_ai.request.model": r.model,
            "gen_ai.response.model": r.model,
            "gen_ai.response.id": r.response_id or r.request_id,
            "tailscope.request_id": r.request_id,
            "gen_ai.usage.input_tokens": r.prompt_tokens,
            "gen_ai.usage.output_tokens": r.emitted_tokens,
            "gen_ai.response.finish_reasons": [r.finish_reason] if r.finish_reason else [],
            "http.response.status_code": r.http_status,
            "tailscope.final_state": r.final_state,
            "tailscope.tenant": r.tenant,
            "tailscope.replica": r.replica,
            "tailscope.config_id": r.config_id,
            "tailscope.model_revision": r.model_revision,
            "tailscope.stream": r.stream,
            "tailscope.e2e_ms": r.e2e_ms,
            "tailscope.tail_ms": r.tail_ms,
            "tailscope.preemptions": r.preemptions,
            **{f"tailscope.{s.column}": getattr(r, s.column)
               for s in (*timing.STAGES, *timing.SUBSTAGES)},
        }
        for key, value in (("gen_ai.request.max_tokens", r.max_tokens),
                           ("gen_ai.request.temperature", r.temperature),
                           ("gen_ai.request.top_p", r.top_p), ("gen_ai.request.top_k", r.top_k),
                           ("gen_ai.request.seed", r.seed), ("tailscope.ttft_ms", r.ttft_ms),
                           ("tailscope.tpot_ms", r.tpot_ms)):
            if value is not None:
                attrs[key] = value
        if r.error_type:
            attrs["error.type"] = r.error_type
        if r.end_user:  # OpenTelemetry's user.id (Langfuse, for one, files the trace under it)
            attrs["user.id"] = r.end_user
        if r.metadata:  # the request's OpenAI metadata, a string attribute per key
            attrs.update({f"tailscope.metadata.{k}": v for k, v in json.loads(r.metadata).items()})
        span = self.tracer.start_span(f"{operation} {r.model}".strip(), context=parent,
                                      kind=SpanKind.SERVER, attributes=attrs, start_time=start)
        if r.final_state in ("FAILED", "TIMED_OUT") or r.http_status >= 500:
            span.set_status(Status(StatusCode.ERROR, r.error_message or r.final_state))
        ctx = trace.set_span_in_context(span)
        # one child per stage window (the windows the record's columns are the sums of)
        for w in (*timing.windows(r.events), *timing.sub_windows(r.events)):
            child = self.tracer.start_span(w.stage.span, context=ctx, kind=SpanKind.INTERNAL,
                                           start_time=w.start_us * 1000)
            child.end(end_time=w.end_us * 1000)
        span.end(end_time=end)

    def close(self) -> None:
        self.provider.shutdown()  # flushes the batch processor
