"""Record sinks and the trace builder's timing identities (no server needed)."""

from __future__ import annotations

import json
import time

import pytest

from engine.observer import RequestStats, TimelineEvent
from gateway.trace import RequestTrace, parse_traceparent
from tracing import timing
from tracing.record import RECORD_COLUMNS, RequestRecord
from tracing.sinks import FanoutSink, JsonlSink, MemorySink


def rec(trace_id: str) -> RequestRecord:
    return RequestRecord(trace_id=trace_id, span_id="s" * 16, request_id="r",
                         itl_ms=[1.5, 2.5], input_token_ids=[1, 2, 3])


def test_jsonl_sink_appends_one_line_per_record_and_survives_reopen(tmp_path):
    path = tmp_path / "sub" / "records.jsonl"
    sink = JsonlSink(path)
    sink.emit(rec("a" * 32))
    sink.close()
    sink = JsonlSink(path)  # a restart keeps history
    sink.emit(rec("b" * 32))
    sink.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["trace_id"] for r in rows] == ["a" * 32, "b" * 32]
    assert set(rows[0]) == set(RECORD_COLUMNS) and rows[0]["itl_ms"] == [1.5, 2.5]


def test_memory_sink_is_bounded_and_finds_the_newest():
    sink = MemorySink(capacity=2)
    for t in ("x", "y", "z"):
        sink.emit(rec(t * 32))
    assert sink.find("x" * 32) is None and sink.find("z" * 32) is not None
    assert sink.emitted == 3 and len(sink.records) == 2


def test_a_failing_sink_does_not_stop_the_others():
    class BrokenSink:  # a fault-injection fake: the store is down
        def emit(self, record):
            raise ConnectionError("store down")

        def close(self):
            pass

    good = MemorySink()
    fan = FanoutSink([BrokenSink(), good])
    fan.emit(rec("c" * 32))
    assert fan.failures == 1 and good.find("c" * 32) is not None


def test_trace_identities_hold_exactly():
    t = RequestTrace("req", "d" * 32, "e" * 16, "", "/v1/completions")
    for stage in ("ADMITTED", "TOKENIZED", "ROUTED"):
        time.sleep(0.001)
        t.mark(stage)
    for _ in range(4):
        time.sleep(0.002)
        t.flush()
    time.sleep(0.001)
    t.end_ns = time.monotonic_ns()
    t.engine_stats = RequestStats(events=tuple(TimelineEvent(*e) for e in (
        ("QUEUED", 0.1), ("RUNNABLE", 0.5), ("PREFILLING", 0.6), ("DECODING", 1.0),
        ("BACKPRESSURED", 2.0), ("DECODING", 5.0), ("FINISHED", 6.0, "length"))),
        token_offsets_ms=(1.0, 5.5))
    r = t.finish(200)
    assert r.final_state == "FINISHED" and r.http_status == 200
    assert r.e2e_ms == pytest.approx(r.ttft_ms + sum(r.itl_ms) + r.tail_ms, abs=1e-9)
    assert len(r.itl_ms) == 3 and r.tpot_ms == pytest.approx(sum(r.itl_ms) / 3)
    assert r.backpressured_ms == pytest.approx(3.0)
    assert (r.engine_queue_ms, r.prefill_ms, r.decode_ms) == pytest.approx((0.5, 0.5, 5.0))
    stages = sum(getattr(r, c) for c in timing.E2E_STAGES)
    finished = next(e for e in r.events if e.state == "FINISHED")
    streaming = (r.events[-1].ts_us - finished.ts_us) / 1e3  # engine done -> end: the rest
    assert r.e2e_ms - stages == pytest.approx(streaming, abs=2e-3)
    assert r.ingress_ms > 0 and r.tokenize_ms > 0 and r.route_ms > 0
    assert [e.ts_us for e in r.events] == sorted(e.ts_us for e in r.events)
    states = [e.state for e in r.events]
    assert states[0] == "RECEIVED" and states[-1] == "END" and "FIRST_FLUSH" in states


def test_a_request_without_content_has_no_ttft():
    t = RequestTrace("req", "f" * 32, "e" * 16, "", "/v1/completions")
    r = t.finish(429)
    assert r.final_state == "REJECTED" and r.ttft_ms is None and r.itl_ms == []
    assert r.tail_ms == r.e2e_ms


@pytest.mark.parametrize("value,ok", [
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", True),
    ("00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-00", True),
    ("00-00000000000000000000000000000000-b7ad6b7169203331-01", False),  # all-zero trace id
    ("00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01", False),  # all-zero span
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b71692033-01", False),
    ("garbage", False),
])
def test_traceparent_parsing(value, ok):
    assert (parse_traceparent(value) is not None) == ok
