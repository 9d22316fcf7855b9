"""The one store client: clickhouse-connect over embedded chDB or a ClickHouse server.

DSNs: ``chdb:///abs/path`` or ``chdb://./rel/path`` (embedded; the default is
``chdb://./.tailscope/store``) and ``http(s)://user:pass@host:8123/tailscope`` (server). The same
calls work on both; chDB locks its directory, so in embedded mode one process (the gateway)
owns it and other tools read through the gateway's ``/debug/query``.

``Store.select`` is the read-only path used by ``/debug/query`` and the CLI: one SELECT (or
WITH ... SELECT) statement, run with ClickHouse's ``readonly`` setting, parameters bound by the
server (``{name:Type}`` placeholders), never interpolated into the SQL.
"""

from __future__ import annotations

import operator
import re
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa

from tracing.schema import DATABASE, MIGRATIONS, TABLES, Table

DEFAULT_DSN = "chdb://./.tailscope/store"


class StoreError(RuntimeError):
    pass


class QueryRefused(ValueError):
    """Not a single read-only SELECT: refused before it reaches the store."""


def normalise_dsn(dsn: str) -> str:
    """chdb DSNs get an absolute path (clickhouse-connect wants ``chdb:///abs``)."""
    if dsn.startswith("chdb://"):
        path = Path(dsn[len("chdb://"):] or ".").expanduser().resolve()
        return f"chdb://{path}"
    if dsn.startswith(("http://", "https://")):
        return dsn
    raise StoreError(f"unsupported store DSN {dsn!r}: use chdb:///path or http(s)://host:8123")


def is_embedded(dsn: str) -> bool:
    return dsn.startswith("chdb://")


_COMMENTS = re.compile(r"--[^\n]*|/\*.*?\*/", re.S)


def check_select(sql: str) -> str:
    """The statement without comments and a trailing ';', or QueryRefused."""
    body = _COMMENTS.sub(" ", sql).strip().rstrip(";").strip()
    if not re.match(r"(?is)^(select|with)\b", body):
        raise QueryRefused("only SELECT queries are allowed")
    # a ';' outside string literals means a second statement
    if ";" in re.sub(r"'(?:[^'\\]|\\.)*'", "''", body):
        raise QueryRefused("one statement only")
    if re.search(r"(?is)\bsettings\b", re.sub(r"'(?:[^'\\]|\\.)*'", "''", body)):
        raise QueryRefused("SETTINGS clauses are not allowed in read queries")
    return body


def arrow_type(ch_type: str) -> pa.DataType:
    t = ch_type.replace("LowCardinality(", "").replace("Nullable(", "").rstrip(")")
    if t.startswith("DateTime64"):
        return pa.timestamp("us", tz="UTC")
    if t.startswith("Array("):
        return pa.list_(arrow_type(t[len("Array("):]))
    return {"String": pa.string(), "Int64": pa.int64(), "Float64": pa.float64(),
            "Float32": pa.float32(), "Bool": pa.bool_(), "UInt8": pa.uint8(),
            "UInt16": pa.uint16(), "UInt32": pa.uint32(), "UInt64": pa.uint64()}[t]


def to_arrow(table: Table, rows: list) -> pa.Table:
    arrays = {}
    for col, ch_type, field in table.columns:
        values = list(map(operator.attrgetter(field), rows))
        arrays[col] = pa.array(values, type=arrow_type(ch_type))
    return pa.table(arrays)


class Store:
    def __init__(self, dsn: str = DEFAULT_DSN) -> None:
        import clickhouse_connect

        self.dsn = normalise_dsn(dsn)
        if is_embedded(self.dsn):
            Path(self.dsn[len("chdb://"):]).mkdir(parents=True, exist_ok=True)
        try:
            self.client = clickhouse_connect.get_client(dsn=self.dsn)
            # Reads get their own client: on chDB a query's ``readonly`` setting can stick to
            # the session (seen with query_arrow), and it must never reach the writer's inserts.
            self.reader = clickhouse_connect.get_client(dsn=self.dsn)
        except Exception as exc:
            raise StoreError(f"cannot open the store at {self.dsn}: {exc}") from exc
        self.lock = threading.Lock()  # one statement at a time on these clients

    # ---- schema -------------------------------------------------------------------------------
    def migrate(self) -> list[int]:
        """Apply the migrations not applied yet; returns the versions applied now."""
        with self.lock:
            self.client.command(f"CREATE DATABASE IF NOT EXISTS {DATABASE}")
            self.client.command(
                f"CREATE TABLE IF NOT EXISTS {DATABASE}.schema_migrations (version UInt32, "
                "name String, applied_at DateTime64(6, 'UTC') DEFAULT now64(6)) "
                "ENGINE = ReplacingMergeTree ORDER BY version")
            done = {r[0] for r in self.client.query(
                f"SELECT version FROM {DATABASE}.schema_migrations").result_rows}
            applied = []
            for version, name, statements in MIGRATIONS:
                if version in done:
                    continue
                for stmt in statements:
                    self.client.command(stmt)
                self.client.command(f"INSERT INTO {DATABASE}.schema_migrations (version, name) "
                                    f"VALUES ({int(version)}, {name!r})")
                applied.append(version)
            return applied

    # ---- writes -------------------------------------------------------------------------------
    def insert(self, table: str, data: pa.Table, token: str | None = None) -> None:
        """Insert an Arrow table; a repeated ``token`` (a replayed batch) inserts nothing."""
        settings = {"insert_deduplication_token": token} if token else None
        with self.lock:
            self.client.insert_arrow(f"{DATABASE}.{table}", data, settings=settings)

    def insert_rows(self, table: str, rows: list, token: str | None = None) -> None:
        if rows:
            self.insert(table, to_arrow(TABLES[table], rows), token)

    def command(self, sql: str, parameters: dict | None = None) -> Any:
        with self.lock:
            return self.client.command(sql, parameters=parameters)

    def delete_tenant(self, tenant: str) -> int:
        """Remove a tenant's request rows and their events; returns the requests removed."""
        n = self.select("SELECT count() FROM tailscope.requests WHERE tenant = {t:String}",
                        {"t": tenant})[1][0][0]
        self.command("DELETE FROM tailscope.request_events WHERE trace_id IN (SELECT trace_id "
                     "FROM tailscope.requests WHERE tenant = {t:String})", {"t": tenant})
        self.command("DELETE FROM tailscope.requests WHERE tenant = {t:String}", {"t": tenant})
        return int(n)

    # ---- reads --------------------------------------------------------------------------------
    def select(self, sql: str, parameters: dict | None = None) -> tuple[list[str], list[tuple]]:
        body = check_select(sql)
        with self.lock:
            res = self.reader.query(body, parameters=parameters or None,
                                    settings={"readonly": 1})
        return list(res.column_names), [tuple(r) for r in res.result_rows]

    def select_arrow(self, sql: str, parameters: dict | None = None) -> pa.Table:
        body = check_select(sql)
        with self.lock:
            return self.reader.query_arrow(body, parameters=parameters or None,
                                           settings={"readonly": 1})

    def close(self) -> None:
        with self.lock:
            for client in (self.reader, self.client):
                try:
                    client.close()
                except Exception:  # closing a broken connection must not raise at shutdown
                    pass
