"""The shared client helpers: SSE payloads and free ports (GatewayProcess is what every gateway
test starts its server with)."""

from __future__ import annotations

import socket

from tracing.client import free_port, sse_json


def test_sse_json_reads_data_lines_only():
    assert sse_json('data: {"id": "cmpl-1", "choices": []}') == {"id": "cmpl-1", "choices": []}
    for line in ("data: [DONE]", "", ": keep-alive", "event: ping"):
        assert sse_json(line) is None


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert s.getsockname()[1] == port
