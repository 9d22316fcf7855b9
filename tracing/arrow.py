"""Records and rows as Arrow tables, the form every insert takes (the writer's batches, the
spool's files, the store process's inbox), and the process-wide settings that keep those
conversions cheap (no pandas import, the system allocator). Paced so that converting a large
batch never holds the GIL long enough to stall the gateway's event loop."""

from __future__ import annotations

import datetime as dt
import itertools
import operator
import os
import sys
import threading
import time
from array import array
from functools import cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from tracing.schema import TABLES, Table


@cache  # ~0.6 us a call, once per column of every conversion (the writer's, ~80 columns)
def arrow_type(ch_type: str) -> pa.DataType:
    t = ch_type.replace("LowCardinality(", "").replace("Nullable(", "").rstrip(")")
    if t.startswith("DateTime64"):
        return pa.timestamp("us", tz="UTC")
    if t.startswith("Array("):
        return pa.list_(arrow_type(t[len("Array("):]))
    return {"String": pa.string(), "Int64": pa.int64(), "Int32": pa.int32(),
            "Float64": pa.float64(),
            "Float32": pa.float32(), "Bool": pa.bool_(), "UInt8": pa.uint8(),
            "UInt16": pa.uint16(), "UInt32": pa.uint32(), "UInt64": pa.uint64()}[t]


def skip_pandas_probe() -> None:
    """Make pyarrow's check for pandas objects find no pandas, without importing it.

    The first ``pa.array`` of a Python list or NumPy array in a process asks pyarrow's pandas
    shim whether it is a pandas object (``_is_array_like`` in pyarrow's ``array.pxi``), and the
    shim imports pandas to answer when pandas is installed. Nothing Tailscope hands pyarrow is
    a pandas object, and that import cost a gateway 38-42 MB of RSS (with the store child
    224 -> 186 MB idle, 253 -> 228 at its peak under load; with the store in process 453 -> 411
    idle); ``tracing.queries`` imports pandas only when a query is asked for a
    DataFrame. Here ``import pandas`` fails during one ``pa.array`` call (``without_pandas``),
    the shim notes "no pandas" for that check and does not look again; its calls that need
    pandas (``to_pandas``, ``from_pandas``) import it when called, as before. Called by the
    processes Tailscope starts (the gateway, the store process) at their start. Nothing to do
    where pandas is already imported."""
    if "pandas" in sys.modules:
        return
    with without_pandas():
        pa.array([0])


def use_arrow_pool() -> str:
    """Make pyarrow allocate from the system allocator instead of its default mimalloc, unless
    ``ARROW_DEFAULT_MEMORY_POOL`` names a pool; returns the pool's backend name.

    pyarrow's mimalloc backs its memory with transparent huge pages, and a record writer's
    conversions are short-lived churn: every flush builds tens of MB of Arrow buffers that the
    inserting thread frees moments later, and the next flush faults fresh 2 MB pages in, each
    zeroed by the kernel whole. Profiled in a loaded gateway (tiny model, ~210 requests/s),
    74 % of the writer thread's CPU was the kernel clearing those pages
    (``clear_page_erms`` under ``do_huge_pmd_anonymous_page``): a 1,100-record flush's
    conversion cost 46-71 ms of CPU, 28-57 of it in the kernel; with the system allocator,
    jemalloc, or mimalloc under ``MIMALLOC_ALLOW_THP=0``, 21-23 ms, and the writer thread
    39-52 -> 24-25 us a request. The system allocator and jemalloc measured alike (CPU and
    peak RSS, alternating runs); the system one needs no background thread and exists in
    every pyarrow build. Called by the processes that convert or insert records (the gateway,
    the store process) at their start."""
    if not os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        pa.set_memory_pool(pa.system_memory_pool())
    return pa.default_memory_pool().backend_name


class _PandasGuard(threading.local):
    """An import finder under which ``import pandas`` fails on the threads that are inside
    ``without_pandas`` (and only there: another thread's import goes on as usual)."""

    depth = 0

    def find_spec(self, name: str, path=None, target=None) -> None:
        if self.depth and name.partition(".")[0] == "pandas":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


_PANDAS_GUARD = _PandasGuard()
# Put in place once, when this module is imported (a finder added and removed while other
# threads import could make one of their imports skip a finder); it looks at the name only on
# a thread inside ``without_pandas``, and returns None (the next finder's turn) elsewhere.
sys.meta_path.insert(0, _PANDAS_GUARD)


