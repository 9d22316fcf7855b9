"""Every request's record in the embedded ClickHouse store (chDB), through real servers:
exactly one row per request whatever happened, nothing lost while the store is down or across a
SIGTERM, the read-only query endpoint, engine steps, and tenant privacy settings."""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from tests.gateway.conftest import LOAD, start_server, stop_server
from tests.gateway.test_faults import wait_for

ADMIN = "sk-admin-test-0123456789"
CONFIG = """
[[tenants]]
name = "alpha"
keys = ["sk-alpha"]

[[tenants]]
name = "limited"
keys = ["sk-limited"]
requests_per_minute = 1

[[tenants]]
name = "private"
keys = ["sk-private"]
capture = "counts"
ttl_days = 7
"""


@pytest.fixture(scope="module")
def store_server(tmp_path_factory, bundled_path):
    d = tmp_path_factory.mktemp("store-server")
    (d / "tenants.toml").write_text(CONFIG)
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          "--config", str(d / "tenants.toml"),
                          env={"TAILSCOPE_ADMIN_KEY": ADMIN,
                               "TAILSCOPE_FAULT_STORE_DOWN_FILE": str(d / "store-down")})
    server.fault_file = d / "store-down"
    yield server
    stop_server(server)


def query(server, sql: str, params: dict | None = None, key: str | None = ADMIN) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(f"{server.url}/debug/query", json={"sql": sql, "params": params or {}},
                   headers=headers, timeout=60)
    return {"status": r.status_code, **r.json()}


def rows_for(server, trace_ids: list[str], columns: str) -> list[dict]:
    res = query(server, f"SELECT {columns} FROM tailscope.requests "
                        "WHERE has({ids:Array(String)}, trace_id)", {"ids": trace_ids})
    assert res["status"] == 200, res
    return [dict(zip(res["columns"], r, strict=True)) for r in res["rows"]]


def tp() -> tuple[str, dict]:
    trace_id = secrets.token_hex(16)
    return trace_id, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}


def send(server, key: str | None, body: dict, stream: bool = False, cut: bool = False
         ) -> tuple[str, int]:
    trace_id, headers = tp()
    if key:
        headers["Authorization"] = f"Bearer {key}"
    full = {"model": server.model, "prompt": "Once upon a time", **body}
    if not stream:
        r = httpx.post(f"{server.url}/v1/completions", json=full, headers=headers, timeout=60)
        return trace_id, r.status_code
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{server.url}/v1/completions", json={**full, "stream": True},
            headers=headers) as r:
        lines = r.iter_lines()
        for i, _ in enumerate(lines):
            if cut and i >= 6:
                break  # leave mid-stream: the client disconnects
        return trace_id, r.status_code


