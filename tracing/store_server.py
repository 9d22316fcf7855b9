"""A store process several gateways can write into: ``tailscope store serve``.

A chDB directory belongs to one process, so gateways that share an embedded store cannot each
open it. This process opens it (``tracing.store.Store``: migrations, the read-only read path,
deduplicated inserts) and serves that same interface over HTTP; a gateway given
``TAILSCOPE_STORE_DSN=tailscope://host:8124`` talks to it through ``RemoteStore``, which has
the ``Store`` methods the gateway's writer and debug endpoints call. Nothing else changes: the
writer still batches, spools while the store process is down and replays spooled batches with
their ``insert_deduplication_token`` (the store drops a batch it already has), and reads still
go through ``Store.select``'s checks, here, in the process that owns the data.

With a ClickHouse server (``http(s)://`` DSNs) no store process is needed: every gateway
writes to the server directly. This is the embedded store's path to several gateways on one
machine or a small fleet, not a replacement for a ClickHouse cluster (docs/guides/scaling-out.md).

Endpoints (JSON unless said; ``Authorization: Bearer <TAILSCOPE_STORE_KEY>`` when a key is set,
loopback clients only otherwise):

More: docs/design/gateway-notes.md#tracingstore_server."""

from __future__ import annotations

import asyncio
import hmac
import io
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tracing.arrow import jsonable, skip_pandas_probe, use_arrow_pool, write_arrow_file
from tracing.schema import TABLES
from tracing.store import InsertStopped, QueryLimits, QueryRefused, Store, StoreError

log = logging.getLogger("tailscope.store")
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
SCHEME = "tailscope://"


def _arrow_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


# the names of the inbox's files: what RemoteStore writes (no path, no dot-dot)
INBOX_FILE = re.compile(r"[0-9a-f]{32}\.[a-z_]+\.arrow")


def _write_inbox_file(inbox: Path, table: str, data: pa.Table) -> Path:
    """``data`` as an Arrow IPC file in ``inbox`` (renamed into place: the store process never
    sees half a file)."""
    path = inbox / f"{uuid.uuid4().hex}.{table}.arrow"
    write_arrow_file(path, data)
    return path


