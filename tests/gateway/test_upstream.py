"""External OpenAI-compatible backends as recorded replicas, over real loopback HTTP: another
Tailscope as the upstream (the openai SDK through the gateway gives what the upstream gives),
and a scripted fault injector (tests/gateway/fault_upstream.py) for stalls, errors, malformed
streams and broken connections."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway import __version__ as gateway_version
from tests.gateway.conftest import start_server, stop_server
from tests.gateway.test_faults import wait_for
from tracing.client import free_port

FAULTS = Path(__file__).with_name("fault_upstream.py")
DIRECT = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def upstream(bundled_path):
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path))
    yield server
    stop_server(server)


def start_faults(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(FAULTS), str(port)])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    return proc


@pytest.fixture(scope="module")
def faults():
    port = free_port()
    proc = start_faults(port)
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


class ResettingUpstream:
    """A FAULT INJECTOR on a raw socket: every odd connection has its request read and is then
    reset (RST, no byte of answer), as a server does to a keep-alive connection it closed just
    as the client reused it; every even one gets a plain completion. ``connections`` counts
    them."""

    ANSWER = json.dumps({"id": "cmpl-reset", "object": "text_completion", "choices": [
        {"index": 0, "text": "after a reset", "finish_reason": "stop"}]}).encode()

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                data, chunk = b"", b"-"
                while chunk and b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                               if h.lower().startswith(b"content-length:")), 0)
                while chunk and len(body) < length:
                    chunk = conn.recv(65536)
                    body += chunk
                if not chunk:  # the caller left before its request was whole
                    continue
                if self.connections % 2:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue  # closed with a reset
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(self.ANSWER), self.ANSWER))


@pytest.fixture(scope="module")
def resetting():
    server = ResettingUpstream()
    yield server
    server.sock.close()


def _backend(name: str, url: str, upstream_model: str, **kw) -> list[str]:
    extra = "".join(f",{k}={v}" for k, v in kw.items())
    return ["--backend", f"{name}={url},upstream_model={upstream_model}{extra}"]


@pytest.fixture(scope="module")
def gateway(bundled_path, upstream, faults, resetting):
    args = ["--model", "tiny:49152", "--tokenizer", str(bundled_path),
            *_backend("up", upstream.url, DIRECT, model="tiny-up", return_token_ids="true"),
            *_backend("echo", faults, "echo"),
            *_backend("stall", faults, "stall-first-byte", first_byte_timeout_s=1),
            *_backend("stallmid", faults, "stall-mid", idle_timeout_s=1),
            *_backend("closemid", faults, "close-mid"),
            *_backend("malformed", faults, "malformed"),
            *_backend("notjson", faults, "not-json"),
            *_backend("err429", faults, "error-429"),
            *_backend("err500", faults, "error-500", eject_s=600),
            *_backend("slow", faults, "slow-stream"),
            *_backend("flaky-a", faults, "error-500", model="flaky"),
            *_backend("flaky-b", faults, "echo", model="flaky"),
            *_backend("llama", faults, "llama"),
            *_backend("vllm", faults, "vllm", return_token_ids="true"),
            *_backend("vllmlp", faults, "vllm"),
            *_backend("dead", f"http://127.0.0.1:{free_port()}", "echo", probe_interval_s=0.2,
                      eject_after=2, eject_s=600),
            *_backend("reset", resetting.url, "reset", probe_interval_s=0)]
    server = start_server(*args)
    yield server
    stop_server(server)


def record(url: str, trace_id: str) -> dict:
    def get():
        r = httpx.get(f"{url}/debug/requests/{trace_id}")
        return r.json() if r.status_code == 200 else None
    assert wait_for(lambda: get() is not None, 10), trace_id
    return get()


def post(gateway, model: str, **body) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/completions", timeout=30,
                      json={"model": model, "prompt": "Hi", "max_tokens": 4, **body})


def test_the_sdk_through_the_gateway_gets_what_the_upstream_gives(gateway, upstream):
    via = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x")
    direct = openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="x")
    ask = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    a = via.completions.create(model="tiny-up", prompt="The sky is", **ask)
    b = direct.completions.create(model=DIRECT, prompt="The sky is", **ask)
    assert a.choices[0].text == b.choices[0].text and a.usage == b.usage
    msgs = [{"role": "user", "content": "Hello"}]
    c = via.chat.completions.create(model="tiny-up", messages=msgs, **ask)
    d = direct.chat.completions.create(model=DIRECT, messages=msgs, **ask)
    assert c.choices[0].message.content == d.choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in via.chat.completions.create(
        model="tiny-up", messages=msgs, stream=True, **ask) if ch.choices)
    assert streamed == d.choices[0].message.content
    models = [m.id for m in via.models.list()]
    assert models[0] == DIRECT and {"tiny-up", "echo", "flaky"} <= set(models)
    assert via.models.retrieve("tiny-up").id == "tiny-up"
    with pytest.raises(openai.NotFoundError) as unknown:  # the answer names every served model
        via.completions.create(model="nope", prompt="Hi", max_tokens=1)
    assert "'tiny-up'" in unknown.value.message and repr(DIRECT) in unknown.value.message


def test_the_responses_api_through_a_backend_is_its_chat_answer(gateway, upstream):
    """/v1/responses for a backend's model: served as the chat request it means, proxied to
    the backend's chat endpoint, its answer (JSON or stream) translated back."""
    via = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x")
    direct = openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="x")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    d = direct.chat.completions.create(model=DIRECT, messages=msgs, max_completion_tokens=6,
                                       temperature=0)
    ask = {"model": "tiny-up", "instructions": "Be brief.", "input": "Hello",
           "max_output_tokens": 6, "temperature": 0}
    out = via.responses.create(**ask)
    assert out.output_text == d.choices[0].message.content != ""
    assert out.usage.input_tokens == d.usage.prompt_tokens
    events = list(via.responses.create(**ask, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        out.output_text
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.output_tokens == d.usage.completion_tokens


def test_a_proxied_request_has_one_record_joined_to_the_upstreams_trace(gateway, upstream):
    r = post(gateway, "tiny-up", stream=True, temperature=0, ignore_eos=True)
    assert r.status_code == 200
    trace_id = r.headers["x-tailscope-trace-id"]
    rec = record(gateway.url, trace_id)["record"]
    events = [e["state"] for e in record(gateway.url, trace_id)["events"]]
    assert rec["replica"] == "up" and rec["final_state"] == "FINISHED"
    assert rec["model"] == "tiny-up" and rec["stream"] is True
    assert events[:4] == ["RECEIVED", "ADMITTED", "TOKENIZED", "ROUTED"]
    assert "UPSTREAM_HEADERS" in events and "FIRST_FLUSH" in events
    assert len(rec["itl_ms"]) >= 2 and rec["e2e_ms"] == pytest.approx(
        rec["ttft_ms"] + sum(rec["itl_ms"]) + rec["tail_ms"], abs=1e-6)
    chunks = [json.loads(x[6:]) for x in r.text.splitlines()
              if x.startswith("data: {")]
    assert rec["response_id"] == chunks[0]["id"]
    theirs = record(upstream.url, trace_id)["record"]  # the upstream continued our trace
    assert theirs["parent_span_id"] == rec["span_id"] and theirs["emitted_tokens"] == 4


def test_return_token_ids_on_the_bundled_engine_in_vllms_shape(upstream):
    """vLLM's extra on our own engine: the prompt's ids and the generated ids, per chunk when
    streamed (they add up to the whole answer's)."""
    ask = {"model": DIRECT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
           "return_token_ids": True}
    ids = httpx.post(f"{upstream.url}/tokenize", json={"prompt": "The sky is"}).json()["tokens"]
    whole = httpx.post(f"{upstream.url}/v1/completions",
                       json={**ask, "prompt": "The sky is"}).json()["choices"][0]
    assert whole["prompt_token_ids"] == ids and len(whole["token_ids"]) == 6
    r = httpx.post(f"{upstream.url}/v1/completions", json={**ask, "prompt": "The sky is",
                                                          "stream": True})
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
    assert not any("prompt_token_ids" in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["token_ids"]
    msgs = [{"role": "user", "content": "Hello"}]
    chat = httpx.post(f"{upstream.url}/v1/chat/completions", json={**ask, "messages": msgs})
    tokenized = httpx.post(f"{upstream.url}/tokenize", json={"messages": msgs}).json()
    assert chat.json()["prompt_token_ids"] == tokenized["tokens"]
    assert len(chat.json()["choices"][0]["token_ids"]) == 6


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_token_ids_from_the_upstream_reach_the_record_not_the_client(gateway, upstream,
                                                                     stream, path):
    """The backend is configured with return_token_ids: the gateway asks for them, keeps them
    in its record (equal to the upstream engine's own record) and strips them from the answer
    of a client that did not ask; a client that asks gets them."""
    body = {"model": "tiny-up", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": stream, **({"prompt": "The sky is"} if "chat" not in path else
                                 {"messages": [{"role": "user", "content": "Hi"}]})}
    r = httpx.post(f"{gateway.url}{path}", json=body, timeout=30)
    assert r.status_code == 200 and "token_ids" not in r.text
    trace_id = r.headers["x-tailscope-trace-id"]
    ours, theirs = record(gateway.url, trace_id)["record"], record(upstream.url, trace_id)[
        "record"]
    assert ours["input_token_ids"] == theirs["input_token_ids"] != []
    assert ours["output_token_ids"] == theirs["output_token_ids"] and len(
        ours["output_token_ids"]) == 5
    asked = httpx.post(f"{gateway.url}{path}", json={**body, "return_token_ids": True},
                       timeout=30)
    assert "token_ids" in asked.text and asked.status_code == 200


def test_fields_reach_the_upstream_unchanged_and_its_fields_come_back(gateway):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    sent = {"tools": tools, "tool_choice": "auto", "vendor_knob": [1, {"a": None}],
            "logit_bias": {"5": 1}, "user": "u-9", "metadata": {"team": "search"}}
    r = post(gateway, "echo", **sent)
    assert r.status_code == 200, r.text
    body = r.json()
    got = json.loads(body["choices"][0]["text"])
    assert got == {"model": "echo", "prompt": "Hi", "max_tokens": 4, **sent}
    assert body["vendor_field"] == {"x": 1} and body["id"] == "cmpl-echo"
    rec = record(gateway.url, r.headers["x-tailscope-trace-id"])["record"]
    assert (rec["prompt_tokens"], rec["emitted_tokens"]) == (3, 7)
    # sent on as they came, and recorded as on the bundled path
    assert rec["end_user"] == "u-9" and json.loads(rec["metadata"]) == {"team": "search"}
    for _ in range(3):
        assert post(gateway, "echo").status_code == 200
        assert post(gateway, "echo", stream=True).status_code == 200
    info = httpx.get(f"{gateway.url}/debug/replicas").json()["echo"]
    assert info["inflight"] == 0 and info["requests"] >= 7  # every slot given back


@pytest.mark.parametrize("model,stream,status,state,code", [
    ("stall", False, 504, "TIMED_OUT", "upstream_timeout"),
    ("notjson", False, 502, "FAILED", "upstream_protocol"),
    ("err429", False, 429, "REJECTED", "scripted_429"),
    ("stallmid", True, 200, "TIMED_OUT", "upstream_timeout"),
    ("closemid", True, 200, "FAILED", "upstream_closed"),
    ("malformed", True, 200, "FAILED", "upstream_protocol"),
])
def test_each_fault_has_its_status_and_one_record(gateway, model, stream, status, state,
                                                  code):
    r = post(gateway, model, stream=stream)
    assert r.status_code == status, r.text
    if stream:  # the stream had begun: its end is an SSE error event
        last = [x for x in r.text.splitlines() if x.startswith("data: ")][-1]
        assert json.loads(last[6:])["error"]["code"] == code
    else:
        assert code in r.text
    rec = record(gateway.url, r.headers["x-tailscope-trace-id"])["record"]
    assert (rec["final_state"], rec["error_type"], rec["replica"]) == (state, code, model)
    assert httpx.get(f"{gateway.url}/ready").status_code == 200  # and the gateway is fine
    assert post(gateway, "echo").status_code == 200


def test_an_error_answer_keeps_its_status_and_repeated_failures_eject_the_backend(gateway):
    for _ in range(3):
        r = post(gateway, "err500")
        assert r.status_code == 500 and r.json()["error"]["message"] == "scripted 500"
    r = post(gateway, "err500")
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable"
    info = httpx.get(f"{gateway.url}/debug/replicas").json()["err500"]
    assert info["state"] == "ejected" and info["errors"] == 3
    assert httpx.get(f"{gateway.url}/ready").json()["backends"]["err500"] == "ejected"
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert 'tailscope:backend_state{backend="err500",state="ejected"} 1.0' in metrics
    assert 'tailscope:backend_errors_total{backend="err500"} 3.0' in metrics


def test_nothing_received_yet_is_retried_on_another_backend_of_the_model(gateway):
    r = post(gateway, "flaky")
    assert r.status_code == 200, r.text
    rec = record(gateway.url, r.headers["x-tailscope-trace-id"])["record"]
    assert rec["replica"] == "flaky-b" and rec["retries"] == 1


def test_a_connection_reset_before_any_answer_is_sent_again_once(gateway, resetting):
    r = post(gateway, "reset")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "after a reset"
    assert resetting.connections == 2  # the reset one, then the one that answered
    assert httpx.get(f"{gateway.url}/debug/replicas").json()["reset"]["resends"] == 1
    rec = record(gateway.url, r.headers["x-tailscope-trace-id"])["record"]
    assert (rec["final_state"], rec["replica"], rec["retries"]) == ("FINISHED", "reset", 0)


def test_a_client_that_leaves_closes_the_upstream_stream_at_once(gateway, faults):
    before = httpx.get(f"{faults}/stats").json()["cancelled"]
    with httpx.stream("POST", f"{gateway.url}/v1/completions", timeout=30, json={
            "model": "slow", "prompt": "Hi", "stream": True}) as r:
        assert r.status_code == 200, r.read()
        trace_id = r.headers["x-tailscope-trace-id"]
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one event, then the client hangs up
    assert wait_for(lambda: httpx.get(f"{faults}/stats").json()["cancelled"] > before, 5)
    rec = record(gateway.url, trace_id)["record"]
    assert (rec["final_state"], rec["error_type"]) == ("CANCELLED", "client_disconnected")
    assert wait_for(lambda: httpx.get(f"{gateway.url}/debug/replicas").json()["slow"][
        "inflight"] == 0, 5)


@pytest.mark.parametrize("stream", [False, True])
def test_llama_cpp_timings_fill_the_engine_stages_and_say_so(gateway, stream):
    r = post(gateway, "llama", stream=stream)
    assert r.status_code == 200, r.text
    got = record(gateway.url, r.headers["x-tailscope-trace-id"])
    rec, events = got["record"], got["events"]
    assert rec["timing_source"] == "upstream"
    # the upstream's own figures, placed on the gateway's clock (µs rounding only)
    assert rec["prefill_ms"] == pytest.approx(40.0, abs=0.01)
    assert rec["decode_ms"] == pytest.approx(100.0, abs=0.01)
    assert (rec["cached_tokens"], rec["prompt_tokens"], rec["generated_tokens"]) == (2, 7, 3)
    # it answered after 0.15 s: what is left of the upstream's time is its queue wait
    assert rec["engine_queue_ms"] > 0 and rec["engine_queue_ms"] + 140 < rec["e2e_ms"]
    assert [e["detail"] for e in events if e["state"] == "PREFILLING"] == ["upstream-reported"]
    e2e = sum(rec[c] for c in ("ingress_ms", "tokenize_ms", "route_ms", "engine_queue_ms",
                               "prefill_ms", "decode_ms", "preempted_ms"))
    assert e2e <= rec["e2e_ms"] + 1e-3
    plain = post(gateway, "echo")  # no timings: only what the gateway saw
    assert record(gateway.url, plain.headers["x-tailscope-trace-id"])["record"][
        "timing_source"] == "gateway"


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_per_request_metrics_and_token_ids_fill_the_record(gateway, faults, stream):
    """vLLM's ``metrics`` (with the usage the gateway asks for on streams) become the engine
    stages; its token ids reach the record; neither asked-for field reaches the client."""
    r = post(gateway, "vllm", stream=stream)
    assert r.status_code == 200, r.text
    assert "token_ids" not in r.text
    assert ('"usage"' in r.text) is not stream  # a stream's usage was the gateway's to ask
    sent = httpx.get(f"{faults}/stats").json()["last_vllm_body"]
    assert sent["return_token_ids"] is True
    assert sent.get("stream_options") == ({"include_usage": True} if stream else None)
    rec = record(gateway.url, r.headers["x-tailscope-trace-id"])["record"]
    assert rec["timing_source"] == "upstream"
    assert rec["prefill_ms"] == pytest.approx(40.0, abs=0.01)
    assert rec["decode_ms"] == pytest.approx(100.0, abs=0.01)
    assert (rec["cached_tokens"], rec["prompt_tokens"], rec["generated_tokens"]) == (2, 7, 3)
    assert rec["input_token_ids"] == [11, 12, 13, 14, 15, 16, 17]
    assert rec["output_token_ids"] == [21, 22, 23]
    if stream:  # a client that asks for usage gets the upstream's usage chunk as it came
        r = post(gateway, "vllm", stream=True, stream_options={"include_usage": True})
        last = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")][-1]
        assert last["usage"]["prompt_tokens"] == 7 and last["metrics"]["queue_time_ms"] == 5.0


@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_from_logprobs_written_as_ids(gateway, stream):
    """An upstream that writes logprobs' tokens as token_id:N (vLLM's
    --return-tokens-as-token-ids): the record takes the ids from them; the answer is as sent."""
    r = post(gateway, "vllmlp", stream=stream, logprobs=1)
    assert r.status_code == 200 and "token_id:21" in r.text
    rec = record(gateway.url, r.headers["x-tailscope-trace-id"])["record"]
    assert rec["output_token_ids"] == [21, 22, 23] and rec["input_token_ids"] == []


def test_probes_find_revision_version_and_eject_a_dead_backend_with_no_traffic(gateway):
    def info():
        return httpx.get(f"{gateway.url}/debug/replicas").json()

    assert wait_for(lambda: info()["echo"]["model_revision"] == "scripted/echo-weights@rev1", 10)
    assert info()["echo"]["version"] == "vllm fault-1.0" and info()["echo"]["probes"] >= 1
    r = post(gateway, "echo")
    rec = record(gateway.url, r.headers["x-tailscope-trace-id"])["record"]
    assert rec["model_revision"] == "scripted/echo-weights@rev1"
    assert rec["engine_version"] == "vllm fault-1.0"
    # another Tailscope behind this one names itself in its /version
    own = httpx.get(f"{gateway.url}/version").json()
    assert own["server"] == "tailscope" and own["version"] == gateway_version
    assert wait_for(lambda: info()["up"]["version"] == f"tailscope {gateway_version}", 10), \
        info()["up"]
    # nothing listens behind "dead": its probes eject it before any request finds it
    assert wait_for(lambda: info()["dead"]["state"] == "ejected", 10), info()["dead"]
    dead = info()["dead"]
    assert dead["requests"] == 0 and dead["errors"] == 0 and dead["probe_failures"] >= 2
    assert "ConnectError" in dead["last_probe"]
    # a backend whose health is fine while its requests fail is still ejected (err500 above)


@pytest.fixture(scope="module")
def pair(bundled_path):
    """Two scripted upstreams behind one model name, probed often."""
    ports = [free_port(), free_port()]
    procs = [start_faults(p) for p in ports]
    args = ["--model", "tiny:49152", "--tokenizer", str(bundled_path)]
    for name, port in zip("ab", ports, strict=True):
        args += _backend(f"pair-{name}", f"http://127.0.0.1:{port}", "slow-stream",
                         model="pair", probe_interval_s=0.2, eject_after=2, eject_s=1)
    server = start_server(*args)
    yield server, ports, procs
    stop_server(server)
    for p in procs:
        p.kill()
        p.wait()


def test_two_backends_one_dies_mid_stream_the_other_takes_over_and_it_comes_back(pair):
    server, ports, procs = pair

    def info():
        return httpx.get(f"{server.url}/debug/replicas").json()

    http = httpx.Client(timeout=30)
    streams = []
    for _ in range(4):  # load spreads: two streams on each
        cm = http.stream("POST", f"{server.url}/v1/completions", json={
            "model": "pair", "prompt": "Hi", "stream": True})
        r = cm.__enter__()
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        streams.append((cm, r, lines))
    assert (info()["pair-a"]["inflight"], info()["pair-b"]["inflight"]) == (2, 2)
    procs[0].kill()  # pair-a dies mid-stream
    procs[0].wait()
    ended = {}
    for cm, r, lines in streams:
        trace_id = r.headers["x-tailscope-trace-id"]
        if r.headers["x-tailscope-replica"] == "pair-a":
            last = [line for line in lines if line.startswith("data: ")][-1]
            ended[trace_id] = json.loads(last[6:])["error"]["code"]
        cm.__exit__(None, None, None)
    assert list(ended.values()) == ["upstream_closed"] * 2
    for trace_id in ended:
        rec = record(server.url, trace_id)["record"]
        assert (rec["final_state"], rec["error_type"]) == ("FAILED", "upstream_closed")
    # requests with nothing received yet go to pair-b (retried there if pair-a was chosen)
    for _ in range(3):
        with http.stream("POST", f"{server.url}/v1/completions", json={
                "model": "pair", "prompt": "Hi", "stream": True}) as r:
            assert r.status_code == 200
            assert next(line for line in r.iter_lines() if line.startswith("data: {"))
            assert r.headers["x-tailscope-replica"] == "pair-b"
    assert wait_for(lambda: info()["pair-a"]["state"] == "ejected", 5), info()["pair-a"]
    procs[0] = start_faults(ports[0])  # it restarts: probes bring it back
    assert wait_for(lambda: info()["pair-a"]["state"] == "ready", 10), info()["pair-a"]
    assert wait_for(lambda: info()["pair-a"]["inflight"] + info()["pair-b"]["inflight"] == 0,
                    10)
    with http.stream("POST", f"{server.url}/v1/completions", json={
            "model": "pair", "prompt": "Hi", "stream": True}) as r:  # ties: the first name
        assert next(line for line in r.iter_lines() if line.startswith("data: {"))
        assert r.headers["x-tailscope-replica"] == "pair-a"
    http.close()


def mixed_pool(bundled_path, faults: str, backend: str, mode: str, **kw):
    """A gateway whose bundled replica and one backend serve the same model name."""
    return start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                        *_backend(backend, faults, mode, model=DIRECT, **kw))


def burst(url: str) -> list[httpx.Response]:
    """Eight concurrent 48-token completions (half streamed): with one in flight on the
    replica, the mixed pool sends the next to the backend."""
    import asyncio

    async def send():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(http.post(f"{url}/v1/completions", json={
                "model": DIRECT, "prompt": f"Count {i}", "max_tokens": 48, "ignore_eos": True,
                "stream": i % 2 == 0}) for i in range(8)))

    return asyncio.run(send())


