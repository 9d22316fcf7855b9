"""Schema, migrations, the read-only query path and the writer, against embedded chDB.

chDB allows one data directory per process, so every test here shares one session store and
tells its rows apart by trace id.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import re
import secrets
import threading
import time
from pathlib import Path

import pytest

from tracing.record import RecordEvent, RequestRecord
from tracing.schema import MIGRATIONS, TABLES, EngineStepRow
from tracing.store import QueryRefused, StoreError, check_ast
from tracing.writer import DEAD_LETTER, INSERTER, QUARANTINE, WRITER, RecordWriter


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
    # the regex check of old let this one through: a quoted identifier hid the ';'s
    "SELECT 1 AS \"'\" ; CREATE TABLE default.pwn (x Int8) ENGINE=Memory ; SELECT 2 AS \"'\"",
    "SELECT 1 INTO OUTFILE '/tmp/tailscope-pwn.txt'",
    "SELECT * FROM file('/etc/passwd', 'LineAsString')",
    "SELECT file('/etc/hostname')",
    "SELECT * FROM url('http://127.0.0.1:1/', CSV, 'x Int8')",
    "SELECT x FROM (SELECT 1 AS x) WHERE x IN (SELECT * FROM s3('http://127.0.0.1:1/x'))",
    "SELECT 1 FORMAT JSON",
])
def test_only_single_plain_selects_pass(store, sql):
    with pytest.raises(QueryRefused):
        store.select(sql)
    tables = {t for (t,) in store.select("SELECT name FROM system.tables WHERE database "
                                         "IN ('default', 'tailscope')")[1]}
    assert "pwn" not in tables and not Path("/tmp/tailscope-pwn.txt").exists()


def test_the_reader_session_is_read_only_for_its_life_with_limits(store):
    cols, rows = store.select("SELECT getSetting('readonly'), getSetting('max_execution_time'),"
                              " getSetting('max_result_rows')")
    assert rows == [(1, store.limits.max_execution_s, store.limits.max_result_rows)]
    with pytest.raises(Exception, match="readonly"):  # even bypassing the statement check
        store.reader.command("CREATE TABLE default.pwn2 (x Int8) ENGINE = Memory")
    with pytest.raises(Exception, match="[Ll]imit"):
        store.select("SELECT count() FROM system.numbers")  # unbounded: refused by the limit


def test_a_read_that_fails_part_way_leaves_the_next_reads_their_own_answers(store):
    """An Arrow read past a limit failed, and on chDB the next read on that connection got the
    failed one's leftover bytes (a 400 "not one valid statement" for a plain SELECT 1): every
    read through a store process is an Arrow read, so one refused drill-down query broke the
    next. The reader is renewed after a failed read; the writer's client is untouched."""
    writer_client = store.client
    for _ in range(2):
        with pytest.raises(Exception, match="[Ll]imit"):
            store.select_arrow("SELECT count() FROM system.numbers")
        assert store.select("SELECT 41 + 1 AS x") == (["x"], [(42,)])
        assert store.select_arrow("SELECT 'after' AS s").to_pylist() == [{"s": "after"}]
    # the renewed reader is read-only with the same limits
    assert store.select("SELECT getSetting('readonly'), getSetting('max_result_rows')")[1] == \
        [(1, store.limits.max_result_rows)]
    with pytest.raises(Exception, match="readonly"):
        store.reader.command("CREATE TABLE default.pwn3 (x Int8) ENGINE = Memory")
    assert store.client is writer_client


def test_the_embedded_engine_runs_with_the_stores_server_settings(store):
    """tracing.store.CHDB_OPTIONS reach chDB's engine (its MemoryWorker polls once a second,
    not its default many times a second). The options go in as server configuration; the ones
    that are server settings show in system.server_settings (the job assignees' idle poll is
    read from the configuration alone, with no table to show them: their effect, chDB's idle CPU,
    is measured in the option's comment, not timed here)."""
    from tracing.store import CHDB_OPTIONS

    _, rows = store.select("SELECT name, value, default FROM system.server_settings WHERE "
                           "name IN {names:Array(String)}", {"names": list(CHDB_OPTIONS)})
    assert {r[0]: r[1] for r in rows} == {"memory_worker_period_ms": "1000"}
    assert rows[0][1] != rows[0][2]  # not the engine's own default


def test_a_long_read_is_cancelled_by_its_id_and_never_blocks_the_writer(store):
    import threading

    out: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            store.select("SELECT sum(sleepEachRow(0.00004)) FROM numbers(1000000)",
                         query_id="test-long")
        except Exception as exc:
            out["error"] = str(exc)
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    store.insert_rows("requests", [make_record()])  # the writer's client is not held up
    assert time.monotonic() - t0 < 2.0
    store.cancel("test-long")
    t.join(10)
    assert "cancelled" in out["error"].lower() and out["s"] < 5.0


