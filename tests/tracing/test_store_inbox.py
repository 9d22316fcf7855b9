"""A store process on the same host takes a batch as an Arrow file in its inbox (the gateway's
own store child, ``TAILSCOPE_STORE_PROCESS=1``): the rows arrive as sent, each file is gone once
taken, and a name that is not one of the inbox's files is refused."""

from __future__ import annotations

import secrets
import time

import httpx
import pyarrow as pa
import pytest
from fastapi.testclient import TestClient

from tests.tracing.test_store import make_record
from tracing.arrow import records_to_arrow
from tracing.record import RecordEvent
from tracing.store_server import create_app


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    from gateway.store_api import StoreProcess

    proc = StoreProcess(f"chdb://{tmp_path_factory.mktemp('inbox')}/store")
    proc.start()
    yield proc
    proc.close()


def test_a_batch_handed_over_as_a_file_arrives_and_the_file_is_gone(child, monkeypatch):
    from tracing import store_server
    from tracing.store_server import RemoteStore

    written = []  # the files handed over (a spy: each is written as it would be)
    real = store_server._write_inbox_file
    monkeypatch.setattr(store_server, "_write_inbox_file",
                        lambda *a: written.append(real(*a)) or written[-1])
    store = RemoteStore(child.url, child.key, inbox=child.inbox)
    now = time.time_ns() // 1000  # inside the rows' TTL
    recs = [make_record(input_token_ids=list(range(i, i + 5)), itl_ms=[0.25] * i,
                        events=[RecordEvent(now + j, "S", f"d{j}") for j in range(3)])
            for i in range(30)]
    requests, events = records_to_arrow(recs)
    token = f"tok-{secrets.token_hex(4)}"
    for _ in range(2):  # a re-sent batch (a spool replay) inserts nothing
        store.insert("requests", requests, token)
        store.insert("request_events", events, token)
    ids = {"ids": [r.trace_id for r in recs]}
    got = store.select_arrow("SELECT * FROM tailscope.requests WHERE trace_id IN "
                             "{ids:Array(String)}", ids).select(requests.column_names)
    assert got.sort_by("trace_id").to_pylist() == requests.sort_by("trace_id").to_pylist()
    n = store.select("SELECT count() FROM tailscope.request_events WHERE trace_id IN "
                     "{ids:Array(String)}", ids)[1][0][0]
    assert n == events.num_rows == 90
    assert len(written) == 4 and all(p.parent == child.inbox for p in written)
    assert list(child.inbox.iterdir()) == []  # every file taken and deleted
    store.close()


