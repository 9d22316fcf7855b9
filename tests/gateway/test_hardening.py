"""Issue #15's findings, each reproduced over real HTTP against a real gateway: the debug
reader cannot write or run away, no request can stop the record writer or leak a slot, bad
input gets a 400 naming its field, and one replica's death or stall does not stop the gateway.
"""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.gateway.conftest import LOAD, start_server, stop_server
from tests.gateway.test_faults import replicas, wait_for
from tracing.client import sse_json

APP_ORIGIN = "http://app.example:3000"  # a browser page allowed by TAILSCOPE_CORS_ORIGINS


@pytest.fixture(scope="module")
def hard_server(bundled_path):
    """Open local mode (no keys, no admin key), listening on every interface."""
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          "--host", "0.0.0.0",
                          env={"TAILSCOPE_QUERY_MAX_EXECUTION_S": "20",
                               "TAILSCOPE_CORS_ORIGINS": f"{APP_ORIGIN}, http://other.example"})
    yield server
    stop_server(server)


def post(server, body: dict, path: str = "/v1/completions", timeout: float = 60,
         **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": server.model, **body},
                      timeout=timeout, **kw)


def debug_query(server, sql: str, params: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}/debug/query", json={"sql": sql, "params": params or {}},
                      timeout=kw.pop("timeout", 60), **kw)


def stored(server, trace_ids: list[str]) -> int:
    r = debug_query(server, "SELECT count() FROM tailscope.requests WHERE "
                            "has({ids:Array(String)}, trace_id)", {"ids": trace_ids})
    assert r.status_code == 200, r.text
    return r.json()["rows"][0][0]


def health_ms(server) -> float:
    t0 = time.monotonic()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    return (time.monotonic() - t0) * 1e3


# ---- the debug reader -------------------------------------------------------------------------
@pytest.mark.parametrize("sql", [
    "SELECT 1 AS \"'\" ; CREATE TABLE default.pwn (x Int8) ENGINE=Memory ; SELECT 2 AS \"'\"",
    "SELECT 1 AS \"'\" ; INSERT INTO tailscope.requests (trace_id) VALUES ('pwn') ; SELECT 2",
    "SELECT 1 INTO OUTFILE '{outfile}'",
    "SELECT * FROM file('/etc/hostname', 'LineAsString')",
    "SELECT count() FROM system.numbers",  # unbounded: refused by the read limits
])
def test_debug_query_cannot_write_read_files_or_run_unbounded(hard_server, sql, tmp_path):
    outfile = tmp_path / "out.txt"
    t0 = time.monotonic()
    r = debug_query(hard_server, sql.replace("{outfile}", str(outfile)))
    assert r.status_code == 400 and r.json()["error"]["param"] == "sql", r.text
    assert time.monotonic() - t0 < 10
    assert not outfile.exists()
    tables = debug_query(hard_server, "SELECT name FROM system.tables WHERE database IN "
                                      "('default', 'tailscope')").json()["rows"]
    assert ["pwn"] not in tables
    assert stored(hard_server, ["pwn"]) == 0


def test_nan_in_a_debug_answer_is_null_not_a_500(hard_server):
    """JSON has no NaN: an empty quantile or a 0/0 comes back as null (it was a 500)."""
    r = debug_query(hard_server, "SELECT nan AS x, [1.5, nan] AS y, 0 / 0 AS z, "
                                 "toDateTime64('1999-01-02 03:04:05', 6, 'UTC') AS t")
    assert r.status_code == 200, r.text
    assert r.json()["rows"] == [[None, [1.5, None], None, "1999-01-02T03:04:05+00:00"]]


