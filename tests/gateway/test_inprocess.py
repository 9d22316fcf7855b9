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


def test_sjf_predicts_from_the_tenants_finished_lengths_per_endpoint(tiny49k, bundled_path):
    """Under sjf the engine orders by the gateway's running mean of the tenant's output
    lengths on the endpoint (kept in the record's sampling_params); none before the first."""
    import json

    from gateway.prepare import LENGTH_EWMA

    cfg = EngineConfig(num_kv_blocks=64, block_size=16, scheduling_policy="sjf")
    with inprocess_client(tiny49k, bundled_path, cfg) as c:
        def send(path, max_tokens, **body):
            r = c.post(path, json={"model": "SmolLM2-135M-Instruct", "max_tokens": max_tokens,
                                   "temperature": 0, "ignore_eos": True, **body})
            assert r.status_code == 200, r.text
            rec = c.sink.find(r.headers["x-tailscope-trace-id"])
            return json.loads(rec.sampling_params)["engine"]["predicted_tokens"]

        assert send("/v1/completions", 4, prompt="a") is None
        assert send("/v1/completions", 12, prompt="b") == 4  # the first one's 4 tokens
        mean = 4 + LENGTH_EWMA * (12 - 4)
        assert send("/v1/completions", 40, prompt="c") == int(-(-mean // 1))
        # the chat endpoint has its own estimate
        assert send("/v1/chat/completions", 3, messages=[{"role": "user", "content": "x"}]) \
            is None


def test_the_gateways_own_stalls_are_in_metrics(tiny49k, bundled_path):
    """A blocked event loop and the garbage collector's pauses: they hold every request the
    gateway serves at once, and no engine stage shows them."""
    import gc
    import time

    from gateway.metrics import LoopStalls
    from tests.gateway.test_records import metric

    def late(text: str) -> float:  # samples more than 0.16 s late
        return metric(text, "tailscope:event_loop_lag_seconds_count") - metric(
            text, "tailscope:event_loop_lag_seconds_bucket", le="0.16")

    with inprocess_client(tiny49k, bundled_path, CFG) as client:
        # counted from here: start-up can be late already (the grammar compiler's warm-up
        # holds the GIL ~0.5 s)
        time.sleep(0.15)
        before = client.get("/metrics").text
        gc.collect()  # a full collection, timed by the gateway's hook (any thread counts)
        gc.collect(0)  # and a young one
        client.portal.call(time.sleep, 0.3)  # the event loop blocked for 0.3 s
        time.sleep(0.15)  # the lag sampler's next timer fires, 0.3 s late
        text = client.get("/metrics").text
        assert metric(text, "tailscope:gc_pause_seconds_count", generation="2") >= 1
        assert metric(text, "tailscope:gc_pause_seconds_count", generation="0") >= 1
        assert metric(text, "tailscope:event_loop_lag_seconds_count") >= 2  # every 50 ms
        assert late(text) >= late(before) + 1  # the blocked loop: one sample 0.25 s late
    # the app is gone: its hook is no longer called by every collection of the process
    assert not [cb for cb in gc.callbacks if isinstance(getattr(cb, "__self__", None),
                                                        LoopStalls)]
