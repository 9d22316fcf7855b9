"""``RecordWriter``: request records and engine steps into the store, batched, never blocking the
request path, and never losing or duplicating a row when the store goes away for a while.

More: docs/design/gateway-notes.md#tracingwriter."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

from tracing.arrow import records_to_arrow, to_arrow, write_arrow_file
from tracing.record import RequestRecord
from tracing.schema import TABLES, EngineStepRow
from tracing.store import InsertStopped, Store, StoreError

# the list fields of what the writer queues (``untrack``)
_LISTS = {cls: tuple(f.name for f in dataclasses.fields(cls) if str(f.type).startswith("list["))
          for cls in (RequestRecord, EngineStepRow)}

DEAD_LETTER = "dead-letter.jsonl"
QUARANTINE = "quarantine"


def item_bytes(kind: str, item) -> int:
    """An estimate of an item's memory (token ids dominate a record)."""
    if kind != "requests":
        return 400
    return 1500 + 32 * (len(item.input_token_ids) + len(item.output_token_ids)
                        + len(item.itl_ms)) + 120 * len(item.events) + len(item.metadata) \
        + len(item.sampling_params) + len(item.error_message)

log = logging.getLogger("tailscope.writer")


def _gc_untrack() -> Callable[[object], None] | None:
    """CPython's ``PyObject_GC_UnTrack`` (public C API; Python itself has no call for it), or
    None where there is none (another interpreter)."""
    try:
        import ctypes

        fn = ctypes.pythonapi.PyObject_GC_UnTrack
    except (ImportError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.py_object], None
    return fn


_UNTRACK = _gc_untrack()


def untrack(item) -> None:
    """Take a queued record (or step row) and its lists out of the garbage collector's view.

    Records wait in the queue up to ``max_age_s`` (5 s in a gateway), and every collection of
    the generation they had reached walked each one, its lists and their elements again, where
    nothing could ever be freed: a record is data, every field a number, a string, None or a
    list of those (events: ``RecordEvent``, itself untracked) and no field can refer back to
    anything, so none can be part of a reference cycle (tests/tracing/test_store.py checks the
    fields' types), and reference counting frees them once their batch is written. A tiny-model
    gateway with the store child under load: collections 12.5-12.9 -> 3.2-3.8 us of CPU a
    request, at ~0.15 us a call here, 7 calls a record and 4 a step row
    (alternating runs). ``PyObject_GC_UnTrack`` is a no-op on an object already untracked."""
    names = _LISTS.get(type(item))
    if _UNTRACK is None or names is None:  # a type whose fields are not known to be data
        return
    for name in names:
        _UNTRACK(getattr(item, name))
    _UNTRACK(item)


