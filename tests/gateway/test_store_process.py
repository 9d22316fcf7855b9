"""The embedded store in a supervised child process (``TAILSCOPE_STORE_PROCESS=1``): killed
mid-load, it is started again and no record is lost or stored twice (the writer spools while
it is down and replays with the same insert tokens); and it does not outlive its gateway."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import psutil

from tests.gateway.conftest import start_server, stop_server
from tests.gateway.test_faults import wait_for


def child(url: str) -> dict:
    return httpx.get(f"{url}/debug/config", timeout=10).json()["store_process"]


def test_the_store_child_killed_mid_load_loses_and_duplicates_nothing(bundled_path):
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          env={"TAILSCOPE_STORE_PROCESS": "1"})
    try:
        first = child(server.url)
        assert first["alive"] and first["pid"] != server.proc.pid
        traces, errors = [], []

        def load(k: int) -> None:
            with httpx.Client(timeout=60) as http:
                for i in range(15):
                    r = http.post(f"{server.url}/v1/completions", json={
                        "model": "SmolLM2-135M-Instruct", "prompt": f"load {k} {i}",
                        "max_tokens": 4, "temperature": 0})
                    (traces if r.status_code == 200 else errors).append(
                        r.headers.get("x-tailscope-trace-id") or r.text)

        threads = [threading.Thread(target=load, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        assert wait_for(lambda: len(traces) >= 10, 60)
        os.kill(first["pid"], signal.SIGKILL)  # mid-load
        for t in threads:
            t.join()
        assert not errors and len(traces) == 45  # the gateway served on
        assert wait_for(lambda: child(server.url)["restarts"] == 1
                        and child(server.url)["alive"], 30), child(server.url)

        def counts() -> dict:
            r = httpx.post(f"{server.url}/debug/query", json={
                "sql": "SELECT trace_id, count() AS n FROM tailscope.requests WHERE trace_id "
                       "IN {t:Array(String)} GROUP BY trace_id", "params": {"t": traces}},
                timeout=30)
            return dict(r.json()["rows"]) if r.status_code == 200 else {}
        assert wait_for(lambda: len(counts()) == len(traces), 60), len(counts())
        assert set(counts().values()) == {1}  # every one once: the replays did not duplicate
        pid = child(server.url)["pid"]
        # neither process loaded pandas (~40 MB each) though both made or inserted Arrow
        # tables and read rows: pyarrow's probe for pandas objects is skipped
        # (tracing.arrow.skip_pandas_probe), and only a large batch (chDB's Python()) needs it
        for proc in (server.proc.pid, pid):
            assert not [m.path for m in psutil.Process(proc).memory_maps()
                        if f"{os.sep}pandas{os.sep}" in m.path]
    finally:
        server.proc.kill()  # SIGKILL: no shutdown path runs
        server.proc.wait()
    # the orphaned store child notices and stops (its store is closed, not left locked)
    assert wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status()
                    == psutil.STATUS_ZOMBIE, 15)


def test_a_clean_stop_drains_into_the_child_then_stops_it(bundled_path, tmp_path):
    dsn = f"chdb://{tmp_path}/store"
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          env={"TAILSCOPE_STORE_PROCESS": "1", "TAILSCOPE_STORE_DSN": dsn,
                               "TAILSCOPE_STORE_FLUSH_S": "60"})  # nothing written before the stop
    pid = child(server.url)["pid"]
    r = httpx.post(f"{server.url}/v1/completions", json={
        "model": "SmolLM2-135M-Instruct", "prompt": "last words", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    stop_server(server)  # SIGTERM: the writer drains into the child, then the child stops
    assert wait_for(lambda: not psutil.pid_exists(pid), 10)
    # the directory is free again and holds the record (read in another process: chDB opens
    # one directory per process, and this one has the session's store)
    out = subprocess.run(
        [sys.executable, "-m", "tailscope.cli", "store", "--dsn", dsn, "query",
         "SELECT count() FROM tailscope.requests WHERE trace_id = {t:String}", "--param",
         f"t={r.headers['x-tailscope-trace-id']}"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "TAILSCOPE_GATEWAY_URL": "http://127.0.0.1:9"})
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "1", out.stderr[-500:]


# Run a command as a terminal's foreground job: a session of its own with the pty on stdin,
# stdout and stderr as its controlling terminal, and ``stty tostop`` (a background job that
# writes to the terminal is stopped) turned on.
AS_FOREGROUND_JOB = """
import fcntl, os, sys, termios
os.setsid()
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
attrs = termios.tcgetattr(0)
attrs[3] |= termios.TOSTOP
termios.tcsetattr(0, termios.TCSANOW, attrs)
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def test_ctrl_c_at_a_terminal_stops_the_gateway_its_replica_and_its_store_child_cleanly(
        bundled_path, tmp_path):
    """A terminal's Ctrl-C signals its whole foreground process group. The replica and the
    store child were in it: the replica died mid-shutdown with a KeyboardInterrupt traceback
    and the supervisor started it again while the gateway stopped, and the gateway ended on a
    traceback of its own. They now run in sessions of their own (not in a process group of
    the gateway's session, where ``stty tostop`` would stop them at their first log line: this
    terminal has it on). Ctrl-C typed at a pty: every record still queued is drained into
    the store, both children stop, and the gateway exits 130 with no traceback."""
    import pty

    from tracing.client import free_port

    dsn, port = f"chdb://{tmp_path}/store", free_port()
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", AS_FOREGROUND_JOB, "-m", "tailscope.cli", "serve", "--model",
         "tiny:49152", "--tokenizer", str(bundled_path), "--port", str(port)],
        env={**os.environ, "TAILSCOPE_STORE_DSN": dsn, "TAILSCOPE_KV_CACHE_MB": "64",
             "TAILSCOPE_STORE_FLUSH_S": "60",  # every record still queued at the signal
             "TAILSCOPE_INSTANCE_ID": ""},
        stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    output = bytearray()

    def drain() -> None:  # the terminal's screen: read, or the writers block on a full pty
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # every writer closed the slave
                return
            if not data:
                return
            output.extend(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            assert proc.poll() is None, output.decode(errors="replace")[-2000:]
            try:
                return httpx.get(f"{url}/ready", timeout=2).json().get("all_ready", False)
            except (httpx.HTTPError, ValueError):
                return False
        assert wait_for(ready, 240), output.decode(errors="replace")[-2000:]
        children = psutil.Process(proc.pid).children(recursive=True)
        assert sorted("replica" if "engine.replica" in c.cmdline() else "store"
                      if "store" in c.cmdline() else c.name() for c in children) == \
            ["replica", "store"]
        traces = []
        for i in range(5):
            r = httpx.post(f"{url}/v1/completions", json={
                "model": "SmolLM2-135M-Instruct", "prompt": f"bye {i}", "max_tokens": 3},
                timeout=60)
            assert r.status_code == 200, r.text
            traces.append(r.headers["x-tailscope-trace-id"])
        os.write(master, b"\x03")  # Ctrl-C, typed
        assert proc.wait(60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    def gone(c: psutil.Process) -> bool:
        try:
            return c.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:  # reaped (between a check and the next, too)
            return True
    assert wait_for(lambda: all(gone(c) for c in children), 15)
    reader.join(5)
    os.close(master)
    text = output.decode(errors="replace")
    assert "Traceback" not in text and "restarting" not in text, text[-3000:]
    assert "Application shutdown complete" in text  # the terminal showed the gateway's log
    out = subprocess.run(
        [sys.executable, "-m", "tailscope.cli", "store", "--dsn", dsn, "query",
         "SELECT count() FROM tailscope.requests WHERE trace_id IN {t:Array(String)}",
         "--param", f"t={json.dumps(traces)}"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "TAILSCOPE_GATEWAY_URL": "http://127.0.0.1:9"})
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "5", out.stderr[-500:]


def test_a_store_child_that_cannot_start_stops_the_gateway_and_its_replicas(bundled_path,
                                                                            tmp_path):
    """The store child starts while the replicas load (the gateway waits for both before it
    serves): where it cannot (here: another store process holds the directory), the gateway
    exits saying so, and takes the replicas it started with it."""
    from gateway.store_api import StoreProcess
    from tracing.client import free_port

    dsn = f"chdb://{tmp_path}/store"
    holder = StoreProcess(dsn)
    holder.start()
    try:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tailscope.cli", "serve", "--model", "tiny:49152",
             "--tokenizer", str(bundled_path), "--port", str(port)],
            env={**os.environ, "TAILSCOPE_STORE_DSN": dsn}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode != 0 and "did not start" in out, out[-3000:]
        left = [p for p in psutil.process_iter(["cmdline"])
                if f"vm:{port}/" in " ".join(p.info["cmdline"] or [])]
        assert left == []
    finally:
        holder.close()