class without_pandas:
    """Within this block, on this thread, ``import pandas`` fails unless pandas is imported
    already: for a library that imports pandas only to ask whether an object is one of its
    (pyarrow's shim, chDB's ``Python()``) and does without it when the import fails."""

    def __enter__(self) -> None:
        _PANDAS_GUARD.depth += 1

    def __exit__(self, *exc) -> None:
        _PANDAS_GUARD.depth -= 1


# Rows per chunk of the transposition and of the id arrays' packing. pyarrow and the loops here
# hold the GIL, and the writer runs in the gateway's process: converting 1000 records' token
# ids in one call stalled the event loop (every stream) for ~10 ms, so the per-row work is done
# in chunks and the GIL is given up between them once 4 ms of work have been done (``_Pacer``).
# Each column is then one Arrow call over the whole batch (an Arrow call has a fixed cost of
# ~10 us: a call per column per chunk, ~3,000 for 10,000 records, was ~3 us a record, and
# joining the chunks another ~0.6).
ARROW_CHUNK_ROWS = 256

# Array columns filled without pa.array's list-of-lists path (~1.5x as costly): the token ids
# appended to one array.array by ``fromlist`` (9 ns an id here, against 14.7 for an array made
# per list by its constructor and joined, 15.4 for extending one array by each list, 24 for
# np.fromiter), the ITLs flattened by np.fromiter (~14 ns a float; array("f") per list and
# joined 17.9, array("d") 24). A value that does not fit (None, negative, not a number) raises
# either way (``fromlist`` leaves its array as it was).
assert array("I").itemsize == 4


class _Pacer:
    """Gives up the GIL (``time.sleep(0)``) once 4 ms of work have been done since it last did,
    now rather than after the interpreter's 5 ms switch interval."""

    def __init__(self) -> None:
        self.held = time.perf_counter()

    def __call__(self) -> None:
        if time.perf_counter() - self.held > 0.004:
            time.sleep(0)
            self.held = time.perf_counter()


def _paced_array(values: list, kind: pa.DataType, pace: _Pacer, rows: int = 8192) -> pa.Array:
    """``pa.array(values)``, made ``rows`` values at a time with the GIL given up between
    them (the 240,000 event rows of a 20,000-record batch in one call held it ~7 ms a
    column)."""
    if len(values) <= rows:
        return pa.array(values, type=kind)
    parts = []
    for i in range(0, len(values), rows):
        parts.append(pa.array(values[i:i + rows], type=kind))
        pace()
    return pa.concat_arrays(parts)


def _column(kind: pa.DataType, values: list, pace: _Pacer) -> pa.Array:
    inner = kind.value_type if pa.types.is_list(kind) else None
    if inner == pa.uint32():
        packed = array("I")
        from_list, extend = packed.fromlist, packed.extend
        for i in range(0, len(values), ARROW_CHUNK_ROWS):
            for ids in values[i:i + ARROW_CHUNK_ROWS]:
                if type(ids) is list:
                    from_list(ids)
                else:
                    extend(ids)
            pace()
        flat = np.frombuffer(packed, np.uint32)
    elif inner == pa.float32():
        parts = [np.zeros(0, np.float32)]
        for i in range(0, len(values), ARROW_CHUNK_ROWS):
            parts.append(np.fromiter(itertools.chain.from_iterable(
                values[i:i + ARROW_CHUNK_ROWS]), np.float32))
            pace()
        flat = np.concatenate(parts)
    else:
        return _paced_array(values, kind, pace)
    offsets = np.zeros(len(values) + 1, np.int32)
    np.cumsum(np.fromiter(map(len, values), np.int32, len(values)), out=offsets[1:])
    # built on the two buffers as they are (offsets made here from the lengths, so nothing to
    # validate): ListArray.from_arrays validates, and gives up the GIL doing so
    return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(offsets)], children=[
        pa.Array.from_buffers(inner, len(flat), [None, pa.py_buffer(flat)])])


def _transposed(rows: list, fields: list[str], pace: _Pacer) -> list[list]:
    """``rows`` as a list of values per field, a chunk of rows at a time (one ``attrgetter``
    per field mapped over the chunk: 2.0 us a record for the 74 fields of ``requests``, against
    2.9 for one getter of all fields per row transposed by ``zip``)."""
    getters = [operator.attrgetter(f) for f in fields]
    cols: list[list] = [[] for _ in fields]
    for i in range(0, len(rows), ARROW_CHUNK_ROWS):
        chunk = rows[i:i + ARROW_CHUNK_ROWS]
        for col, getter in zip(cols, getters, strict=True):
            col.extend(map(getter, chunk))
        pace()
    return cols