def test_debug_query_takes_json_only(hard_server):
    body = json.dumps({"sql": "SELECT 1"})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", ""):
        r = httpx.post(f"{hard_server.url}/debug/query", content=body,
                       headers={"Content-Type": ctype} if ctype else {})
        assert r.status_code == 415, (ctype, r.text)
    ok = httpx.post(f"{hard_server.url}/debug/query", content=body,
                    headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200 and ok.json()["rows"] == [[1]]


def test_a_read_is_killed_when_its_client_leaves_and_health_stays_fast(hard_server):
    sql = "SELECT sum(sleepEachRow(0.00004)) FROM numbers(1000000) AS marker_for_kill"
    with pytest.raises(httpx.ReadTimeout):
        debug_query(hard_server, sql, timeout=1.5)
    assert health_ms(hard_server) < 500  # the event loop was never blocked

    def running() -> int:
        return debug_query(hard_server, "SELECT count() FROM system.processes WHERE "
                                        "query LIKE '%marker_for_kill%' AND query NOT LIKE "
                                        "'%system.processes%'").json()["rows"][0][0]

    # it would run ~40 s (20 s limit); gone within seconds of the client leaving
    assert wait_for(lambda: running() == 0, 4)


def _other_address() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def test_open_mode_serves_debug_endpoints_to_loopback_only(hard_server):
    addr = _other_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    port = hard_server.url.rsplit(":", 1)[1]
    remote = f"http://{addr}:{port}"
    r = httpx.post(f"{remote}/debug/query", json={"sql": "SELECT 1"})
    assert r.status_code == 403 and "loopback" in r.json()["error"]["message"]
    assert httpx.get(f"{remote}/debug/replicas").status_code == 403
    assert httpx.get(f"{hard_server.url}/debug/replicas").status_code == 200
    ok = httpx.post(f"{remote}/v1/completions", timeout=60,
                    json={"model": hard_server.model, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200  # the API itself is open in open mode, as documented


# ---- numbers the path can carry ---------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("seed", 1 << 63), ("seed", 1 << 64),
                                         ("top_k", 1 << 63), ("top_k", 1 << 64),
                                         ("top_k", 10 ** 6), ("max_tokens", 1 << 64),
                                         ("stop_token_ids", [1 << 64]), ("logprobs", 1 << 64)])
def test_out_of_range_numbers_are_a_400_and_take_no_slot(hard_server, field, value):
    r = post(hard_server, {"prompt": "Hi", "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == field, r.json()
    info = replicas(hard_server.url)["r0"]
    assert info["inflight"] == 0 and info["pending_tokens"] == 0
    ids = []
    for _ in range(2):  # normal requests still work and their rows still land
        trace_id = secrets.token_hex(16)
        ok = post(hard_server, {"prompt": "Hi", "max_tokens": 2, "seed": (1 << 63) - 1},
                  headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
        assert ok.status_code == 200
        ids.append(trace_id)
    assert wait_for(lambda: stored(hard_server, ids) == 2, 10)
    metrics = httpx.get(f"{hard_server.url}/metrics").text
    assert "tailscope:record_writer_alive 1.0" in metrics
    assert httpx.get(f"{hard_server.url}/ready").json()["record_writer"] == "alive"


def test_n_samples_with_the_largest_seed_stay_in_range(hard_server):
    r = post(hard_server, {"prompt": "Hi", "max_tokens": 2, "n": 3, "seed": (1 << 63) - 1,
                           "temperature": 1.0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


@pytest.mark.parametrize("raw,param", [
    ('{"model": "M", "prompt": "Hi", "temperature": Infinity}', "temperature"),
    ('{"model": "M", "prompt": "Hi", "top_p": NaN}', "top_p"),
    ('{"model": "M", "prompt": "a\\ud800b"}', "prompt"),
    ('{"model": "M", "prompt": "Hi", "logit_bias": {"\\u00b2": 1}}', "logit_bias"),
    ('{"model": "M", "prompt": "Hi", "x": ' + "[" * 5000 + "]" * 5000 + "}", None),
    ('{"model": "M", "prompt": "Hi", "x": ' + "[" * 100 + "]" * 100 + "}", None),
])
def test_malformed_values_are_a_400(hard_server, raw, param):
    raw = raw.replace('"M"', json.dumps(hard_server.model))
    r = httpx.post(f"{hard_server.url}/v1/completions", content=raw.encode(),
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("body,param", [
    ({"stop": [f"s{i}" for i in range(60_000)]}, "stop"),
    ({"stop": ["x" * 1000]}, "stop"),
    ({"logit_bias": {str(i): 1 for i in range(2000)}}, "logit_bias"),
    ({"stop_token_ids": list(range(2000))}, "stop_token_ids"),
])
def test_oversized_lists_are_a_400_and_never_stall_the_loop(hard_server, body, param):
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(
        r=post(hard_server, {"prompt": "Hi", "max_tokens": 64, **body})))
    t.start()
    slowest = max(health_ms(hard_server) for _ in range(5))
    t.join(30)
    assert result["r"].status_code == 400 and result["r"].json()["error"]["param"] == param
    assert slowest < 500


def test_a_long_prompt_is_tokenized_without_stalling_other_requests(hard_server):
    text = "The quick brown fox jumps over the lazy dog. " * 22_000  # ~1 MB, ~0.5 s to tokenize
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=post(hard_server, {
        "prompt": text, "max_tokens": 2})))
    t.start()
    slowest = 0.0
    while t.is_alive():  # for as long as the request is being read and tokenized
        slowest = max(slowest, health_ms(hard_server))
    t.join(60)
    r = result["r"]
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    assert slowest < 300


def test_too_many_messages_are_a_400(hard_server):
    msgs = [{"role": "user", "content": "hi"}] * 3000
    r = post(hard_server, {"messages": msgs, "max_tokens": 2}, path="/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


# ---- one request's bad state stays its own ----------------------------------------------------
def test_a_bad_request_never_fails_an_innocent_stream(hard_server):
    lines: list[str] = []

    def innocent():
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{hard_server.url}/v1/"
                                                           "completions", json={
                "model": hard_server.model, "prompt": "Once upon a time", "max_tokens": 200,
                "stream": True, "ignore_eos": True}) as r:
            lines.extend(x for x in r.iter_lines() if x)

    t = threading.Thread(target=innocent)
    t.start()
    time.sleep(0.3)
    bad = post(hard_server, {"prompt": "Once", "max_tokens": 5, "top_k": 10 ** 6,
                             "temperature": 1.0})
    t.join(60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k"
    assert lines[-1] == "data: [DONE]"
    # each event parsed: an error event has an "error" key; the text itself may be "error"
    # (the tiny model's random weights can sample that very token, 2742, and a substring check on
    # the raw lines read `"text":"error"` as a failure)
    events = [e for e in map(sse_json, lines) if e is not None]
    errors = [e for e in events if "error" in e]
    assert not errors, errors
    assert all(e["object"] == "text_completion" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_minus_infinity_logprobs_are_clamped_and_valid_json(hard_server):
    body = {"prompt": "Once upon a time", "max_tokens": 4, "logprobs": 5, "top_k": 1,
            "temperature": 1.0, "ignore_eos": True}
    r = post(hard_server, body)
    assert r.status_code == 200, r.text
    top = r.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert all(min(t.values()) == -9999.0 for t in top)  # top_k=1 masks the other four
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{hard_server.url}/v1/completions",
            json={"model": hard_server.model, **body, "stream": True}) as s:
        lines = [x for x in s.iter_lines() if x.startswith("data: {")]
    assert lines and not any("Infinity" in x or "NaN" in x for x in lines)
    for x in lines:
        json.loads(x[6:], parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    chat = post(hard_server, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                              "logprobs": True, "top_logprobs": 3, "top_k": 1,
                              "temperature": 1.0}, path="/v1/chat/completions")
    assert chat.status_code == 200
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert {t["logprob"] for c in content for t in c["top_logprobs"]} >= {-9999.0}


# ---- the edge: bodies, paths, schemas, clients that leave -------------------------------------
def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(hard_server):
    port = int(hard_server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                  b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        sent = 0
        s.settimeout(0.05)
        answer = b""
        while sent < 48 << 20 and not answer:
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
            except OSError:  # the server answered and closed: stop sending
                break
            try:
                answer = s.recv(4096)
            except TimeoutError:
                pass
        s.settimeout(10)
        answer += s.recv(4096) if not answer else b""
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 8 << 20  # answered after about 1 MiB, not after the whole 48 MiB


def test_unknown_api_paths_make_no_records_and_no_metric_labels(hard_server):
    for i in range(20):
        r = httpx.post(f"{hard_server.url}/v1/nope{i}", json={})
        assert r.status_code == 404
    metrics = httpx.get(f"{hard_server.url}/metrics").text
    endpoints = {line.split('endpoint="')[1].split('"')[0] for line in metrics.splitlines()
                 if line.startswith("tailscope:http_requests_total{")}
    assert endpoints <= {"/v1/chat/completions", "/v1/completions"}, endpoints
    time.sleep(1.0)  # past the store's flush age
    r = debug_query(hard_server, "SELECT count() FROM tailscope.requests WHERE "
                                 "startsWith(endpoint, '/v1/nope')")
    assert r.json()["rows"] == [[0]]


def test_schemas_are_bounded_and_compiled_off_the_event_loop(hard_server):
    too_big = {"type": "string", "enum": [f"value-{i:06d}" for i in range(8000)]}
    r = post(hard_server, {"prompt": "Hi", "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": too_big}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    big = {"type": "string", "enum": [f"value-{i:06d}" for i in range(3500)]}  # ~60 KB
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=post(hard_server, {
        "prompt": "Hi", "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": big}}})))
    t.start()
    slowest = max(health_ms(hard_server) for _ in range(10))
    t.join(120)
    assert result["r"].status_code == 200, result["r"].text
    assert slowest < 500


def test_a_non_streamed_request_is_cancelled_when_its_client_leaves(hard_server):
    before = replicas(hard_server.url)["r0"]["ended"].get("CANCELLED", 0)
    with pytest.raises(httpx.ReadTimeout):
        post(hard_server, {"prompt": "Once upon a time", "max_tokens": 1000, "n": 16,
                           "ignore_eos": True}, timeout=0.5)
    assert wait_for(lambda: replicas(hard_server.url)["r0"]["ended"].get("CANCELLED", 0)
                    == before + 16, 3), replicas(hard_server.url)
    assert wait_for(lambda: replicas(hard_server.url)["r0"]["inflight"] == 0, 2)


def test_sigterm_during_a_long_read_stops_the_gateway_at_once(bundled_path):
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path))
    try:
        t = threading.Thread(target=lambda: httpx.post(
            f"{server.url}/debug/query", timeout=120,
            json={"sql": "SELECT sum(sleepEachRow(0.00004)) FROM numbers(1000000)"}))
        t.start()
        time.sleep(1.0)  # the read runs (~40 s unless killed; its limit is 30 s)
        t0 = time.monotonic()
        server.proc.terminate()
        server.proc.wait(timeout=30)
        assert time.monotonic() - t0 < 10
        t.join(10)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


# ---- supervision ------------------------------------------------------------------------------
@pytest.fixture
def pair(bundled_path):
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                          "--replicas", "2",
                          env={"TAILSCOPE_HEARTBEAT_TIMEOUT_S": "3",
                               "TAILSCOPE_REQUEST_TIMEOUT_S": "2"})
    yield server
    stop_server(server)


