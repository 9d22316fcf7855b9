"""Schema, migrations, the read-only query path and the writer, against embedded chDB.

chDB allows one data directory per process, so every test here shares one session store and
tells its rows apart by trace id.
"""

from __future__ import annotations

import secrets
import time

import pytest

from tracing.record import RecordEvent, RequestRecord
from tracing.schema import MIGRATIONS, TABLES, EngineStepRow
from tracing.store import QueryRefused, check_select
from tracing.writer import RecordWriter


def make_record(**kw) -> RequestRecord:
    # six hours ago: clear of the windows the dashboard tests seed and read in the same
    # session store (the last hour, 3.5-4.5 h ago, days ago), whatever order tests run in
    now = time.time_ns() // 1000 - 6 * 3600 * 1_000_000
    base = dict(trace_id=secrets.token_hex(16), span_id=secrets.token_hex(8),
                request_id="req-1", arrival_ts_us=now, final_state="FINISHED",
                finish_reason="length", http_status=200, model="m", replica="r0",
                prompt_tokens=3, input_token_ids=[1, 2, 3], output_token_ids=[7, 8],
                ttft_ms=5.0, itl_ms=[1.25, 2.5], tail_ms=0.25, e2e_ms=9.0, temperature=0.0,
                events=[RecordEvent(now, "RECEIVED"), RecordEvent(now + 9000, "END")])
    base.update(kw)
    return RequestRecord(**base)


def test_every_record_field_is_a_column_and_migrations_are_idempotent(store):
    stored = {field for _, _, field in TABLES["requests"].columns}
    assert stored == {f for f in RequestRecord.__dataclass_fields__} - {"events"}
    assert store.migrate() == []  # already applied: nothing to do
    versions = store.select("SELECT version FROM tailscope.schema_migrations FINAL")[1]
    assert sorted(v for (v,) in versions) == [v for v, _, _ in MIGRATIONS]
    cols = dict(store.select("SELECT name, type FROM system.columns WHERE database = "
                             "'tailscope' AND table = 'requests'")[1])
    assert cols["arrival_ts"] == "DateTime64(6, 'UTC')"
    assert cols["input_token_ids"] == "Array(UInt32)" and cols["ttft_ms"] == "Nullable(Float64)"
    engine = store.select("SELECT engine, partition_key, sorting_key FROM system.tables "
                          "WHERE database = 'tailscope' AND name = 'requests'")[1][0]
    assert engine[0] == "MergeTree" and "toDate(arrival_ts)" in engine[1]
    assert engine[2].startswith("toStartOfHour(arrival_ts), model, replica")


def test_insert_round_trips_and_a_replayed_token_inserts_nothing(store):
    rec = make_record(ttft_ms=None)
    for _ in range(2):  # the same batch twice, as a replay would send it
        store.insert_rows("requests", [rec], token="tok-" + rec.trace_id)
    cols, rows = store.select("SELECT trace_id, input_token_ids, itl_ms, ttft_ms, arrival_ts "
                              "FROM tailscope.requests WHERE trace_id = {t:String}",
                              {"t": rec.trace_id})
    assert len(rows) == 1
    row = dict(zip(cols, rows[0], strict=True))
    assert row["input_token_ids"] == [1, 2, 3] and row["itl_ms"] == [1.25, 2.5]
    assert row["ttft_ms"] is None
    assert abs(row["arrival_ts"].timestamp() * 1e6 - rec.arrival_ts_us) < 2


@pytest.mark.parametrize("sql", [
    "DROP TABLE tailscope.requests",
    "INSERT INTO tailscope.requests (trace_id) VALUES ('x')",
    "SELECT 1; DROP TABLE tailscope.requests",
    "SELECT 1 SETTINGS readonly = 0",
    "/* SELECT */ ALTER TABLE tailscope.requests DELETE WHERE 1",
])
def test_only_single_selects_pass(store, sql):
    with pytest.raises(QueryRefused):
        store.select(sql)


def test_a_read_only_query_never_makes_the_writer_read_only(store):
    store.select_arrow("SELECT 1")  # on chDB, readonly can stick to the session it ran on
    store.select("SELECT 1")
    rec = make_record()
    store.insert_rows("requests", [rec])
    assert store.select("SELECT count() FROM tailscope.requests WHERE trace_id = {t:String}",
                        {"t": rec.trace_id})[1] == [(1,)]


def test_parameters_are_values_never_sql(store):
    rec = make_record()
    store.insert_rows("requests", [rec])
    evil = "x' OR 1=1 --"
    assert store.select("SELECT count() FROM tailscope.requests WHERE trace_id = {t:String}",
                        {"t": evil})[1] == [(0,)]
    assert check_select("select 1 -- a comment;") == "select 1"
    assert check_select("WITH 1 AS x SELECT x;") == "WITH 1 AS x SELECT x"


def test_writer_batches_records_events_and_steps(store, tmp_path):
    w = RecordWriter(store, tmp_path / "spool", batch_size=50, max_age_s=0.2)
    recs = [make_record() for _ in range(120)]
    for r in recs:
        w.emit(r)
    w.emit_step(EngineStepRow("rw", 0, 1, time.time_ns() // 1000, 1.0, 2, 16, 1, 3, 100,
                              0.8, 0.1, 0.1))
    w.close()
    ids = [r.trace_id for r in recs]
    q = ("SELECT count(), uniqExact(trace_id) FROM tailscope.{t:Identifier} "
         "WHERE has({ids:Array(String)}, trace_id)")
    assert store.select(q, {"t": "requests", "ids": ids})[1] == [(120, 120)]
    assert store.select(q, {"t": "request_events", "ids": ids})[1] == [(240, 120)]
    assert store.select("SELECT count() FROM tailscope.engine_steps WHERE replica = 'rw'")[1] \
        == [(1,)]
    assert w.stats["written"] == 120 and w.stats["dropped"] == 0 and not w.spool_files()


def test_writer_spools_while_the_store_is_down_and_replays_without_duplicates(store, tmp_path):
    fault = tmp_path / "store-down"
    fault.touch()  # fault injection: every insert fails
    w = RecordWriter(store, tmp_path / "spool", batch_size=20, max_age_s=0.1,
                     replay_interval_s=0.2, fault_file=str(fault))
    recs = [make_record() for _ in range(75)]
    for r in recs[:40]:
        w.emit(r)
    deadline = time.monotonic() + 10
    while w.stats["spooled"] < 40 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w.stats["spooled"] == 40 and w.spool_files()
    for r in recs[40:]:
        w.emit(r)
    fault.unlink()  # the store is back
    w.close()
    # a batch replayed twice (e.g. an insert that landed but reported an error) changes nothing
    ids = [r.trace_id for r in recs]
    assert store.select("SELECT count(), uniqExact(trace_id) FROM tailscope.requests "
                        "WHERE has({ids:Array(String)}, trace_id)", {"ids": ids})[1] \
        == [(75, 75)]
    assert w.stats["replayed"] == 40 and w.stats["written"] == 75 and not w.spool_files()


def test_writer_bounds_its_queue_and_counts_drops(store, tmp_path):
    fault = tmp_path / "down"
    fault.touch()
    w = RecordWriter(store, tmp_path / "spool", batch_size=1000, max_age_s=60, max_queue=10,
                     fault_file=str(fault))
    for _ in range(15):
        w.emit(make_record())
    assert w.stats["dropped"] == 5 and w.stats["queued"] == 10
    fault.unlink()
    w.close()
    assert w.stats["written"] == 10
