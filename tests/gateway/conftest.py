from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from tracing.client import (  # noqa: F401
    GatewayProcess,
    GatewayStartError,
    free_port,
    stop_process,
)


@contextmanager
def inprocess_client(model, tokenizer_path, engine_config, tokenizer=None, **config
                     ) -> Iterator:
    """A TestClient on a gateway over the in-process backend (a real engine of ``model``, no
    replica subprocess), with its records in ``client.sink``; ``tokenizer`` (the engine's)
    gives the engine a grammar compiler for response_format and tool calls; ``config``: more
    ``GatewayConfig`` fields."""
    from starlette.testclient import TestClient

    from engine import Engine
    from engine.constrained import GrammarCompiler
    from gateway.app import GatewayConfig, create_app
    from gateway.inprocess import InProcessBackend
    from tracing.sinks import MemorySink

    grammar = None if tokenizer is None else GrammarCompiler.from_tokenizer(
        tokenizer, model.config.vocab_size)
    sink = MemorySink(100)
    app = create_app(GatewayConfig(model="tiny:49152", tokenizer=str(tokenizer_path),
                                   engine=engine_config, **config), extra_sinks=[sink],
                     backend=InProcessBackend(Engine(model, engine_config, grammar=grammar)))
    with TestClient(app) as client:
        client.sink = sink
        yield client


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    model: str = "SmolLM2-135M-Instruct"


def start_server(*args: str, timeout_s: float = 240.0, env: dict[str, str] | None = None,
                 ready_field: str = "all_ready") -> Server:
    store = tempfile.mkdtemp(prefix="tailscope-test-store-")  # chDB: one directory per process
    gw = GatewayProcess(list(args), env={
        "TAILSCOPE_KV_CACHE_MB": "64", "TAILSCOPE_STORE_DSN": f"chdb://{store}/store",
        "TAILSCOPE_STORE_FLUSH_S": "0.5",
        # one gateway per store: replica ids stay "r0", "r1" (test_instances.py runs several)
        "TAILSCOPE_INSTANCE_ID": "", **(env or {})}, ready_timeout_s=timeout_s,
        ready_field=ready_field)
    try:
        gw.start()
    except GatewayStartError as exc:
        raise AssertionError(f"gateway never became ready: {exc}") from None
    return Server(gw.url, gw.proc)


def stop_server(server: Server) -> None:
    stop_process(server.proc, 20)


@pytest.fixture(scope="session")
def records_file(tmp_path_factory):
    return tmp_path_factory.mktemp("records") / "records.jsonl"


@pytest.fixture(scope="session")
def tiny_server(bundled_path, records_file):
    """The gateway with one replica of the tiny model (sized to the bundled tokenizer),
    writing its records to ``records_file``."""
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          "--records-jsonl", str(records_file))
    yield server
    stop_server(server)


# A load generator in its own process: prints "trace_id wall_time" for every 200.
LOAD = r"""
import sys, secrets, threading, time, httpx
url, model = sys.argv[1], sys.argv[2]
lock = threading.Lock()
def worker():
    with httpx.Client(timeout=30) as http:
        while True:
            tid = secrets.token_hex(16)
            try:
                r = http.post(url + "/v1/completions", headers={
                    "traceparent": f"00-{tid}-{secrets.token_hex(8)}-01"}, json={
                    "model": model, "prompt": "Once upon a time", "max_tokens": 8,
                    "ignore_eos": True})
            except httpx.HTTPError:
                return
            if r.status_code == 200:
                with lock:
                    print(tid, time.time(), flush=True)
threads = [threading.Thread(target=worker) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
"""
