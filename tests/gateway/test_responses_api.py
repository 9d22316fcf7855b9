"""OpenAI's Responses API (``POST /v1/responses``) through the OpenAI SDK's own
``client.responses`` over the in-process backend (the real engine and tokenizer): each answer
is the one the same request gets as a chat completion, streamed events add up to it, function
tools round-trip, ``text.format`` constrains, the record is kept, and what the gateway cannot
honour is a 400 naming the field (stored responses: test_responses_state.py)."""

from __future__ import annotations

import json

import openai
import pytest

from engine import EngineConfig
from tests.gateway.conftest import inprocess_client

CFG = EngineConfig(num_kv_blocks=128, block_size=16)
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture
def client(tiny49k, bundled_path, bundled_tokenizer):
    with inprocess_client(tiny49k, bundled_path, CFG, tokenizer=bundled_tokenizer) as c:
        yield c


@pytest.fixture
def sdk(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client,
                         max_retries=0)


def weather_answered(call_id: str, arguments: str) -> dict:
    """The chat request's tools and messages of the weather call answered with "18C, sunny"
    (what a Responses turn with that call and its output means)."""
    return {"tools": [{"type": "function", "function": {
        k: WEATHER[k] for k in ("name", "description", "parameters")}}], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": call_id, "type": "function", "function": {
                "name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "18C, sunny"}]}


def chat(client, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_response_is_the_chat_answer_of_the_same_request(sdk, client):
    out = sdk.responses.create(model=MODEL, instructions="Answer briefly.", input="Hi there",
                               max_output_tokens=6, temperature=0)
    same = chat(client, messages=[{"role": "system", "content": "Answer briefly."},
                                  {"role": "user", "content": "Hi there"}],
                max_completion_tokens=6, temperature=0)
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.output_text == same["choices"][0]["message"]["content"] != ""
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant"
    assert item.content[0].type == "output_text"
    u = same["usage"]
    assert (out.usage.input_tokens, out.usage.output_tokens, out.usage.total_tokens) == (
        u["prompt_tokens"], u["completion_tokens"], u["total_tokens"])
    if same["choices"][0]["finish_reason"] == "length":
        assert out.status == "incomplete"
        assert out.incomplete_details.reason == "max_output_tokens"
    else:
        assert out.status == "completed"
    assert item.status == out.status  # the item the budget cut is incomplete too
    # the record: an ordinary chat record, on its own endpoint
    rec = next(r for r in client.sink.records if r.endpoint == "/v1/responses")
    assert rec.final_state == "FINISHED" and rec.generated_tokens == u["completion_tokens"]
    assert rec.prompt_tokens == u["prompt_tokens"]


def test_input_items_are_the_conversation(sdk, client):
    items = [{"role": "developer", "content": "Be terse."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Name a colour."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Red."}]},
             {"role": "user", "content": "Another?"}]
    out = sdk.responses.create(model=MODEL, input=items, max_output_tokens=5, temperature=0)
    same = chat(client, messages=[{"role": "developer", "content": "Be terse."},
                                  {"role": "user", "content": "Name a colour."},
                                  {"role": "assistant", "content": "Red."},
                                  {"role": "user", "content": "Another?"}],
                max_completion_tokens=5, temperature=0)
    assert out.output_text == same["choices"][0]["message"]["content"]
    assert out.usage.input_tokens == same["usage"]["prompt_tokens"]


def test_a_stream_is_the_typed_events_adding_up_to_the_response(sdk):
    whole = sdk.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=8,
                                 temperature=0)
    events = list(sdk.responses.create(model=MODEL, input="Tell me a story",
                                       max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text != ""
    done = events[-1].response
    assert done.output_text == text and done.usage.output_tokens == whole.usage.output_tokens
    assert events[-2].item.status == done.output[0].status == whole.output[0].status
    assert whole.status == "incomplete" or whole.output[0].status == "completed"
    assert done.id == events[0].response.id and events[0].response.status == "in_progress"


def test_function_tools_round_trip(sdk, client):
    forced = {"type": "function", "name": "get_weather"}
    out = sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                               tool_choice=forced, max_output_tokens=60, temperature=0)
    calls = [o for o in out.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    args = json.loads(calls[0].arguments)  # the grammar enforces the schema
    assert set(args) == {"city"} and isinstance(args["city"], str)
    # the call and its output go back in as input items: the next turn answers
    follow = sdk.responses.create(
        model=MODEL, tools=[WEATHER], max_output_tokens=6, temperature=0,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "18C, sunny"}])
    same = chat(client, max_completion_tokens=6, temperature=0,
                **weather_answered(calls[0].call_id, calls[0].arguments))
    assert follow.usage.input_tokens == same["usage"]["prompt_tokens"]
    # streamed: the call's arguments arrive in deltas and add up
    events = list(sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                       tool_choice=forced, max_output_tokens=60,
                                       temperature=0, stream=True))
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == calls[0].arguments


def test_text_format_json_schema_constrains_the_output(sdk):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}},
              "required": ["answer"], "additionalProperties": False}
    out = sdk.responses.create(model=MODEL, input="Reply in JSON.", max_output_tokens=60,
                               temperature=0, text={"format": {
                                   "type": "json_schema", "name": "reply", "schema": schema,
                                   "strict": True}})
    assert set(json.loads(out.output_text)) == {"answer"}


def test_logprobs_come_with_include(sdk):
    out = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0,
                               include=["message.output_text.logprobs"], top_logprobs=2)
    lps = out.output[0].content[0].logprobs
    assert len(lps) == out.usage.output_tokens
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in lps)


def test_a_generation_that_fails_mid_stream_ends_in_response_failed(
        tiny49k, bundled_path, bundled_tokenizer):
    """The gateway's deadline passes mid-stream: the chat stream's error event becomes
    OpenAI's ``error`` event and ``response.failed``; the record says TIMED_OUT. A first short
    request takes the engine's warm-up (it alone once outlasted a 0.3 s deadline under CI's
    load, so the stream failed before its first token); then 980 tokens take the tiny model
    ~3.4 s here, so a 1 s deadline cuts the stream mid-way on a machine 3x faster too."""
    with inprocess_client(tiny49k, bundled_path, CFG, tokenizer=bundled_tokenizer,
                          request_timeout_s=1.0) as client:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client,
                            max_retries=0)
        try:
            sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
        except openai.APIError:  # a deadline spent warming up: still warmed up
            pass
        events = list(sdk.responses.create(model=MODEL, input="Tell me a long story",
                                           max_output_tokens=980, stream=True))
        kinds = [e.type for e in events]
        assert kinds[-2:] == ["error", "response.failed"], kinds[-5:]
        assert "response.output_text.delta" in kinds  # it failed mid-stream
        assert events[-2].code == "timeout"
        failed = events[-1].response
        assert failed.status == "failed" and failed.error.code == "timeout"
        rec = [r for r in client.sink.records if r.endpoint == "/v1/responses"][-1]
        assert rec.final_state == "TIMED_OUT"


@pytest.mark.parametrize(("extra", "param"), [
    ({"conversation": "conv_123"}, "conversation"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"),
])
def test_what_the_gateway_cannot_honour_is_a_400_naming_it(client, extra, param):
    r = client.post("/v1/responses", json={"model": MODEL, "input": "Hi", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert param.split(".")[0] in r.json()["error"]["message"]  # named as the client did
