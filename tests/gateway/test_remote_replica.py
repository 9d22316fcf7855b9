"""Replicas on other hosts, over ``tcp://`` on loopback: a replica started on its own (as its
host's supervisor would start it) joins the gateway's pool and serves requests; one with the
wrong key is never used; one running another engine config is refused by name; a
remote replica that dies is marked unreachable (a request no replica can take gets a 503), and
it is routed to again once its host restarts it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import pytest

from tests.gateway.conftest import free_port, start_server, stop_server
from tests.gateway.test_faults import replicas, wait_for

KEY = "replica-key-test-0123456789"
ENGINE = {"kv_cache_mb": 64}  # what start_server gives the gateway (TAILSCOPE_KV_CACHE_MB)


def remote(rid: str, inbox: int, outbox: int, key: str, engine: dict = ENGINE
           ) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "engine.replica", "--id", rid, "--model", "tiny:49152",
         "--inbox", f"tcp://127.0.0.1:{inbox}", "--outbox", f"tcp://127.0.0.1:{outbox}",
         "--engine-config", json.dumps(engine), "--parent-pid", "0"],
        env={**os.environ, "TAILSCOPE_REPLICA_KEY": key})


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}(?:_total)? ([0-9.e+]+)$", text, re.M)
    return float(m[1]) if m else -1.0


@pytest.fixture(scope="module")
def fleet(bundled_path):
    outbox, far, bad, other = (free_port() for _ in range(4))
    procs = {"far": remote("far", far, outbox, KEY),
             "bad": remote("bad", bad, outbox, "not-the-key-0123456789"),
             "other": remote("other", other, outbox, KEY, {**ENGINE, "max_num_seqs": 3})}
    server = start_server(
        "--model", "tiny:49152", "--tokenizer", str(bundled_path), "--replicas", "0",
        "--remote-replica", f"far=tcp://127.0.0.1:{far}",
        "--remote-replica", f"bad=tcp://127.0.0.1:{bad}",
        "--remote-replica", f"other=tcp://127.0.0.1:{other}",
        env={"TAILSCOPE_REPLICA_KEY": KEY, "TAILSCOPE_REPLICA_OUTBOX": f"tcp://127.0.0.1:{outbox}",
             "TAILSCOPE_HEARTBEAT_TIMEOUT_S": "3"}, ready_field="ready")
    out = {"server": server, "procs": procs, "ports": {"far": far, "outbox": outbox}}
    yield out
    stop_server(server)
    for p in out["procs"].values():
        p.kill()
        p.wait()


def complete(url: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={
        "model": "SmolLM2-135M-Instruct", "prompt": "hello from afar", "max_tokens": max_tokens,
        "temperature": 0}, timeout=60)


def test_a_remote_replica_serves_and_the_wrong_key_is_refused_and_counted(fleet):
    url = fleet["server"].url
    for _ in range(3):
        r = complete(url)
        assert r.status_code == 200 and r.headers["x-tailscope-replica"] == "far", r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    info = replicas(url)
    assert info["far"]["ready"] and info["far"]["kind"] == "remote"
    assert info["far"]["inbox"] == f"tcp://127.0.0.1:{fleet['ports']['far']}"
    # the wrong key: it drops the gateway's Hellos, so it never speaks and is never ready
    # (tests/gateway/test_replica_link.py counts what the gateway drops)
    assert not info["bad"]["ready"] and info["bad"]["state"] == "starting"
    # the right key, another engine config: refused, and the message says what differs
    assert wait_for(lambda: replicas(url)["other"]["state"] == "refused", 15)
    assert "max_num_seqs=3 (here " in replicas(url)["other"]["last_failure"]


def test_a_remote_replica_that_dies_is_unreachable_then_back_when_restarted(fleet):
    url, ports = fleet["server"].url, fleet["ports"]
    assert complete(url).status_code == 200
    fleet["procs"]["far"].kill()
    fleet["procs"]["far"].wait()
    assert wait_for(lambda: replicas(url)["far"]["state"] == "unreachable", 10)
    r = complete(url)  # no replica left that can take it
    assert r.status_code == 503, r.text
    before = replicas(url)["far"]["restarts"]
    fleet["procs"]["far"] = remote("far", ports["far"], ports["outbox"], KEY)  # its host's job
    assert wait_for(lambda: replicas(url)["far"]["ready"], 120), replicas(url)["far"]
    assert replicas(url)["far"]["restarts"] == before
    r = complete(url)
    assert r.status_code == 200 and r.headers["x-tailscope-replica"] == "far"


def test_tcp_without_a_key_is_refused_at_start():
    out = subprocess.run([sys.executable, "-m", "engine.replica", "--id", "x", "--model",
                          "tiny:49152", "--inbox", "tcp://127.0.0.1:1", "--outbox",
                          "tcp://127.0.0.1:2"], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items()
                              if k != "TAILSCOPE_REPLICA_KEY"})
    assert out.returncode == 2 and "TAILSCOPE_REPLICA_KEY" in out.stderr