def test_one_row_per_request_with_the_right_final_state(store_server):
    s = store_server
    sent = [
        (*send(s, "sk-alpha", {"max_tokens": 5, "ignore_eos": True}), "FINISHED", "length"),
        (*send(s, "sk-alpha", {"max_tokens": 5, "ignore_eos": True}, stream=True),
         "FINISHED", "length"),
        (*send(s, "sk-alpha", {"max_tokens": 900, "ignore_eos": True}, stream=True, cut=True),
         "CANCELLED", "cancelled"),
        (*send(s, None, {"max_tokens": 5}), "REJECTED", "rejected"),  # 401
        (*send(s, "sk-alpha", {"max_tokens": 5, "temperature": -1}), "REJECTED", "rejected"),
        (*send(s, "sk-limited", {"max_tokens": 3}), "FINISHED", None),
        (*send(s, "sk-limited", {"max_tokens": 3}), "REJECTED", "rejected"),  # 429
    ]
    # a stop string: the tiny model's text is random, so stop on what it really says
    first = httpx.post(f"{s.url}/v1/completions", headers={"Authorization": "Bearer sk-alpha"},
                       json={"model": s.model, "prompt": "Once upon a time", "max_tokens": 12,
                             "ignore_eos": True, "temperature": 0}, timeout=60).json()
    text = first["choices"][0]["text"]
    stop = next(text[i:i + 3] for i in range(len(text) // 2, len(text) - 2)
                if text[i:i + 3].strip())
    sent.append((*send(s, "sk-alpha", {"max_tokens": 12, "ignore_eos": True,
                                       "temperature": 0, "stop": [stop]}),
                 "FINISHED", "stop_string"))
    assert [status for _, status, _, _ in sent] == [200, 200, 200, 401, 400, 200, 429, 200]
    ids = [t for t, _, _, _ in sent]
    assert wait_for(lambda: len(rows_for(s, ids, "trace_id")) == len(ids), 10)
    rows = {r["trace_id"]: r for r in rows_for(
        s, ids, "trace_id, final_state, finish_reason, http_status, tenant, e2e_ms, "
                "ttft_ms, itl_ms, tail_ms, model_revision, engine_version, tokenizer_revision, "
                "gateway_version, config_id")}
    assert len(rows) == len(ids)  # exactly one row each
    for trace_id, status, state, reason in sent:
        row = rows[trace_id]
        assert row["final_state"] == state and row["http_status"] == status, row
        if reason:
            assert row["finish_reason"] == reason, row
        ttft = row["ttft_ms"] or 0.0
        assert abs(row["e2e_ms"] - (ttft + sum(row["itl_ms"]) + row["tail_ms"])) < 1e-3 * (
            1 + len(row["itl_ms"]))
        if status == 200:
            assert all(row[k] for k in ("model_revision", "engine_version", "tokenizer_revision",
                                        "gateway_version", "config_id"))
    # events, and the engine steps of the replica during a request
    events = query(s, "SELECT state FROM tailscope.request_events WHERE trace_id = {t:String} "
                      "ORDER BY ts, seq", {"t": sent[0][0]})["rows"]
    states = [e[0] for e in events]
    assert states[0] == "RECEIVED" and states[-1] == "END" and "DECODING" in states
    detail = httpx.get(f"{s.url}/debug/requests/{sent[1][0]}",
                       headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert detail["record"]["final_state"] == "FINISHED"
    assert detail["engine_steps"] and all(st["replica"] == "r0"
                                          for st in detail["engine_steps"])


def test_privacy_counts_only_and_ttl(store_server):
    s = store_server
    trace_id, status = send(s, "sk-private", {"max_tokens": 4, "ignore_eos": True})
    assert status == 200
    assert wait_for(lambda: len(rows_for(s, [trace_id], "trace_id")) == 1, 10)
    row = rows_for(s, [trace_id], "input_token_ids, output_token_ids, prompt_tokens, "
                                  "generated_tokens, ttl_days")[0]
    assert row["input_token_ids"] == [] and row["output_token_ids"] == []
    assert row["prompt_tokens"] > 0 and row["generated_tokens"] == 4 and row["ttl_days"] == 7
    # a tenant's rows can be deleted, and only theirs
    others = query(s, "SELECT count() FROM tailscope.requests WHERE tenant != 'private'")
    r = httpx.delete(f"{s.url}/debug/tenants/private/records",
                     headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert r.status_code == 200 and r.json()["deleted_requests"] >= 1
    assert rows_for(s, [trace_id], "trace_id") == []
    assert query(s, "SELECT count() FROM tailscope.request_events WHERE trace_id = {t:String}",
                 {"t": trace_id})["rows"] == [[0]]
    assert query(s, "SELECT count() FROM tailscope.requests WHERE tenant != 'private'")[
        "rows"] == others["rows"]


def test_a_second_tenant_naming_a_trace_id_gets_its_own_and_deletes_stay_apart(store_server):
    """Both callers send the same traceparent: the second tenant's request gets a trace id of
    its own (its record must not stand for the first's), and deleting the first tenant's rows
    leaves the second's record and events."""
    s = store_server
    trace_id = secrets.token_hex(16)
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    got = {}
    for key in ("sk-private", "sk-alpha"):
        r = httpx.post(f"{s.url}/v1/completions", timeout=60, json={
            "model": s.model, "prompt": "Hi", "max_tokens": 2},
            headers={**headers, "Authorization": f"Bearer {key}"})
        assert r.status_code == 200
        got[key] = r.headers["x-tailscope-trace-id"]
    assert got["sk-private"] == trace_id and got["sk-alpha"] != trace_id
    # deleted at once: the rows still in the writer's queue are written first, then deleted
    r = httpx.delete(f"{s.url}/debug/tenants/private/records",
                     headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert r.status_code == 200
    time.sleep(1.5)  # past the flush age: nothing of the deleted tenant lands afterwards
    assert query(s, "SELECT tenant FROM tailscope.requests WHERE trace_id = {t:String}",
                 {"t": trace_id})["rows"] == []
    alpha = got["sk-alpha"]
    assert wait_for(lambda: query(s, "SELECT tenant FROM tailscope.requests WHERE trace_id = "
                                     "{t:String}", {"t": alpha})["rows"] == [["alpha"]], 10)
    events = query(s, "SELECT tenant, count() FROM tailscope.request_events WHERE trace_id = "
                      "{t:String} GROUP BY tenant", {"t": alpha})["rows"]
    assert len(events) == 1 and events[0][0] == "alpha" and events[0][1] > 3


def test_api_key_ids_are_keyed_hashes(store_server):
    import hashlib

    trace_id, status = send(store_server, "sk-alpha", {"max_tokens": 2})
    assert status == 200
    assert wait_for(lambda: len(rows_for(store_server, [trace_id], "trace_id")) == 1, 10)
    kid = rows_for(store_server, [trace_id], "api_key_id")[0]["api_key_id"]
    assert len(kid) == 16 and not hashlib.sha256(b"sk-alpha").hexdigest().startswith(kid)


def test_query_endpoint_is_admin_only_read_only_and_binds_parameters(store_server):
    s = store_server
    trace_id, status = send(s, "sk-alpha", {"max_tokens": 2})
    assert status == 200
    assert wait_for(lambda: len(rows_for(s, [trace_id], "trace_id")) == 1, 10)
    assert query(s, "SELECT 1", key=None)["status"] == 401
    assert query(s, "SELECT 1", key="sk-alpha")["status"] == 403
    for bad in ("DROP TABLE tailscope.requests", "SELECT 1; DROP TABLE tailscope.requests",
                "INSERT INTO tailscope.requests (trace_id) VALUES ('x')"):
        res = query(s, bad)
        assert res["status"] == 400 and res["error"]["param"] == "sql", res
    evil = "x' OR 1=1 OR trace_id != '"
    res = query(s, "SELECT count() FROM tailscope.requests WHERE trace_id = {t:String}",
                {"t": evil})
    assert res["status"] == 200 and res["rows"] == [[0]]
    assert query(s, "SELECT count() FROM tailscope.requests")["rows"][0][0] > 0  # still there
    r = httpx.post(f"{s.url}/debug/query", json={"sql": "SELECT 1 AS one", "format": "arrow"},
                   headers={"Authorization": f"Bearer {ADMIN}"})
    import pyarrow.ipc as ipc

    assert ipc.open_stream(r.content).read_all().to_pydict() == {"one": [1]}


def test_store_down_under_load_loses_and_duplicates_nothing(store_server):
    s = store_server
    s.fault_file.touch()  # fault injection: every insert fails from now on
    try:
        ids = [send(s, "sk-alpha", {"max_tokens": 3, "ignore_eos": True},
                    stream=bool(i % 2))[0] for i in range(16)]
        metrics = lambda: httpx.get(f"{s.url}/metrics").text  # noqa: E731
        assert wait_for(lambda: "tailscope:records_spooled_total 0.0" not in metrics(), 10)
        assert len(rows_for(s, ids, "trace_id")) == 0  # nothing landed while it was down
        time.sleep(1.0)  # a few failed replay attempts too
    finally:
        s.fault_file.unlink()
    assert wait_for(lambda: len(rows_for(s, ids, "trace_id")) == 16, 15)
    time.sleep(1.5)  # give a (wrong) second replay the chance to duplicate
    rows = rows_for(s, ids, "trace_id")
    assert sorted(r["trace_id"] for r in rows) == sorted(ids)  # 16 rows, 16 distinct
    text = httpx.get(f"{s.url}/metrics").text
    assert "tailscope:records_dropped_total 0.0" in text
    assert "tailscope:records_spool_files 0.0" in text


def test_sigterm_under_load_then_restart_keeps_every_answered_request(bundled_path):
    store = f"chdb://{tempfile.mkdtemp(prefix='tailscope-sigterm-')}/store"
    env = {"TAILSCOPE_STORE_DSN": store}
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path), env=env)
    answered: list[str] = []
    client = subprocess.Popen([sys.executable, "-c", LOAD, server.url, server.model],
                              stdout=subprocess.PIPE, text=True)
    time.sleep(3.0)  # under load
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises it
    out, _ = client.communicate(timeout=60)
    answered = [line.split()[0] for line in out.splitlines() if line]
    assert len(answered) >= 5
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path), env=env)
    try:
        rows = rows_for(server, answered, "trace_id")
        got = {r["trace_id"] for r in rows}
        assert got == set(answered) and len(rows) == len(answered)
    finally:
        stop_server(server)