@pytest.fixture(scope="module")
def mixed(bundled_path, faults):
    server = mixed_pool(bundled_path, faults, "ext", "echo")
    yield server
    stop_server(server)


def test_a_mixed_pool_serves_one_model_from_a_replica_and_a_backend(mixed):
    replicas: dict[str, list[dict]] = {}
    for _ in range(3):
        for r in burst(mixed.url):
            assert r.status_code == 200, r.text
            rec = record(mixed.url, r.headers["x-tailscope-trace-id"])["record"]
            replicas.setdefault(rec["replica"], []).append(rec)
        if {"r0", "ext"} <= set(replicas):
            break
    assert {"r0", "ext"} <= set(replicas), {k: len(v) for k, v in replicas.items()}
    assert all(x["route_reason"].startswith("mixed pool:") for v in replicas.values()
               for x in v)
    assert all(x["timing_source"] == "engine" and x["generated_tokens"] == 48
               for x in replicas["r0"])
    assert all(x["timing_source"] == "gateway" and x["model"] == DIRECT
               for x in replicas["ext"])
    info = httpx.get(f"{mixed.url}/debug/replicas").json()
    assert info["r0"]["ready"] and info["ext"]["kind"] == "external"
    assert [m["id"] for m in httpx.get(f"{mixed.url}/v1/models").json()["data"]] == [DIRECT]
    # the store (what the drill-down and Grafana read) groups both as replicas of the model
    def stored() -> set[str]:
        return {row[0] for row in httpx.post(f"{mixed.url}/debug/query", json={"sql": (
            "SELECT DISTINCT replica FROM tailscope.requests WHERE model = "
            f"'{DIRECT}'")}).json()["rows"]}

    assert wait_for(lambda: stored() >= {"ext", "r0"}, 10), stored()


