"""A gateway of external backends only (``tailscope serve --replicas 0 --backend …``): what a
team with a vLLM or SGLang fleet tries first. It starts no replica and loads no model, serves
the backends' model names alone, is ready while a backend can serve, and records every request
as any other gateway does. The upstream is tests/gateway/fault_upstream.py (a FAULT INJECTOR)
answering as an echo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import start_server, stop_server
from tests.gateway.test_faults import wait_for
from tests.gateway.test_upstream import start_faults
from tracing.client import free_port

BUNDLED = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def gateway():
    port = free_port()
    faults = start_faults(port)
    server = start_server("--replicas", "0", "--backend",
                          f"echo=http://127.0.0.1:{port},model=echo-model,upstream_model=echo",
                          ready_field="ready", timeout_s=120)
    yield server
    stop_server(server)
    faults.kill()
    faults.wait()


def _children(pid: int) -> list[str]:
    """The command lines of ``pid``'s child processes."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue
    return out


def test_it_serves_the_backends_model_and_records_the_request(gateway):
    r = httpx.post(f"{gateway.url}/v1/completions", timeout=30,
                   json={"model": "echo-model", "prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.headers["x-tailscope-replica"] == "echo"
    trace = r.headers["x-tailscope-trace-id"]

    def record():
        got = httpx.get(f"{gateway.url}/debug/requests/{trace}", timeout=10)
        return got.json() if got.status_code == 200 else None

    assert wait_for(lambda: record() is not None, 10)
    rec = record()["record"]
    assert rec["replica"] == "echo" and rec["final_state"] == "FINISHED"


def test_it_serves_no_bundled_model(gateway):
    models = httpx.get(f"{gateway.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["echo-model"]
    r = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                   json={"model": BUNDLED, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "echo-model" in r.json()["error"]["message"]
    doc = httpx.get(f"{gateway.url}/openapi.json", timeout=30).json()
    enum = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]["enum"]
    assert enum == ["echo-model"]


def test_it_is_ready_on_its_backend_and_runs_no_replica_nor_model(gateway):
    ready = httpx.get(f"{gateway.url}/ready", timeout=10)
    assert ready.status_code == 200
    body = ready.json()
    assert body["replicas"] == {} and body["backends"] == {"echo": "ready"}
    assert set(httpx.get(f"{gateway.url}/debug/replicas", timeout=10).json()) == {"echo"}
    children = _children(gateway.proc.pid)
    assert children and not [c for c in children if "engine.replica" in c]  # its store only
    maps = Path(f"/proc/{gateway.proc.pid}/maps").read_text()
    assert "libtorch" not in maps  # no model, no torch, in the gateway itself either


def test_no_replicas_and_no_backends_is_refused_at_start():
    run = subprocess.run([sys.executable, "-m", "tailscope.cli", "serve", "--replicas", "0",
                          "--port", str(free_port())], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "TAILSCOPE_STORE_DSN": "none"})
    assert run.returncode != 0
    assert "no replicas and no backends" in run.stdout + run.stderr
