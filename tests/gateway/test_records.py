"""One trace record per request (docs/design/record-contract.md), traceparent continuation,
and /metrics."""

from __future__ import annotations

import json
import re
import secrets
import time

import httpx
import pytest

from tests.gateway.test_faults import wait_for


def traceparent() -> tuple[str, str, str]:
    trace_id, span = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span, f"00-{trace_id}-{span}-01"


def record(url: str, trace_id: str, timeout_s: float = 5.0, admin_key: str | None = None
           ) -> dict:
    """The record appears when the exchange is over (just after the last byte); ``admin_key``
    for a gateway with tenants."""
    found: list[dict] = []
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}

    def get() -> bool:
        r = httpx.get(f"{url}/debug/requests/{trace_id}", headers=headers)
        if r.status_code == 200:
            body = r.json()
            found.append({**body["record"], "events": body["events"]})
        return bool(found)

    assert wait_for(get, timeout_s), f"no record for {trace_id}"
    return found[0]


def check_identities(rec: dict) -> None:
    """e2e = ttft + sum(itl) + tail, and the stage boundaries in order."""
    ttft = rec["ttft_ms"] or 0.0
    assert rec["e2e_ms"] == pytest.approx(ttft + sum(rec["itl_ms"]) + rec["tail_ms"], abs=1e-6)
    if rec["ttft_ms"] is not None:
        assert rec["ttft_ms"] >= rec["ingress_ms"] + rec["tokenize_ms"] + rec["route_ms"] - 1e-6
    times = [e["ts_us"] for e in rec["events"]]
    assert times == sorted(times)
    assert rec["events"][0]["state"] == "RECEIVED" and rec["events"][-1]["state"] == "END"