def test_a_killed_replica_never_stops_the_other_from_serving(pair):
    pid = replicas(pair.url)["r1"]["pid"]
    psutil.Process(pid).kill()
    for _ in range(6):  # at once, while r1 is dead and then restarting
        r = post(pair, {"prompt": "Hi", "max_tokens": 2}, timeout=20)
        assert r.status_code == 200, r.text
    assert httpx.get(f"{pair.url}/ready").status_code == 200
    # the watchdog may not have seen the death yet (it looks every 0.2 s): wait for the restart
    assert wait_for(lambda: (i := replicas(pair.url)["r1"])["restarts"] == 1
                    and i["state"] == "ready", 120)
    info = replicas(pair.url)["r1"]
    assert info["restarts"] == 1 and info["pid"] != pid and "exited" in info["last_failure"]


def test_a_stopped_replica_is_drained_its_request_ends_504_and_it_restarts(pair):
    pid = replicas(pair.url)["r1"]["pid"]
    with httpx.Client(timeout=30) as http, http.stream(
            "POST", f"{pair.url}/v1/completions", json={
                "model": pair.model, "prompt": "Once upon a time", "max_tokens": 900,
                "stream": True, "ignore_eos": True}) as held:
        lines = held.iter_lines()
        next(lines)  # r0 holds a long request: the next one goes to r1
        assert replicas(pair.url)["r0"]["inflight"] == 1
        psutil.Process(pid).suspend()  # SIGSTOP: alive, silent
        t0 = time.monotonic()
        stuck = post(pair, {"prompt": "A different prompt", "max_tokens": 4}, timeout=30)
        waited = time.monotonic() - t0
    assert stuck.status_code == 504 and stuck.json()["error"]["code"] == "timeout", stuck.text
    assert waited < 5  # the gateway's own deadline (2 s), not the client's
    assert wait_for(lambda: replicas(pair.url)["r1"]["state"] != "ready", 6)
    info = replicas(pair.url)["r1"]
    assert "stalled" in info["last_failure"] and not psutil.pid_exists(pid) or \
        psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    ok = post(pair, {"prompt": "Hi", "max_tokens": 2}, timeout=20)
    assert ok.status_code == 200  # served by r0 meanwhile
    assert wait_for(lambda: replicas(pair.url)["r1"]["state"] == "ready", 120)
    assert replicas(pair.url)["r1"]["restarts"] == 1