def test_cli_store_query_goes_through_the_gateway(store_server):
    import os

    trace_id, _ = send(store_server, "sk-alpha", {"max_tokens": 2})
    assert wait_for(lambda: len(rows_for(store_server, [trace_id], "trace_id")) == 1, 10)
    out = subprocess.run(
        [sys.executable, "-m", "tailscope.cli", "store", "--url", store_server.url, "query",
         "SELECT count() AS n FROM tailscope.requests WHERE tenant = {t:String}",
         "--param", "t=alpha", "--format", "json"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "TAILSCOPE_ADMIN_KEY": ADMIN})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip())["n"] > 0


def test_query_library_reads_the_embedded_store_through_the_gateway(store_server):
    import datetime as dt

    from tracing import queries as Q

    trace_id, status = send(store_server, "sk-alpha", {"max_tokens": 4, "ignore_eos": True},
                            stream=True)
    assert status == 200
    assert wait_for(lambda: len(rows_for(store_server, [trace_id], "trace_id")) == 1, 10)
    src = Q.GatewaySource(store_server.url, ADMIN)
    now = dt.datetime.now(dt.UTC)
    pct = Q.percentiles(src, now - dt.timedelta(hours=1), now + dt.timedelta(minutes=1),
                        "ttft_ms", by="replica")
    assert list(pct["replica"]) == ["r0"] and pct.at[0, "n"] >= 1
    t = Q.trace(src, trace_id)
    assert t["record"]["trace_id"] == trace_id and t["record"]["emitted_tokens"] == 4
    assert "DECODING" in list(t["events"]["state"]) and len(t["steps"]) > 0
    with pytest.raises(Q.QueryError):
        Q.GatewaySource(store_server.url, "wrong-key").select("SELECT 1")
