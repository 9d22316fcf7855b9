"""The shared client helpers: SSE payloads and free ports (GatewayProcess is what every gateway
test starts its server with)."""

from __future__ import annotations

import socket

from tracing.client import free_port, sse_json


def test_sse_json_reads_data_lines_only():
    assert sse_json('data: {"id": "cmpl-1", "choices": []}') == {"id": "cmpl-1", "choices": []}
    for line in ("data: [DONE]", "", ": keep-alive", "event: ping"):
        assert sse_json(line) is None


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    """Outside it, no outgoing connection takes the port before its process binds it."""
    lo, hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    for _ in range(20):
        port = free_port()
        assert not lo <= port <= hi, (port, lo, hi)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            assert s.getsockname()[1] == port