def test_traceparent_continues_into_headers_and_record(tiny_server, bundled_tokenizer):
    trace_id, parent_span, tp = traceparent()
    body = {"model": tiny_server.model, "prompt": "Once upon a time", "max_tokens": 5,
            "ignore_eos": True}
    r = httpx.post(f"{tiny_server.url}/v1/completions", json=body,
                   headers={"traceparent": tp, "x-request-id": "my-req-1"}, timeout=60)
    assert r.status_code == 200
    assert r.headers["x-tailscope-trace-id"] == trace_id
    assert r.headers["x-request-id"] == "my-req-1"
    m = re.fullmatch(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01", r.headers["traceparent"])
    assert m and m.group(1) == trace_id and m.group(2) != parent_span  # our span, same trace
    rec = record(tiny_server.url, trace_id)
    assert rec["trace_id"] == trace_id and rec["parent_span_id"] == parent_span
    assert rec["span_id"] == m.group(2) and rec["request_id"] == "my-req-1"
    assert rec["final_state"] == "FINISHED" and rec["finish_reason"] == "length"
    assert rec["http_status"] == 200 and rec["replica"] == "r0" and rec["tenant"] == "local"
    tok = httpx.post(f"{tiny_server.url}/v1/completions", timeout=60,
                     json={**body, "max_tokens": 1}).json()
    assert rec["prompt_tokens"] == tok["usage"]["prompt_tokens"] == len(rec["input_token_ids"])
    assert rec["generated_tokens"] == rec["emitted_tokens"] == 5 == len(rec["output_token_ids"])
    assert rec["max_tokens"] == 5 and rec["stream"] is False
    # the recorded ids decode to exactly the text the client received
    assert bundled_tokenizer.decode(rec["output_token_ids"], skip_special_tokens=True) == \
        r.json()["choices"][0]["text"]
    assert rec["engine_version"] and rec["gateway_version"] and rec["config_id"]
    assert rec["model_revision"] == "tiny-seed0" and rec["tokenizer_revision"]
    assert rec["ttft_ms"] == pytest.approx(rec["e2e_ms"] - rec["tail_ms"])  # one JSON flush
    assert rec["decode_ms"] > 0 and rec["prefill_ms"] > 0
    states = [e["state"] for e in rec["events"]]
    for stage in ("ADMITTED", "TOKENIZED", "ROUTED", "QUEUED", "PREFILLING", "DECODING",
                  "FINISHED", "FIRST_FLUSH"):
        assert stage in states, states
    check_identities(rec)


def test_streamed_record_has_one_itl_per_content_flush(tiny_server, records_file):
    trace_id, _, tp = traceparent()
    body = {"model": tiny_server.model, "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 12, "ignore_eos": True, "stream": True}
    content_chunks = 0
    with httpx.stream("POST", f"{tiny_server.url}/v1/chat/completions", json=body,
                      headers={"traceparent": tp}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if choice["delta"].get("content"):
                    content_chunks += 1
    rec = record(tiny_server.url, trace_id)
    assert rec["stream"] is True and rec["final_state"] == "FINISHED"
    assert len(rec["itl_ms"]) == content_chunks - 1 and content_chunks > 1
    assert rec["tpot_ms"] == pytest.approx(sum(rec["itl_ms"]) / len(rec["itl_ms"]))
    check_identities(rec)
    # the same record, once, in the JSON-lines sink
    lines = [json.loads(x) for x in records_file.read_text().splitlines()]
    mine = [x for x in lines if x["trace_id"] == trace_id]
    assert len(mine) == 1 and mine[0]["itl_ms"] == rec["itl_ms"]


@pytest.mark.parametrize("body,status,state", [
    ({"temperature": -1}, 400, "REJECTED"),
    ({"model": "nope"}, 404, "REJECTED"),
])
def test_rejected_requests_get_a_record_too(tiny_server, body, status, state):
    trace_id, _, tp = traceparent()
    full = {"model": tiny_server.model, "prompt": "Hi", "max_tokens": 3, **body}
    r = httpx.post(f"{tiny_server.url}/v1/completions", json=full, headers={"traceparent": tp})
    assert r.status_code == status
    rec = record(tiny_server.url, trace_id)
    assert rec["final_state"] == state and rec["http_status"] == status
    assert rec["finish_reason"] == "rejected" and rec["replica"] == ""
    assert rec["error_message"] and rec["ttft_ms"] is None and rec["itl_ms"] == []
    check_identities(rec)


def test_malformed_json_and_oversized_bodies_are_recorded(tiny_server):
    trace_id, _, tp = traceparent()
    r = httpx.post(f"{tiny_server.url}/v1/completions", content=b"{not json",
                   headers={"traceparent": tp, "content-type": "application/json"})
    assert r.status_code == 400
    assert record(tiny_server.url, trace_id)["final_state"] == "REJECTED"
    trace_id, _, tp = traceparent()
    r = httpx.post(f"{tiny_server.url}/v1/completions", content=b"x" * (2 << 20),
                   headers={"traceparent": tp})
    assert r.status_code == 413 and r.headers["x-tailscope-trace-id"] == trace_id
    rec = record(tiny_server.url, trace_id)
    assert rec["http_status"] == 413 and rec["error_type"] == "body_too_large"


def test_disconnect_is_recorded_as_cancelled(tiny_server):
    trace_id, _, tp = traceparent()
    body = {"model": tiny_server.model, "prompt": "Once upon a time", "max_tokens": 900,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{tiny_server.url}/v1/completions", json=body,
                         headers={"traceparent": tp}) as r:
            lines = r.iter_lines()
            for _ in range(8):
                next(lines)
    rec = record(tiny_server.url, trace_id)
    assert rec["final_state"] == "CANCELLED" and rec["finish_reason"] == "cancelled"
    assert 0 < rec["emitted_tokens"] < 900 and rec["ttft_ms"] is not None
    check_identities(rec)


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "") + r" (\S+)"
    m = re.search(r"^" + pattern + "$", text, re.M)
    assert m, f"{name}{{{want}}} not in /metrics"
    return float(m.group(1))


def test_metrics_count_requests_and_latencies(tiny_server):
    before = httpx.get(f"{tiny_server.url}/metrics").text
    ttft0 = metric(before, "tailscope:time_to_first_token_seconds_count")
    try:
        length0 = metric(before, "tailscope:request_success_total", finish_reason="length")
    except AssertionError:
        length0 = 0.0
    body = {"model": tiny_server.model, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True}
    for _ in range(3):
        assert httpx.post(f"{tiny_server.url}/v1/completions", json=body,
                          timeout=60).status_code == 200
    assert httpx.post(f"{tiny_server.url}/v1/completions",
                      json={**body, "top_p": 2}).status_code == 400
    time.sleep(0.1)
    text = httpx.get(f"{tiny_server.url}/metrics").text
    assert metric(text, "tailscope:request_success_total", finish_reason="length") == length0 + 3
    assert metric(text, "tailscope:time_to_first_token_seconds_count") == ttft0 + 3
    assert metric(text, "tailscope:http_requests_total", endpoint="/v1/completions",
                  status="400") >= 1
    assert metric(text, "tailscope:e2e_request_latency_seconds_count") >= 4
    assert metric(text, "tailscope:request_prefill_time_seconds_count") >= 3
    assert metric(text, "tailscope:replica_ready", replica="r0") == 1.0
    assert metric(text, "tailscope:num_requests_running", replica="r0") == 0.0
    assert 0.0 <= metric(text, "tailscope:kv_cache_usage_perc", replica="r0") <= 1.0
    # a serving gateway collects its youngest generation at 20,000 objects, not Python's 700
    # (TAILSCOPE_GC_THRESHOLD); the older generations keep theirs
    assert metric(text, "tailscope:gc_threshold", generation="0") == 20000
    assert metric(text, "tailscope:gc_threshold", generation="1") == 10
    # the writer's Arrow buffers come from the system allocator, not pyarrow's default
    # mimalloc and its huge pages (tracing.arrow.use_arrow_pool)
    assert metric(text, "tailscope:arrow_allocated_bytes", pool="system") >= 0


def test_a_step_row_copies_every_step_stats_field_and_names_its_members():
    """``step_row`` names its fields one by one (it runs on the event loop for every engine
    step): every field the engine_steps row shares with StepStats is copied, with a value of
    its own here so that a field left out (its default) or crossed with another shows."""
    import dataclasses

    import msgspec

    from engine.observer import StepMember, StepStats
    from engine.protocol import StepReport
    from gateway.store_api import _STEP_FIELDS, step_row
    from tracing.schema import EngineStepRow

    shared = [f for f in msgspec.structs.fields(StepStats) if f.name in _STEP_FIELDS]
    assert {f.name for f in shared} == set(_STEP_FIELDS) and len(_STEP_FIELDS) >= 15
    values = {f.name: (100 + i) * (1.5 if f.type is float else 1)
              for i, f in enumerate(shared)}
    members = (StepMember("e1", 7, 0), StepMember("e2", 0, 1))
    stats = StepStats(**values, wall_ns=1_700_000_000_123_456_789, members=members)
    msg = StepReport(replica="r0", deltas=[], stats=stats, running=3, waiting=4)
    row = step_row("gw/r0", 2, msg, 9, {"e1": "t1", "e2": "t2"}.get, "gw")
    for name, value in values.items():
        assert getattr(row, name) == value, name
    assert (row.replica, row.incarnation, row.ts_us, row.running, row.waiting, row.ttl_days,
            row.instance) == ("gw/r0", 2, 1_700_000_000_123_456, 3, 4, 9, "gw")
    assert (row.member_traces, row.member_prefill, row.member_decode) == (
        ["t1", "t2"], [7, 0], [0, 1])
    # every column of the row is one of those: none is left to its default unnoticed
    named = set(values) | {"replica", "incarnation", "ts_us", "running", "waiting",
                           "ttl_days", "instance", "member_traces", "member_prefill",
                           "member_decode"}
    assert {f.name for f in dataclasses.fields(EngineStepRow)} == named
    assert step_row("r0", 0, msg, 30).member_traces == ["e1", "e2"]  # no trace_of: engine ids
