"""Client-side helpers, one copy each, for the CLI tools, benchmarks, evals and tests: a free
loopback port, a gateway in a child process that is ready once started, and the JSON payload of
a streamed response's SSE line. (The ``/debug/query`` client is ``tracing.queries.GatewaySource``.)

They talk to a gateway over HTTP and import nothing of it, so every layer may use them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tracing.sse import data_of


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (a gateway or store process then drains), SIGKILL if it is still there after
    ``timeout_s``; returns once it has exited."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port() -> int:
    """A free loopback port for a process that binds it later (a gateway, a replica's inbox, an
    upstream server), outside the kernel's ephemeral range: a port from ``bind(0)`` lies inside
    it, and an outgoing connection can take it before a slow starter binds it (seen in CI: a
    replica's inbox was taken while it imported torch: EADDRINUSE)."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999  # Linux's default
    spans = [(a, b) for a, b in ((10000, lo), (hi + 1, 65536)) if b - a > 100]
    for _ in range(200 if spans else 0):
        start, end = random.choice(spans)
        port = random.randrange(start, end)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:  # no room outside the ephemeral range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayStartError(RuntimeError):
    pass


class GatewayProcess:
    """``tailscope serve ARGS --port N`` in a child process, started when ``/ready`` says every
    replica is up; stopped with SIGTERM (the gateway drains its record writer), killed if it
    does not exit in time. A context manager."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 ready_timeout_s: float = 300.0, log: str | Path | None = None,
                 cwd: str | Path | None = None, quiet: bool = False,
                 ready_field: str = "all_ready", module: str = "tailscope.cli") -> None:
        """``ready_field``: what of ``/ready`` must be true (``ready``: one replica is up);
        ``module``: what ``python -m`` runs (a bench's wrapper of the CLI)."""
        self.args, self.cwd, self.log, self.module = list(args), cwd, log, module
        self.ready_field = ready_field
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout_s = ready_timeout_s
        self.quiet = quiet  # discard its output (else inherited, or appended to ``log``)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> GatewayProcess:
        import httpx

        out = open(self.log, "ab") if self.log else (subprocess.DEVNULL if self.quiet else None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, "serve", *self.args, "--port",
             str(self.port)], env=self.env, cwd=self.cwd, stdout=out,
            stderr=subprocess.STDOUT if out is not None else None)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise GatewayStartError(f"the gateway exited with {self.proc.returncode} during "
                                        "start-up" + (f"; see {self.log}" if self.log else ""))
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).json().get(self.ready_field):
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        self.stop()
        raise GatewayStartError(f"the gateway was not ready in {self.ready_timeout_s:.0f} s")

    def wait_compiled(self, timeout_s: float = 900.0) -> set[str]:
        """Until no replica's compiled decode step is still building (``/debug/replicas``'
        ``compile``: a replica serves on the eager step meanwhile); the states then, with
        ``compiling`` among them where ``timeout_s`` ran out."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            states = {r["compile"] for r in
                      httpx.get(f"{self.url}/debug/replicas", timeout=10).json().values()}
            if "compiling" not in states or time.monotonic() > deadline:
                return states
            time.sleep(0.5)

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout_s)

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def sse_json(line: str) -> dict | None:
    """The JSON object of one line of an OpenAI-style event stream; None for anything else
    (blank lines, comments, ``data: [DONE]``)."""
    data = data_of(line)
    return None if data is None else json.loads(data)
