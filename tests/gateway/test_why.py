"""Why a request was slow, over real HTTP: a victim tenant's stream decodes while another tenant's
long prompts are prefilled in chunks beside it; ``tracing.why`` on the victim names those
requests and that tenant as the prefill in its slowest gaps. A victim alone names nobody."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.gateway.conftest import start_server, stop_server
from tests.gateway.test_faults import wait_for
from tracing import queries as Q
from tracing import why as W

TENANTS = """
[[tenants]]
name = "victim"
keys = ["sk-victim"]
admin = true

[[tenants]]
name = "globex"
keys = ["sk-globex"]
"""
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory, bundled_path):
    cfg = tmp_path_factory.mktemp("why") / "tenants.toml"
    cfg.write_text(TENANTS)
    s = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path), "--config",
                     str(cfg), "--max-batched-tokens", "32", "--no-prefix-caching")
    yield s
    stop_server(s)


def victim(server, noisy: bool, burst: int = 3, tokens: int = 120) -> str:
    """Streams the victim; with ``noisy``, globex sends ``burst`` long prompts once it decodes.
    The burst's client (and its connections) exist before the victim starts: the victim's 120
    tokens take ~100-150 ms here, and a fresh ``httpx.post`` per prompt (a client and its TLS
    context each, three threads taking turns with the GIL) once sent them after it had ended,
    so no slow gap had a neighbour. ``tokens``: the victim's length (a longer one leaves the
    burst's threads more time to be sent while it decodes)."""
    long_prompt = " ".join(f"word{i}" for i in range(90))  # 260 tokens: 9 chunks
    threads = []
    with httpx.Client(timeout=120, headers={"Authorization": "Bearer sk-globex"},
                      limits=httpx.Limits(max_keepalive_connections=burst)) as globex:
        if noisy:  # its connections opened ahead (a request the gateway answers at once)
            warm = [threading.Thread(target=globex.get, args=(f"{server.url}/health",))
                    for _ in range(burst)]
            for t in warm:
                t.start()
            for t in warm:
                t.join()
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, headers={
                "Authorization": "Bearer sk-victim"}, json={
                "model": MODEL, "prompt": "Count slowly:", "max_tokens": tokens, "ignore_eos": True,
                "stream": True}) as r:
            trace_id = r.headers["x-tailscope-trace-id"]
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # it is decoding now
            if noisy:
                for _ in range(burst):
                    t = threading.Thread(target=globex.post, args=(
                        f"{server.url}/v1/completions",), kwargs={"json": {
                            "model": MODEL, "prompt": long_prompt, "max_tokens": 2}})
                    t.start()
                    threads.append(t)
            for _ in lines:
                pass
        for t in threads:
            t.join()
    return trace_id


def why(server, trace_id: str, top: int = 5, tokens: int = 120):
    source = Q.GatewaySource(server.url, admin_key="sk-victim")
    assert wait_for(lambda: Q.records_found(source, [trace_id]) == 1, 10)
    # the steps are flushed by the same writer in their own batches, maybe after the record:
    # wait until every gap between the victim's tokens has its steps (a fixed second once
    # let a loaded CI run read the early steps only, so no gap it saw had the burst in it)
    assert wait_for(lambda: len(W.why(source, trace_id, top=1000)[0]) == tokens - 1, 15)
    return W.why(source, trace_id, top=top)


def test_why_names_the_neighbour_tenant_whose_prefill_sat_in_the_slowest_gaps(server):
    # 480 tokens: with 120 (~130 ms here) a loaded CI run once sent the burst after the victim
    # had ended, and no gap had a neighbour
    trace_id = victim(server, noisy=True, tokens=480)
    gaps, sentence = why(server, trace_id, top=20, tokens=480)
    assert not gaps.empty, sentence
    crowded = gaps[gaps["neighbour_prefill_tokens"] > 0]
    assert len(crowded) >= 1, gaps
    assert all(t == ["globex"] for t in crowded["neighbour_tenants"]), gaps
    # each gap splits into its steps' time and the time between steps (the engine idle or
    # descheduled): on 2 shared cores some slow gaps are the latter, and the table says so
    assert ((gaps["step_ms"] + gaps["idle_ms"] - gaps["gap_ms"]).abs() < 1e-6).all()
    assert "tenant globex" in sentence and "prefill chunks of" in sentence, sentence
    neighbours = {t for n in crowded["neighbours"] for t in n}
    assert trace_id not in neighbours and 1 <= len(neighbours) <= 3
    # the same answer from GET /debug/requests/{id} and from `tailscope why`
    got = httpx.get(f"{server.url}/debug/requests/{trace_id}?top=20",
                    headers={"Authorization": "Bearer sk-victim"}).json()
    assert "tenant globex" in got["why"]["sentence"] and got["why"]["gaps"]
    cli = subprocess.run([sys.executable, "-m", "tailscope.cli", "why", trace_id, "--url",
                          server.url, "--top", "20"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "TAILSCOPE_ADMIN_KEY": "sk-victim"})
    assert cli.returncode == 0 and "tenant globex" in cli.stdout, cli.stderr[-500:]
    unknown = subprocess.run([sys.executable, "-m", "tailscope.cli", "why", "0" * 32, "--url",
                              server.url], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "TAILSCOPE_ADMIN_KEY": "sk-victim"})
    assert unknown.returncode == 1 and "no record for trace" in unknown.stderr, unknown.stdout


