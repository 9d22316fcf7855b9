"""``tailscope serve`` with capture switched on and off at run time by signals, for
bench/trace_overhead.py's one-gateway comparison (``switched``): SIGUSR2 turns capture on,
SIGUSR1 off and then flushes the record writer (every record and step row of the window just
ended inserted into the store), after which it writes how many such flushes are done to the
file named by ``TAILSCOPE_BENCH_SWITCH_FILE``, so the bench can end the "on" window there:
capture's whole cost for the window, inserts included, falls within it.

    TAILSCOPE_BENCH_SWITCH_FILE=F python -m bench.capture_switch serve ARGS...

Off, the gateway makes no ``engine_steps`` row for an engine step and hands the record writer
nothing (``emit`` and ``emit_step`` return at once): what capture adds to a request is left out,
while the process, its replica, its store child and the writer's idle threads stay as they were.
Comparing throughput across separate gateway processes on this shared 2-core VM carries each
process's own offset of a few per cent (a gateway restarted with identical code read up to
250 us a request dearer or cheaper); within one process, windows a few seconds apart differ by
the capture alone and the minute's drift, which alternating the order cancels.

A bench harness only: the product has no such switch (its debug endpoints are read-only by
construction, and capture is decided by ``TAILSCOPE_STORE_DSN`` at start).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from gateway import runtime as gateway_runtime
from tailscope import cli
from tracing.writer import RecordWriter

_on = True
_emit, _emit_step, _step_row = RecordWriter.emit, RecordWriter.emit_step, gateway_runtime.step_row
_init = RecordWriter.__init__
_writers: list[RecordWriter] = []
_flushed = 0


def _flush() -> None:
    global _flushed
    for writer in _writers:
        writer.flush(timeout_s=120)
    _flushed += 1
    with open(os.environ["TAILSCOPE_BENCH_SWITCH_FILE"], "w") as f:
        f.write(str(_flushed))


def _on_signal(_signum, _frame) -> None:
    global _on
    _on = True


def _off_signal(_signum, _frame) -> None:
    global _on
    _on = False
    threading.Thread(target=_flush, daemon=True).start()  # a handler must not block the loop


def init(self: RecordWriter, *args, **kwargs) -> None:
    _init(self, *args, **kwargs)
    _writers.append(self)


def emit(self: RecordWriter, record) -> None:
    if _on:
        _emit(self, record)


def emit_step(self: RecordWriter, row) -> None:
    if _on and row is not None:
        _emit_step(self, row)


def step_row(*args, **kwargs):
    return _step_row(*args, **kwargs) if _on else None


if __name__ == "__main__":
    RecordWriter.__init__, RecordWriter.emit, RecordWriter.emit_step = init, emit, emit_step
    gateway_runtime.step_row = step_row  # looked up by the gateway's on_step at each step
    signal.signal(signal.SIGUSR1, _off_signal)
    signal.signal(signal.SIGUSR2, _on_signal)
    sys.exit(cli.main(sys.argv[1:]))
