"""KV lifecycle over real HTTP: prefix-cache hits in the records (and TTFT) on the bundled
model, tenant namespaces, and a storm of 500 requests (cancellations, disconnects, queue
timeouts, preemptions, n > 1) after which every block is back and every request has one
terminal record."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.gateway.conftest import start_server, stop_server

ADMIN = "admin-secret-0123456789"
TENANTS = """
[[tenants]]
name = "acme"
keys = ["k-acme"]
[[tenants]]
name = "globex"
keys = ["k-globex"]
[[tenants]]
name = "pub1"
keys = ["k-pub1"]
cache_namespace = "public"
[[tenants]]
name = "pub2"
keys = ["k-pub2"]
cache_namespace = "public"
"""
# ~480 tokens of system prompt shared by the requests below
SYSTEM = " ".join(f"Rule {i}: answer briefly, politely and only about item {i}." for i in range(40))


def record(server, trace_id: str) -> dict:
    r = httpx.get(f"{server.url}/debug/requests/{trace_id}",
                  headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    return r.json()["record"]


def chat(server, key: str, question: str, stream: bool = False) -> tuple[str, httpx.Response]:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": server.model, "max_tokens": 4, "temperature": 0,
                         "stream": stream,
                         "messages": [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return r.headers["x-tailscope-trace-id"], r


@pytest.fixture(scope="module")
def bundled_server(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("kv") / "tenants.toml"
    cfg.write_text(TENANTS)
    server = start_server("--config", str(cfg), env={"TAILSCOPE_ADMIN_KEY": ADMIN})
    server.model = "SmolLM2-135M-Instruct"
    yield server
    stop_server(server)


def test_a_shared_prefix_is_not_prefilled_again_and_answers_sooner(bundled_server):
    s = bundled_server
    first_id, first = chat(s, "k-acme", "What is item 3?", stream=True)
    second_id, second = chat(s, "k-acme", "What is item 7?", stream=True)
    a, b = record(s, first_id), record(s, second_id)
    assert a["prompt_tokens"] > 400 and a["cached_tokens"] == 0
    # everything up to the last full block of the shared system prompt is reused
    assert b["cached_tokens"] >= 400 and b["cached_tokens"] % 16 == 0
    assert b["prompt_tokens"] - b["cached_tokens"] < 64  # the prefilled part is the question
    assert b["ttft_ms"] < a["ttft_ms"]
    assert b["prefill_ms"] < a["prefill_ms"]
    metrics = httpx.get(f"{s.url}/metrics").text
    hits = [float(line.split()[-1]) for line in metrics.splitlines()
            if line.startswith("tailscope:prefix_cache_hits_total")]
    assert hits and sum(hits) >= b["cached_tokens"]


def test_tenants_only_hit_their_own_or_an_opted_in_shared_namespace(bundled_server):
    s = bundled_server
    question = "Which item is the first one?"
    base = record(s, chat(s, "k-acme", question)[0])
    other = record(s, chat(s, "k-globex", question)[0])
    assert other["cached_tokens"] == 0  # same prompt, another tenant: no hit
    again = record(s, chat(s, "k-acme", question)[0])
    p = again["prompt_tokens"]
    assert again["cached_tokens"] == min(p // 16 * 16, p - 1)  # every full block
    chat(s, "k-pub1", question)
    shared = record(s, chat(s, "k-pub2", question)[0])
    assert shared["cached_tokens"] >= 400  # both opted into "public"
    assert base["output_token_ids"] == other["output_token_ids"] == again["output_token_ids"]


STORM_CONFIG = """
name: storm
model: tiny:49152
engine: {dtype: float32, block_size: 4, num_kv_blocks: 160, max_num_seqs: 16,
         max_batched_tokens: 32, preemption: auto}
"""


async def storm(url: str, n: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 40000) for _ in range(rng.randrange(8, 40))]
                for _ in range(4)]
    outcomes: dict[str, int] = {}
    gate = asyncio.Semaphore(48)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        prompt = rng.choice(prefixes) + [rng.randrange(100, 40000)
                                         for _ in range(rng.randrange(1, 30))]
        body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt,
                "max_tokens": rng.randrange(2, 40), "temperature": rng.choice([0, 0.8]),
                "seed": i, "n": rng.choice([1, 1, 1, 2, 3]), "ignore_eos": True,
                "stream": rng.random() < 0.5}
        kind = rng.choices(["normal", "disconnect", "client_timeout"], [0.8, 0.1, 0.1])[0]
        headers = {"x-tailscope-bench-run": f"storm-{seed}"}
        async with gate:
            try:
                if kind == "client_timeout":
                    # only the wait for the answer is short: a connect or write timeout of
                    # 10 ms could give up before the request reached the gateway at all, and
                    # a request never received has no record to count
                    await client.post("/v1/completions", json=body, headers=headers,
                                      timeout=httpx.Timeout(120, read=rng.uniform(0.01, 0.3)))
                elif kind == "disconnect":
                    body["stream"] = True
                    async with client.stream("POST", "/v1/completions", json=body,
                                             headers=headers) as r:
                        async for _ in r.aiter_lines():
                            break  # go away after the first line
                else:
                    r = await client.post("/v1/completions", json=body, headers=headers)
                    outcomes[str(r.status_code)] = outcomes.get(str(r.status_code), 0) + 1
                    return
            except httpx.TimeoutException:
                pass
            outcomes[kind] = outcomes.get(kind, 0) + 1

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(*(one(i, client) for i in range(n)))
    return outcomes


def test_a_storm_returns_every_block_and_records_every_request_once(tmp_path, bundled_path):
    cfg = tmp_path / "storm.yaml"
    cfg.write_text(STORM_CONFIG)
    server = start_server("--engine-config", str(cfg), "--tokenizer", str(bundled_path),
                          "--queue-timeout", "3", "--max-inflight", "400")
    try:
        outcomes = asyncio.run(storm(server.url, 500, seed=5))
        assert outcomes.get("200", 0) > 200, outcomes
        # one more request after the storm: the replica reports its books after it
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": "SmolLM2-135M-Instruct", "prompt": [5, 6, 7],
                             "max_tokens": 2})
        assert r.status_code == 200
        deadline = time.monotonic() + 30
        while True:
            rep = httpx.get(f"{server.url}/debug/replicas").json()["r0"]
            if (rep["inflight"] == 0 and rep["kv_blocks_used"] == 0) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        books = rep["kv_books"]
        assert rep["restarts"] == 0
        assert rep["kv_blocks_used"] == 0 and books["reserved"] == 0, rep
        # every block handed out (or taken back from the cache) was released exactly once
        assert books["allocated"] + books["revived"] == books["released"], books
        assert books["preemptions"] > 0 and books["hits"] > 0, books

        def rows() -> list:
            q = httpx.post(f"{server.url}/debug/query", json={
                "sql": "SELECT trace_id, count() AS c, any(final_state) AS s, "
                       "max(preemptions) AS p FROM tailscope.requests WHERE bench_run = "
                       "'storm-5' GROUP BY trace_id"}, timeout=60)
            assert q.status_code == 200, q.text
            return q.json()["rows"]

        deadline = time.monotonic() + 30
        while len(got := rows()) < 500 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(got) == 500
        assert all(c == 1 for _, c, _, _ in got)
        terminal = {"FINISHED", "CANCELLED", "TIMED_OUT", "REJECTED", "FAILED"}
        assert {s for _, _, s, _ in got} <= terminal
        assert not any(s == "FAILED" for _, _, s, _ in got)
        assert any(p > 0 for _, _, _, p in got)  # preempted requests say so in their record
    finally:
        stop_server(server)