def test_a_victim_alone_names_no_neighbour(server):
    trace_id = victim(server, noisy=False)
    gaps, sentence = why(server, trace_id)
    assert not gaps.empty and (gaps["neighbour_prefill_tokens"] == 0).all(), gaps
    assert "no other request's prefill" in sentence, sentence


def test_the_record_names_the_neighbour_and_compare_windows_ranks_it_first(server):
    """The victim alone, then with globex's burst: its record names globex as the neighbour
    tenant (none alone), and the window comparison by neighbour tenant compares globex's
    requests with the base window as a whole, stage by stage, adding up to the records' own
    difference.

    Whether the burst made this victim slower is not asserted: on the tiny model its 1,560
    prefill tokens add ~0-80 ms to a 150-320 ms stream, within what one lone run varies by on
    2 cores (CI saw a lone run the slower, twice); what is asserted is the arithmetic the
    comparison does on whatever the two runs measured."""
    source = Q.GatewaySource(server.url, admin_key="sk-victim")
    t0 = time.time()
    alone = victim(server, noisy=False)
    t1 = time.time()
    noisy = victim(server, noisy=True, burst=6)
    t2 = time.time()
    assert wait_for(lambda: Q.records_found(source, [alone, noisy]) == 2, 10)
    recs = {t: httpx.get(f"{server.url}/debug/requests/{t}", headers={
        "Authorization": "Bearer sk-victim"}).json()["record"] for t in (alone, noisy)}
    assert (recs[alone]["neighbour_tenant"], recs[alone]["neighbour_prefill_tokens"]) == ("", 0)
    assert recs[noisy]["neighbour_tenant"] == "globex"
    assert recs[noisy]["neighbour_prefill_tokens"] > 0
    cmp = Q.compare_windows(source, (t0, t1), (t1, t2), metric="e2e_ms", by="neighbour_tenant",
                            filters={"tenant": "victim"})
    assert set(cmp["neighbour_tenant"]) == {"globex"}, cmp  # the one value the suspect had
    assert (cmp["weight"] == 1.0).all(), cmp
    stages = cmp.set_index("column")
    for column in Q.STAGES["e2e_ms"]:  # each stage: the noisy record's against the lone one's
        assert stages.loc[column, "base_ms"] == pytest.approx(recs[alone][column], abs=1e-3)
        assert stages.loc[column, "suspect_ms"] == pytest.approx(recs[noisy][column], abs=1e-3)
    assert cmp["weighted_ms"].sum() == pytest.approx(
        recs[noisy]["e2e_ms"] - recs[alone]["e2e_ms"], abs=1e-3), cmp
    assert list(cmp["weighted_ms"]) == sorted(cmp["weighted_ms"], reverse=True), cmp


# ---- why it waited, over HTTP ----------------------------------------------------------------
@pytest.fixture(scope="module")
def small_pool(bundled_path):
    # 64 blocks of 16 tokens: "holder" takes 19 and grows to 63 as it decodes 700 tokens, so
    # "blocked" (50 blocks) waits for KV until it ends; "behind" (1 block) would fit but
    # arrives after "blocked"
    s = start_server("--model", "tiny:49152", "--tokenizer", str(bundled_path),
                     "--num-kv-blocks", "64", "--block-size", "16", "--max-model-len", "1024",
                     "--max-batched-tokens", "1024", "--no-prefix-caching")
    yield s
    stop_server(s)


def completion(url: str, prompt: list[int], max_tokens: int, out: dict, key: str) -> None:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    out[key] = r.headers["x-tailscope-trace-id"]


