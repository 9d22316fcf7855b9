"""Routing across replicas, queue timeouts, and the retry of a sample whose replica died
before its first token, with real replica processes over loopback HTTP."""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time

import httpx
import pytest

from tests.gateway.conftest import start_server, stop_server
from tests.gateway.test_faults import replicas, wait_for
from tests.gateway.test_records import record


@pytest.fixture(scope="module")
def two_replicas(bundled_path):
    """Two tiny replicas, one running sequence each, 3 s queue timeout."""
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          "--replicas", "2", "--queue-timeout", "3",
                          env={"TAILSCOPE_MAX_NUM_SEQS": "1"})
    yield server
    stop_server(server)


def traced_post(server, body: dict, timeout: float = 60) -> tuple[httpx.Response, dict]:
    trace_id = secrets.token_hex(16)
    r = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, **body},
                   headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
                   timeout=timeout)
    return r, record(server.url, trace_id)


def long_stream(http: httpx.Client, server, max_tokens: int = 1000, **fields):
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, **fields}
    return http.stream("POST", f"{server.url}/v1/completions", json=body)


def test_least_work_then_prefix_locality(two_replicas):
    s = two_replicas
    shared = " ".join(f"w{i}" for i in range(150))  # ~490 tokens: 30 full 16-token blocks
    r, rec = traced_post(s, {"prompt": shared, "max_tokens": 1})
    assert r.status_code == 200 and rec["replica"] == "r0"  # both idle: lowest id
    # r0 gets <= 400 tokens of work: less than the ~480 prefix tokens it could skip (and it
    # finishes well within the queue timeout, ~0.3 s here, so the request queued behind it is
    # served)
    with httpx.Client(timeout=60) as http, long_stream(http, s, max_tokens=400) as busy:
        lines = busy.iter_lines()
        next(lines)
        assert replicas(s.url)["r0"]["inflight"] == 1
        # r0 has work in flight, r1 none: a fresh prompt goes to r1 ...
        fresh = " ".join(f"v{i}" for i in range(150))
        r, rec = traced_post(s, {"prompt": fresh, "max_tokens": 1})
        assert r.status_code == 200 and rec["replica"] == "r1", rec["route_reason"]
        assert rec["prefix_hit_tokens"] == 0
        # ... but the prompt r0 served before still goes to r0: its prefix is there
        r, rec = traced_post(s, {"prompt": shared, "max_tokens": 1})
        assert r.status_code == 200 and rec["replica"] == "r0", rec["route_reason"]
        assert rec["prefix_hit_tokens"] >= 128 and "prefix hit" in rec["route_reason"]


@pytest.fixture(scope="module")
def short_timeout(bundled_path):
    """Two tiny replicas, one running sequence each, a 0.3 s queue timeout."""
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          "--replicas", "2", "--queue-timeout", "0.3",
                          env={"TAILSCOPE_MAX_NUM_SEQS": "1"})
    yield server
    stop_server(server)


def test_queue_timeout_is_504_and_timed_out(short_timeout):
    """Both replicas run a 1,000-token stream with 20 logprobs a token (~1.1 s here, nearly
    four times the queue timeout); one more request waits its 0.3 s in a replica's queue and
    is answered 504. (With a 3 s timeout and plain 1,000-token streams this held only while two
    replicas of two threads each stalled each other on two cores; one thread each, such a
    stream ends in ~0.7 s.)"""
    s = short_timeout
    with httpx.Client(timeout=60) as http, \
            long_stream(http, s, logprobs=20) as a, long_stream(http, s, logprobs=20) as b:
        la, lb = a.iter_lines(), b.iter_lines()
        next(la), next(lb)
        info = replicas(s.url)
        assert info["r0"]["inflight"] == 1 and info["r1"]["inflight"] == 1
        trace_id = secrets.token_hex(16)
        t0 = time.monotonic()
        r = httpx.post(f"{s.url}/v1/completions", timeout=60, json={
            "model": s.model, "prompt": "Hi", "max_tokens": 3},
            headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
        waited = time.monotonic() - t0
        info = replicas(s.url)  # the streams still held both slots: the wait was for them
        assert info["r0"]["inflight"] == 1 and info["r1"]["inflight"] == 1
    rec = record(s.url, trace_id)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert 0.28 < waited < 10
    assert rec["final_state"] == "TIMED_OUT" and rec["finish_reason"] == "timeout"
    assert rec["http_status"] == 504 and rec["engine_queue_ms"] >= 280
    assert rec["generated_tokens"] == 0


def test_sample_retried_on_another_replica_when_its_replica_dies_before_a_token(
        bundled_path):
    """The bundled model prefills a long prompt for seconds: r0 dies mid-prefill (no token yet),
    the sample moves to r1 and the client never sees the failure."""
    server = start_server("--replicas", "2", env={"TAILSCOPE_MAX_BATCHED_TOKENS": "64",
                                                  "TAILSCOPE_KV_CACHE_MB": "256"})
    try:
        pid = replicas(server.url)["r0"]["pid"]
        trace_id = secrets.token_hex(16)
        prompt = " ".join(f"item {i}," for i in range(350))  # ~1,400 tokens: seconds of prefill
        body = {"model": server.model, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
        with httpx.Client(timeout=180) as http:
            out: list[httpx.Response] = []
            t = threading.Thread(target=lambda: out.append(http.post(
                f"{server.url}/v1/completions", json=body,
                headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})))
            t.start()
            assert wait_for(lambda: replicas(server.url)["r0"]["inflight"] == 1, 10), out
            time.sleep(0.5)  # prefilling: thousands of tokens in 64-token chunks
            os.kill(pid, signal.SIGKILL)
            t.join(180)
        r = out[0]
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
        rec = record(server.url, trace_id)
        assert rec["retries"] == 1 and rec["replica"] == "r1"
        assert rec["final_state"] == "FINISHED"
        assert wait_for(lambda: replicas(server.url)["r0"]["restarts"] == 1, 5)
    finally:
        stop_server(server)
