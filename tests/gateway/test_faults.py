"""Client disconnects and replica crashes, over real HTTP and real replica processes."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.gateway.conftest import start_server, stop_server
from tracing.client import sse_json


def replicas(url: str) -> dict:
    return httpx.get(f"{url}/debug/replicas").json()


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_disconnect_mid_stream_cancels_and_frees_kv(tiny_server):
    body = {"model": tiny_server.model, "prompt": "Once upon a time", "max_tokens": 900,
            "stream": True, "ignore_eos": True}
    cancelled = replicas(tiny_server.url)["r0"]["ended"].get("CANCELLED", 0)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{tiny_server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert replicas(tiny_server.url)["r0"]["kv_blocks_used"] > 0
        # leaving the block closes the connection mid-stream
    t0 = time.monotonic()
    assert wait_for(lambda: replicas(tiny_server.url)["r0"]["inflight"] == 0
                    and replicas(tiny_server.url)["r0"]["kv_blocks_used"] == 0, 1.0), \
        replicas(tiny_server.url)
    assert time.monotonic() - t0 < 1.0
    ended = replicas(tiny_server.url)["r0"]["ended"]
    assert ended.get("CANCELLED", 0) == cancelled + 1, ended  # aborted, not run to the end


@pytest.fixture
def own_server(bundled_path):
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path))
    yield server
    stop_server(server)


def test_replica_killed_mid_stream(own_server):
    url = own_server.url
    body = {"model": own_server.model, "prompt": "Once upon a time", "max_tokens": 1000,
            "stream": True, "ignore_eos": True}
    pid = replicas(url)["r0"]["pid"]
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(pid, signal.SIGKILL)
            rest = list(lines)
    # an error event, parsed (a chunk whose text is the token "error" is not one)
    events = [e for e in map(sse_json, rest) if e is not None]
    errors = [e["error"] for e in events if "error" in e]
    assert errors and errors[0]["type"] == "server_error", rest[-3:]
    assert httpx.get(f"{url}/health").status_code == 200  # the gateway stays up
    assert wait_for(lambda: httpx.get(f"{url}/ready").status_code == 200, 120)
    info = replicas(url)["r0"]
    assert info["restarts"] == 1 and info["pid"] != pid
    ok = httpx.post(f"{url}/v1/completions", timeout=60,
                    json={"model": own_server.model, "prompt": "Hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_load_shedding_answers_503_at_once(bundled_path):
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          "--max-inflight", "1")
    try:
        body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 900,
                "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                lines = r.iter_lines()  # keep the iterator: dropping it closes the stream
                next(lines)  # the only slot is taken
                assert replicas(server.url)["r0"]["inflight"] == 1
                t0 = time.monotonic()
                shed = http.post(f"{server.url}/v1/completions",
                                 json={**body, "stream": False, "max_tokens": 2})
                assert time.monotonic() - t0 < 1.0  # answered at once, not queued
        assert shed.status_code == 503 and shed.headers["Retry-After"] == "1"
        assert shed.json()["error"]["code"] == "overloaded"
        assert wait_for(lambda: replicas(server.url)["r0"]["inflight"] == 0, 2.0)
        ok = httpx.post(f"{server.url}/v1/completions", timeout=60,
                        json={"model": server.model, "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        stop_server(server)