class StoreApp:
    """The store process's endpoints over an open (migrated) ``store``; ``inbox``: the
    directory whose Arrow files ``/v1/insert/{table}?file=NAME`` inserts."""

    def __init__(self, store: Store, key: str | None, inbox: Path | None) -> None:
        self.store, self.key, self.inbox = store, key, inbox
        self.inserts = 0  # batches inserted (``/health`` reports it)

    @staticmethod
    def error(status: int, message: str, code: str, **extra) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "store_error",
                                       "code": code}, **extra}, status_code=status)

    async def authenticate(self, request: Request, call_next):
        if request.url.path != "/health":
            auth = (request.headers.get("authorization") or "").encode()
            if self.key:
                if not hmac.compare_digest(auth, f"Bearer {self.key}".encode()):
                    return self.error(401, "a valid store key is required "
                                      "(TAILSCOPE_STORE_KEY)", "invalid_store_key")
            elif (request.client.host if request.client else "") not in LOOPBACK:
                return self.error(403, "without TAILSCOPE_STORE_KEY the store serves "
                                  "loopback clients only", "loopback_only")
        return await call_next(request)

    def failure(self, exc: Exception, **extra) -> JSONResponse:
        if isinstance(exc, QueryRefused):
            return self.error(400, str(exc), "query_refused", **extra)
        if isinstance(exc, StoreError):
            return self.error(503, str(exc), "store_unavailable", **extra)
        # ClickHouse's own errors (bad SQL, a bad batch): the caller's
        return self.error(400, str(exc).strip().splitlines()[0][:500] if str(exc)
                          else type(exc).__name__, "store_error", **extra)

    async def run(self, fn, *args):
        try:
            return await asyncio.to_thread(fn, *args)
        except Exception as exc:
            return self.failure(exc)

    async def json_of(self, request: Request) -> dict | None:
        try:
            body = await request.json()
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    async def health(self) -> dict:
        return {"ok": True, "dsn": self.store.dsn, "inserts": self.inserts}

    def inbox_file(self, file) -> Path | None:
        """The inbox's file of that name (what RemoteStore writes), or None."""
        if isinstance(file, str) and INBOX_FILE.fullmatch(file) and (self.inbox / file).is_file():
            return self.inbox / file
        return None

    def insert_files(self, batch: list[tuple[str, Path, str | None]]
                     ) -> tuple[list[str], int, Exception | None]:
        """Insert each file in order, stopping at the first that fails; every file is deleted
        either way (inserted or not: the client keeps its own copy). Returns the tables
        inserted, their rows and the failure."""
        done, rows = [], 0
        try:
            for table, path, token in batch:
                rows += self.store.insert_file(table, path, token)
                done.append(table)
        except Exception as exc:
            return done, rows, exc
        finally:
            for _, path, _ in batch:
                path.unlink(missing_ok=True)
        return done, rows, None

    async def insert_batch(self, request: Request):
        """A writer's flush in one call: ``{"batch": [{"table", "file", "token"}, ...]}``,
        inbox files inserted in order (one HTTP request, not one per table: each cost the store
        process's event loop ~1.1 ms of CPU)."""
        if self.inbox is None:
            return self.error(400, "this store process has no inbox (--inbox): send each table "
                              "to /v1/insert/{table} as the request body", "no_inbox")
        items = (await self.json_of(request) or {}).get("batch")
        if not isinstance(items, list) or not items or not all(
                isinstance(i, dict) and isinstance(i.get("token"), str | None) for i in items):
            return self.error(400, 'body: {"batch": [{"table": "...", "file": "...", "token": '
                              '"..."}, ...]}', "bad_body")
        batch = []
        for item in items:
            table, file = item.get("table"), item.get("file")
            if table not in TABLES:
                return self.error(400, f"unknown table {table!r}", "unknown_table")
            if (path := self.inbox_file(file)) is None:
                return self.error(400, f"no file {file!r} in the inbox", "bad_batch")
            batch.append((table, path, item.get("token") or None))
        done, rows, exc = await asyncio.to_thread(self.insert_files, batch)
        self.inserts += len(done)
        if exc is not None:
            return self.failure(exc, inserted=done)
        return {"inserted": done, "rows": rows}

    async def insert(self, table: str, request: Request, token: str | None = None,
                     file: str | None = None):
        if table not in TABLES:
            return self.error(400, f"unknown table {table!r}", "unknown_table")
        if file is not None:
            if self.inbox is None:
                return self.error(400, "this store process has no inbox (--inbox): send the "
                                  "batch as the request body", "no_inbox")
            if (path := self.inbox_file(file)) is None:
                return self.error(400, f"no file {file!r} in the inbox", "bad_batch")
            _, rows, exc = await asyncio.to_thread(self.insert_files,
                                                   [(table, path, token or None)])
            if exc is not None:
                return self.failure(exc)
            self.inserts += 1
            return {"table": table, "rows": rows}
        body = await request.body()
        try:
            data = ipc.open_stream(body).read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            return self.error(400, f"body is not an Arrow IPC stream: {exc}", "bad_batch")
        out = await self.run(self.store.insert, table, data, token or None)
        if isinstance(out, Response):
            return out
        self.inserts += 1
        return {"table": table, "rows": data.num_rows}

    async def select(self, request: Request):
        body = await self.json_of(request) or {}
        sql, params = body.get("sql"), body.get("params") or None
        if not isinstance(sql, str) or not isinstance(params, dict | None):
            return self.error(400, "body: {\"sql\": \"SELECT ...\", \"params\": {...}}", "bad_body")
        qid = body.get("query_id") or None
        if body.get("format") == "arrow":
            out = await self.run(self.store.select_arrow, sql, params, qid)
            return out if isinstance(out, Response) else Response(
                _arrow_bytes(out), media_type="application/vnd.apache.arrow.stream")
        out = await self.run(self.store.select, sql, params, qid)
        if isinstance(out, Response):
            return out
        cols, rows = out
        return JSONResponse({"columns": cols, "rows": jsonable([list(r) for r in rows])})

    async def cancel(self, request: Request):
        query_id = (await self.json_of(request) or {}).get("query_id") or None
        out = await self.run(self.store.cancel, query_id)
        return out if isinstance(out, Response) else {"cancelled": True}

    async def delete_tenant(self, request: Request):
        tenant = (await self.json_of(request) or {}).get("tenant")
        if not isinstance(tenant, str) or not tenant:
            return self.error(400, "body: {\"tenant\": \"...\"}", "bad_body")
        out = await self.run(self.store.delete_tenant, tenant)
        return out if isinstance(out, Response) else {"deleted_requests": out}


