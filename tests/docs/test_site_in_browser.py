"""The built docs site as a reader sees it: every page opened in headless Chromium (Debian's
``chromium``, which ``make test`` installs) over loopback HTTP, with no console error, no
uncaught exception and no failed load. The browser is driven over its DevTools protocol
(``websockets``, already a dependency of the drill-down's Streamlit), one tab for every page.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request

import pytest

from tracing.client import free_port


@pytest.fixture(scope="module")
def site(built_site):
    run, out = built_site
    assert run.returncode == 0, run.stdout + run.stderr
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(out)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield out, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    exe = shutil.which("chromium")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (make test installs Debian's package)")
        pytest.skip("chromium is not installed (make test installs Debian's package)")
    port = free_port()
    proc = subprocess.Popen([exe, "--headless=new", "--no-sandbox", "--disable-gpu",
                             f"--remote-debugging-port={port}",
                             f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
                             "about:blank"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as r:
                    pages = [t for t in json.load(r) if t["type"] == "page"]
                if pages:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("chromium's DevTools endpoint did not answer")
            time.sleep(0.2)
        yield pages[0]["webSocketDebuggerUrl"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class Tab:
    """One DevTools session: send commands, collect the events that say a page is broken."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.next_id = 0
        self.errors: list[str] = []
        self.loaded = False
        for method in ("Page.enable", "Runtime.enable", "Log.enable"):
            self.call(method)

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = self._read(30)
            if msg.get("id") == self.next_id:
                return msg

    def _read(self, timeout: float) -> dict:
        msg = json.loads(self.ws.recv(timeout=timeout))
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Runtime.exceptionThrown":
            self.errors.append(params["exceptionDetails"].get("exception", {}).get(
                "description") or params["exceptionDetails"].get("text", ""))
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.errors.append(" ".join(str(a.get("value", a.get("description", "")))
                                        for a in params.get("args", [])))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.errors.append(f"{params['entry']['text']} {params['entry'].get('url', '')}")
        elif method == "Page.loadEventFired":
            self.loaded = True
        return msg

    def open(self, url: str) -> list[str]:
        self.errors, self.loaded = [], False
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + 30
        while not self.loaded and time.monotonic() < deadline:
            self._read(deadline - time.monotonic())
        settle = time.monotonic() + 0.3  # scripts that run after load (search index, palette)
        while True:
            try:
                self._read(max(0.01, settle - time.monotonic()))
            except TimeoutError:
                break
            if time.monotonic() > settle:
                break
        assert self.loaded, f"{url} did not finish loading"
        return self.errors


def test_every_page_loads_without_console_errors(site, browser):
    root, base = site
    pages = sorted(p.relative_to(root).as_posix() for p in root.rglob("index.html"))
    assert len(pages) > 30  # the whole site, not a stub
    from websockets.sync.client import connect

    broken = {}
    with connect(browser, max_size=None, open_timeout=30) as ws:
        tab = Tab(ws)
        for page in pages:
            errors = tab.open(f"{base}/{page}")
            if errors:
                broken[page] = errors
    assert not broken
