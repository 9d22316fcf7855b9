"""The one store client: clickhouse-connect over embedded chDB or a ClickHouse server.

DSNs: ``chdb:///abs/path`` or ``chdb://./rel/path`` (embedded; the default is
``chdb://./.tailscope/store``), ``http(s)://user:pass@host:8123/tailscope`` (server) and
``tailscope://host:8124`` (a store process that owns an embedded store for several gateways,
``tracing.store_server``; ``connect`` opens any of them). The same
calls work on both; chDB locks its directory, so in embedded mode one process (the gateway)
owns it and other tools read through the gateway's ``/debug/query``.

``Store.select`` is the read-only path used by ``/debug/query`` and the CLI, read-only by
construction rather than by pattern matching:

- it runs on its own client whose session is ``readonly = 1`` for its whole life (set once, after
  the resource limits of ``QueryLimits``, so no query can lift either);
- the statement is checked by ClickHouse's own parser: ``formatQuerySingleLine`` refuses more
  than one statement, and ``EXPLAIN AST`` of the canonical text must be one SELECT with no
  ``INTO OUTFILE``, ``FORMAT`` or ``SETTINGS`` clause, no table function outside a short list of
  generators and no function that reads files (``check_ast``); the canonical text is what runs;
- parameters are bound by the server (``{name:Type}`` placeholders), never pasted into SQL;
- every read is tagged with an id, so ``cancel`` can stop it (``KILL QUERY``) when its caller
  goes away.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pyarrow as pa
import pyarrow.ipc as ipc

from tracing.arrow import arrow_type, to_arrow, without_pandas, write_arrow_file
from tracing.schema import DATABASE, MIGRATIONS, TABLES

log = logging.getLogger("tailscope.store")

DEFAULT_DSN = "chdb://./.tailscope/store"


class StoreError(RuntimeError):
    pass


class InsertStopped(StoreError):
    """``insert_many`` stopped at a table whose insert failed: ``inserted`` names the tables of
    the batch that landed before it (the writer spools the others)."""

    def __init__(self, message: str, inserted: list[str]) -> None:
        super().__init__(message)
        self.inserted = list(inserted)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:500]


class QueryRefused(ValueError):
    """Not a single read-only SELECT: refused before it reaches the store."""


def normalise_dsn(dsn: str) -> str:
    """chdb DSNs get an absolute path (clickhouse-connect wants ``chdb:///abs``)."""
    if dsn.startswith("chdb://"):
        path = Path(dsn[len("chdb://"):] or ".").expanduser().resolve()
        return f"chdb://{path}"
    if dsn.startswith(("http://", "https://", "tailscope://")):
        return dsn
    raise StoreError(f"unsupported store DSN {dsn!r}: use chdb:///path, http(s)://host:8123 "
                     "or tailscope://host:8124 (a store process)")


def is_embedded(dsn: str) -> bool:
    return dsn.startswith("chdb://")


def connect(dsn: str, limits: QueryLimits | None = None, key: str | None = None,
            inbox: str | Path | None = None):
    """A ``Store`` on chDB or a ClickHouse server, or a ``RemoteStore`` on a store process
    (``tailscope://``, ``tracing.store_server``; ``key`` is its ``TAILSCOPE_STORE_KEY``,
    ``inbox`` its ``--inbox`` when it runs on this host). The limits of a store process's
    reads are its own."""
    dsn = normalise_dsn(dsn)
    if dsn.startswith("tailscope://"):
        from tracing.store_server import RemoteStore

        return RemoteStore(dsn, key, inbox=inbox)
    return Store(dsn, limits)


@dataclass(frozen=True)
class QueryLimits:
    """ClickHouse resource limits on every read (``TAILSCOPE_QUERY_*``;
    docs/guides/security.md). Past a limit the query fails with ClickHouse's error, which
    ``/debug/query`` returns as a 400."""

    max_execution_s: float = 30.0
    max_result_rows: int = 500_000
    max_rows_to_read: int = 2_000_000_000
    max_memory_mb: int = 2048

    def settings(self) -> dict[str, object]:
        # readonly goes last: once it is set, the session can change no setting at all
        return {"max_execution_time": self.max_execution_s,
                "timeout_overflow_mode": "throw",
                "max_result_rows": self.max_result_rows, "result_overflow_mode": "throw",
                "max_rows_to_read": self.max_rows_to_read, "read_overflow_mode": "throw",
                "max_memory_usage": self.max_memory_mb << 20, "readonly": 1}


# Table functions that only generate values; every other one (file, url, s3, remote, mysql, ...)
# reaches outside the store and is refused.
ALLOWED_TABLE_FUNCTIONS = frozenset({"numbers", "numbers_mt", "zeros", "zeros_mt", "values",
                                     "generateSeries", "generate_series"})
# Ordinary functions that read local files.
DENIED_FUNCTIONS = frozenset({"file"})
_READ_TAG = "tailscope-read:"


def check_ast(lines: list[str]) -> None:
    """Refuse (QueryRefused) an ``EXPLAIN AST`` tree that is not one plain SELECT. Each line is
    a node, indented one space per level: ``Kind [name] [(alias x)] [(children n)]``."""
    nodes = []
    for line in lines:
        if line.strip():
            kind, _, rest = line.strip().partition(" ")
            nodes.append((len(line) - len(line.lstrip(" ")), kind, rest.partition(" ")[0]))
    if not nodes or nodes[0][1] not in ("SelectWithUnionQuery", "SelectIntersectExceptQuery"):
        raise QueryRefused("only SELECT queries are allowed")
    parents: list[str] = []  # the kind of the latest node at each depth
    for depth, kind, name in nodes:
        del parents[depth:]
        parent = parents[-1] if parents else ""
        parents.append(kind)
        if kind == "Set":
            raise QueryRefused("SETTINGS clauses are not allowed in read queries")
        if depth == 1 and kind == "Literal":
            raise QueryRefused("INTO OUTFILE is not allowed in read queries")
        if depth == 1 and kind == "Identifier" and name != "Native":
            raise QueryRefused("FORMAT clauses are not allowed: ask for format json or arrow")
        if kind == "Function" and parent == "TableExpression" \
                and name not in ALLOWED_TABLE_FUNCTIONS:
            raise QueryRefused(f"table function {name}() is not allowed in read queries (allowed: "
                               f"{', '.join(sorted(ALLOWED_TABLE_FUNCTIONS))})")
        if kind == "Function" and name in DENIED_FUNCTIONS:
            raise QueryRefused(f"function {name}() is not allowed in read queries")


CHDB_OPTIONS = {"memory_worker_period_ms": 1000,
                "background_processing_pool_thread_sleep_seconds_if_nothing_to_do": 2,
                "background_streaming_processing_pool_thread_sleep_seconds_if_nothing_to_do": 10}


def _embedded_handle(dsn: str):
    """A chDB connection of its own to the embedded engine that ``dsn``'s clients opened (chDB
    runs one engine per path and process; each ``connect`` with the same path and settings is
    another handle on it), for inserts: its ``Python()`` table function reads an Arrow table
    in this process as it is. ``insert_arrow`` of clickhouse-connect writes the table as an
    Arrow IPC file, to a temporary file, that chDB reads and parses again; a batch of 10,000
    writer records (both tables) took 100-150 ms against 180-330, with the GIL held at most
    ~4 ms at a time against up to ~13, and it saves ~3 us of CPU per record.
    """
    import chdb

    path = os.path.realpath(dsn[len("chdb://"):])  # as clickhouse-connect spells it for chDB
    return chdb.connect(f"{path}?{urlencode(CHDB_OPTIONS)}")


# The size from which an embedded insert goes through ``Python()``: an INSERT ... SELECT has a
# fixed cost that reading an Arrow file does not, and a lower cost per byte; a gateway's usual
# batch (~0.5 MB) is cheaper as a file, a flood's batches through ``Python()``, the two even at
# ~1-2 MB (figures: docs/benchmarks/store.md#chdb-settings).
PYTHON_INSERT_MIN_BYTES = 2 << 20


def _typed_as_its_columns(table: str, data: pa.Table) -> bool:
    """Whether every column of ``data`` has the Arrow type of its ClickHouse column (as the
    writer's conversion makes them). Only such a table goes through ``Python()``: an INSERT ...
    SELECT casts what it reads as ``CAST`` does, so text in a number column would become 0
    where ``insert_arrow`` refuses it."""
    kinds = _ARROW_KINDS.get(table)
    if kinds is None:
        kinds = _ARROW_KINDS[table] = {c: arrow_type(t) for c, t, _ in TABLES[table].columns}
    return all(kinds.get(f.name) == f.type for f in data.schema)


_ARROW_KINDS: dict[str, dict[str, pa.DataType]] = {}


def _sql_string(text: str) -> str:
    """``text`` as a ClickHouse string literal (its backslashes and quotes escaped)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _identifier(name: str) -> str:
    """``name`` as a ClickHouse identifier in backquotes (its backslashes and backquotes
    escaped)."""
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


def _token_setting(token: str | None, *more: str) -> str:
    """The SETTINGS clause of an INSERT under ``token`` (a batch sent again inserts nothing),
    with ``more`` settings (``name = value``)."""
    settings = [*more, *([f"insert_deduplication_token = {_sql_string(token)}"] if token else [])]
    return f" SETTINGS {', '.join(settings)}" if settings else ""


class Store:
    def __init__(self, dsn: str = DEFAULT_DSN, limits: QueryLimits | None = None) -> None:
        import clickhouse_connect

        self.dsn = normalise_dsn(dsn)
        if is_embedded(self.dsn):
            Path(self.dsn[len("chdb://"):]).mkdir(parents=True, exist_ok=True)
        engine = {"chdb_options": CHDB_OPTIONS} if is_embedded(self.dsn) else {}
        try:
            self.client = clickhouse_connect.get_client(dsn=self.dsn, **engine)
            # Reads get their own client, read-only with resource limits for its whole life
            # (on chDB the settings are SET on its own session; over HTTP they go with every
            # query), so nothing it runs can write and nothing can make the writer read-only.
            self.limits = limits or QueryLimits()
            self.reader = clickhouse_connect.get_client(dsn=self.dsn, **engine,
                                                        settings=self.limits.settings())
            self._arrow_in = _embedded_handle(self.dsn) if is_embedded(self.dsn) else None
            if self._arrow_in is not None:
                # closed at exit if not before, ahead of the engine (as clickhouse-connect's
                # own handles are): left to the garbage collector, it outlived the engine and
                # chDB reported an error at exit
                weakref.finalize(self, self._arrow_in.close)
        except Exception as exc:
            reason = _first_line(exc)
            if is_embedded(self.dsn) and "EmbeddedServer" in reason:
                # chDB reports every start-up failure as BAD_ARGUMENTS; its real reason (a
                # metadata file it cannot parse, a lock, ...) is in the log lines above
                reason = ("chDB could not start on this directory: it is damaged, from an "
                          "incompatible chDB version, or held by another process (chDB's "
                          f"own reason is logged just above; its error: {reason})")
            raise StoreError(f"cannot open the store at {self.dsn}: {reason}") from exc
        # One statement at a time per client; the reader has its own lock, so a long read never
        # holds up the writer's inserts.
        self.lock = threading.Lock()
        self.read_lock = threading.Lock()
        self._known_columns: dict[str, frozenset[str]] = {}  # ``_columns``

    # ---- schema -------------------------------------------------------------------------------
    def migrate(self) -> list[int]:
        """Apply the migrations not applied yet; returns the versions applied now."""
        self._known_columns.clear()
        with self.lock:
            self.client.command(f"CREATE DATABASE IF NOT EXISTS {DATABASE}")
            self.client.command(
                f"CREATE TABLE IF NOT EXISTS {DATABASE}.schema_migrations (version UInt32, "
                "name String, applied_at DateTime64(6, 'UTC') DEFAULT now64(6)) "
                "ENGINE = ReplacingMergeTree ORDER BY version")
            done = {r[0] for r in self.client.query(
                f"SELECT version FROM {DATABASE}.schema_migrations").result_rows}
            pending = [v for v, _, _ in MIGRATIONS if v not in done]
            if pending and self.client.query(
                    "SELECT count() FROM system.tables WHERE database = {d:String} AND name = "
                    "'schema_migrations' AND engine = 'Distributed'",
                    parameters={"d": DATABASE}).result_rows[0][0]:
                raise StoreError(f"the store is a cluster and migrations {pending} are not "
                                 "applied: run `tailscope store init --cluster NAME` (it applies "
                                 "them ON CLUSTER to the local and distributed tables)")
            applied = []
            for version, name, statements in MIGRATIONS:
                if version in done:
                    continue
                for stmt in statements:
                    self.client.command(stmt)
                self.client.command(f"INSERT INTO {DATABASE}.schema_migrations (version, name) "
                                    "VALUES ({v:UInt32}, {n:String})",
                                    parameters={"v": version, "n": name})
                applied.append(version)
            return applied

    # ---- writes -------------------------------------------------------------------------------
    def insert(self, table: str, data: pa.Table, token: str | None = None) -> None:
        """Insert an Arrow table; a repeated ``token`` (a replayed batch) inserts nothing."""
        small = data.nbytes < PYTHON_INSERT_MIN_BYTES
        if self._arrow_in is not None and small:
            # what insert_arrow does on chDB (the table as an Arrow file that chDB reads), with
            # the column list left out where it can be (``_infile``)
            fd, name = tempfile.mkstemp(prefix="tailscope-insert-", suffix=".arrow")
            os.close(fd)
            path = Path(name)
            try:
                write_arrow_file(path, data)
                self._infile(table, path, data.column_names, token)
            finally:
                path.unlink(missing_ok=True)
            return
        if self._arrow_in is None or small or not _typed_as_its_columns(table, data):
            settings = {"insert_deduplication_token": token} if token else None
            with self.lock:
                self.client.insert_arrow(f"{DATABASE}.{table}", data, settings=settings)
            return
        # chDB's Python() table function imports pandas on every call (to tell a DataFrame from
        # the other objects it reads) and reads an Arrow table without it where the import
        # fails, as it does here (``without_pandas``, this thread only): ~40 MB of RSS, and a
        # first large batch's import (a first Python() query took 123 ms of CPU with it, 46
        # without; the import holds the GIL the rest of the process needs) are not paid. The
        # bench's cold 100,000-record ingest in process: 42,500-50,000 records/s with the
        # import, 49,100-61,800 without (alternating runs).
        # Python() reads the table's buffers where they are, found by the local variable's name
        # in this frame
        _tailscope_arrow_batch = data  # noqa: F841
        cols = ", ".join(map(_identifier, data.column_names))
        setting = _token_setting(token)
        with self.lock, without_pandas():  # a failure raises chDB's error with ClickHouse's
            # message, as the insert_arrow route raises clickhouse-connect's (not StoreError:
            # the store is up)
            self._arrow_in.query(f"INSERT INTO {DATABASE}.{_identifier(table)} ({cols}) SELECT "
                                 f"{cols} FROM Python(_tailscope_arrow_batch){setting}")

    def insert_file(self, table: str, path: Path, token: str | None = None) -> int:
        """Insert the rows of the Arrow IPC file at ``path`` (the store child's inbox); returns
        how many. On chDB, a file under ``PYTHON_INSERT_MIN_BYTES`` is read by the engine itself
        (``INSERT ... FROM INFILE ... FORMAT Arrow``): ``insert_arrow`` of the same table, read
        into this process, runs that very statement after writing the table out again to a
        temporary file of its own. A gateway's flush of ~600 short records, all three tables,
        cost chDB's process 20.2 against 23.2 ms of CPU (medians of 6 rounds).
        Anything else is read (memory-mapped) and goes by ``insert``."""
        with pa.memory_map(str(path)) as source:
            reader = ipc.open_file(source)
            rows = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
            if self._arrow_in is None or source.size() >= PYTHON_INSERT_MIN_BYTES:
                self.insert(table, reader.read_all(), token)
                return rows
            names = reader.schema.names
        self._infile(table, path, names, token)
        return rows

    def _infile(self, table: str, path: Path, names: list[str], token: str | None) -> None:
        """``INSERT ... FROM INFILE path FORMAT Arrow`` on the embedded engine; a failure raises
        chDB's error with ClickHouse's message (not StoreError: the store is up).

        The statement names no columns when the file's are all the table's: ClickHouse then
        takes the file's columns by name and gives the table's others their defaults, as
        with the list. Listing the requests table's 73 columns cost ~2.4 ms of CPU of a
        10.5 ms insert of 600 short records, ~3.3 ms over a gateway flush's three tables (~5 us
        a request; medians of 10). A file with a column the table lacks keeps the
        list, so ClickHouse refuses it naming the column: without one, that column would be
        dropped without a word.

        It runs on one thread (``max_threads = 1``): a file this small gains nothing from
        more, and their hand-offs cost a gateway's flush of 600 short records 17.9 against
        15.5 ms of CPU for its three tables (medians of 28)."""
        cols = "" if set(names) <= self._columns(table) else \
            f" ({', '.join(map(_identifier, names))})"
        with self.lock:
            self._arrow_in.query(f"INSERT INTO {DATABASE}.{_identifier(table)}{cols} FROM INFILE "
                                 f"{_sql_string(str(path))}"
                                 f"{_token_setting(token, 'max_threads = 1')} FORMAT Arrow")

    def _columns(self, table: str) -> frozenset[str]:
        """The table's column names, read once per table (migrations add columns and never drop
        one, and ``migrate`` forgets what was read; a column added by another process since
        only makes a file that has it keep its column list)."""
        known = self._known_columns.get(table)
        if known is None:
            with self.lock:
                known = frozenset(r[0] for r in self.client.query(
                    "SELECT name FROM system.columns WHERE database = {d:String} AND "
                    "table = {t:String}", parameters={"d": DATABASE, "t": table}).result_rows)
            self._known_columns[table] = known
        return known

    def insert_many(self, batch: list[tuple[str, pa.Table, str | None]]) -> None:
        """``insert`` of each ``(table, data, token)`` in order (a writer's flush: its requests,
        events and steps); the first that fails stops the rest and raises ``InsertStopped``
        naming the tables that landed."""
        done: list[str] = []
        for table, data, token in batch:
            try:
                self.insert(table, data, token)
            except Exception as exc:
                raise InsertStopped(f"insert into {table} failed: {_first_line(exc)}",
                                    done) from exc
            done.append(table)

    def insert_rows(self, table: str, rows: list, token: str | None = None) -> None:
        if rows:
            self.insert(table, to_arrow(TABLES[table], rows), token)

    def command(self, sql: str, parameters: dict | None = None) -> Any:
        with self.lock:
            return self.client.command(sql, parameters=parameters)

    def delete_tenant(self, tenant: str) -> int:
        """Remove a tenant's request rows and their events; returns the requests removed.
        Events are matched by their own tenant column (a trace id can come from a caller's
        traceparent, so two tenants' requests may share one); events stored before that column
        existed (tenant '') are matched through their request's trace id."""
        n = self.select("SELECT count() FROM tailscope.requests WHERE tenant = {t:String}",
                        {"t": tenant})[1][0][0]
        self.command("DELETE FROM tailscope.request_events WHERE tenant = {t:String} OR "
                     "(tenant = '' AND trace_id IN (SELECT trace_id FROM tailscope.requests "
                     "WHERE tenant = {t:String}))", {"t": tenant})
        self.command("DELETE FROM tailscope.requests WHERE tenant = {t:String}", {"t": tenant})
        return int(n)

    # ---- reads --------------------------------------------------------------------------------
    def check_select(self, sql: str, parameters: dict | None = None) -> str:
        """The canonical text of ``sql`` if it is one plain SELECT (see the module doc), else
        QueryRefused. Parsing runs on the read-only client and executes nothing."""
        try:
            body = self.reader.query("SELECT formatQuerySingleLine({q:String})",
                                     parameters={"q": sql}).result_rows[0][0]
        except Exception as exc:
            raise QueryRefused(f"not one valid statement: {_first_line(exc)}") from None
        try:
            ast = self.reader.query(f"EXPLAIN AST {body}", parameters=parameters or None)
        except Exception as exc:
            raise QueryRefused(f"not a valid query: {_first_line(exc)}") from None
        check_ast([row[0] for row in ast.result_rows])
        return body

    def _read(self, method: str, sql: str, parameters: dict | None, query_id: str | None):
        with self.read_lock:
            body = self.check_select(sql, parameters)
            tagged = f"/* {_READ_TAG}{query_id or uuid.uuid4().hex} */ {body}"
            try:
                return getattr(self.reader, method)(tagged, parameters=parameters or None)
            except Exception:
                if is_embedded(self.dsn):
                    self._renew_reader()
                raise

    def _renew_reader(self) -> None:
        """A fresh read-only client in place of one whose read just failed. On chDB (4.4 with
        clickhouse-connect 1.12), an Arrow read that fails part-way (a limit, a cancel) leaves
        the rest of its output on the connection, and the next read on it gets those bytes
        (``'utf-8' codec can't decode byte 0xff``: Arrow's stream marker) instead of its own
        answer: one failed drill-down query broke the next one. A new client is a new
        connection to the same engine (~9 ms); the writer's client is not touched."""
        import clickhouse_connect

        old = self.reader
        try:
            self.reader = clickhouse_connect.get_client(
                dsn=self.dsn, chdb_options=CHDB_OPTIONS, settings=self.limits.settings())
        except Exception:  # keep the old one rather than none: the next read may still work
            log.exception("could not open a fresh read client for %s", self.dsn)
            return
        try:
            old.close()
        except Exception:  # closing a broken connection must not fail the read's own error
            pass

    def select(self, sql: str, parameters: dict | None = None, query_id: str | None = None
               ) -> tuple[list[str], list[tuple]]:
        res = self._read("query", sql, parameters, query_id)
        return list(res.column_names), [tuple(r) for r in res.result_rows]

    def select_arrow(self, sql: str, parameters: dict | None = None,
                     query_id: str | None = None) -> pa.Table:
        return self._read("query_arrow", sql, parameters, query_id)

    def cancel(self, query_id: str | None = None) -> None:
        """Stop the read tagged ``query_id`` (every tagged read when None), if it still runs."""
        tag = f"/* {_READ_TAG}{query_id or ''}"
        with self.lock:
            self.client.command("KILL QUERY WHERE startsWith(query, {tag:String}) ASYNC",
                                parameters={"tag": tag})

    def close(self) -> None:
        with self.lock:
            for client in (self._arrow_in, self.reader, self.client):
                if client is None:
                    continue
                try:
                    client.close()
                except Exception:  # closing a broken connection must not raise at shutdown
                    pass