def test_check_ast_reads_clickhouse_trees():
    ok = ["SelectWithUnionQuery (children 2)", " ExpressionList (children 1)",
          "  SelectQuery (children 2)", "   ExpressionList (children 1)", "    Asterisk",
          "   TablesInSelectQuery (children 1)", "    TablesInSelectQueryElement (children 1)",
          "     TableExpression (children 1)", "      Function numbers (children 1)",
          "       ExpressionList (children 1)", "        Literal UInt64_3",
          " Identifier Native"]
    check_ast(ok)
    with pytest.raises(QueryRefused, match="table function"):
        check_ast([line.replace("numbers", "remote") for line in ok])
    with pytest.raises(QueryRefused, match="OUTFILE"):
        check_ast([*ok[:-1], " Literal '/tmp/x'", " Identifier Native"])
    with pytest.raises(QueryRefused, match="only SELECT"):
        check_ast(["DropQuery  x (children 2)", " Identifier x"])


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
    assert store.check_select("select 1 -- a comment;") == "SELECT 1"
    assert store.check_select("WITH 1 AS x SELECT x;") == "WITH 1 AS x SELECT x"


def test_writer_batches_records_events_and_steps(store, tmp_path):
    w = RecordWriter(store, tmp_path / "spool", batch_size=50, max_age_s=0.2)
    recs = [make_record() for _ in range(120)]
    for r in recs:
        w.emit(r)
    w.emit_step(EngineStepRow("rw", 0, 1, time.time_ns() // 1000, 1.0, 2, 16, 1, 3, 100,
                              0.8, 0.1, 0.1))
    assert w.flush()
    # the writer's threads carry their own names where the OS shows them (what capture costs
    # a gateway's CPU is read by them: bench/trace_overhead.py)
    def comm(thread) -> str:
        return Path(f"/proc/self/task/{thread.native_id}/comm").read_text().strip()

    (inserter,) = w._inserter._threads
    assert (comm(w._thread), comm(inserter)) == (WRITER, INSERTER)
    w.close()
    ids = [r.trace_id for r in recs]
    q = ("SELECT count(), uniqExact(trace_id) FROM tailscope.{t:Identifier} "
         "WHERE has({ids:Array(String)}, trace_id)")
    assert store.select(q, {"t": "requests", "ids": ids})[1] == [(120, 120)]
    assert store.select(q, {"t": "request_events", "ids": ids})[1] == [(240, 120)]
    assert store.select("SELECT count() FROM tailscope.engine_steps WHERE replica = 'rw'")[1] \
        == [(1,)]
    assert w.stats["written"] == 120 and w.stats["dropped"] == 0 and not w.spool_files()


def test_queued_records_are_out_of_the_collectors_view_and_hold_only_data(store, tmp_path):
    """The writer takes what it queues out of the garbage collector's view (tracing.writer.
    untrack). That is safe only while no field can hold anything that refers back (else a
    cycle through it would never be freed): every field of a record and of a step row is a
    number, a string, None, or a list of those or of untracked events. A field of another
    type fails here first."""
    data = {"str", "int", "float", "bool", "int | None", "float | None", "list[int]",
            "list[float]", "list[str]", "list[RecordEvent]"}
    for cls in (RequestRecord, EngineStepRow):
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        assert {n: k for n, k in kinds.items() if k not in data} == {}, cls
    assert not gc.is_tracked(RecordEvent(1, "END"))  # a gc=False struct
    w = RecordWriter(store, tmp_path / "spool", batch_size=50, max_age_s=0.2)
    rec = make_record()
    step = EngineStepRow("gc", 0, 1, time.time_ns() // 1000, 1.0, 2, 16, 1, 3, 100, 0.8, 0.1,
                         0.1, member_traces=[rec.trace_id], member_prefill=[16],
                         member_decode=[0])
    lists = [rec.input_token_ids, rec.output_token_ids, rec.token_steps, rec.itl_ms,
             rec.events, rec.tool_calls, step.member_traces, step.member_prefill,
             step.member_decode]
    assert gc.is_tracked(rec) and gc.is_tracked(step) and all(map(gc.is_tracked, lists))
    w.emit(rec)
    w.emit_step(step)
    assert not gc.is_tracked(rec) and not gc.is_tracked(step)
    assert not any(map(gc.is_tracked, lists))
    assert w.flush()
    w.close()
    assert store.select("SELECT count() FROM tailscope.requests WHERE trace_id = {t:String}",
                        {"t": rec.trace_id})[1] == [(1,)]
    assert store.select("SELECT member_traces FROM tailscope.engine_steps WHERE replica = "
                        "'gc'")[1] == [([rec.trace_id],)]
    dropped = make_record()  # the writer is closed: not queued, left as it was
    w.emit(dropped)
    assert gc.is_tracked(dropped) and w.stats["dropped"] == 1