def test_a_wait_for_kv_names_its_holders_and_the_one_behind_it_names_the_head(small_pool):
    url, ids = small_pool.url, {}
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": list(range(100, 400)), "max_tokens": 700,
            "ignore_eos": True, "stream": True}) as r:
        ids["holder"] = r.headers["x-tailscope-trace-id"]
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # it is decoding now
        threads = []
        for key, prompt, n in (("blocked", list(range(500, 1300)), 2), ("behind", [7, 8], 2)):
            t = threading.Thread(target=completion, args=(url, prompt, n, ids, key))
            t.start()
            threads.append(t)
            time.sleep(0.2)  # in this order
        for _ in lines:
            pass
    for t in threads:
        t.join()

    def got(key):
        assert wait_for(lambda: httpx.get(f"{url}/debug/requests/{ids[key]}").status_code
                        == 200, 10)
        return httpx.get(f"{url}/debug/requests/{ids[key]}").json()

    for key in ids:  # the identity, for every request
        rec = got(key)["record"]
        causes = sum(rec[c] for c in ("wait_step_ms", "wait_budget_ms", "wait_kv_ms",
                                      "wait_seqs_ms", "wait_hol_ms"))
        assert causes == pytest.approx(rec["engine_queue_ms"] + rec["preempted_ms"],
                                       abs=0.01), (key, rec)
    blocked = got("blocked")
    assert blocked["record"]["wait_kv_ms"] > 0, blocked["events"]
    notes = [e["detail"] for e in blocked["events"] if e["state"] == "WAIT"]
    assert notes[0].startswith("kv:") and ids["holder"] in notes[0], notes
    behind = got("behind")
    assert behind["record"]["wait_hol_ms"] > 0, (behind["events"], blocked["events"])
    notes = [e["detail"] for e in behind["events"] if e["state"] == "WAIT"]
    assert any(n.startswith("hol:") and ids["blocked"] in n for n in notes), notes
    # /debug/requests answers from the gateway's memory; why reads the store (its flush
    # interval later: a full CI run once asked before the record was there)
    source = Q.GatewaySource(url)
    assert wait_for(lambda: Q.records_found(source, [ids["blocked"]]) == 1, 10)
    _, sentence = W.why(source, ids["blocked"])
    assert "for KV blocks (held by " + ids["holder"] in sentence, sentence


@pytest.mark.bundled
def test_a_request_that_arrives_during_a_step_waits_for_it_in_its_record():
    """The replica reads its inbox between steps: a request sent while a long prefill step runs
    waits for that step. Its record must say so (engine queue time with cause 'step'), and the
    engine's timeline must sit where it happened: the first token reaches the client soon
    after the engine produced it (before the replica's timeline was anchored at the send, so
    the wait vanished from the queue and reappeared between first token and first flush)."""
    s = start_server("--max-batched-tokens", "1024", "--max-model-len", "2048",
                     env={"TAILSCOPE_THREADS": "1", "TAILSCOPE_DTYPE": "bfloat16"})
    try:
        ids: dict[str, str] = {}
        long = threading.Thread(target=completion, args=(s.url, list(range(200, 900)), 2, ids,
                                                         "long"))
        long.start()
        time.sleep(0.15)  # its one 700-token prefill step is running now (~0.5 s here)
        completion(s.url, [7, 8, 9], 2, ids, "short")
        long.join()

        def got(key):
            assert wait_for(lambda: httpx.get(f"{s.url}/debug/requests/{ids[key]}")
                            .status_code == 200, 10)
            return httpx.get(f"{s.url}/debug/requests/{ids[key]}").json()

        short, long_ = got("short"), got("long")
        rec = short["record"]
        assert rec["wait_step_ms"] > 150, short["events"]  # the rest of the long step
        causes = sum(rec[c] for c in ("wait_step_ms", "wait_budget_ms", "wait_kv_ms",
                                      "wait_seqs_ms", "wait_hol_ms", "wait_share_ms"))
        assert causes == pytest.approx(rec["engine_queue_ms"] + rec["preempted_ms"], abs=0.01)
        for r in (short, long_):
            ev = {e["state"]: e["ts_us"] for e in r["events"]}
            assert ev["ROUTED"] <= ev["QUEUED"] <= ev["DECODING"] <= ev["FIRST_FLUSH"]
            # the first token left the engine at DECODING: the client had it soon after (41-84
            # ms measured alone, 107 ms once in a full CI run; before the fix the short
            # request's gap was the rest of the long step, ~350 ms)
            assert ev["FIRST_FLUSH"] - ev["DECODING"] < 200_000, r["events"]
    finally:
        stop_server(s)
