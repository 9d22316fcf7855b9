"""Several gateways, one store: two gateways of the tiny model write into one store process
(``tailscope store serve`` owns the chDB directory), each under its own instance id. Their
records, events and engine steps all arrive, every id is unique, the query library groups and
filters by instance, and records sent while the store process is down arrive once it is back.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.gateway.conftest import free_port, start_server, stop_server
from tests.gateway.test_faults import replicas, wait_for
from tracing import queries as Q
from tracing.store import QueryRefused, connect

KEY = "store-key-test"


def start_store(path: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tailscope.cli", "store", "--dsn",
                             f"chdb://{path}", "serve", "--port", str(port)],
                            env={**os.environ, "TAILSCOPE_STORE_KEY": KEY})
    ok = wait_for(lambda: _healthy(port) or proc.poll() is not None, 120)
    assert ok and proc.poll() is None, "the store process did not start"
    return proc


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, bundled_path):
    d = tmp_path_factory.mktemp("fleet")
    port = free_port()
    store = start_store(str(d / "store"), port)
    dsn = f"tailscope://127.0.0.1:{port}"
    common = ("--model", "tiny:49152", "--tokenizer", str(bundled_path))
    env = {"TAILSCOPE_STORE_DSN": dsn, "TAILSCOPE_STORE_KEY": KEY}
    a = start_server(*common, env={**env, "TAILSCOPE_INSTANCE_ID": "auto",
                                   "TAILSCOPE_SPOOL_DIR": str(d / "spool-a")})
    b = start_server(*common, env={**env, "TAILSCOPE_INSTANCE_ID": "gw-b",
                                   "TAILSCOPE_SPOOL_DIR": str(d / "spool-b")})
    out = {"a": a, "b": b, "dsn": dsn, "port": port, "store": store, "dir": d}
    yield out
    stop_server(a)
    stop_server(b)
    out["store"].terminate()  # (the last test starts it again)
    out["store"].wait(timeout=30)


def send(url: str, n: int) -> list[str]:
    out = []
    for i in range(n):
        r = httpx.post(f"{url}/v1/completions", json={
            "model": "SmolLM2-135M-Instruct", "prompt": f"request {i} to {url}",
            "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        out.append(r.headers["x-tailscope-trace-id"])
    return out


def stored(store, sql: str, params: dict | None = None) -> list[dict]:
    cols, rows = store.select(sql, params or {})
    return [dict(zip(cols, r, strict=True)) for r in rows]


def test_two_gateways_write_into_one_store_under_their_instance_ids(fleet):
    a, b = fleet["a"], fleet["b"]
    port_a = int(a.url.rsplit(":", 1)[1])
    inst_a = f"{socket.gethostname()}:{port_a}"  # TAILSCOPE_INSTANCE_ID=auto
    assert set(replicas(a.url)) == {f"{inst_a}/r0"}
    assert set(replicas(b.url)) == {"gw-b/r0"}
    traces = {"a": send(a.url, 4), "b": send(b.url, 3)}
    store = connect(fleet["dsn"], key=KEY)
    every = traces["a"] + traces["b"]

    def rows() -> list[dict]:
        return stored(store, "SELECT trace_id, instance, replica FROM tailscope.requests "
                             "WHERE trace_id IN {t:Array(String)}", {"t": every})
    assert wait_for(lambda: len(rows()) == len(every), 30), rows()
    got = rows()
    assert len({r["trace_id"] for r in got}) == len(every)  # one row each, ids unique
    by_trace = {r["trace_id"]: r for r in got}
    assert all(by_trace[t]["instance"] == inst_a and by_trace[t]["replica"] == f"{inst_a}/r0"
               for t in traces["a"])
    assert all(by_trace[t]["instance"] == "gw-b" and by_trace[t]["replica"] == "gw-b/r0"
               for t in traces["b"])
    events = stored(store, "SELECT instance, count() AS n, uniqExact(trace_id) AS t FROM "
                           "tailscope.request_events WHERE trace_id IN {t:Array(String)} "
                           "GROUP BY instance ORDER BY instance", {"t": every})
    assert {e["instance"]: e["t"] for e in events} == {inst_a: 4, "gw-b": 3}
    assert wait_for(lambda: {s["instance"]: s["replica"] for s in stored(
        store, "SELECT DISTINCT instance, replica FROM tailscope.engine_steps")} == {
        inst_a: f"{inst_a}/r0", "gw-b": "gw-b/r0"}, 30)

    # the query library: grouped by instance, and filtered to one
    start, end = time.time() - 600, time.time() + 60
    pct = Q.percentiles(store, start, end, metric="e2e_ms", by="instance")
    counts = dict(zip(pct["instance"], pct["n"], strict=True))
    assert counts[inst_a] >= 4 and counts["gw-b"] >= 3
    only_b = Q.slowest(store, start, end, filters={"instance": "gw-b"}, limit=100)
    assert set(only_b["instance"]) == {"gw-b"} and set(traces["b"]) <= set(only_b["trace_id"])
    # each gateway's /debug/requests finds the other's trace in the shared store
    r = httpx.get(f"{a.url}/debug/requests/{traces['b'][0]}", timeout=30)
    assert r.status_code == 200 and r.json()["record"]["instance"] == "gw-b"
    assert r.json()["engine_steps"] and all(s["replica"] == "gw-b/r0"
                                            for s in r.json()["engine_steps"])


def test_the_drill_down_filters_the_shared_store_by_instance(fleet, monkeypatch):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    send(fleet["b"].url, 1)
    monkeypatch.setenv("TAILSCOPE_DRILL_SOURCE", fleet["dsn"])
    monkeypatch.setenv("TAILSCOPE_STORE_KEY", KEY)
    app = str(Path(__file__).resolve().parents[2] / "dashboards" / "drill.py")
    at = AppTest.from_file(app, default_timeout=120)
    at.run()
    at.sidebar.radio(key="page").set_value("Requests")
    at.run()
    assert len(set(at.dataframe[0].value["instance"])) == 2  # both gateways' requests
    at.text_input(key="rq_i").set_value("gw-b")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert set(at.dataframe[0].value["instance"]) == {"gw-b"}


def test_the_store_process_keeps_its_read_path_and_its_key(fleet):
    store = connect(fleet["dsn"], key=KEY)
    with pytest.raises(QueryRefused):
        store.select("DROP TABLE tailscope.requests")
    r = httpx.post(f"http://127.0.0.1:{fleet['port']}/v1/select", json={"sql": "SELECT 1"},
                   headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_store_key"
    for bad in (b"not json", b"[1, 2]", b'{"sql": 5}'):  # a clear 400, never a 500
        r = httpx.post(f"http://127.0.0.1:{fleet['port']}/v1/select", content=bad,
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_body", r.text
    assert stored(store, "SELECT count() AS n FROM tailscope.requests")[0]["n"] >= 0
    r = httpx.post(f"http://127.0.0.1:{fleet['port']}/v1/select", timeout=10,
                   json={"sql": "SELECT nan AS x, [nan] AS y"},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["rows"] == [[None, [None]]], r.text


def test_records_sent_while_the_store_process_is_down_arrive_when_it_is_back(fleet):
    a = fleet["a"]
    fleet["store"].terminate()
    fleet["store"].wait(timeout=30)
    traces = send(a.url, 3)  # the gateway serves on; its writer spools
    spool = fleet["dir"] / "spool-a"
    assert wait_for(lambda: any(spool.glob("*")), 20), "nothing was spooled"
    fleet["store"] = start_store(str(fleet["dir"] / "store"), fleet["port"])
    store = connect(fleet["dsn"], key=KEY)
    assert wait_for(lambda: len(stored(
        store, "SELECT trace_id FROM tailscope.requests WHERE trace_id IN {t:Array(String)}",
        {"t": traces})) == 3, 60)