def test_a_record_queued_behind_a_full_batch_is_left_to_the_collector(store, tmp_path):
    """In a flood the writer converts a record within moments of its queueing, so it is not
    worth untracking: only records that will wait for their batch are (tracing.writer
    ``_waits``). The store's first insert is held up, so the writer holds two batches (one
    in the insert, one converted, waiting) and what follows stays queued."""
    gate = threading.Event()
    w = RecordWriter(lambda: (gate.wait(30), store)[1], tmp_path / "spool", batch_size=2,
                     max_age_s=60)
    first = [make_record() for _ in range(4)]
    for r in first:
        w.emit(r)
    deadline = time.monotonic() + 10
    while w.queue_depth and time.monotonic() < deadline:  # both batches taken
        time.sleep(0.01)
    assert w.queue_depth == 0
    later = [make_record() for _ in range(3)]
    for r in later:
        w.emit(r)
    # the third finds a full batch ahead of it
    assert [gc.is_tracked(r) for r in later] == [False, False, True]
    assert not gc.is_tracked(first[0]) and not gc.is_tracked(first[1])
    gate.set()
    assert w.flush()
    w.close()
    ids = [r.trace_id for r in first + later]
    assert store.select("SELECT count() FROM tailscope.requests WHERE has({i:Array(String)}, "
                        "trace_id)", {"i": ids})[1] == [(7,)]


def test_an_idle_writer_inserts_a_lone_record_once_it_is_max_age_old(store, tmp_path):
    """The writer sleeps until its next deadline: a record emitted into an empty queue, with
    the next look at the spool far off, is inserted ``max_age_s`` later, not at that look."""
    w = RecordWriter(store, tmp_path / "spool", batch_size=1000, max_age_s=0.3,
                     replay_interval_s=60)
    try:
        time.sleep(0.5)  # the writer is asleep, its next deadline the replay a minute off
        for _ in range(2):  # twice: the second record arrives after the first batch's insert
            rec = make_record()
            w.emit(rec)
            q = "SELECT count() FROM tailscope.requests WHERE trace_id = {t:String}"
            deadline = time.monotonic() + 20
            while store.select(q, {"t": rec.trace_id})[1] != [(1,)]:
                assert time.monotonic() < deadline, "not inserted within 20 s"
                time.sleep(0.05)
    finally:
        w.close()


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


