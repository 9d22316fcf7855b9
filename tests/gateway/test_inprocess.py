"""The serving code over the in-process backend: the OpenAI API, streaming and the record,
with a real engine (the tiny model) and no replica subprocess."""

from __future__ import annotations

import json

import pytest

from engine import Engine, EngineConfig, SamplingParams
from tests.gateway.conftest import inprocess_client

CFG = EngineConfig(num_kv_blocks=64, block_size=16)


@pytest.fixture
def client(tiny49k, bundled_path):
    with inprocess_client(tiny49k, bundled_path, CFG) as c:
        yield c


def test_a_completion_matches_the_engine_and_has_one_record(client, tiny49k):
    r = client.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct",
                                             "prompt": "Hello there", "max_tokens": 6,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    rec = client.sink.find(r.headers["x-tailscope-trace-id"])
    assert rec.replica == "local" and rec.final_state == "FINISHED"
    assert rec.response_id == r.json()["id"]
    reference = Engine(tiny49k, CFG).generate([rec.input_token_ids], SamplingParams(
        max_tokens=6, ignore_eos=True))[0]
    assert rec.output_token_ids == reference.output_token_ids
    states = [e.state for e in rec.events]
    assert states.index("ROUTED") < states.index("QUEUED") < states.index("DECODING")
    assert rec.decode_ms > 0 and rec.prefill_ms > 0


def test_streaming_and_refusals_through_the_backend(client):
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": 4,
            "ignore_eos": True, "messages": [{"role": "user", "content": "Hi"}]}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]
              if json.loads(e)["choices"]]
    assert finish[-1] == "length"
    too_long = client.post("/v1/completions", json={
        "model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 10**6})
    assert too_long.status_code == 400 and "max_tokens" in too_long.text
    rec = client.sink.find(too_long.headers["x-tailscope-trace-id"])
    assert rec.final_state == "REJECTED" and rec.prompt_tokens > 0  # it was tokenized
