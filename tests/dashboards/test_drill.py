"""The Streamlit drill-down, headless (streamlit.testing AppTest), on a seeded embedded store."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from tracing.seed import synthetic_records, synthetic_steps

APP = str(Path(__file__).resolve().parents[2] / "dashboards" / "drill.py")
NOW = dt.datetime.now(dt.UTC).replace(microsecond=0)
T0 = (NOW - dt.timedelta(days=3)).replace(hour=10, minute=0, second=0)
BASE = (T0, T0 + dt.timedelta(minutes=10))
SUSPECT = (T0 + dt.timedelta(hours=1), T0 + dt.timedelta(hours=1, minutes=10))
FMT = "%Y-%m-%d %H:%M:%S"


def us(t: dt.datetime) -> int:
    return int(t.timestamp() * 1e6)


@pytest.fixture(scope="module")
def seeded(store, monkeypatch_module):
    recent = synthetic_records(300, us(NOW - dt.timedelta(minutes=50)),
                               us(NOW - dt.timedelta(minutes=10)), seed=7, token_ids=True)
    base = synthetic_records(600, us(BASE[0]), us(BASE[1]), seed=3)
    suspect = synthetic_records(600, us(SUSPECT[0]), us(SUSPECT[1]), seed=3,
                                slow_replica="r1", slow_fraction=0.06, slow_queue_ms=200.0)
    store.insert_rows("requests", recent + base + suspect)
    store.insert_rows("engine_steps", synthetic_steps(us(NOW - dt.timedelta(minutes=50)),
                                                      us(NOW - dt.timedelta(minutes=10))))
    monkeypatch_module.setenv("TAILSCOPE_DRILL_SOURCE", store.dsn)
    return recent


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def run(at: AppTest) -> AppTest:
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_overview_renders_percentiles_rates_and_slo(seeded, store):
    at = run(AppTest.from_file(APP, default_timeout=120))
    assert at.title[0].value == "Tailscope · Overview"
    assert any(store.dsn in c.value for c in at.caption)  # the data source is on the page
    tables = [d.value for d in at.dataframe]
    pct = next(t for t in tables if "p99" in t.columns)
    assert list(pct["replica"]) == ["r0", "r1"] and pct["n"].sum() == len(seeded)
    slo = next(t for t in tables if "attainment" in t.columns)
    assert slo["n"].sum() == len(seeded) and slo["attainment"].between(0, 1).all()


def test_regression_names_engine_queue_time_on_r1(seeded):
    at = run(AppTest.from_file(APP, default_timeout=120))
    at.sidebar.radio(key="page").set_value("Regression")
    run(at)
    at.selectbox(key="rg_m").set_value("e2e_ms")
    for key, t in (("rg_base_a", BASE[0]), ("rg_base_b", BASE[1]), ("rg_sus_a", SUSPECT[0]),
                   ("rg_sus_b", SUSPECT[1])):
        at.text_input(key=key).set_value(t.strftime(FMT))
    run(at)
    sentence = at.success[0].value
    assert sentence.startswith("p99 E2E +") and "engine queue time on r1" in sentence


def test_trace_view_shows_the_stages_of_a_trace(seeded):
    rec = max(seeded, key=lambda r: r.e2e_ms)
    at = run(AppTest.from_file(APP, default_timeout=120))
    at.sidebar.radio(key="page").set_value("Requests")
    run(at)
    slow = at.dataframe[0].value
    assert slow["trace_id"].iloc[0] == rec.trace_id  # the slowest first
    at.text_input(key="rq_trace").set_value(rec.trace_id)
    run(at)
    assert any(rec.trace_id in h.value for h in at.header)
    stages = next(d.value for d in at.dataframe if list(d.value.columns) == ["stage", "ms"])
    got = dict(zip(stages["stage"], stages["ms"], strict=True))
    assert got["engine queue time"] == pytest.approx(rec.engine_queue_ms, rel=1e-6)
    assert sum(got.values()) == pytest.approx(rec.e2e_ms, rel=1e-6)
    gaps = next(d.value for d in at.dataframe if "gap_ms" in d.value.columns)
    assert len(gaps) == len(rec.itl_ms) and "num_seqs" in gaps.columns
    fall = next(d.value for d in at.dataframe if "lane" in d.value.columns)
    lane = fall[fall["lane"] == "request"]
    assert lane["ms"].sum() == pytest.approx(rec.e2e_ms, rel=1e-6)  # segments add up to E2E
    assert (fall["lane"] == "client").sum() == len(rec.itl_ms)


def test_client_text_is_shown_as_plain_text_never_markdown(seeded, store):
    """end_user and metadata are the client's words: a Markdown link or image there must not
    become a live link or a fetched image in the operator's view."""
    import dataclasses

    evil = "[click](http://evil.example/x) ![t](http://evil.example/t.png)"
    rec = dataclasses.replace(seeded[0], trace_id="ab" * 16, end_user=evil,
                              metadata='{"k": "' + evil.replace('"', "'") + '"}')
    store.insert_rows("requests", [rec])
    at = run(AppTest.from_file(APP, default_timeout=120))
    at.sidebar.radio(key="page").set_value("Requests")
    run(at)
    at.text_input(key="rq_trace").set_value(rec.trace_id)
    run(at)
    shown = [t.value for t in at.text]
    assert any(evil in t for t in shown if t.startswith("end user: "))
    assert any("evil.example" in t for t in shown if t.startswith("metadata: "))
    rendered = [e.value for kind in ("caption", "markdown", "error", "warning", "info", "success")
                for e in getattr(at, kind)]
    assert not any("evil.example" in v for v in rendered)


