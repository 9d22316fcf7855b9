"""Spans over OTLP/HTTP to an in-process receiver: names, GenAI attributes, parent/child
structure and ids that match the trace records and the traceparent the client saw."""

from __future__ import annotations

import secrets
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.gateway.conftest import start_server, stop_server
from tests.gateway.test_faults import wait_for
from tests.gateway.test_records import record


class Receiver:
    """A minimal OTLP/HTTP collector: decodes every ExportTraceServiceRequest it gets."""

    def __init__(self) -> None:
        self.spans: list = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        outer.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def otel_setup(bundled_path):
    receiver = Receiver()
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          env={"TAILSCOPE_OTLP_ENDPOINT": receiver.url,
                               "OTEL_BSP_SCHEDULE_DELAY": "100"})
    yield server, receiver
    stop_server(server)
    receiver.server.shutdown()


def attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = [x.string_value for x in v.array_value.values] if kind == "array_value" \
            else getattr(v, kind)
    return out


def test_request_span_with_stage_children_matches_the_record(otel_setup):
    server, receiver = otel_setup
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   headers={"traceparent": f"00-{trace_id}-{caller_span}-01"},
                   json={"model": server.model, "max_tokens": 6, "ignore_eos": True,
                         "temperature": 0.5, "seed": 3, "safety_identifier": "u-7",
                         "metadata": {"team": "search", "run": "a"},
                         "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200
    our_span = r.headers["traceparent"].split("-")[2]
    rec = record(server.url, trace_id)

    def mine():
        return [s for s in receiver.spans if s.trace_id.hex() == trace_id]

    assert wait_for(lambda: len(mine()) >= 4, 15), [s.name for s in receiver.spans]
    spans = {s.name: s for s in mine()}
    root = spans[f"chat {server.model}"]
    assert root.span_id.hex() == our_span == rec["span_id"]
    assert root.parent_span_id.hex() == caller_span
    a = attrs(root)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == server.model
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.seed"] == 3
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert a["gen_ai.usage.input_tokens"] == rec["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == 6 == r.json()["usage"]["completion_tokens"]
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["tailscope.replica"] == "r0" and a["tailscope.config_id"] == rec["config_id"]
    assert a["gen_ai.response.id"] == r.json()["id"] == rec["response_id"]
    assert a["user.id"] == "u-7" == rec["end_user"]
    assert (a["tailscope.metadata.team"], a["tailscope.metadata.run"]) == ("search", "a")
    assert (root.end_time_unix_nano - root.start_time_unix_nano) / 1e6 == \
        pytest.approx(rec["e2e_ms"], abs=0.01)
    for name in ("queue", "prefill", "decode"):
        child = spans[name]
        assert child.parent_span_id == root.span_id
        assert root.start_time_unix_nano <= child.start_time_unix_nano
        assert child.start_time_unix_nano <= child.end_time_unix_nano <= root.end_time_unix_nano
    for name, column in (("queue", "engine_queue_ms"), ("prefill", "prefill_ms"),
                         ("decode", "decode_ms"), ("ingress", "ingress_ms")):
        span = spans[name]
        assert (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6 == \
            pytest.approx(rec[column], abs=0.002)


def test_a_rejected_request_has_a_root_span_without_a_caller_parent(otel_setup):
    server, receiver = otel_setup
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": server.model, "prompt": "Hi", "top_p": 3})
    assert r.status_code == 400
    trace_id = r.headers["x-tailscope-trace-id"]
    assert wait_for(lambda: any(s.trace_id.hex() == trace_id for s in receiver.spans), 15)
    mine = [s for s in receiver.spans if s.trace_id.hex() == trace_id]
    span = next(s for s in mine if s.name.startswith("text_completion"))
    assert {s.name for s in mine} - {span.name} <= {"ingress", "tokenize"}  # never routed
    assert span.parent_span_id == b"" and attrs(span)["http.response.status_code"] == 400