@pytest.fixture(scope="module")
def mixed_bad(bundled_path, faults):
    server = mixed_pool(bundled_path, faults, "bad", "error-500", eject_after=100)
    yield server
    stop_server(server)


def test_a_mixed_pool_request_its_backend_failed_is_served_by_the_bundled_replicas(mixed_bad):
    fell_back = []
    for _ in range(5):
        for r in burst(mixed_bad.url):
            assert r.status_code == 200, r.text  # nobody sees the backend's 500
            rec = record(mixed_bad.url, r.headers["x-tailscope-trace-id"])["record"]
            assert rec["replica"] == "r0" and rec["final_state"] == "FINISHED"
            assert rec["generated_tokens"] == 48
            if rec["retries"]:
                fell_back.append(rec)
        if fell_back:
            break
    assert fell_back, "no request was routed to the backend"
    rec = fell_back[0]
    assert rec["retries"] == 1 and "backend bad failed before any content" in rec[
        "route_reason"] and rec["timing_source"] == "engine"
    # the failed try is routing time; the bundled engine's own timeline follows
    assert rec["route_ms"] > rec["tokenize_ms"] and rec["prefill_ms"] > 0
    info = httpx.get(f"{mixed_bad.url}/debug/replicas").json()
    assert info["bad"]["errors"] >= 1 and info["bad"]["inflight"] == 0
    # every tenant slot came back: a second burst is not refused
    assert all(r.status_code == 200 for r in burst(mixed_bad.url))


def test_eval_run_and_bench_go_through_a_backend_unchanged(gateway, upstream):
    """``eval run --url --model <backend's model>`` and the load generator: every request is
    answered by the backend and recorded with it as the replica."""
    from bench import loadgen as L
    from evals import runner as R

    _, cases = R.load_suite("protocol")
    summary = R.run(gateway.url, "protocol", cases[:4], model="tiny-up", concurrency=2)
    assert len(summary.results) == 4 and summary.records_found == 4
    for res in summary.results:
        assert record(gateway.url, res.trace_id)["record"]["replica"] == "up"
    items = L.workload(6, L.Dist.parse("8"), L.Dist.parse("4"), seed=1)
    result = L.run(L.Target(gateway.url, model="tiny-up"), "closed", items, concurrency=2)
    assert result["succeeded"] == 6 and not result["errors"], result