def create_app(store: Store, key: str | None = None, inbox: Path | None = None):
    """The store process's HTTP app (``StoreApp``'s endpoints)."""
    s = StoreApp(store, key, inbox)
    app = FastAPI(title="Tailscope store", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.store_app = s
    app.middleware("http")(s.authenticate)
    app.get("/health")(s.health)
    for path, handler in (("/v1/insert", s.insert_batch), ("/v1/insert/{table}", s.insert),
                          ("/v1/select", s.select), ("/v1/cancel", s.cancel),
                          ("/v1/delete-tenant", s.delete_tenant)):
        app.post(path)(handler)
    return app


class RemoteStore:
    """The ``Store`` methods the gateway calls, sent to a store process (``tailscope://``).

    Its schema is the store process's business (it migrates at start), so ``migrate`` applies
    nothing here. A store process that cannot be reached raises ``StoreError``: the writer then
    spools, and the debug endpoints answer 503, as for a ClickHouse server that is down."""

    def __init__(self, dsn: str, key: str | None = None, timeout_s: float = 60.0,
                 inbox: str | Path | None = None) -> None:
        import httpx

        # the store process's --inbox when it runs on this host: batches go there as files
        self.inbox = Path(inbox) if inbox else None

        rest = dsn[len(SCHEME):] if dsn.startswith(SCHEME) else dsn
        scheme = "http"
        if rest.startswith("https:"):  # tailscope://https:host:port: TLS to the store process
            scheme, rest = "https", rest[len("https:"):]
        self.dsn = dsn
        self.url = f"{scheme}://{rest.rstrip('/')}"
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)
        self._lock = threading.Lock()  # httpx.Client is thread-safe; this orders close()

    def _post(self, path: str, **kw):
        r = self._send(path, **kw)
        if r.status_code != 200:
            self._raise_for(r)
        return r

    def _send(self, path: str, **kw):
        import httpx

        try:
            return self._client.post(path, **kw)
        except httpx.HTTPError as exc:
            raise StoreError(f"store process {self.url} unreachable: {exc!r}") from None

    def _raise_for(self, r) -> None:
        """The error a store process's answer carries, raised as ``Store`` raises it."""
        try:
            err = r.json()["error"]
            message, code = err["message"], err.get("code", "")
        except (ValueError, KeyError, TypeError):
            message, code = r.text[:500], ""
        if code == "query_refused":
            raise QueryRefused(message)
        if r.status_code in (400, 422):
            raise ValueError(message)
        raise StoreError(f"store process {self.url}: {r.status_code} {message}")

    def migrate(self) -> list[int]:
        self._post("/v1/select", json={"sql": "SELECT 1"})  # reachable and answering
        return []

    def insert(self, table: str, data: pa.Table, token: str | None = None) -> None:
        params = {"token": token} if token else {}
        if self.inbox is None:
            self._post(f"/v1/insert/{table}", params=params or None, content=_arrow_bytes(data),
                       headers={"content-type": "application/vnd.apache.arrow.stream"})
            return
        try:
            path = _write_inbox_file(self.inbox, table, data)
        except OSError as exc:  # the inbox is gone or full: the writer spools the batch
            raise StoreError(f"cannot write to the store process's inbox {self.inbox}: "
                             f"{exc}") from None
        try:
            self._post(f"/v1/insert/{table}", params={**params, "file": path.name})
        finally:
            path.unlink(missing_ok=True)  # the store process deletes it once read

    def insert_many(self, batch: list[tuple[str, pa.Table, str | None]]) -> None:
        """As ``Store.insert_many``; through the inbox, one request for the whole batch."""
        if self.inbox is None:
            Store.insert_many(self, batch)
            return
        paths: list[Path] = []
        try:
            try:
                for table, data, _ in batch:
                    paths.append(_write_inbox_file(self.inbox, table, data))
            except OSError as exc:  # the inbox is gone or full: the writer spools the batch
                raise InsertStopped(f"cannot write to the store process's inbox {self.inbox}: "
                                    f"{exc}", []) from None
            r = self._send("/v1/insert", json={"batch": [
                {"table": table, "file": path.name, "token": token}
                for (table, _, token), path in zip(batch, paths, strict=True)]})
            if r.status_code != 200:
                try:
                    inserted = r.json().get("inserted") or []
                except ValueError:
                    inserted = []
                try:
                    self._raise_for(r)
                except Exception as exc:
                    raise InsertStopped(str(exc), inserted) from exc
        finally:
            for path in paths:  # the store process deletes them once read
                path.unlink(missing_ok=True)

    insert_rows = Store.insert_rows  # rows to Arrow here, then ``insert``

    def select(self, sql: str, parameters: dict | None = None, query_id: str | None = None
               ) -> tuple[list[str], list[tuple]]:
        # as Arrow: types survive the trip (datetimes, NaN), which JSON would not keep
        table = self.select_arrow(sql, parameters, query_id)
        return table.column_names, list(zip(*(c.to_pylist() for c in table.columns),
                                            strict=True))

    def select_arrow(self, sql: str, parameters: dict | None = None,
                     query_id: str | None = None) -> pa.Table:
        r = self._post("/v1/select", json={"sql": sql, "params": parameters or {},
                                           "query_id": query_id, "format": "arrow"})
        return ipc.open_stream(r.content).read_all()

    def command(self, sql: str, parameters: dict | None = None):
        """A read only (the writer's ``SELECT 1`` probe): a store process takes no DDL or
        writes but its inserts."""
        rows = self.select(sql, parameters)[1]
        return rows[0][0] if rows and rows[0] else None

    def cancel(self, query_id: str | None = None) -> None:
        self._post("/v1/cancel", json={"query_id": query_id})

    def delete_tenant(self, tenant: str) -> int:
        return int(self._post("/v1/delete-tenant", json={"tenant": tenant}).json()[
            "deleted_requests"])

    def close(self) -> None:
        with self._lock:
            self._client.close()