def test_a_name_that_is_not_an_inbox_file_is_refused(child, tmp_path):
    outside = tmp_path / "x.arrow"
    outside.write_bytes(b"not arrow")
    url = f"http://127.0.0.1:{child.port}/v1/insert/requests"
    headers = {"Authorization": f"Bearer {child.key}"}
    for name in (str(outside), f"../{outside.name}", "0" * 32 + ".requests.arrow"):
        r = httpx.post(url, params={"file": name}, headers=headers, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_batch", r.text
    assert outside.exists()  # nothing outside the inbox is read or deleted


def test_a_store_process_without_an_inbox_says_so(store):
    client = TestClient(create_app(store, key="k"))
    r = client.post("/v1/insert/requests", params={"file": "0" * 32 + ".requests.arrow"},
                    headers={"Authorization": "Bearer k"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_inbox", r.text
    # the body route still works there
    sink = pa.BufferOutputStream()
    requests, _ = records_to_arrow([make_record()])
    with pa.ipc.new_stream(sink, requests.schema) as w:
        w.write_table(requests)
    r = client.post("/v1/insert/requests", content=sink.getvalue().to_pybytes(),
                    headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and r.json()["rows"] == 1, r.text


def test_a_file_chdb_cannot_take_is_refused_with_its_reason_and_nothing_lands(child):
    """The inbox's small files are read by chDB itself (``INSERT ... FROM INFILE``): a column
    of the wrong kind, or one the table lacks, is ClickHouse's 400 as it would be for the same
    batch sent as a body, no row of the file lands, and the file is deleted."""
    from tracing.store_server import RemoteStore, _write_inbox_file

    requests, _ = records_to_arrow([make_record() for _ in range(3)])
    e2e = requests.column_names.index("e2e_ms")
    wrong_kind = requests.set_column(e2e, "e2e_ms", pa.array(["slow"] * 3))
    extra = requests.append_column("no_such_column", pa.array([1, 2, 3]))
    url = f"http://127.0.0.1:{child.port}/v1/insert/requests"
    headers = {"Authorization": f"Bearer {child.key}"}
    for bad, reason in ((wrong_kind, "Cannot parse string 'slow' as Float64"),
                        (extra, "no_such_column")):
        path = _write_inbox_file(child.inbox, "requests", bad)
        r = httpx.post(url, params={"file": path.name}, headers=headers, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "store_error", r.text
        assert reason in r.json()["error"]["message"], r.text
        assert not path.exists()
    store = RemoteStore(child.url, child.key, inbox=child.inbox)
    ids = {"ids": requests.column("trace_id").to_pylist()}
    assert store.select("SELECT count() FROM tailscope.requests WHERE trace_id IN "
                        "{ids:Array(String)}", ids)[1][0][0] == 0
    store.close()


def test_a_writers_flush_is_one_request_and_a_failure_names_what_landed(child):
    """``RemoteStore.insert_many`` (the writer's flush: requests, events, steps) hands the
    three files over in one request; sent again under the same tokens it inserts nothing. A
    batch whose second table ClickHouse refuses stops there: the error names the first table
    as inserted, the third is not, and every file of the batch is deleted."""
    from bench.trace_overhead import step_rows
    from tracing.arrow import to_arrow
    from tracing.schema import TABLES
    from tracing.store import InsertStopped
    from tracing.store_server import RemoteStore

    store = RemoteStore(child.url, child.key, inbox=child.inbox)
    posts = []  # the requests sent (a spy: each is sent as it would be)
    real = store._send
    store._send = lambda path, **kw: posts.append(path) or real(path, **kw)
    now = time.time_ns() // 1000
    recs = [make_record(events=[RecordEvent(now + j, "S") for j in range(2)]) for _ in range(5)]
    requests, events = records_to_arrow(recs)
    steps = step_rows(4, 2)
    replica = f"r-{secrets.token_hex(4)}"
    for row in steps:
        row.replica = replica
    tables = {"requests": requests, "request_events": events,
              "engine_steps": to_arrow(TABLES["engine_steps"], steps)}
    token = f"tok-{secrets.token_hex(4)}"
    for _ in range(2):
        store.insert_many([(t, data, f"{token}-{t}") for t, data in tables.items()])
    assert posts == ["/v1/insert", "/v1/insert"]
    ids = {"ids": [r.trace_id for r in recs]}
    count = ("SELECT count() FROM tailscope.{t:Identifier} WHERE trace_id IN "
             "{ids:Array(String)}")
    assert [store.select(count, {"t": t, **ids})[1][0][0] for t in tables if t != "engine_steps"
            ] == [5, 10]
    assert store.select("SELECT count() FROM tailscope.engine_steps WHERE replica = "
                        "{r:String}", {"r": replica})[1][0][0] == len(steps)
    assert list(child.inbox.iterdir()) == []

    recs = [make_record(events=[RecordEvent(now, "S")]) for _ in range(3)]
    requests, events = records_to_arrow(recs)
    bad = requests.set_column(requests.column_names.index("e2e_ms"), "e2e_ms",
                              pa.array(["slow"] * 3))
    for row in steps:
        row.replica = replica + "-2"
    with pytest.raises(InsertStopped) as err:
        store.insert_many([("request_events", events, "e"), ("requests", bad, "r"),
                           ("engine_steps", to_arrow(TABLES["engine_steps"], steps), "s")])
    assert err.value.inserted == ["request_events"]
    assert "Cannot parse string 'slow'" in str(err.value)
    ids = {"ids": [r.trace_id for r in recs]}
    assert [store.select(count, {"t": t, **ids})[1][0][0] for t in ("request_events",
                                                                    "requests")] == [3, 0]
    assert store.select("SELECT count() FROM tailscope.engine_steps WHERE replica = "
                        "{r:String}", {"r": replica + "-2"})[1][0][0] == 0
    assert list(child.inbox.iterdir()) == []
    store.close()


def test_a_batch_request_that_is_not_one_is_refused(child, tmp_path, store):
    """``/v1/insert``: a body that is not a batch, a table that does not exist or a file that
    is not one of the inbox's is a 400 naming it, and nothing outside the inbox is touched; a
    store process without an inbox says so."""
    outside = tmp_path / "x.arrow"
    outside.write_bytes(b"not arrow")
    url = f"http://127.0.0.1:{child.port}/v1/insert"
    headers = {"Authorization": f"Bearer {child.key}"}
    name = "0" * 32 + ".requests.arrow"
    for body, code in (({"batch": []}, "bad_body"), ({"rows": 1}, "bad_body"),
                       ({"batch": [{"table": "requests", "file": name, "token": 5}]}, "bad_body"),
                       ({"batch": [{"table": "nope", "file": name}]}, "unknown_table"),
                       ({"batch": [{"table": "requests", "file": str(outside)}]}, "bad_batch"),
                       ({"batch": [{"table": "requests", "file": name}]}, "bad_batch")):
        r = httpx.post(url, json=body, headers=headers, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, (body, r.text)
    assert outside.exists()
    client = TestClient(create_app(store, key="k"))
    r = client.post("/v1/insert", json={"batch": [{"table": "requests", "file": name}]},
                    headers={"Authorization": "Bearer k"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_inbox", r.text
