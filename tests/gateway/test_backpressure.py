"""A client that stops reading: its requests go BACKPRESSURED (KV kept, no tokens), resume when
it reads again, and are cancelled when it stays away. Real sockets, real replica.

The client is a raw socket with a tiny receive buffer, so the server's send buffers fill after a
few hundred kilobytes; 16 parallel samples with logprobs produce that in a few seconds.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.gateway.conftest import start_server, stop_server
from tests.gateway.test_faults import replicas, wait_for


@pytest.fixture(scope="module")
def bp_server(bundled_path):
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          env={"TAILSCOPE_MAX_BUFFERED_DELTAS": "8",
                               "TAILSCOPE_SLOW_CLIENT_TIMEOUT_S": "3"})
    yield server
    stop_server(server)


def open_stream(server, max_tokens: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.connect(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    body = json.dumps({"model": server.model, "prompt": "Once upon a time", "n": 16,
                       "max_tokens": max_tokens, "logprobs": 5, "stream": True,
                       "ignore_eos": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return s


def wait_paused(url: str) -> int:
    """Until all 16 samples are paused and stay so for 0.5 s with their KV held. (While the
    server's socket buffer still takes data, the gateway drains the buffers, resumes the
    samples and pauses them again; the first moment all 16 read paused can be such a cycle.)"""
    def settled() -> bool:
        before = replicas(url)["r0"]
        time.sleep(0.5)
        after = replicas(url)["r0"]
        return before["paused"] == after["paused"] == 16 and \
            before["kv_blocks_used"] == after["kv_blocks_used"] > 0  # no tokens, KV kept

    assert wait_for(settled, 60), replicas(url)
    return replicas(url)["r0"]["kv_blocks_used"]


def test_paused_then_resumed_when_the_client_reads_again(bp_server):
    s = open_stream(bp_server, max_tokens=450)
    try:
        wait_paused(bp_server.url)
        data = b""
        s.settimeout(60)
        while b"data: [DONE]" not in data:
            chunk = s.recv(1 << 16)
            assert chunk, "connection closed before [DONE]"
            data += chunk
    finally:
        s.close()
    finishes = [json.loads(line[6:])["choices"][0]["finish_reason"]
                for line in data.decode(errors="replace").split("\n")
                if line.startswith("data: {") and '"finish_reason":"' in line.replace(" ", "")]
    assert finishes.count("length") == 16 and b'data: {"error"' not in data
    info = replicas(bp_server.url)["r0"]
    assert info["paused"] == 0 and info["inflight"] == 0


def test_client_that_never_reads_is_cancelled_and_its_kv_freed(bp_server):
    cancelled = replicas(bp_server.url)["r0"]["ended"].get("CANCELLED", 0)
    s = open_stream(bp_server, max_tokens=1000)
    try:
        wait_paused(bp_server.url)
        # past the 3 s limit every sample is cancelled and its blocks return to the pool
        assert wait_for(lambda: replicas(bp_server.url)["r0"]["ended"].get("CANCELLED", 0)
                        == cancelled + 16, 10), replicas(bp_server.url)
        assert wait_for(lambda: replicas(bp_server.url)["r0"]["kv_blocks_used"] == 0, 2)
        # its gateway slots too, while its socket is still open
        assert wait_for(lambda: replicas(bp_server.url)["r0"]["inflight"] == 0, 2)
        assert httpx.get(f"{bp_server.url}/health").status_code == 200
    finally:
        s.close()
    assert wait_for(lambda: replicas(bp_server.url)["r0"]["inflight"] == 0, 5)


@pytest.fixture(scope="module")
def impatient_server(bundled_path):
    """Buffers of 8 deltas and a paused request cancelled after 0.5 s: a choice left unread
    while another one generates its 150 tokens (seconds here) would be cancelled."""
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          env={"TAILSCOPE_MAX_BUFFERED_DELTAS": "8",
                               "TAILSCOPE_SLOW_CLIENT_TIMEOUT_S": "0.5"})
    yield server
    stop_server(server)


def test_a_non_streamed_request_reads_all_its_choices_as_they_come(impatient_server):
    """n samples answered in one body: the gateway takes every choice's tokens as they come,
    so none of them fills its buffer, gets paused and then cancelled as a slow client while
    the first choice is still generating (choices read one after the other were: a 500)."""
    server = impatient_server
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": server.model, "prompt": "Once upon a time", "n": 4, "max_tokens": 150,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 4
    assert r.json()["usage"]["completion_tokens"] == 4 * 150
    info = replicas(server.url)["r0"]
    assert info["ended"].get("CANCELLED", 0) == 0 and info["paused"] == 0
