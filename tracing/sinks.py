"""Where finished request records go. ``RecordSink`` is the interface the gateway calls once per
request; the ClickHouse writer and the OpenTelemetry exporter implement it too.

``emit`` is called on the request path (the event loop): implementations must not block on I/O
for long. ``JsonlSink`` appends one buffered line per record (microseconds) and flushes at
close or every ``flush_every`` records.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Protocol

import msgspec

from tracing.record import RequestRecord

log = logging.getLogger("tailscope.records")


class RecordSink(Protocol):
    def emit(self, record: RequestRecord) -> None: ...

    def close(self) -> None: ...


class MemorySink:
    """The latest ``capacity`` records (for tests and ``/debug``), kept encoded (msgpack bytes,
    decoded on lookup): ten thousand records as objects were hundreds of thousands of objects
    for the garbage collector to walk in every full pass, pausing the gateway's event loop."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._by_trace: dict[str, bytes] = {}  # insertion order = arrival order
        self.emitted = 0

    def emit(self, record: RequestRecord) -> None:
        self._by_trace.pop(record.trace_id, None)  # a re-used trace id: the latest wins
        self._by_trace[record.trace_id] = _encode(record)
        while len(self._by_trace) > self.capacity:
            del self._by_trace[next(iter(self._by_trace))]
        self.emitted += 1

    @property
    def records(self) -> list[RequestRecord]:
        return [_decode(b) for b in self._by_trace.values()]

    def find(self, trace_id: str) -> RequestRecord | None:
        data = self._by_trace.get(trace_id)
        return None if data is None else _decode(data)

    def close(self) -> None:
        pass


_encode = msgspec.msgpack.Encoder().encode
_decoder = msgspec.msgpack.Decoder(RequestRecord)
_decode = _decoder.decode


class JsonlSink:
    """One JSON object per line; the file is opened for append so restarts keep history."""

    def __init__(self, path: str | Path, flush_every: int = 1) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self._flush_every = max(1, flush_every)
        self._pending = 0

    def emit(self, record: RequestRecord) -> None:
        line = json.dumps(record.to_dict(), ensure_ascii=False, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")
            self._pending += 1
            if self._pending >= self._flush_every:
                self._file.flush()
                self._pending = 0

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                self._file.close()


class FanoutSink:
    """Every record to every sink; one failing sink never stops the others (it is logged)."""

    def __init__(self, sinks: list[RecordSink]) -> None:
        self.sinks = sinks
        self.failures = 0

    def emit(self, record: RequestRecord) -> None:
        for sink in self.sinks:
            try:
                sink.emit(record)
            except Exception:  # a record sink must never fail a request
                self.failures += 1
                log.exception("record sink %s failed for trace %s", type(sink).__name__,
                              record.trace_id)

    def close(self) -> None:
        for sink in self.sinks:  # every sink gets to flush, even if one fails to
            try:
                sink.close()
            except Exception:
                log.exception("record sink %s failed to close", type(sink).__name__)
