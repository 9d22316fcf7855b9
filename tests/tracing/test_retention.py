"""Tail-based retention (tracing.retention): full detail for the tail, the unfinished, the
warm-up and a sample; counts and stage totals for the rest; the decision on the row. Over HTTP,
the drill-down's queries and ``why`` work on both kinds of record."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.gateway.conftest import start_server, stop_server
from tests.gateway.test_faults import wait_for
from tracing import queries as Q
from tracing.record import RequestRecord
from tracing.retention import TailRetention
from tracing.why import why


def record(i: int, e2e: float, ttft: float, state: str = "FINISHED") -> RequestRecord:
    return RequestRecord(f"{i:032x}", "s" * 16, f"r{i}", model="m", final_state=state,
                         e2e_ms=e2e, ttft_ms=ttft, itl_ms=[1.0, 2.0], input_token_ids=[1, 2],
                         output_token_ids=[3, 4], token_steps=[5, 6], prompt_tokens=2,
                         emitted_tokens=2)


def test_the_tail_the_unfinished_the_warmup_and_a_sample_keep_detail():
    keep = TailRetention(sample=0.1, quantile=0.9, window=200, warmup=20, seed=1)
    rng = random.Random(0)
    out = [keep.decide(record(i, rng.expovariate(1 / 100), 10.0)) for i in range(2000)]
    reasons = [r.detail_reason for r in out]
    assert reasons[:20] == ["warmup"] * 20
    for r in out:
        assert r.detail_kept == (r.detail_reason != "dropped")
        if r.detail_kept:
            assert r.output_token_ids == [3, 4] and r.itl_ms == [1.0, 2.0]
        else:  # counts and stage totals stay
            assert (r.input_token_ids, r.output_token_ids, r.token_steps, r.itl_ms) == (
                [], [], [], [])
            assert r.emitted_tokens == 2 and r.e2e_ms > 0
    tail = sum(x == "tail_e2e" for x in reasons[20:]) / len(reasons[20:])
    assert 0.06 < tail < 0.16  # about a tenth above a sliding p90
    rest = [x for x in reasons[20:] if x in ("sampled", "dropped")]
    assert 0.05 < rest.count("sampled") / len(rest) < 0.15
    slow_ttft = keep.decide(record(5000, 1.0, 10_000.0))
    assert slow_ttft.detail_reason == "tail_ttft"
    failed = keep.decide(record(5001, 1.0, 1.0, state="FAILED"))
    assert failed.detail_kept and failed.detail_reason == "not_finished"
    everything = TailRetention()  # the default keeps it all
    assert everything.decide(record(1, 1.0, 1.0)).detail_reason == "all"
    with pytest.raises(ValueError):
        TailRetention(sample=2)


@pytest.fixture(scope="module")
def sampled(bundled_path):
    s = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                     env={"TAILSCOPE_DETAIL_SAMPLE": "0", "TAILSCOPE_DETAIL_WARMUP": "3"})
    yield s
    stop_server(s)


def test_over_http_dropped_and_kept_records_both_work_in_the_drill_down(sampled):
    traces = []
    for i in range(12):
        r = httpx.post(f"{sampled.url}/v1/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 4 + (i == 9) * 250,
            "ignore_eos": True, "stream": True})
        assert r.status_code == 200
        traces.append(r.headers["x-tailscope-trace-id"])
    source = Q.GatewaySource(sampled.url)
    assert wait_for(lambda: Q.records_found(source, traces) == len(traces), 15)
    recs = {t: httpx.get(f"{sampled.url}/debug/requests/{t}").json()["record"] for t in traces}
    reasons = [recs[t]["detail_reason"] for t in traces]
    assert reasons[:3] == ["warmup"] * 3
    # 254 tokens among 4-token requests: above every earlier one, the first (cold) one too
    assert reasons[9] == "tail_e2e", [recs[t]["e2e_ms"] for t in traces]
    dropped = [t for t in traces if recs[t]["detail_reason"] == "dropped"]
    assert dropped, reasons
    d = recs[dropped[0]]
    assert d["output_token_ids"] == [] and d["itl_ms"] == [] and d["emitted_tokens"] == 4
    assert recs[traces[9]]["output_token_ids"] and recs[traces[9]]["itl_ms"]
    _, sentence = why(source, dropped[0])
    assert "not kept" in sentence
    gaps, _ = why(source, traces[9])
    assert not gaps.empty
    for t in (dropped[0], traces[9]):  # the waterfall of either adds up to its E2E
        fall = Q.waterfall(Q.trace(source, t))
        assert fall[fall["lane"] == "request"]["ms"].sum() == pytest.approx(
            recs[t]["e2e_ms"], abs=0.01)