# The writer's two threads as the OS names them (``top -H``, ``/proc/<pid>/task/<tid>/comm``):
# what capture costs a gateway's CPU is theirs plus the store engine's own threads
# (``bench/trace_overhead.py`` reads them apart from the request path's).
WRITER, INSERTER = "ts-writer", "ts-insert"


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` (15 bytes at most) where the OS shows thread names
    (Linux: its ``comm``); elsewhere nothing. Python's own thread names stay inside Python."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


class RecordWriter:
    def __init__(self, store: Store | Callable[[], Store], spool_dir: str | Path,
                 batch_size: int = 20_000, max_age_s: float = 1.0, max_queue: int = 200_000,
                 replay_interval_s: float = 1.0, fault_file: str | None = None,
                 max_queue_bytes: int = 256 << 20) -> None:
        self._store_factory = store if callable(store) else (lambda: store)
        self._store: Store | None = None
        self.spool_dir = Path(spool_dir)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.batch_size = batch_size
        self.max_age_s = max_age_s
        self.max_queue = max_queue
        self.max_queue_bytes = max_queue_bytes
        self.queued_bytes = 0
        self.replay_interval_s = replay_interval_s
        self.fault_file = fault_file
        self._queue: deque[tuple[str, object, float, int]] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._unsaved: list[tuple[str, str, pa.Table]] = []  # (token, table, data) not on disk
        self._spool_dirty = True  # the spool may hold files (``_spool_pending``)
        self._flush_asked = self._flush_done = 0  # ``flush()`` requests and completions
        self.last_success_ts: float | None = None  # wall clock of the latest insert
        self.stats = {"queued": 0, "written": 0, "spooled": 0, "replayed": 0, "dropped": 0,
                      "steps_written": 0, "steps_dropped": 0, "insert_errors": 0,
                      "dead_lettered": 0, "spool_errors": 0, "quarantined": 0,
                      "writer_errors": 0}
        # inserts run here, one at a time, while the writer thread converts the next batch
        self._inserter = ThreadPoolExecutor(1, thread_name_prefix="record-inserter",
                                            initializer=name_os_thread, initargs=(INSERTER,))
        self._thread = threading.Thread(target=self._run, name="record-writer", daemon=True)
        self._thread.start()

    # ---- the request path ---------------------------------------------------------------------
    def emit(self, record: RequestRecord) -> None:
        if self._put("requests", record) and self._waits():
            untrack(record)

    def emit_step(self, row: EngineStepRow) -> None:
        if self._put("engine_steps", row) and self._waits():
            untrack(row)

    def _waits(self) -> bool:
        """Whether the item just queued will wait for its batch (and so is worth ``untrack``):
        not where a full batch is queued ahead of it already (a flood: it is converted within
        moments). Untracking costs ~1-1.5 us a record on the request path; in the ingest flood
        of bench/trace_overhead.py (prebuilt records, so no collections to save) that cost took
        ~10 % off the records/s (42,000-49,000 against 47,000-58,000 in process, alternating)."""
        return len(self._queue) <= self.batch_size

    def _put(self, kind: str, item: object) -> bool:
        """Queue ``item``; False where it was dropped."""
        size = item_bytes(kind, item)
        if (len(self._queue) >= self.max_queue or self.queued_bytes + size > self.max_queue_bytes
                or self._closing):
            why = "writer is closed" if self._closing else \
                f"queue full ({len(self._queue)} items, {self.queued_bytes >> 20} MiB)"
            if kind == "requests":
                self.stats["dropped"] += 1
                log.warning("dropped the record of trace %s: %s", item.trace_id, why)
            else:
                self.stats["steps_dropped"] += 1
            return False
        was_empty = not self._queue
        self._queue.append((kind, item, time.monotonic(), size))
        self.queued_bytes += size
        if kind == "requests":
            self.stats["queued"] += 1
        # the writer sleeps until its next deadline (``_wait_s``); the first item of an empty
        # queue brings one, and a full batch is due now
        if was_empty or len(self._queue) >= self.batch_size:
            with self._cond:
                self._cond.notify()
        return True

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def spool_files(self) -> list[Path]:
        return sorted(self.spool_dir.glob("*.arrow"))

    # ---- the writer thread --------------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread(WRITER)
        last_replay = 0.0
        while True:
            with self._cond:  # wake for a full batch, a flush, the oldest item's age, a replay
                if not self._closing and not self._due() and not self._flush_wanted():
                    self._cond.wait(timeout=self._wait_s(last_replay))
            closing, asked = self._closing, self._flush_asked
            try:
                force = closing or asked > self._flush_done
                # a forced flush drains what is queued now, not what keeps arriving meanwhile
                left = len(self._queue) if force else 0
                inserting: Future | None = None
                try:
                    while self._queue and (left > 0 or self._due()):
                        batch = self._take()
                        left -= len(batch)
                        # convert this batch while the previous one is being inserted (chDB
                        # and the HTTP client release the GIL): +34 % records/s in a flood
                        prepared = self._prepare(batch)
                        if inserting is not None:
                            inserting.result()
                        inserting = self._inserter.submit(self._deliver, *prepared) \
                            if prepared is not None else None
                finally:
                    if inserting is not None:  # every batch taken is inserted or spooled
                        inserting.result()
                now = time.monotonic()
                if self._spool_pending() and (now - last_replay >= self.replay_interval_s
                                              or force):
                    last_replay = now
                    self._retry_unsaved()
                    self._replay()
            except Exception:  # a bug or an unexpected error: logged, counted, never fatal
                self.stats["writer_errors"] += 1
                log.exception("record writer: unexpected error; carrying on")
                time.sleep(0.1)
            with self._cond:
                if asked > self._flush_done:
                    self._flush_done = asked
                    self._cond.notify_all()
            if closing and not self._queue:
                return

    def _wait_s(self, last_replay: float) -> float:
        """Seconds until the next thing falls due: the oldest queued item reaching
        ``max_age_s`` or, while something waits there (``_spool_pending``), the next look at
        the spool; at most ``IDLE_WAIT_S``. (Waking at a quarter of the shorter of the two
        instead, 4 times a second in a gateway, cost an idle gateway's writer 0.46-0.56 ms/s
        of CPU against 0.19-0.26 with a look at the spool every second, on this VM with the
        machine otherwise idle, where a wake-up costs ~0.2 ms; alternating runs.
        An empty spool is not looked at: those looks, a wake-up and a listing of the spool
        directory each, were ~4 us of a loaded gateway's writer per request.)"""
        now = time.monotonic()
        until = now + self.IDLE_WAIT_S
        if self._spool_pending():
            until = min(until, last_replay + self.replay_interval_s)
        if self._queue:
            until = min(until, self._queue[0][2] + self.max_age_s)
        return max(until - now, 0.001)

    # the longest the writer sleeps with nothing due (an item arriving, a flush or close wakes
    # it at once)
    IDLE_WAIT_S = 60.0

    def _spool_pending(self) -> bool:
        """Whether the spool may hold files (or the disk refused batches kept in memory): true
        at start (files left by an earlier process) and once a batch is spooled, false once a
        replay has found the spool empty."""
        return self._spool_dirty or bool(self._unsaved)

    def _flush_wanted(self) -> bool:
        return self._flush_asked > self._flush_done

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Insert (or spool) everything queued now and replay the spool; True once done."""
        with self._cond:
            self._flush_asked += 1
            target = self._flush_asked
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._flush_done >= target or not self.alive,
                                       timeout=timeout_s) and self._flush_done >= target

    def _due(self) -> bool:
        q = self._queue
        return bool(q) and (len(q) >= self.batch_size
                            or time.monotonic() - q[0][2] >= self.max_age_s)

    def _take(self) -> list[tuple[str, object, float, int]]:
        out = []
        while self._queue and len(out) < self.batch_size:
            item = self._queue.popleft()
            self.queued_bytes -= item[3]
            out.append(item)
        return out

    def _tables(self, items) -> dict[str, pa.Table]:
        # by index: ``for kind, it, *_ in items`` builds a list per item for ``*_`` (a flush
        # of 1,700 items: 318 against 45 us)
        records = [it[1] for it in items if it[0] == "requests"]
        steps = [it[1] for it in items if it[0] == "engine_steps"]
        out = {}
        if records:  # a record whose row cannot be converted keeps its events out too
            out["requests"], out["request_events"] = self._convert(
                "requests", records, records_to_arrow)
        if steps:
            out["engine_steps"], = self._convert(
                "engine_steps", steps, lambda rows: (to_arrow(TABLES["engine_steps"], rows),))
        return {name: data for name, data in out.items() if data.num_rows}

    def _convert(self, name: str, rows: list, convert: Callable[[list], tuple]) -> tuple:
        """``convert(rows)``; when that fails, row by row: the ones that cannot be converted go
        to the dead-letter file and the rest are converted together."""
        try:
            return convert(rows)
        except Exception:
            pass
        good = []
        for row in rows:
            try:
                convert([row])
                good.append(row)
            except Exception as exc:
                self._dead_letter(name, row, exc)
        return convert(good)

    def _dead_letter(self, name: str, row, exc: Exception) -> None:
        trace_id = getattr(row, "trace_id", "")
        self.stats["dead_lettered"] += 1
        log.error("record of trace %s cannot be stored (%s: %s); set aside in %s", trace_id,
                  type(exc).__name__, exc, self.spool_dir / DEAD_LETTER)
        try:
            line = json.dumps({"table": name, "trace_id": trace_id, "error": str(exc),
                               "row": row.to_dict() if isinstance(row, RequestRecord)
                               else dataclasses.asdict(row)}, default=str)
            with open(self.spool_dir / DEAD_LETTER, "a") as f:
                f.write(line + "\n")
        except Exception:
            log.exception("could not write the dead-letter file")

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
        self.last_success_ts = time.time()

    def _store_answers(self) -> bool:
        """The store is up (so a failing insert is the data's fault, not the store's)."""
        try:
            self._store_or_raise().command("SELECT 1")
            return True
        except Exception:
            return False

    def _prepare(self, items) -> tuple[str, dict[str, pa.Table]] | None:
        """A batch as Arrow tables under its insert token (None: nothing could be converted;
        its rows are in the dead-letter file)."""
        token = f"{time.time_ns()}-{uuid.uuid4().hex[:12]}"
        try:
            return token, self._tables(items)
        except Exception as exc:  # a bug in conversion: the rows are set aside, not lost
            log.exception("record writer: cannot convert a batch of %d items", len(items))
            self.stats["writer_errors"] += 1
            for kind, item, *_ in items:
                self._dead_letter(kind, item, exc)
            return None

    def _deliver(self, token: str, tables: dict[str, pa.Table]) -> None:
        """Insert a prepared batch's tables (one ``insert_many``: a store process takes them in
        one request); spool what the store did not take."""
        pending: dict[str, pa.Table] = {}
        try:
            self._store_or_raise().insert_many(
                [(name, data, f"{token}-{name}") for name, data in tables.items()])
            self.last_success_ts = time.time()
        except Exception as exc:
            landed = exc.inserted if isinstance(exc, InsertStopped) else []
            pending = {name: data for name, data in tables.items() if name not in landed}
            self.stats["insert_errors"] += 1
            log.warning("store insert failed (%s); spooling %d table(s) to %s", exc,
                        len(pending), self.spool_dir)
            for name, data in pending.items():
                self._save(token, name, data)
        n_req = tables["requests"].num_rows if "requests" in tables else 0
        n_steps = tables["engine_steps"].num_rows if "engine_steps" in tables else 0
        if "requests" in pending:
            self.stats["spooled"] += n_req
        else:
            self.stats["written"] += n_req
        if "engine_steps" not in pending:
            self.stats["steps_written"] += n_steps

    def _save(self, token: str, name: str, data: pa.Table) -> None:
        """Spool a table; if the disk refuses, keep it in memory for the next replay."""
        try:
            self._spool(name, data, token)
        except OSError as exc:
            self.stats["spool_errors"] += 1
            log.error("cannot spool %d %s rows to %s (%s); kept in memory and retried",
                      data.num_rows, name, self.spool_dir, exc)
            self._unsaved.append((token, name, data))

    def _spool(self, name: str, data: pa.Table, token: str) -> None:
        """A file that exists under its final name is complete and survives a crash."""
        write_arrow_file(self.spool_dir / f"{token}.{name}.arrow", data, durable=True)
        # after the file is in place: a replay that clears the mark before this listed it
        self._spool_dirty = True

    def _retry_unsaved(self) -> None:
        """Batches the disk refused: insert them now, or spool them if the disk has room."""
        unsaved, self._unsaved = self._unsaved, []
        for token, name, data in unsaved:
            try:
                self._insert(name, data, f"{token}-{name}")
            except StoreError:
                self._save(token, name, data)
                continue
            if name == "requests":
                self.stats["written"] += data.num_rows
                self.stats["replayed"] += data.num_rows

    def _replay(self) -> None:
        # cleared before the listing: a batch spooled meanwhile (the inserter thread) sets it
        self._spool_dirty = False
        for path in self.spool_files():
            token, name = path.name[:-len(".arrow")].rsplit(".", 1)
            try:
                with pa.memory_map(str(path)) as src:
                    data = ipc.open_file(src).read_all()
            except (OSError, pa.ArrowInvalid) as exc:
                log.error("unreadable spool file %s (%s); quarantined", path, exc)
                self._quarantine(path)
                continue
            try:
                self._insert(name, data, f"{token}-{name}")
            except StoreError as exc:
                if self._store_answers():  # the store is up: this file is the problem
                    log.error("spool file %s fails while the store is up (%s); quarantined",
                              path.name, exc)
                    self._quarantine(path)
                    continue
                self._spool_dirty = True
                return  # still down: keep the files, try again later
            path.unlink()
            if name == "requests":
                self.stats["replayed"] += data.num_rows
                self.stats["written"] += data.num_rows
            log.info("replayed %d %s rows from %s", data.num_rows, name, path.name)

    def _quarantine(self, path: Path) -> None:
        self.stats["quarantined"] += 1
        qdir = self.spool_dir / QUARANTINE
        qdir.mkdir(exist_ok=True)
        os.replace(path, qdir / path.name)

    def close(self, timeout_s: float = 30.0) -> None:
        """Drain: every queued item is inserted or spooled before this returns."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("record writer did not finish within %.0f s; %d items left", timeout_s,
                      len(self._queue))
        else:
            self._inserter.shutdown(wait=True)
