"""``RecordWriter``: request records and engine steps into the store, batched, never blocking the
request path, and never losing or duplicating a row when the store goes away for a while.

- ``emit`` / ``emit_step`` append to a bounded in-memory queue (O(1), no I/O; called from the
  event loop). Past ``max_queue`` items a record is dropped, counted and logged with the reason.
- A background thread takes batches (by size, or when the oldest waiting item is ``max_age_s``
  old), turns them into Arrow tables (``requests``, ``request_events``, ``engine_steps``) and
  inserts each with an ``insert_deduplication_token`` derived from the batch's id.
- An insert that fails spools the batch's tables to Arrow IPC files under ``spool_dir``
  (written to a temporary name, then renamed); every ``replay_interval_s`` the thread replays
  spooled files with the same tokens, so a batch that did land before the error is not inserted
  twice, and deletes each file once its insert succeeded. Spool files left by an earlier
  process are replayed too.
- ``close`` (graceful shutdown) drains the queue: every item is inserted or spooled.

Fault injection for tests: when ``fault_file`` exists, inserts fail as if the store were down.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

from tracing.record import RequestRecord
from tracing.schema import TABLES, EngineStepRow
from tracing.store import Store, StoreError, arrow_type, to_arrow

log = logging.getLogger("tailscope.writer")


class RecordWriter:
    def __init__(self, store: Store | Callable[[], Store], spool_dir: str | Path,
                 batch_size: int = 2000, max_age_s: float = 1.0, max_queue: int = 200_000,
                 replay_interval_s: float = 1.0, fault_file: str | None = None) -> None:
        self._store_factory = store if callable(store) else (lambda: store)
        self._store: Store | None = None
        self.spool_dir = Path(spool_dir)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.batch_size = batch_size
        self.max_age_s = max_age_s
        self.max_queue = max_queue
        self.replay_interval_s = replay_interval_s
        self.fault_file = fault_file
        self._queue: deque[tuple[str, object, float]] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self.stats = {"queued": 0, "written": 0, "spooled": 0, "replayed": 0, "dropped": 0,
                      "steps_written": 0, "steps_dropped": 0, "insert_errors": 0}
        self._thread = threading.Thread(target=self._run, name="record-writer", daemon=True)
        self._thread.start()

    # ---- the request path ---------------------------------------------------------------------
    def emit(self, record: RequestRecord) -> None:
        self._put("requests", record)

    def emit_step(self, row: EngineStepRow) -> None:
        self._put("engine_steps", row)

    def _put(self, kind: str, item: object) -> None:
        if len(self._queue) >= self.max_queue or self._closing:
            why = "writer is closed" if self._closing else f"queue full ({self.max_queue})"
            if kind == "requests":
                self.stats["dropped"] += 1
                log.warning("dropped the record of trace %s: %s", item.trace_id, why)
            else:
                self.stats["steps_dropped"] += 1
            return
        self._queue.append((kind, item, time.monotonic()))
        if kind == "requests":
            self.stats["queued"] += 1
        if len(self._queue) >= self.batch_size:
            with self._cond:
                self._cond.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def spool_files(self) -> list[Path]:
        return sorted(self.spool_dir.glob("*.arrow"))

    # ---- the writer thread --------------------------------------------------------------------
    def _run(self) -> None:
        last_replay = 0.0
        while True:
            with self._cond:  # wake for a full batch, or to check ages and the spool
                if not self._closing and not self._due():
                    self._cond.wait(timeout=min(self.max_age_s, self.replay_interval_s) / 4)
            closing = self._closing
            while self._queue and (closing or self._due()):
                self._flush(self._take())
            now = time.monotonic()
            if now - last_replay >= self.replay_interval_s or closing:
                last_replay = now
                self._replay()
            if closing and not self._queue:
                return

    def _due(self) -> bool:
        q = self._queue
        return bool(q) and (len(q) >= self.batch_size
                            or time.monotonic() - q[0][2] >= self.max_age_s)

    def _take(self) -> list[tuple[str, object, float]]:
        out = []
        while self._queue and len(out) < self.batch_size:
            out.append(self._queue.popleft())
        return out

    def _tables(self, items) -> dict[str, pa.Table]:
        records = [it for kind, it, _ in items if kind == "requests"]
        steps = [it for kind, it, _ in items if kind == "engine_steps"]
        out = {}
        for name, rows in (("requests", records), ("engine_steps", steps)):
            if rows:
                out[name] = to_arrow(TABLES[name], rows)
        if any(r.events for r in records):
            out["request_events"] = self._events_table(records)
        return out

    @staticmethod
    def _events_table(records: list[RequestRecord]) -> pa.Table:
        """Column by column (no per-event row objects: a request has a dozen events)."""
        cols: dict[str, list] = {c: [] for c, _, _ in TABLES["request_events"].columns}
        for r in records:
            n = len(r.events)
            cols["trace_id"] += [r.trace_id] * n
            cols["ts"] += [e.ts_us for e in r.events]
            cols["state"] += [e.state for e in r.events]
            cols["detail"] += [e.detail for e in r.events]
            cols["seq"] += range(n)
            cols["ttl_days"] += [r.ttl_days] * n
        return pa.table({c: pa.array(cols[c], type=arrow_type(t))
                         for c, t, _ in TABLES["request_events"].columns})

    def _store_or_raise(self) -> Store:
        if self.fault_file and os.path.exists(self.fault_file):
            raise StoreError("fault injected: the store is down")
        if self._store is None:
            self._store = self._store_factory()
        return self._store

    def _insert(self, name: str, data: pa.Table, token: str) -> None:
        try:
            self._store_or_raise().insert(name, data, token)
        except StoreError:
            raise
        except Exception as exc:
            raise StoreError(f"insert into {name} failed: {exc}") from exc

    def _flush(self, items) -> None:
        token = f"{time.time_ns()}-{uuid.uuid4().hex[:12]}"
        tables = self._tables(items)
        pending = dict(tables)
        try:
            for name, data in tables.items():
                self._insert(name, data, f"{token}-{name}")
                del pending[name]
        except StoreError as exc:
            self.stats["insert_errors"] += 1
            log.warning("store insert failed (%s); spooling %d table(s) to %s", exc,
                        len(pending), self.spool_dir)
            for name, data in pending.items():
                self._spool(name, data, token)
        n_req = tables["requests"].num_rows if "requests" in tables else 0
        n_steps = tables["engine_steps"].num_rows if "engine_steps" in tables else 0
        if "requests" in pending:
            self.stats["spooled"] += n_req
        else:
            self.stats["written"] += n_req
        if "engine_steps" not in pending:
            self.stats["steps_written"] += n_steps

    def _spool(self, name: str, data: pa.Table, token: str) -> None:
        path = self.spool_dir / f"{token}.{name}.arrow"
        tmp = path.with_suffix(".tmp")
        with pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, data.schema) as w:
            w.write_table(data)
        os.replace(tmp, path)

    def _replay(self) -> None:
        for path in self.spool_files():
            token, name = path.name[:-len(".arrow")].rsplit(".", 1)
            try:
                with pa.memory_map(str(path)) as src:
                    data = ipc.open_file(src).read_all()
            except (OSError, pa.ArrowInvalid) as exc:
                log.error("unreadable spool file %s (%s); moved aside", path, exc)
                os.replace(path, path.with_suffix(".bad"))
                continue
            try:
                self._insert(name, data, f"{token}-{name}")
            except StoreError:
                return  # still down: keep the files, try again later
            path.unlink()
            if name == "requests":
                self.stats["replayed"] += data.num_rows
                self.stats["written"] += data.num_rows
            log.info("replayed %d %s rows from %s", data.num_rows, name, path.name)

    def close(self, timeout_s: float = 30.0) -> None:
        """Drain: every queued item is inserted or spooled before this returns."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("record writer did not finish within %.0f s; %d items left", timeout_s,
                      len(self._queue))
