"""Replay of recorded requests (``POST /debug/replay``, ``tailscope replay``) on the bundled
model in batch-invariant mode: identical under the recorded config whatever else runs beside
it, the first divergence under another dtype, and a clear refusal for a record without token
ids. The records and the ``configs`` table hold everything a replay needs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from engine.sampling_params import SamplingParams
from tailscope import engine_config
from tests.gateway.conftest import start_server, stop_server
from tracing import replay as R

ADMIN = "sk-admin-replay-0123456789"
TENANTS = """
[[tenants]]
name = "alpha"
keys = ["sk-alpha"]
admin = true

[[tenants]]
name = "private"
keys = ["sk-private"]
capture = "counts"
"""
CONFIG = """
name: bundled-bi
model: bundled
engine: {batch_invariant: true, kv_cache_mb: 64, max_num_seqs: 16}
"""
BF16 = """
name: bundled-bi-bf16
model: bundled
engine: {batch_invariant: true, kv_cache_mb: 64, max_num_seqs: 16, dtype: bfloat16}
"""
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
CASES = {
    "chat-greedy": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 16}),
    "chat-seeded": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Write a haiku about the sea."}],
        "temperature": 1.0, "seed": 7, "max_tokens": 40, "ignore_eos": True}),
    "completion-stop": ("/v1/completions", {
        "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "temperature": 0, "max_tokens": 24,
        "stop": [" 11"], "presence_penalty": 0.5, "logit_bias": {"28": 1.5}}),
    "chat-json-schema": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Describe a cat as JSON with a name and age."}],
        "temperature": 0.7, "seed": 3, "max_tokens": 40,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "cat", "schema": SCHEMA}}}),
    "completion-n3": ("/v1/completions", {
        "prompt": "Once upon a time", "temperature": 0.9, "seed": 11, "n": 3,
        "max_tokens": 16, "top_p": 0.9, "stop_token_ids": [13]}),
}


@pytest.fixture(scope="module")
def replay_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay")
    (d / "tenants.toml").write_text(TENANTS)
    (d / "bi.yaml").write_text(CONFIG)
    (d / "bf16.yaml").write_text(BF16)
    server = start_server("--engine-config", str(d / "bi.yaml"),
                          "--config", str(d / "tenants.toml"),
                          env={"TAILSCOPE_ADMIN_KEY": ADMIN})
    server.dir = d
    yield server
    stop_server(server)


async def _send_all(url: str, key: str) -> dict[str, str]:
    """Every case at once (they share engine steps); case -> trace id."""
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 headers={"Authorization": f"Bearer {key}"}) as c:
        async def one(name):
            path, body = CASES[name]
            r = await c.post(path, json={"model": "SmolLM2-135M-Instruct", **body})
            assert r.status_code == 200, (name, r.text)
            return name, r.headers["x-tailscope-trace-id"]

        return dict(await asyncio.gather(*(one(n) for n in CASES)))


@pytest.fixture(scope="module")
def recorded(replay_server):
    return asyncio.run(_send_all(replay_server.url, "sk-alpha"))


def _replay(server, trace_id: str, key: str = "sk-alpha", **body) -> httpx.Response:
    return httpx.post(f"{server.url}/debug/replay", json={"trace_id": trace_id, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=300)


def _record(server, trace_id: str) -> dict:
    r = httpx.get(f"{server.url}/debug/requests/{trace_id}",
                  headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["record"]


@pytest.mark.bundled
def test_the_record_keeps_the_sampling_params_and_the_store_keeps_the_config(replay_server,
                                                                              recorded):
    rec = _record(replay_server, recorded["completion-stop"])
    sp = json.loads(rec["sampling_params"])
    assert sp["stop"] == [" 11"] and sp["n"] == 1 and sp["scoring"] is False
    engine = SamplingParams(**{**sp["engine"], "structured": None,
                               "logit_bias": {int(k): v for k, v in
                                              sp["engine"]["logit_bias"].items()},
                               "stop_token_ids": tuple(sp["engine"]["stop_token_ids"])})
    assert engine.presence_penalty == 0.5 and engine.logit_bias == {28: 1.5}
    js = json.loads(_record(replay_server, recorded["chat-json-schema"])["sampling_params"])
    assert json.loads(js["engine"]["structured"]["schema"])["required"] == ["name", "age"]
    assert json.loads(_record(replay_server, recorded["completion-n3"])["sampling_params"]
                      )["engine"]["stop_token_ids"] == [13]
    config = R.fetch_config(replay_server.url, rec["config_id"], ADMIN)
    assert config is not None and config["engine"]["batch_invariant"] is True
    path = replay_server.dir / "from-store.yaml"
    path.write_text(R.config_file_text(config))
    loaded = engine_config.load(path)  # what `tailscope replay` starts a gateway with
    assert loaded.engine["batch_invariant"] is True and loaded.model == "bundled"


@pytest.mark.bundled
@pytest.mark.parametrize("case", list(CASES))
def test_replay_under_the_recorded_config_is_identical(replay_server, recorded, case):
    r = _replay(replay_server, recorded[case])
    assert r.status_code == 200, r.text
    rep = r.json()
    assert rep["identical"] is True, json.dumps(rep)
    assert rep["first_divergence"] is None and rep["replay_text"]
    assert recorded[case] not in rep["replay_trace_ids"]
    assert rep["stages"]["recorded"]["e2e_ms"] > 0 and rep["stages"]["replay"]["e2e_ms"] > 0
    assert rep["replayed_on_config_id"] == _record(replay_server, recorded[case])["config_id"]


@pytest.mark.bundled
def test_concurrent_replays_beside_other_traffic_are_all_identical(replay_server, recorded):
    r = _replay(replay_server, recorded["chat-seeded"], n=4, background=3)
    assert r.status_code == 200, r.text
    rep = r.json()
    assert rep["replays"] == 4 and rep["identical_replays"] == 4, rep
    assert len(set(rep["replay_trace_ids"])) == 4


@pytest.mark.bundled
def test_replay_under_another_dtype_reports_the_first_divergence(replay_server, recorded):
    trace = recorded["chat-seeded"]
    proc = subprocess.run(
        [sys.executable, "-m", "tailscope.cli", "replay", trace, "--source", replay_server.url,
         "--engine-config", str(replay_server.dir / "bf16.yaml"), "--json"],
        env={**_env(), "TAILSCOPE_ADMIN_KEY": ADMIN}, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["identical"] is False
    d = rep["first_divergence"]
    recorded_ids = _record(replay_server, trace)["output_token_ids"]
    assert d["recorded_token"] == recorded_ids[d["position"]]
    assert d["replay_token"] != d["recorded_token"] and d["replay_logprob"] is not None
    assert rep["replayed_on_config_id"] != rep["config_id"]
    # on the recorded gateway (its config_id matches): identical, exit 0; the record is read
    # from the --url gateway it runs on (no --source, no gateway at TAILSCOPE_GATEWAY_URL)
    same = subprocess.run(
        [sys.executable, "-m", "tailscope.cli", "replay", trace, "--url", replay_server.url,
         "--api-key", "sk-alpha"], env={**_env(), "TAILSCOPE_ADMIN_KEY": ADMIN,
                                        "TAILSCOPE_GATEWAY_URL": "http://127.0.0.1:9"},
        capture_output=True, text=True, timeout=600)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "IDENTICAL" in same.stdout and "first divergence" not in same.stdout


@pytest.mark.bundled
def test_a_record_without_token_ids_is_refused_with_the_reason(replay_server):
    r = httpx.post(f"{replay_server.url}/v1/completions",
                   json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 4},
                   headers={"Authorization": "Bearer sk-private"}, timeout=60)
    assert r.status_code == 200
    trace = r.headers["x-tailscope-trace-id"]
    refused = _replay(replay_server, trace)
    assert refused.status_code == 422
    err = refused.json()["error"]
    assert err["code"] == "not_replayable" and 'capture = "counts"' in err["message"]
    proc = subprocess.run(
        [sys.executable, "-m", "tailscope.cli", "replay", trace, "--source", replay_server.url],
        env={**_env(), "TAILSCOPE_ADMIN_KEY": ADMIN}, capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 2 and 'capture = "counts"' in proc.stderr, proc.stderr
    assert _replay(replay_server, "0" * 32).status_code == 404
    bad = httpx.post(f"{replay_server.url}/v1/completions",
                     json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "temperature": -1},
                     headers={"Authorization": "Bearer sk-alpha"}, timeout=60)
    assert bad.status_code == 400
    refused = _replay(replay_server, bad.headers["x-tailscope-trace-id"])
    assert refused.status_code == 422
    assert "answered 400" in refused.json()["error"]["message"]


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("TAILSCOPE_")}


@pytest.mark.bundled
def test_the_protocol_suites_seeded_case_holds_20_of_20_beside_other_traffic(replay_server):
    """The protocol suite's seeded-sampling case, 20 times at once with other sampled traffic
    of assorted lengths running beside it: every answer is the same as the case alone."""
    from evals.runner import load_suite, send

    _, cases = load_suite("protocol")
    case = next(c for c in cases if c.id == "seeded-sampling")

    async def run():
        headers = {"Authorization": "Bearer sk-alpha"}
        async with httpx.AsyncClient(base_url=replay_server.url, timeout=300,
                                     headers=headers) as c:
            alone = await send(c, case, "SmolLM2-135M-Instruct", "seeded-alone")
            stop = asyncio.Event()
            others = [asyncio.ensure_future(R._background(c, "SmolLM2-135M-Instruct", {}, stop,
                                                          i)) for i in range(4)]
            await asyncio.sleep(0.1)
            try:
                many = await asyncio.gather(*(send(c, case, "SmolLM2-135M-Instruct",
                                                   "seeded-many") for _ in range(20)))
            finally:
                stop.set()
            sent = await asyncio.gather(*others)
            return alone, many, sum(sent)

    alone, many, background = asyncio.run(run())
    assert alone.choices and alone.choices[0] and not alone.error
    assert background >= 4
    differing = [i for i, a in enumerate(many) if a.error or a.choices != alone.choices]
    assert not differing, [many[i].choices or many[i].error for i in differing]
