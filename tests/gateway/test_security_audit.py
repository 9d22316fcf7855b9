"""The second security audit's findings on the gateway's own surfaces, each reproduced over
real HTTP against a real gateway (open local mode, the tiny model): debug routes and DNS
rebinding, where replays are sent, secrets in what the gateway shows, keys it refuses."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import httpx
import pytest

from tests.gateway.conftest import start_server, stop_server


@pytest.fixture(scope="module")
def open_server(bundled_path):
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          "--backend", "up=http://user:hunter2-secret@127.0.0.1:9/v1,"
                          "probe_interval_s=0")
    yield server
    stop_server(server)


def test_debug_routes_refuse_a_host_that_is_not_this_gateway(open_server):
    """A page on attacker.example whose name was re-pointed at 127.0.0.1 reaches the gateway
    from loopback, but says so in Host."""
    url = open_server.url
    port = url.rsplit(":", 1)[1]
    for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.attacker.example"):
        r = httpx.post(f"{url}/debug/query", json={"sql": "SELECT 1"},
                       headers={"Host": host}, timeout=30)
        assert r.status_code == 421 and r.json()["error"]["code"] == "misdirected_request", (
            host, r.text)
        r = httpx.get(f"{url}/debug/replicas", headers={"Host": host}, timeout=30)
        assert r.status_code == 421, host
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost",
                 f"{socket.gethostname()}:{port}"):
        r = httpx.post(f"{url}/debug/query", json={"sql": "SELECT 1"},
                       headers={"Host": host}, timeout=30)
        assert r.status_code == 200, (host, r.text)
    # the API itself is not a debug route: any Host (a proxy's) is fine there
    r = httpx.get(f"{url}/v1/models", headers={"Host": "api.example"}, timeout=30)
    assert r.status_code == 200


class Listener:
    """Whatever connects to it is written down (it answers nothing)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.received = b""
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.settimeout(2)
            try:
                self.received += conn.recv(65536)
            except OSError:
                pass
            conn.close()


def test_replay_goes_to_this_gateway_whatever_host_the_caller_names(open_server):
    url = open_server.url
    r = httpx.post(f"{url}/v1/completions", json={
        "model": open_server.model, "prompt": "replay me", "max_tokens": 3,
        "temperature": 0}, timeout=60)
    assert r.status_code == 200
    trace_id = r.headers["x-tailscope-trace-id"]
    other = Listener()
    r = httpx.post(f"{url}/debug/replay", json={"trace_id": trace_id},
                   headers={"Host": f"127.0.0.1:{other.port}",
                            "Authorization": "Bearer sk-secret-of-the-caller"}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["identical"] is True
    assert other.received == b""  # neither the prompt nor the caller's key went there
    other.sock.close()


def test_backend_passwords_never_show(open_server):
    r = httpx.get(f"{open_server.url}/debug/config", timeout=30)
    assert r.status_code == 200
    assert "hunter2-secret" not in r.text
    (backend,) = r.json()["config"]["backends"]
    assert backend["url"] == "http://user:***@127.0.0.1:9/v1"
    replicas = httpx.get(f"{open_server.url}/debug/replicas", timeout=30)
    assert replicas.status_code == 200 and "hunter2-secret" not in replicas.text
    configs = httpx.post(f"{open_server.url}/debug/query", json={
        "sql": "SELECT * FROM tailscope.configs"}, timeout=30)
    assert configs.status_code == 200 and "hunter2-secret" not in configs.text


@pytest.mark.parametrize("name,value,says", [
    ("TAILSCOPE_ADMIN_KEY", "REPLACE-ME", "placeholder"),
    ("TAILSCOPE_ADMIN_KEY", "short-key", "at least 16"),
    ("TAILSCOPE_REPLICA_KEY", "replace-me-with-a-real-key", "placeholder"),
])
def test_a_placeholder_or_short_key_refuses_to_start(name, value, says, tmp_path):
    out = subprocess.run([sys.executable, "-m", "tailscope.cli", "serve", "--model",
                          "tiny:49152", "--port", "9"], capture_output=True, text=True,
                         timeout=120, env={**_env(), name: value,
                                           "TAILSCOPE_STORE_DSN": "none"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert name in out.stderr and says in out.stderr


def test_a_replica_with_a_placeholder_key_refuses_to_start():
    out = subprocess.run([sys.executable, "-m", "engine.replica", "--id", "x", "--model",
                          "tiny:49152", "--inbox", "tcp://127.0.0.1:1", "--outbox",
                          "tcp://127.0.0.1:2"], capture_output=True, text=True, timeout=120,
                         env={**_env(), "TAILSCOPE_REPLICA_KEY": "REPLACE-ME"})
    assert out.returncode == 2 and "placeholder" in out.stderr


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("TAILSCOPE_")}
