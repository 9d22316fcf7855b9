"""The one timing owner: a timeline in, every stage out; the record's columns, the OTel spans
and the seed data all agree with it, preempted and backpressured time included."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.request import RequestState
from tracing import timing
from tracing.otel import OtelSink
from tracing.record import RecordEvent, RequestRecord
from tracing.seed import synthetic_records

T0 = 1_700_000_000_000_000  # µs


def _timeline(*points: tuple[str, float]) -> list[RecordEvent]:
    return [RecordEvent(T0 + int(ms * 1000), state) for state, ms in points]


PREEMPTED = _timeline(
    ("RECEIVED", 0), ("ADMITTED", 1), ("TOKENIZED", 1.5), ("ROUTED", 2), ("QUEUED", 2.1),
    ("RUNNABLE", 10), ("PREFILLING", 11), ("DECODING", 20), ("FIRST_FLUSH", 20.5),
    ("PREEMPTED", 30), ("RUNNABLE", 45), ("PREFILLING", 46), ("DECODING", 50),
    ("BACKPRESSURED", 60), ("DECODING", 64), ("FINISHED", 70), ("END", 71))


def test_every_engine_state_opens_a_stage():
    for state in RequestState:  # a new state must be placed on the timeline, never ignored
        assert state.name in timing._OPENS, state.name


def test_a_preempted_request_splits_into_stages_that_add_up():
    d = timing.durations(PREEMPTED)
    assert d == pytest.approx({"ingress_ms": 1, "tokenize_ms": 0.5, "route_ms": 0.5,
                               "engine_queue_ms": 8, "prefill_ms": 10 + 5, "decode_ms": 10 + 20,
                               "preempted_ms": 15, "backpressured_ms": 4,
                               # no wait notes: all of its waiting is for the step in progress
                               "wait_step_ms": 8 + 15, "wait_budget_ms": 0, "wait_kv_ms": 0,
                               "wait_seqs_ms": 0, "wait_hol_ms": 0,
                               "wait_share_ms": 0})
    streaming = 1  # FINISHED -> END
    assert sum(d[c] for c in timing.E2E_STAGES) + streaming == pytest.approx(71)
    w = timing.windows(PREEMPTED)
    assert [x.stage.span for x in w] == ["ingress", "tokenize", "route", "queue", "prefill",
                                         "decode", "preempted", "prefill", "decode",
                                         "streaming"]
    assert all(a.end_us == b.start_us for a, b in zip(w, w[1:], strict=False))  # no gaps
    rec = timing.apply(RequestRecord("t" * 32, "s" * 16, "r", events=PREEMPTED))
    assert rec.preemptions == 1 and rec.preempted_ms == pytest.approx(15)


def test_wait_notes_split_queue_and_preempted_time_by_cause():
    notes = [RecordEvent(T0 + int(ms * 1000), "WAIT", detail) for ms, detail in (
        (4, "budget: 12 tokens went to 3 requests [t1, t2]"), (6, "kv: 0 of 8 blocks free"),
        (30, "seqs: max_num_seqs (3) requests running"), (40, "hol: behind [t9]"))]
    ev = sorted(PREEMPTED + notes, key=lambda e: e.ts_us)
    d = timing.durations(ev)
    # queue 2 -> 10: step 2 -> 4, budget 4 -> 6, kv 6 -> 10; preempted 30 -> 45: a new spell,
    # seqs from its first note at 30, hol from 40
    assert d["wait_step_ms"] == pytest.approx(2) and d["wait_budget_ms"] == pytest.approx(2)
    assert d["wait_kv_ms"] == pytest.approx(4) and d["wait_seqs_ms"] == pytest.approx(10)
    assert d["wait_hol_ms"] == pytest.approx(5)
    assert sum(d[c.column] for c in timing.CAUSES) == pytest.approx(
        d["engine_queue_ms"] + d["preempted_ms"])
    assert d["engine_queue_ms"] == pytest.approx(8)  # markers change no stage
    rec = RequestRecord("t" * 32, "s" * 16, "r", events=ev, timing_source="upstream")
    assert timing.apply(rec).wait_kv_ms == 0  # an upstream's queue has no causes
    rec.timing_source = "engine"
    assert timing.apply(rec).wait_kv_ms == pytest.approx(4)


def test_a_request_without_an_engine_timeline_is_not_called_queueing():
    # routed, then the client left before the replica's timeline came back
    ev = _timeline(("RECEIVED", 0), ("ADMITTED", 1), ("TOKENIZED", 2), ("ROUTED", 3),
                   ("END", 500))
    d = timing.durations(ev)
    assert d["engine_queue_ms"] == 0 and d["route_ms"] == pytest.approx(1)
    assert timing.windows(ev)[-1].stage is timing.IN_ENGINE


def test_client_timings_identity():
    c = timing.client_timings(0, [5_000_000, 7_000_000, 12_000_000], 13_000_000)
    assert (c.ttft_ms, c.itl_ms, c.tpot_ms, c.tail_ms) == (5.0, [2.0, 5.0], 3.5, 1.0)
    assert c.e2e_ms == c.ttft_ms + sum(c.itl_ms) + c.tail_ms
    none = timing.client_timings(0, [], 4_000_000)
    assert none.ttft_ms is None and none.tail_ms == none.e2e_ms == 4.0


def test_slo_rule():
    rule = timing.Slo(ttft_ms=100, tpot_ms=10)
    assert rule.met(True, 100, 10) and rule.met(True, 50, None)  # one token: no TPOT
    assert not rule.met(False, 1, 1) and not rule.met(True, None, 1)
    assert not rule.met(True, 101, 1) and not rule.met(True, 1, 11)
    assert timing.Slo().met(True, None, None)


def test_otel_children_agree_with_the_record_columns():
    exporter = InMemorySpanExporter()
    sink = OtelSink(exporter)
    rec = timing.apply(RequestRecord(
        "ab" * 16, "cd" * 8, "req-1", response_id="chatcmpl-xyz", endpoint="/v1/completions",
        model="m", arrival_ts_us=T0, e2e_ms=71.0, final_state="FINISHED",
        events=PREEMPTED))
    sink.emit(rec)
    sink.close()
    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.parent is None)
    assert root.attributes["gen_ai.response.id"] == "chatcmpl-xyz"
    assert root.attributes["tailscope.preempted_ms"] == pytest.approx(15)
    assert root.attributes["tailscope.backpressured_ms"] == pytest.approx(4)
    for stage in (*timing.STAGES, *timing.SUBSTAGES):
        total = sum((s.end_time - s.start_time) / 1e6 for s in spans
                    if s.parent is not None and s.name == stage.span)
        assert total == pytest.approx(getattr(rec, stage.column), abs=1e-6), stage.span
    assert all(s.parent.span_id == root.context.span_id for s in spans if s.parent)


def test_seed_records_take_their_stages_from_the_timing_owner():
    for r in synthetic_records(50, T0, T0 + 60_000_000, seed=3):
        assert timing.durations(r.events) == pytest.approx(
            {c: getattr(r, c) for c in timing.durations(r.events)})
        stages = sum(getattr(r, c) for c in timing.E2E_STAGES)
        assert stages <= r.e2e_ms + 1e-6
        assert r.e2e_ms == pytest.approx(r.ttft_ms + sum(r.itl_ms) + r.tail_ms, abs=1e-6)