def test_the_waterfall_from_a_timeline_splits_waiting_by_cause_and_shows_the_steps():
    import pandas as pd

    from tracing import queries as Q

    rec = synthetic_records(40, us(BASE[0]), us(BASE[1]), seed=3, slow_replica="r0",
                            slow_fraction=1.0, slow_queue_ms=50.0)[0]
    assert any(e.state == "WAIT" for e in rec.events)

    def ts(us_: int):
        return pd.Timestamp(us_, unit="us", tz="UTC")

    first_flush = rec.arrival_ts_us + int(rec.ttft_ms * 1000)  # a step inside the first gap
    steps = pd.DataFrame([{"ts": ts(first_flush + 100), "step": 7,
                           "duration_ms": rec.itl_ms[0] / 2,
                           "num_seqs": 3, "member_traces": ["x", rec.trace_id, "y"],
                           "member_prefill": [32, 0, 16], "member_decode": [0, 1, 0]}])
    fall = Q.waterfall({"record": {**rec.to_dict(), "arrival_ts": ts(rec.arrival_ts_us)},
                        "events": pd.DataFrame([{"ts": ts(e.ts_us), "state": e.state,
                                                 "detail": e.detail} for e in rec.events]),
                        "steps": steps})
    lane = fall[fall["lane"] == "request"]
    assert lane["ms"].sum() == pytest.approx(rec.e2e_ms, abs=1e-3)
    assert list(lane["start_ms"]) == sorted(lane["start_ms"])
    waits = lane[lane["segment"].str.startswith("waiting: ")].set_index("segment")["ms"]
    assert waits.sum() == pytest.approx(rec.engine_queue_ms, abs=1e-3)
    assert waits["waiting: no free KV blocks"] == pytest.approx(rec.wait_kv_ms, abs=1e-3)
    (step,) = fall[fall["lane"] == "engine"].itertuples()
    assert step.segment == "decode" and "others' prefill 48" in step.detail
    gaps = fall[fall["lane"] == "client"]  # the gap the step ended in is coloured by it
    shared = gaps[gaps["segment"] == "gap with others' prefill"]
    assert list(shared["detail"]) == ["token 1"]