def test_sigkill_of_the_gateway_under_load_loses_only_the_last_flush_window(bundled_path):
    """Documented: a gateway killed without a chance to drain loses at most the records of its
    last TAILSCOPE_STORE_FLUSH_S seconds (plus the batch being inserted)."""
    flush_s = 0.5
    store = f"chdb://{tempfile.mkdtemp(prefix='tailscope-sigkill-')}/store"
    env = {"TAILSCOPE_STORE_DSN": store, "TAILSCOPE_STORE_FLUSH_S": str(flush_s)}
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path), env=env)
    client = subprocess.Popen([sys.executable, "-c", LOAD, server.url, server.model],
                              stdout=subprocess.PIPE, text=True)
    time.sleep(4.0)
    children = psutil.Process(server.proc.pid).children(recursive=True)
    killed_at = time.time()
    server.proc.kill()
    server.proc.wait(timeout=30)
    out, _ = client.communicate(timeout=60)
    answered = [(tid, float(ts)) for tid, ts in (line.split() for line in out.splitlines())]
    assert len(answered) >= 10
    assert wait_for(lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE
                                    for c in children), 10)  # its replicas went with it
    server = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path), env=env)
    try:
        r = debug_query(server, "SELECT trace_id FROM tailscope.requests")
        landed = {t for (t,) in r.json()["rows"]}
    finally:
        stop_server(server)
    old = [tid for tid, ts in answered if ts < killed_at - flush_s - 1.0]
    assert old and set(old) <= landed, len(set(old) - landed)