def uvicorn_server(app, on_exit_signal: Callable[[], None] | None = None, **config):
    """A uvicorn server for ``app`` that wakes once a second when idle, not ten times.

    uvicorn's main loop sleeps 0.1 s between looks at its exit flag (refreshing the Date
    header every tenth), and on this VM a wake-up costs ~0.2 ms of CPU when the machine is
    otherwise idle (its vCPU has to be woken; with the CPUs busy it is cheap): an idle store
    process's main thread took 2.63 ms/s with uvicorn's loop and 0.25 ms/s with this one, a
    gateway's store child's 1.3-1.7 against 0.21-0.26 (/proc/<pid>/task/<tid>/
    schedstat; alternating runs); while a test suite kept the CPUs busy, ~0.2 ms/s both. A stop
    signal is then acted on within a second instead of 0.1 s; requests are served as before
    (the loop only waits). The gateway (``tailscope serve``) and the store process run on it;
    ``on_exit_signal`` is called first thing on SIGTERM/SIGINT."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if on_exit_signal is not None:
                on_exit_signal()
            super().handle_exit(sig, frame)

        async def main_loop(self) -> None:
            # 0 as the tick count: the Date header is refreshed at every tick
            while not await self.on_tick(0):
                await asyncio.sleep(1.0)

    return Server(uvicorn.Config(app, **config))


def serve(dsn: str, host: str, port: int, key: str | None, parent_pid: int | None = None,
          limits: QueryLimits | None = None, inbox: str | Path | None = None) -> None:
    """Open and migrate the store at ``dsn``, then serve it until stopped (SIGTERM, or
    ``parent_pid`` no longer being our parent); ``inbox``: see ``create_app``."""
    import signal

    skip_pandas_probe()
    use_arrow_pool()
    store = Store(dsn, limits)
    store.migrate()
    log.info("store process: %s on %s:%d (%s)", store.dsn, host, port,
             "keyed" if key else "loopback clients only")
    if parent_pid:
        def watch_parent() -> None:
            while os.getppid() == parent_pid:
                time.sleep(1.0)
            log.error("store process: parent %d is gone; stopping", parent_pid)
            os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful stop, then close()

        threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    try:
        uvicorn_server(create_app(store, key, Path(inbox) if inbox else None), host=host,
                       port=port, log_level="warning").run()
    finally:
        store.close()


__all__ = ["RemoteStore", "SCHEME", "create_app", "serve"]
