"""External backends under the gateway's rules (second security audit): a tenant's limits hold
for a backend's model, its tokens are charged from the upstream's usage, what an upstream
sends is bounded and checked (a lie is a 502 or an ignored number, never a 500, a lost slot or
an unbounded metric label), and the gateway's deadline holds on proxied requests.

The upstream is ``fault_upstream.py`` (a FAULT INJECTOR): ``echo`` answers with the body it
received, so a test sees exactly what was forwarded."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.gateway.conftest import start_server, stop_server
from tests.gateway.test_upstream import _backend, faults  # noqa: F401 (a fixture)

ADMIN = "sk-admin-backend-rules-0123"
SMALL = "sk-small-backend-rules-0123"
TPM = "sk-tpm-backend-rules-0123"
PLAIN = "sk-plain-backend-rules-0123"
TENANTS = f"""
[[tenants]]
name = "ops"
keys = ["{ADMIN}"]
admin = true

[[tenants]]
name = "small"
keys = ["{SMALL}"]
max_output_tokens = 8
max_prompt_tokens = 50
max_concurrent = 1

[[tenants]]
name = "tpm"
keys = ["{TPM}"]
tokens_per_minute = 200

[[tenants]]
name = "plain"
keys = ["{PLAIN}"]
"""


@pytest.fixture(scope="module")
def gateway(bundled_path, faults, tmp_path_factory):  # noqa: F811
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(TENANTS)
    args = ["--model", "tiny:49152", "--tokenizer", str(bundled_path), "--config", str(tenants)]
    for mode in ("echo", "bad-usage", "big-usage", "choices-int", "odd-finish", "slow-stream",
                 "stall-first-byte"):
        args += _backend(mode, faults, mode, probe_interval_s=0)
    args += _backend("big-body", faults, "big-body", probe_interval_s=0, max_response_mb=1)
    args += _backend("long-line", faults, "long-line", probe_interval_s=0, max_line_kb=64)
    server = start_server(*args, env={"TAILSCOPE_REQUEST_TIMEOUT_S": "3"})
    yield server
    stop_server(server)


def post(gateway, key: str, model: str, stream: bool = False, **body) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "prompt": "Hi", "stream": stream, **body})


def forwarded(r: httpx.Response) -> dict:
    """The body the echo upstream received."""
    assert r.status_code == 200, r.text
    return json.loads(r.json()["choices"][0]["text"])


def record(gateway, r: httpx.Response) -> dict:
    from tests.gateway.test_faults import wait_for

    trace = r.headers["x-tailscope-trace-id"]

    def get():
        got = httpx.get(f"{gateway.url}/debug/requests/{trace}", timeout=10,
                        headers={"Authorization": f"Bearer {ADMIN}"})
        return got.json()["record"] if got.status_code == 200 else None
    assert wait_for(lambda: get() is not None, 10), trace
    return get()


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 100000, "n": 50}, "n"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"max_tokens": 4, "prompt": "word " * 200}, "prompt"),
    ({"max_tokens": 4, "stop": ["x"] * 100}, "stop"),
    ({"max_tokens": 4, "logprobs": 500}, "logprobs"),
    ({"max_tokens": 4, "metadata": {"k": "v" * 600}}, "metadata"),
])
def test_the_tenants_limits_hold_for_a_backends_model(gateway, body, param):
    r = post(gateway, SMALL, "echo", **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_missing_max_tokens_is_the_tenants_limit_and_the_rest_goes_as_sent(gateway):
    sent = forwarded(post(gateway, SMALL, "echo", vendor_field={"x": 1}))
    assert sent["max_tokens"] == 8 and sent["vendor_field"] == {"x": 1}
    assert forwarded(post(gateway, SMALL, "echo", max_tokens=5))["max_tokens"] == 5


def test_tokens_are_charged_from_the_upstreams_usage(gateway):
    r = post(gateway, TPM, "big-usage", max_tokens=4)  # admitted: 4 + the prompt fit
    assert r.status_code == 200, r.text
    # the upstream said 5,003 tokens were used: far past the 200 a minute
    r = post(gateway, TPM, "echo", max_tokens=4)
    assert r.status_code == 429 and "tokens/min" in r.json()["error"]["message"], r.text
    assert r.headers["x-ratelimit-remaining-tokens"] == "0"


@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_usage_never_loses_the_tenants_slot(gateway, stream):
    """``small`` may have one request in flight: a slot lost to an exception would refuse
    every later request with a 429."""
    for _ in range(3):
        r = post(gateway, SMALL, "bad-usage", stream, max_tokens=4)
        assert r.status_code == 200, r.text
    rec = record(gateway, r)
    assert rec["final_state"] == "FINISHED"
    assert 0 <= rec["prompt_tokens"] < 2**31 and 0 <= rec["generated_tokens"] < 2**31
    r = post(gateway, SMALL, "echo", max_tokens=4)
    assert r.status_code == 200, r.text


def test_an_answer_that_is_not_openais_shape_is_a_502(gateway):
    r = post(gateway, ADMIN, "choices-int", max_tokens=4)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_protocol", r.text


def test_an_upstreams_finish_reason_is_one_of_a_closed_set(gateway):
    r = post(gateway, ADMIN, "odd-finish", max_tokens=4)
    assert r.status_code == 200
    assert record(gateway, r)["finish_reason"] == "other"
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    assert "banana" not in metrics


def test_a_body_past_the_backends_bound_is_refused(gateway):
    r = post(gateway, ADMIN, "big-body", max_tokens=4)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_too_large", r.text


def test_a_stream_line_past_the_backends_bound_ends_the_stream(gateway):
    r = post(gateway, ADMIN, "long-line", True, max_tokens=4)
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == "first "
    assert events[-1]["error"]["code"] == "upstream_protocol"
    assert "max_line_kb" in events[-1]["error"]["message"]


def test_the_gateway_deadline_holds_on_proxied_requests(gateway):
    r = post(gateway, ADMIN, "stall-first-byte", max_tokens=4)  # it sleeps 30 s
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout", r.text
    r = post(gateway, ADMIN, "slow-stream", True, max_tokens=4)  # 20 s of chunks
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "request_timeout"
    assert len(events) - 1 < 200  # cut before the upstream's 200 chunks ended
    rec = record(gateway, r)
    assert rec["final_state"] == "TIMED_OUT"
    assert re.search(r"deadline", rec["error_message"])


def test_a_client_cannot_take_another_tenants_trace_id(gateway):
    """(Not backend-specific.) bob's traceparent naming alice's trace id would make his
    record stand for hers."""
    def traced(key: str, trace_id: str) -> httpx.Response:
        return httpx.post(f"{gateway.url}/v1/completions", timeout=60, json={
            "model": "echo", "prompt": "Hi", "max_tokens": 2}, headers={
            "Authorization": f"Bearer {key}",
            "traceparent": f"00-{trace_id}-{'b' * 16}-01"})
    theirs = "c0ffee" + "0" * 26
    first = traced(SMALL, theirs)
    assert first.status_code == 200 and first.headers["x-tailscope-trace-id"] == theirs
    again = traced(SMALL, theirs)  # the same tenant may go on in its own trace
    assert again.headers["x-tailscope-trace-id"] == theirs
    other = traced(ADMIN, theirs)
    assert other.status_code == 200
    mine = other.headers["x-tailscope-trace-id"]
    assert mine != theirs and other.headers["traceparent"].startswith(f"00-{mine}-")
    assert record(gateway, other)["tenant"] == "ops"
    assert record(gateway, first)["tenant"] == "small"  # theirs still shows theirs


def test_a_tenant_cannot_tag_into_another_tenants_bench_run(gateway):
    """(Not backend-specific.) ``x-tailscope-bench-run`` joins a record to a run that
    ``whatif --bench-run`` reads: a run is its first tenant's, or every tenant's that holds
    the token an admin opened it with."""
    def tagged(key: str, run: str, token: str = "") -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}", "x-tailscope-bench-run": run}
        if token:
            headers["x-tailscope-bench-token"] = token
        return httpx.post(f"{gateway.url}/v1/completions", timeout=60, headers=headers,
                          json={"model": "echo", "prompt": "Hi", "max_tokens": 2})
    first = tagged(SMALL, "first-run")
    assert first.status_code == 200 and record(gateway, first)["bench_run"] == "first-run"
    assert tagged(SMALL, "first-run").status_code == 200
    other = tagged(PLAIN, "first-run")
    assert other.status_code == 403, other.text
    assert other.json()["error"]["code"] == "bench_run_forbidden"
    assert "'small'" not in other.json()["error"]["message"]  # the owner is not named
    # a token is the admin's to give, and only for its run
    assert httpx.post(f"{gateway.url}/debug/bench-runs/open", json={"run_id": "shared"},
                      headers={"Authorization": f"Bearer {PLAIN}"}).status_code == 403
    opened = httpx.post(f"{gateway.url}/debug/bench-runs/open", json={"run_id": "shared"},
                        headers={"Authorization": f"Bearer {ADMIN}"})
    assert opened.status_code == 200 and opened.json()["run_id"] == "shared"
    token = opened.json()["token"]
    for key in (SMALL, PLAIN):
        r = tagged(key, "shared", token)
        assert r.status_code == 200 and record(gateway, r)["bench_run"] == "shared"
    assert tagged(PLAIN, "first-run", token).status_code == 403  # another run's token
    assert tagged(ADMIN, "first-run").status_code == 200  # an admin tenant may
    from bench.loadgen import Target, open_run
    target = Target(gateway.url, run_id="loadgen-run")
    assert not open_run(target, PLAIN) and target.run_token == ""
    assert open_run(target, ADMIN) and target.run_token == httpx.post(
        f"{gateway.url}/debug/bench-runs/open", json={"run_id": "loadgen-run"},
        headers={"Authorization": f"Bearer {ADMIN}"}).json()["token"]