def test_the_store_and_spool_are_private_to_the_gateway_user(hard_server):
    dsn = psutil.Process(hard_server.proc.pid).environ()["TAILSCOPE_STORE_DSN"]
    store = Path(dsn[len("chdb://"):])
    for path in (store, Path(f"{store}-spool")):
        assert (path.stat().st_mode & 0o077) == 0, (path, oct(path.stat().st_mode))


def test_cors_lets_an_allowed_page_call_the_api_but_never_read_the_debug_endpoints(hard_server):
    """TAILSCOPE_CORS_ORIGINS: a browser page of an allowed origin gets its preflight granted
    and may read the API's answers and the trace id header; another origin is refused. Even
    for an allowed origin, /debug/* and /metrics grant nothing: in open local mode they answer
    loopback clients, and a browser on the gateway's host is one."""
    url = hard_server.url
    preflight = {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    ok = httpx.options(f"{url}/v1/chat/completions", headers=preflight, timeout=10)
    assert ok.status_code == 200, ok.text
    assert ok.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in ok.headers
    r = post(hard_server, {"prompt": "Hi", "max_tokens": 2}, headers={"Origin": APP_ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
    exposed = r.headers["access-control-expose-headers"].lower()
    assert "x-tailscope-trace-id" in exposed and r.headers["x-tailscope-trace-id"]
    bad = post(hard_server, {"prompt": "Hi", "max_tokens": 2, "bogus": 1},
               headers={"Origin": APP_ORIGIN})  # an error answer is readable too
    assert bad.status_code == 400 and bad.headers["access-control-allow-origin"] == APP_ORIGIN
    other = httpx.options(f"{url}/v1/chat/completions",
                          headers={**preflight, "Origin": "http://evil.example"}, timeout=10)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    plain = post(hard_server, {"prompt": "Hi", "max_tokens": 2},
                 headers={"Origin": "http://evil.example"})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
    trace_id = r.headers["x-tailscope-trace-id"]
    for method, path in (("OPTIONS", "/debug/query"), ("GET", f"/debug/requests/{trace_id}"),
                         ("GET", "/debug/config"), ("GET", "/metrics")):
        got = httpx.request(method, f"{url}{path}", headers=preflight, timeout=10)
        assert "access-control-allow-origin" not in got.headers, (path, got.headers)
    assert httpx.get(f"{url}/debug/config", timeout=10).status_code == 200  # loopback: served


def test_cors_origins_that_could_never_match_are_refused_at_start():
    from tailscope.cli import cors_origins

    assert cors_origins("") == ()
    assert cors_origins(" http://a.example:3000/ ,https://b.example") == (
        "http://a.example:3000", "https://b.example")
    assert cors_origins("*") == ("*",)
    for bad in ("localhost:3000", "http://a.example/app", "ftp://a.example", "http://"):
        with pytest.raises(ValueError, match="TAILSCOPE_CORS_ORIGINS"):
            cors_origins(bad)