def _table(table: Table, columns: list[list], pace: _Pacer) -> pa.Table:
    """The table's columns (a list of values each) as one Arrow table, one array per column:
    ClickHouse takes one record batch of a 10,000-row insert faster than 40 of 256 rows."""
    arrays = []
    for (_, ch_type, _), values in zip(table.columns, columns, strict=True):
        arrays.append(_column(arrow_type(ch_type), values, pace))
        pace()
    return pa.table(dict(zip([c for c, _, _ in table.columns], arrays, strict=True)))


def to_arrow(table: Table, rows: list) -> pa.Table:
    """Rows (dataclass instances with the table's fields) as an Arrow table of its columns."""
    pace = _Pacer()
    if not rows:
        return _table(table, [[] for _ in table.columns], pace)
    return _table(table, _transposed(rows, [f for _, _, f in table.columns], pace), pace)


# one getter per field: a map per field makes no tuples (a tuple per event and zip cost ~6x more)
_EVENT_FIELDS = {f: operator.attrgetter(f) for f in ("ts_us", "state", "detail")}


def records_to_arrow(records: list) -> tuple[pa.Table, pa.Table]:
    """Request records as the ``requests`` table and their events as ``request_events``, both
    from one pass over the records (the columns an event row repeats from its request are taken
    from the ``requests`` table at the end, in one ``take`` for all of them, not built again
    per event)."""
    req, ev = TABLES["requests"], TABLES["request_events"]
    pace = _Pacer()
    if not records:
        return to_arrow(req, []), to_arrow(ev, [])
    *columns, per_record_events = _transposed(
        records, [*(f for _, _, f in req.columns), "events"], pace)
    requests = _table(req, columns, pace)
    per_record = np.fromiter(map(len, per_record_events), np.int64, len(records))
    if not per_record.sum():
        return requests, to_arrow(ev, [])
    own: dict[str, list] = {f: [] for _, _, f in ev.columns if f in _EVENT_FIELDS}
    for i in range(0, len(records), ARROW_CHUNK_ROWS):
        events = list(itertools.chain.from_iterable(per_record_events[i:i + ARROW_CHUNK_ROWS]))
        for f, values in own.items():
            values.extend(map(_EVENT_FIELDS[f], events))
        pace()
    rows = pa.array(np.repeat(np.arange(len(per_record)), per_record))  # each event's request
    # its place among its request's events (timestamps can tie)
    seq = np.arange(len(rows)) - np.repeat(np.cumsum(per_record) - per_record, per_record)
    column_of = {f: col for col, _, f in req.columns}
    repeated = requests.select([column_of[f] for _, _, f in ev.columns
                                if f not in own and f != "seq"]).take(rows)
    arrays = {}
    for col, t, f in ev.columns:
        if f in own:
            arrays[col] = _paced_array(own[f], arrow_type(t), pace)
            pace()
        elif f == "seq":
            arrays[col] = pa.array(seq, type=arrow_type(t))
        else:
            arrays[col] = repeated.column(column_of[f]).combine_chunks()
    return requests, pa.table(arrays)


def write_arrow_file(path: Path, data: pa.Table, durable: bool = False) -> None:
    """``data`` as an Arrow IPC file at ``path``, written under a temporary name and renamed
    into place, so a file under its final name is complete; with ``durable``, the file and then
    its directory are fsynced, so it survives a crash too (the writer's spool; the store
    child's inbox needs no more than the rename). A failure leaves no temporary file behind
    and raises ``OSError``."""
    tmp = path.with_suffix(".tmp")
    try:
        with pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, data.schema) as w:
            w.write_table(data)
        if durable:
            _fsync(tmp)
        os.replace(tmp, path)
    except (OSError, pa.ArrowException) as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(str(exc)) from exc
    if durable:
        _fsync(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def jsonable(v):
    """A row value (or a dict/list of them) as JSON can carry it: datetimes as ISO 8601 (UTC
    when naive), NaN as null (JSON has no NaN; ClickHouse gives it for an empty quantile or a
    0/0). The JSON answers of the gateway's debug endpoints and of the store process."""
    if isinstance(v, dt.datetime):
        return (v if v.tzinfo else v.replace(tzinfo=dt.UTC)).isoformat()
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, list | tuple):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: jsonable(x) for k, x in v.items()}
    return v


# Server settings of an embedded chDB engine (its connection string's parameters): an idle
# store should cost next to nothing. ClickHouse's memory worker re-reads the process's memory
# many times a second, and each table's background assignees poll every 0.1 s when idle (the
# "streaming" ones for queries Tailscope never runs); once a second, every 2 s and every 10 s
# are plenty, and an insert still wakes its table's assignee at once
# (figures: docs/benchmarks/store.md#chdb-settings).