def test_an_empty_spool_is_looked_at_once_until_a_batch_is_spooled(store, tmp_path):
    """The writer lists its spool at start (files an earlier process left) and then only while
    a batch it spooled waits there: an idle or healthy writer does not wake to list an empty
    directory every ``replay_interval_s``."""
    fault = tmp_path / "store-down"
    w = RecordWriter(store, tmp_path / "spool", batch_size=100, max_age_s=0.05,
                     replay_interval_s=0.05, fault_file=str(fault))
    looks = []  # a spy: the listing runs as it would
    real = w.spool_files
    w.spool_files = lambda: looks.append(time.monotonic()) or real()
    try:
        time.sleep(0.3)
        first = len(looks)
        w.emit(make_record())
        assert w.flush(10)
        time.sleep(0.3)
        assert first <= 1 and len(looks) == first  # ~12 replay intervals, no listing
        fault.touch()  # the store goes down: the next batch is spooled
        rec = make_record()
        w.emit(rec)
        deadline = time.monotonic() + 10
        while w.stats["spooled"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        fault.unlink()
        while real() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not real() and len(looks) > first  # replayed: the spool was listed again
        assert store.select("SELECT count() FROM tailscope.requests WHERE trace_id = "
                            "{t:String}", {"t": rec.trace_id})[1] == [(1,)]
    finally:
        w.close()


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


def test_a_row_that_cannot_be_stored_is_set_aside_and_the_rest_of_its_batch_lands(store,
                                                                                  tmp_path):
    good = [make_record() for _ in range(5)]
    bad = make_record(seed=1 << 63)  # past Int64: Arrow refuses the value
    w = RecordWriter(store, tmp_path / "spool", batch_size=100, max_age_s=0.1)
    for r in [*good[:2], bad, *good[2:]]:
        w.emit(r)
    w.close()
    assert w.alive is False and w.stats["writer_errors"] == 0
    ids = [r.trace_id for r in good + [bad]]
    rows = store.select("SELECT trace_id FROM tailscope.requests WHERE has({ids:Array(String)},"
                        " trace_id)", {"ids": ids})[1]
    assert sorted(t for (t,) in rows) == sorted(r.trace_id for r in good)
    events = store.select("SELECT count() FROM tailscope.request_events WHERE trace_id = "
                          "{t:String}", {"t": bad.trace_id})[1]
    assert events == [(0,)]
    assert w.stats["dead_lettered"] == 1 and w.stats["written"] == 5
    lines = (tmp_path / "spool" / DEAD_LETTER).read_text().splitlines()
    assert [json.loads(x)["trace_id"] for x in lines] == [bad.trace_id]
    assert json.loads(lines[0])["row"]["seed"] == 1 << 63  # nothing lost


def test_columnar_conversion_matches_a_plain_row_by_row_one():
    """records_to_arrow (row chunks, typed buffers for ids and ITLs, event columns taken from
    their request's) against the obvious conversion: one pa.array per column over all rows,
    events as one row object each. Over several chunks, with records of no events, no ids and
    odd lengths."""
    import pyarrow as pa

    from tracing.arrow import ARROW_CHUNK_ROWS, arrow_type, records_to_arrow, to_arrow
    from tracing.schema import EventRow

    recs = []
    for i in range(2 * ARROW_CHUNK_ROWS + 37):
        r = make_record(tenant=f"t{i % 3}", instance=f"gw{i % 2}", ttl_days=1 + i % 5,
                        input_token_ids=list(range(i % 7, i % 7 + i % 11)),
                        output_token_ids=[(i * 7919) % 49152] * (i % 5),
                        itl_ms=[i / 3] * (i % 4), seed=i if i % 2 else None,
                        events=[RecordEvent(1000 + j, f"S{j}", f"d{i}") for j in range(i % 4)])
        recs.append(r)

    def plain(table, rows):
        return pa.table({c: pa.array([getattr(r, f) for r in rows], type=arrow_type(t))
                         for c, t, f in TABLES[table].columns})

    requests, events = records_to_arrow(recs)
    assert requests.equals(plain("requests", recs))
    assert to_arrow(TABLES["requests"], recs).equals(requests)
    rows = [EventRow(r.trace_id, e.ts_us, e.state, e.detail, seq, r.ttl_days, r.tenant,
                     r.instance) for r in recs for seq, e in enumerate(r.events)]
    assert events.num_rows == len(rows) > 0 and events.equals(plain("request_events", rows))
    empty_req, empty_ev = records_to_arrow([])
    assert empty_req.num_rows == empty_ev.num_rows == 0
    assert empty_req.schema.equals(requests.schema)


@pytest.mark.parametrize("field,value", [("input_token_ids", [1, -2]),
                                         ("output_token_ids", [1, None]),
                                         ("itl_ms", ["x"]), ("input_token_ids", [1 << 32])])
def test_an_array_value_its_column_cannot_hold_is_dead_lettered(store, tmp_path, field, value):
    good, bad = make_record(), make_record(**{field: value})
    w = RecordWriter(store, tmp_path / "spool", batch_size=100, max_age_s=0.1)
    w.emit(good)
    w.emit(bad)
    w.close()
    assert w.stats["dead_lettered"] == 1 and w.stats["written"] == 1
    found = store.select("SELECT trace_id FROM tailscope.requests WHERE trace_id IN "
                         "({a:String}, {b:String})", {"a": good.trace_id, "b": bad.trace_id})[1]
    assert found == [(good.trace_id,)]


def test_writer_keeps_going_after_an_unexpected_error(store, tmp_path):
    w = RecordWriter(store, tmp_path / "spool", batch_size=100, max_age_s=0.05,
                     replay_interval_s=0.05)
    real_tables, real_replay = w._tables, w._replay

    def tables_fault(items):  # fault injection: a conversion bug, once
        w._tables = real_tables
        raise RuntimeError("injected conversion fault")

    def replay_fault():  # fault injection: the replay loop raises, once
        w._replay = real_replay
        raise RuntimeError("injected replay fault")

    assert w.flush(10)  # its start-up look at the spool is over: the thread waits, idle
    w._tables, w._replay = tables_fault, replay_fault
    w._spool_dirty = True  # so that its next round looks at the spool (the replay fault)
    first = make_record()
    w.emit(first)
    deadline = time.monotonic() + 60  # left as soon as both are seen; a bound, not a margin
    # both faults counted and the batch set aside (the error is counted before its rows are
    # written to the dead-letter file: waiting on the count alone raced with that write)
    while (w.stats["writer_errors"] < 2 or w.stats["dead_lettered"] < 1) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert w.stats["writer_errors"] == 2 and w.alive
    assert w.stats["dead_lettered"] == 1  # the batch hit by the bug is set aside, not lost
    line = json.loads((tmp_path / "spool" / DEAD_LETTER).read_text().splitlines()[0])
    assert line["trace_id"] == first.trace_id and "injected" in line["error"]
    later = make_record()
    w.emit(later)
    assert w.flush(10)
    assert store.select("SELECT count() FROM tailscope.requests WHERE trace_id = {t:String}",
                        {"t": later.trace_id})[1] == [(1,)]
    assert w.last_success_ts is not None
    w.close()


def test_a_poison_spool_file_is_quarantined_and_later_files_replay(store, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "0000-poison.requests.arrow").write_bytes(b"not an arrow file")
    import pyarrow as pa

    # readable, but the store refuses it: a column the table does not have
    bad = pa.table({"no_such_column": pa.array([1], pa.int64())})
    import pyarrow.ipc as ipc

    with pa.OSFile(str(spool / "0001-bad.requests.arrow"), "wb") as sink, \
            ipc.new_file(sink, bad.schema) as wr:
        wr.write_table(bad)
    w = RecordWriter(store, spool, batch_size=100, max_age_s=0.05, replay_interval_s=0.1)
    rec = make_record()
    w.emit(rec)
    w.close()
    assert w.stats["quarantined"] == 2 and not w.spool_files()
    assert sorted(p.name for p in (spool / QUARANTINE).iterdir()) == [
        "0000-poison.requests.arrow", "0001-bad.requests.arrow"]
    assert store.select("SELECT count() FROM tailscope.requests WHERE trace_id = {t:String}",
                        {"t": rec.trace_id})[1] == [(1,)]


def test_a_spool_disk_that_refuses_writes_loses_nothing(store, tmp_path):
    fault = tmp_path / "store-down"
    fault.touch()
    spool = tmp_path / "spool"
    w = RecordWriter(store, spool, batch_size=10, max_age_s=0.05, replay_interval_s=0.1,
                     fault_file=str(fault))
    # fault injection that even root meets: a file where the spool directory was, so every
    # spool write fails with an OSError (as on a full disk)
    spool.rmdir()
    spool.write_text("")
    try:
        recs = [make_record() for _ in range(12)]
        for r in recs:
            w.emit(r)
        deadline = time.monotonic() + 5
        while w.stats["spool_errors"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert w.stats["spool_errors"] >= 1 and w.alive and not w.spool_files()
    finally:
        spool.unlink()
        spool.mkdir()
    fault.unlink()  # the store is back: the batches kept in memory are inserted
    w.close()
    ids = [r.trace_id for r in recs]
    assert store.select("SELECT count(), uniqExact(trace_id) FROM tailscope.requests WHERE "
                        "has({ids:Array(String)}, trace_id)", {"ids": ids})[1] == [(12, 12)]


def test_writer_queue_is_bounded_in_bytes(store, tmp_path):
    fault = tmp_path / "down"
    fault.touch()
    w = RecordWriter(store, tmp_path / "spool", batch_size=1000, max_age_s=60,
                     max_queue_bytes=1 << 20, fault_file=str(fault))
    big = [make_record(input_token_ids=list(range(8000))) for _ in range(10)]
    for r in big:
        w.emit(r)
    assert 0 < w.stats["queued"] < 10 and w.stats["dropped"] == 10 - w.stats["queued"]
    assert w.queued_bytes <= 1 << 20
    fault.unlink()
    w.close()


def test_a_damaged_store_is_reported_as_damaged_not_as_bad_arguments(tmp_path):
    import subprocess
    import sys

    # chDB allows one directory per process: open, damage and reopen in a child process
    code = f"""
import sys
from pathlib import Path
from tracing.store import Store, StoreError
d = {str(tmp_path / "store")!r}
s = Store("chdb://" + d); s.migrate(); s.close()
Path(d, "metadata", "tailscope", "requests.sql").write_text("garbage ((")
try:
    Store("chdb://" + d)
except StoreError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert "damaged" in out.stdout and str(tmp_path) in out.stdout, out.stdout + out.stderr


def engine_settings(store, db: str, table: str) -> tuple[str, set[str]]:
    """A table's engine clause up to its SETTINGS, and its settings as a set (a setting a
    migration adds comes last, one declared in CREATE TABLE where it was written)."""
    engine = store.select("SELECT engine_full FROM system.tables WHERE database = {d:String} "
                          "AND name = {t:String}", {"d": db, "t": table})[1][0][0]
    head, _, listed = engine.partition(" SETTINGS ")
    return head, set(listed.split(", "))


def test_the_migration_chain_ends_exactly_at_the_declared_tables(store):
    """A store built by the migrations (frozen migration 1, then each later step) and tables
    created straight from today's declarations DESCRIBE the same, column for column."""
    store.command("CREATE DATABASE IF NOT EXISTS declared")
    for table in TABLES.values():
        store.command(table.create("declared"))

    def describe(db: str, name: str) -> dict[str, tuple[str, str]]:
        rows = store.select("SELECT name, type, compression_codec FROM system.columns WHERE "
                            "database = {d:String} AND table = {t:String}",
                            {"d": db, "t": name})[1]
        return {r[0]: (r[1], r[2]) for r in rows}

    def settings(db: str, name: str) -> tuple[str, set[str]]:
        return engine_settings(store, db, name)

    for name in TABLES:
        assert describe("tailscope", name) == describe("declared", name), name
        # ... and have the same engine, order, TTL and MergeTree settings (migration 19 set
        # the merge selector's base on the tables the writer fills)
        assert settings("tailscope", name) == settings("declared", name), name
    assert "merge_selector_base = 50" in settings("tailscope", "request_events")[1]
    assert not any("merge_selector" in x for x in settings("tailscope", "configs")[1])
    # the codecs the migrations set (migration 18) are the declared ones, and only those
    requests = describe("tailscope", "requests")
    assert requests["input_token_ids"][1] == "CODEC(T64, LZ4)"
    assert requests["token_steps"][1] == "CODEC(DoubleDelta, LZ4)"
    assert requests["itl_ms"][1] == "CODEC(ZSTD(1))"
    assert describe("tailscope", "request_events")["ts"][1] == "CODEC(DoubleDelta, LZ4)"
    assert describe("tailscope", "engine_steps")["member_traces"][1] == "CODEC(ZSTD(1))"
    assert requests["trace_id"][1] == ""  # the default, LZ4


def test_a_store_with_rows_upgrades_to_the_codecs_and_keeps_every_row(tmp_path):
    """A store at version 17 holding records, events and steps takes migration 18 (codecs on
    sort-key columns too: request_events.ts, engine_steps.ts and step) and 19 (the merge
    selector's base); its rows and the rows inserted after it read back in full, also once
    merges have rewritten the old parts. (In a process of its own: chDB opens one directory
    per process.)"""
    import subprocess
    import sys

    code = f"""
import json
import tracing.store as S
from tracing.arrow import records_to_arrow
from bench.trace_overhead import make_records, step_rows
full = list(S.MIGRATIONS)
S.MIGRATIONS = full[:17]
store = S.Store("chdb://{tmp_path}/store")
out = {{"before": store.migrate()[-1]}}
def write(tag):
    req, ev = records_to_arrow(make_records(500))
    if tag == "old":  # as a version-17 gateway wrote them (20 added these)
        req = req.drop_columns(["end_user", "metadata"])
    store.insert("requests", req, "r" + tag)
    store.insert("request_events", ev, "e" + tag)
    store.insert_rows("engine_steps", step_rows(50, 8), "s" + tag)
write("old")
S.MIGRATIONS = full
out["applied"] = store.migrate()
write("new")
for table in ("requests", "request_events", "engine_steps"):
    store.command("OPTIMIZE TABLE tailscope." + table + " FINAL")
out["requests"] = store.select("SELECT count(), sum(length(input_token_ids)), "
                               "sum(length(itl_ms)), sum(length(token_steps)) "
                               "FROM tailscope.requests")[1][0]
out["events"] = store.select("SELECT count() FROM tailscope.request_events")[1][0][0]
out["steps"] = store.select("SELECT count(), countIf(length(member_traces) != num_seqs) "
                            "FROM tailscope.engine_steps")[1][0]
print(json.dumps(out))
"""
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert got.returncode == 0, got.stderr[-2000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    assert out["before"] == 17 and out["applied"] == [18, 19, 20]
    assert out["requests"] == [1000, 128_000, 127_000, 128_000]
    assert out["events"] == 12_000
    assert out["steps"][0] > 0 and out["steps"][1] == 0


def test_a_python_insert_loads_no_pandas_and_the_guard_holds_on_its_own_thread_only(tmp_path):
    """chDB's ``Python()`` imports pandas on each call to ask whether the object is a DataFrame;
    ``Store.insert`` runs it under ``without_pandas``, so a large batch lands (every row) and
    the process still has no pandas. The guard is per thread: inside it ``import pandas``
    fails on that thread while another thread imports pandas as usual (and then the first
    gets the module too). (In a fresh interpreter: this one may have pandas loaded.)"""
    import subprocess
    import sys

    code = f"""
import sys, threading
from tracing import store as S
from tracing.arrow import records_to_arrow, skip_pandas_probe, without_pandas
from tracing.store import Store
from bench.trace_overhead import make_records
skip_pandas_probe()
S.PYTHON_INSERT_MIN_BYTES = 0  # every insert through Python()
store = Store("chdb://{tmp_path}/store")
store.migrate()
sent = []
handle = store._arrow_in
class Spy:
    def query(self, sql, *args):
        sent.append(sql)
        return handle.query(sql, *args)
store._arrow_in = Spy()
requests, events = records_to_arrow(make_records(300))
store.insert("requests", requests, "t1")
store.insert("request_events", events, "t1")
print(all("FROM Python(" in q for q in sent), len(sent),
      store.select("SELECT count() FROM tailscope.requests")[1][0][0],
      store.select("SELECT count() FROM tailscope.request_events")[1][0][0] == events.num_rows,
      "pandas" in sys.modules)
inside, imported, out = threading.Event(), threading.Event(), []
def guarded():
    with without_pandas():
        try:
            import pandas  # noqa: F401
            out.append("imported")
        except ModuleNotFoundError:
            out.append("refused")
        inside.set()
        imported.wait(60)
        import pandas  # noqa: F401,F811  (in sys.modules now: the guard lets it through)
        out.append("then " + pandas.__name__)
t = threading.Thread(target=guarded)
t.start()
inside.wait(60)
import pandas
imported.set()
t.join(60)
print(*out)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[-2] == "True 2 300 True False", lines
    assert lines[-1] == "refused then pandas", lines


@pytest.mark.parametrize("route", ["Arrow file", "Python()"])
def test_the_writers_arrow_tables_read_back_value_for_value_and_a_resent_batch_is_a_no_op(
        store, monkeypatch, route):
    """Every column of the three tables the writer fills reads back from the store as the
    conversion made it (nulls, empty arrays, quotes and non-ASCII text, microsecond times), and
    a batch sent again under the same token (a spool replay; here a token holding a quote and a
    backslash) inserts nothing; by both routes of an embedded insert (an Arrow file chDB reads
    below ``PYTHON_INSERT_MIN_BYTES``, its INSERT naming no columns since the table has them
    all; chDB's ``Python()`` from there)."""
    from bench.trace_overhead import step_rows
    from tracing import store as S
    from tracing.arrow import records_to_arrow, to_arrow

    monkeypatch.setattr(S, "PYTHON_INSERT_MIN_BYTES", 0 if route == "Python()" else 1 << 40)
    sent = []  # the statements of chDB's own handle, run as they are (a spy, not a fake)
    handle = store._arrow_in

    class Spy:
        def query(self, sql, *args):
            sent.append(sql)
            return handle.query(sql, *args)

    monkeypatch.setattr(store, "_arrow_in", Spy())

    t0 = time.time_ns() // 1000 - 6 * 3600 * 1_000_000 + 123  # inside the rows' TTL
    recs = [make_record(tenant="t'1", detail_reason="naïve \\ 'q'", seed=None, top_k=i,
                        input_token_ids=list(range(i)), itl_ms=[0.5] * (i % 3),
                        events=[RecordEvent(t0 + j, "S", "d'é") for j in range(i % 4)])
            for i in range(40)]
    steps = step_rows(5, 2)
    replica = f"r-{secrets.token_hex(4)}"
    for row in steps:
        row.replica = replica
    requests, events = records_to_arrow(recs)
    steps_table = to_arrow(TABLES["engine_steps"], steps)
    token = f"tok-{secrets.token_hex(4)}-'\\"
    for _ in range(2):
        store.insert("requests", requests, token)
        store.insert("request_events", events, token)
        store.insert("engine_steps", steps_table, token)
    assert len(sent) == 6
    if route == "Python()":
        assert all("FROM Python(_tailscope_arrow_batch)" in sql for sql in sent), sent
    else:
        assert all(re.match(r"INSERT INTO tailscope\.`\w+` FROM INFILE '", sql) for sql in sent)
    ids = {"ids": [r.trace_id for r in recs]}

    def back(sql, parameters, like, order):
        return store.select_arrow(sql, parameters).select(like.column_names).sort_by(order)

    got = back("SELECT * FROM tailscope.requests WHERE trace_id IN {ids:Array(String)}", ids,
               requests, "trace_id")
    assert got.num_rows == len(recs)
    assert got.to_pylist() == requests.sort_by("trace_id").to_pylist()
    order = [("trace_id", "ascending"), ("seq", "ascending")]
    got = back("SELECT * FROM tailscope.request_events WHERE trace_id IN {ids:Array(String)}",
               ids, events, order)
    assert got.num_rows == events.num_rows > 0
    assert got.to_pylist() == events.sort_by(order).to_pylist()
    got = back("SELECT * FROM tailscope.engine_steps WHERE replica = {r:String}",
               {"r": replica}, steps_table, "step")
    assert got.to_pylist() == steps_table.sort_by("step").to_pylist()


@pytest.mark.parametrize("route", ["Arrow file", "Python()"])
def test_a_batch_its_table_cannot_take_fails_as_a_bad_batch_by_both_routes(store, monkeypatch,
                                                                            route):
    """A table whose column cannot go into its ClickHouse column (text for ``http_status``)
    raises ClickHouse's error, not ``StoreError`` (which says the store is unreachable, and
    makes a caller wait and retry), and inserts nothing, at any size: ``Python()`` takes only
    tables typed as the writer types them (its INSERT ... SELECT would cast the text to 0)."""
    import pyarrow as pa

    from tracing import store as S

    monkeypatch.setattr(S, "PYTHON_INSERT_MIN_BYTES", 0 if route == "Python()" else 1 << 40)
    trace = f"bad-{secrets.token_hex(4)}"
    bad = pa.table({"trace_id": [trace], "http_status": ["not a number"]})
    with pytest.raises(Exception) as err:
        store.insert("requests", bad, f"tok-{trace}")
    assert not isinstance(err.value, StoreError), str(err.value)
    assert "Cannot parse string 'not a number'" in str(err.value)
    assert store.select("SELECT count() FROM tailscope.requests WHERE trace_id = {t:String}",
                        {"t": trace})[1][0][0] == 0


def test_a_column_the_table_lacks_is_refused_by_name_not_dropped(store):
    """An embedded insert names no columns when the table has all of the batch's (ClickHouse
    then matches them by name); a batch with a column the table lacks keeps its column list,
    so ClickHouse refuses it naming the column, instead of dropping that column's values."""
    import pyarrow as pa

    from tracing.arrow import records_to_arrow

    rec = make_record()
    requests, _ = records_to_arrow([rec])
    extra = requests.append_column("no_such_column", pa.array([1]))
    with pytest.raises(Exception) as err:
        store.insert("requests", extra, f"tok-{rec.trace_id}")
    assert not isinstance(err.value, StoreError) and "no_such_column" in str(err.value)
    count = "SELECT count() FROM tailscope.requests WHERE trace_id = {t:String}"
    assert store.select(count, {"t": rec.trace_id})[1] == [(0,)]
    store.insert("requests", requests, f"tok2-{rec.trace_id}")
    assert store.select(count, {"t": rec.trace_id})[1] == [(1,)]


def test_insert_many_stops_at_the_table_that_fails_and_names_those_that_landed(store):
    """A writer's flush in one call: each table in order; the first failure stops the rest and
    ``InsertStopped.inserted`` names the tables already in (the writer spools the others)."""
    import pyarrow as pa

    from bench.trace_overhead import step_rows
    from tracing.arrow import records_to_arrow, to_arrow
    from tracing.store import InsertStopped

    rec = make_record()
    requests, events = records_to_arrow([rec])
    bad = requests.set_column(requests.schema.get_field_index("http_status"), "http_status",
                              pa.array(["not a number"]))
    steps = step_rows(1, 1)
    replica = steps[0].replica = f"r-{secrets.token_hex(4)}"
    with pytest.raises(InsertStopped) as err:
        store.insert_many([("request_events", events, f"a-{rec.trace_id}"),
                           ("requests", bad, f"b-{rec.trace_id}"),
                           ("engine_steps", to_arrow(TABLES["engine_steps"], steps[:1]),
                            f"c-{rec.trace_id}")])
    assert err.value.inserted == ["request_events"] and "not a number" in str(err.value)
    count = "SELECT count() FROM tailscope.{t:Identifier} WHERE {c:Identifier} = {v:String}"
    assert [store.select(count, {"t": t, "c": c, "v": v})[1][0][0] for t, c, v in [
        ("request_events", "trace_id", rec.trace_id), ("requests", "trace_id", rec.trace_id),
        ("engine_steps", "replica", replica)]] == [2, 0, 0]


def test_the_writer_conversion_leaves_pandas_unloaded_and_pyarrow_can_still_use_it():
    """``skip_pandas_probe``: pyarrow's first ``pa.array`` of a list imports pandas to ask
    whether the list is a pandas object; after the probe is skipped, converting records and
    steps loads no pandas, and pyarrow's own pandas functions still import and use it. (In a
    fresh interpreter: this one may have pandas loaded already.)"""
    import subprocess
    import sys

    code = """
import sys
import pyarrow as pa
from tracing.schema import TABLES
from tracing.arrow import records_to_arrow, skip_pandas_probe, to_arrow
from bench.trace_overhead import make_records, step_rows
control = "control" in sys.argv
if not control:
    skip_pandas_probe()
requests, events = records_to_arrow(make_records(3))
to_arrow(TABLES["engine_steps"], step_rows(2, 2))
print("pandas" in sys.modules)
if not control:
    frame = requests.select(["trace_id"]).to_pandas()
    print(type(frame).__name__, len(frame), pa.array(frame["trace_id"]).to_pylist()
          == requests.column("trace_id").to_pylist())
"""
    def run(*args: str) -> list[str]:
        out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                             text=True, timeout=120, cwd=Path(__file__).parents[2])
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split("\n")

    # without the skip, the conversion loads pandas: what the function is there to avoid
    assert run("control")[0] == "True"
    assert run()[:2] == ["False", "DataFrame 3 True"]


def test_use_arrow_pool_moves_conversions_off_mimalloc_unless_a_pool_is_named():
    """``use_arrow_pool``: the gateway's and the store process's Arrow buffers come from the
    system allocator (pyarrow's default mimalloc backs them with huge pages that every flush
    faults in and zeroes again); the conversion then allocates from it, gives the same tables,
    and frees what it held once they are gone; an operator's ``ARROW_DEFAULT_MEMORY_POOL``
    wins. (In fresh interpreters: the pool is the process's.)"""
    import os
    import subprocess
    import sys

    code = """
import pyarrow as pa
from tracing.arrow import records_to_arrow, use_arrow_pool
from bench.trace_overhead import make_records
records = make_records(50)
before = pa.default_memory_pool().backend_name
reference = records_to_arrow(records)
print(before, use_arrow_pool())
pool = pa.default_memory_pool()
held = pool.bytes_allocated()
tables = records_to_arrow(records)
print(pool.bytes_allocated() > held, all(a.equals(b) for a, b in zip(tables, reference)))
del tables
print(pool.bytes_allocated() == held)
"""
    def run(**env: str) -> list[str]:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, cwd=Path(__file__).parents[2],
                             env={k: v for k, v in os.environ.items()
                                  if k != "ARROW_DEFAULT_MEMORY_POOL"} | env)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split("\n")

    first, *rest = run()
    assert first.split()[1] == "system" and rest[:2] == ["True True", "True"]
    assert run(ARROW_DEFAULT_MEMORY_POOL="mimalloc")[0] == "mimalloc mimalloc"