def test_evals_page_compares_two_runs_and_links_failures_to_traces(seeded, store):
    from tracing.schema import EvalResultRow, EvalRunRow

    recs = seeded[:20]
    now = us(NOW)
    rows = []
    for i, rec in enumerate(recs):
        run_id, case = ("ev-base", f"c{i}") if i < 10 else ("ev-cand", f"c{i - 10}")
        ok = run_id == "ev-base" or i - 10 >= 7  # the candidate fails c0..c6
        rows.append(EvalResultRow(run_id=run_id, case_id=case, trace_id=rec.trace_id,
                                  ts_us=now, score=float(ok), passed=ok,
                                  detail="" if ok else "output contains none of ['Paris']",
                                  output="Paris" if ok else "Lyon"))
    store.insert_rows("eval_results", rows)
    store.insert_rows("eval_runs", [
        EvalRunRow(run_id="ev-base", ts_us=now - 1000, suite="s", config_id="cfg-1", cases=10,
                   passed=10),
        EvalRunRow(run_id="ev-cand", ts_us=now, suite="s", config_id="cfg-2", cases=10,
                   passed=3)])
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["page"] = "Evals"
    at.query_params["a"] = "ev-base"
    at.query_params["b"] = "ev-cand"
    run(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Verdict"] == "REGRESSED" and metrics["Pass rate B"] == "30.0%"
    assert metrics["Newly failing / passing"] == "7 / 0"
    failing = next(d.value for d in at.dataframe if "detail" in d.value.columns)
    assert sorted(failing["case_id"]) == [f"c{i}" for i in range(7)]
    by_case = dict(zip(failing["case_id"], failing["trace"], strict=True))
    assert by_case["c0"] == f"/?page=Requests&trace={recs[10].trace_id}"
    repro = next(d.value for d in at.dataframe if "same output" in d.value.columns)
    differ = repro[~repro["same output"]]
    assert sorted(differ["case_id"]) == [f"c{i}" for i in range(7)]
    assert differ["first divergence"].iloc[0].startswith("first diverges at character 0: 'Paris'")


def test_whatif_page_shows_a_stored_run_and_its_frontier(seeded, store):
    """A what-if run as ``tailscope whatif`` stores it (tailscope.whatif.compare on a
    hand-built window) and a sizing run: the page shows the predicted percentiles, the
    frontier over the two rate scales and the replica count."""
    import random

    from engine import EngineConfig
    from engine.whatif import Arrival, StepCost
    from tailscope import whatif as W
    from tracing.schema import WhatIfRunRow
    from tracing.timing import Slo

    rng = random.Random(5)
    arrivals = [Arrival(f"q{i}", i * 20.0, [rng.randrange(5, 9000) for _ in range(80)], 12)
                for i in range(40)]
    cfg = EngineConfig(num_kv_blocks=256, block_size=16, max_num_seqs=4)
    w = W.Window.of_arrivals(arrivals, cfg, StepCost((2.0, 0.05, 0.4, 0.3, 0.01)))
    w.contention, w.contention_source = 0.25, "flag"  # as --contention 0.25 sets it
    # the window's steps all ran 4 sequences: a one-sequence candidate's cost is extrapolated
    w.step_rows = [{"num_seqs": 4}] * (W.SEEN_MIN + 10)
    cand = W.candidate(cfg, sets=["max_num_seqs=1"])
    params, results = W.compare(w, cand, None, [1.0, 2.0], Slo(ttft_ms=100.0))
    now = us(NOW)
    body = {"run_id": "wi-1", "kind": "whatif", "window_start_us": now - 60_000_000,
            "window_end_us": now, "replicas": "r0", "config_id": "cfg-w", "params": params,
            "step_cost": w.cost.as_dict(), "results": results}
    store.insert_rows("whatif_runs", [WhatIfRunRow.from_body(body, now)])
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["page"] = "What-if"
    run(at)
    table = next(d.value for d in at.dataframe if "metric" in d.value.columns)
    ttft = table[(table["metric"] == "ttft_ms") & (table["rate_scale"] == 1.0)]
    by_col = dict(zip(ttft["column"], ttft["p99"], strict=True))
    assert set(by_col) == {"recorded config", "candidate"}  # no records: nothing recorded
    assert by_col["candidate"] > by_col["recorded config"]  # one sequence at a time queues
    share = dict(zip(ttft["column"], ttft["extrapolated"], strict=True))
    assert share["candidate"] == results["points"][0]["candidate"]["extrapolated"] == 1.0
    # a warning for each prediction past the threshold, and for no other
    warned = sorted(w.value.split(":")[0] for w in at.warning)
    assert warned == sorted(
        f"{col.replace('_', ' ')} at rate scale {p['rate_scale']:g}"
        for p in results["points"] for col in ("recorded_config", "candidate")
        if p[col]["extrapolated"] > W.EXTRAPOLATED_WARN)
    assert "candidate at rate scale 2" in warned and len(warned) < 4  # not all of them
    assert "TTFT p99 over the offered rate" in [h.value for h in at.subheader]
    assert len(at.get("vega_lite_chart")) == 1  # the frontier over the two scales
    assert any("step cost" in c.value for c in at.caption)
    assert any("1 + 0.250×b (flag)" in c.value for c in at.caption)
    size = W.size(w, cfg, Slo(ttft_ms=100.0), 4 * w.rate_rps, 1.0, 0.95)
    store.insert_rows("whatif_runs", [WhatIfRunRow.from_body(
        {**body, "run_id": "sz-1", "kind": "size", "results": size}, now + 1)])
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["page"] = "What-if"
    run(at)
    assert {m.label: m.value for m in at.metric}["Replicas"] == str(size["replicas"])


def test_stopping_tailscope_drill_leaves_no_streamlit_behind():
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx
    import psutil

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tailscope.cli", "drill", "--port", str(port),
                             "--source", "gateway:http://127.0.0.1:9"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, healthy = time.monotonic() + 120, False
        while not healthy and time.monotonic() < deadline and proc.poll() is None:
            try:
                healthy = httpx.get(f"http://127.0.0.1:{port}/_stcore/health",
                                    timeout=1).is_success
            except httpx.HTTPError:
                time.sleep(0.3)
        assert healthy, f"the drill-down never answered (exit code {proc.poll()})"
        family = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        time.sleep(0.5)
        alive = [p for p in family if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert alive == [], alive
    finally:
        if proc.poll() is None:
            proc.kill()


def test_token_text_comes_only_from_the_records_own_tokenizer(bundled_path):
    from dashboards.drill import tokenizer_text
    from engine.text import load_tokenizer

    tok = load_tokenizer(bundled_path)
    ids = tok.encode("Hello there")
    assert tokenizer_text(ids, tok.revision, [str(bundled_path)]) == tok.decode(ids)
    # another model's record: its ids are never shown as this tokenizer's text
    assert tokenizer_text(ids, "another-tokenizer-rev", [str(bundled_path)]) is None
    assert tokenizer_text(ids, "", [str(bundled_path)]) is None
    assert tokenizer_text(ids, tok.revision, ["/no/such/tokenizer"]) is None
