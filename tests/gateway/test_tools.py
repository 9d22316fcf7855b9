"""Tool calling on the bundled engine (gateway.tools): forced calls through the grammar engine
(arguments always parse and validate), streamed as OpenAI streams them, tool-result turns,
``tool_choice: none``, refusals naming their field; and the call scanner on plain text."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from engine import EngineConfig
from gateway.tools import ToolSpec, ToolStream, parse, scan
from tests.gateway.conftest import inprocess_client

CFG = EngineConfig(num_kv_blocks=128, block_size=16)
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture
def client(tiny49k, bundled_path, bundled_tokenizer):
    with inprocess_client(tiny49k, bundled_path, CFG, bundled_tokenizer) as c:
        yield c


def valid(name: str, arguments: str) -> bool:
    """The arguments parse and validate against the named tool's schema."""
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}[name]
    jsonschema.validate(json.loads(arguments), schema)
    return True


def test_a_named_tool_choice_returns_a_valid_call_and_the_record_keeps_it(client):
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 200,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert valid("get_weather", call["function"]["arguments"])
    rec = client.sink.find(r.headers["x-tailscope-trace-id"])
    assert rec.tool_calls == ["get_weather"] and rec.finish_reason == "tool_calls"


def test_required_calls_stream_as_openai_streams_them(client):
    with client.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 300,
            "tool_choice": "required", "stream": True, "parallel_tool_calls": False}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert not any(d.get("content") for d in deltas)
    headers = [tc for tc in calls if "id" in tc]
    assert len(headers) == 1 and headers[0]["index"] == 0
    assert len([tc for tc in calls if "id" not in tc]) > 1  # arguments in fragments
    arguments = "".join(tc["function"]["arguments"] for tc in calls)
    assert valid(headers[0]["function"]["name"], arguments)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_forced_call_cut_by_max_tokens_is_a_partial_call_streamed_or_not(client):
    """As OpenAI answers it: the call so far with finish_reason length, never the call object
    as content; the streamed deltas add up to the same arguments."""
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 24, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = client.post("/v1/chat/completions", json=body)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    args = call["function"]["arguments"]
    assert call["function"]["name"] == "get_weather" and args.startswith("{")
    with pytest.raises(ValueError):
        json.loads(args)  # cut short
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    deltas = [tc for c in chunks if c["choices"]
              for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert "".join(tc["function"]["arguments"] for tc in deltas) == args  # greedy: same text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert client.sink.find(r.headers["x-tailscope-trace-id"]).tool_calls == ["get_weather"]


def test_the_openai_sdk_a_tool_result_turn_and_tool_choice_none(client):
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    out = sdk.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = out.choices[0].message.tool_calls[0]
    assert valid(call.function.name, call.function.arguments)
    turn = [*ASK, out.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    follow = sdk.chat.completions.create(model=MODEL, messages=turn, tools=[WEATHER],
                                         tool_choice="none", max_tokens=8)
    assert follow.choices[0].message.tool_calls is None
    assert follow.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 5,
                                               "maximum": 1}}, "required": ["x"]}}}],
      "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
     "messages.0.tool_call_id"),
])
def test_malformed_tool_requests_are_400s_naming_the_field(client, body, param):
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


LEGACY_WEATHER = WEATHER["function"]  # OpenAI's deprecated ``functions`` entry


def test_deprecated_functions_are_answered_as_function_call_streamed_or_not(client):
    """``functions`` / ``function_call`` (what clients written before tools send): the same
    forced call, answered in their shape, one call, ``finish_reason: function_call``."""
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    out = sdk.chat.completions.create(model=MODEL, messages=ASK, functions=[LEGACY_WEATHER],
                                      function_call={"name": "get_weather"}, max_tokens=200,
                                      temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.content is None and choice.message.function_call.name == "get_weather"
    assert valid("get_weather", choice.message.function_call.arguments)
    with client.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "functions": [LEGACY_WEATHER], "max_tokens": 200,
            "function_call": {"name": "get_weather"}, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
        trace_id = r.headers["x-tailscope-trace-id"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any("tool_calls" in d or d.get("content") for d in deltas)
    calls = [d["function_call"] for d in deltas if "function_call" in d]
    assert calls[0]["name"] == "get_weather" and all("name" not in x for x in calls[1:])
    assert "".join(x["arguments"] for x in calls) == choice.message.function_call.arguments
    assert chunks[-1]["choices"][0]["finish_reason"] == "function_call"
    rec = client.sink.find(trace_id)
    assert rec.tool_calls == ["get_weather"] and rec.finish_reason == "function_call"


def test_a_deprecated_function_turn_is_the_prompt_its_tool_form_is(client):
    """An assistant ``function_call`` and a ``function`` message render as a tool call and
    its result (named by the function); ``/tokenize`` counts what the chat request costs."""
    legacy = [*ASK, {"role": "assistant", "content": None, "function_call": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
        {"role": "function", "name": "get_weather", "content": "sunny, 21 C"}]
    tools = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "get_weather", "content": "sunny, 21 C"}]

    def tokens(body):
        r = client.post("/tokenize", json={"model": MODEL, **body})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    old = tokens({"messages": legacy, "functions": [LEGACY_WEATHER]})
    assert old == tokens({"messages": tools, "tools": [WEATHER]})
    plain = tokens({"messages": tools})  # no tools: no preamble, the turns still rendered
    assert len(plain) < len(old) and len(plain) > len(tokens({"messages": ASK})) + 20
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": legacy, "functions": [LEGACY_WEATHER], "max_tokens": 4,
        "function_call": "none"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": tools, "tools": [WEATHER], "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == len(old)  # what /tokenize counted


@pytest.mark.parametrize("body,param", [
    ({"functions": [LEGACY_WEATHER], "tools": [WEATHER]}, "functions"),
    ({"functions": [LEGACY_WEATHER], "function_call": {"name": "nope"}}, "function_call"),
    ({"functions": [LEGACY_WEATHER], "function_call": "required"}, "function_call"),
    ({"functions": [LEGACY_WEATHER], "parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"functions": [{"name": "bad name"}]}, "functions.0.name"),
    ({"functions": ["get_weather"]}, "functions.0"),
    ({"messages": [*ASK, {"role": "function", "content": "x"}]}, "messages.1.name"),
    ({"messages": [{"role": "user", "content": "x", "function_call": {
        "name": "get_weather", "arguments": "{}"}}]}, "messages.0.function_call"),
])
def test_malformed_deprecated_function_requests_are_400s_naming_the_field(client, body, param):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK,
                                                  "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_tools_on_completions_are_an_unknown_parameter(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"


def test_the_scanner_parses_calls_and_streams_exact_argument_fragments():
    spec = ToolSpec.parse([WEATHER, TIME], "auto", None)
    text = ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa\\"ris", '
            '"days": 3}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]}')
    calls = parse(text, spec)
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.arguments) for c in calls] == [{"city": 'Pa"ris', "days": 3},
                                                        {"zone": "UTC"}]
    stream, out = ToolStream(), []
    for i in range(0, len(text), 3):  # any split gives the same calls
        out += stream.feed(text[i:i + 3])
    assert [d["function"]["name"] for d in out if "id" in d] == ["get_weather", "get_time"]
    args = ["".join(d["function"]["arguments"] for d in out if d["index"] == i) for i in (0, 1)]
    assert args == [c.arguments for c in calls]
    # text is text: plain answers, unknown tools, extra keys, trailing words
    for answer in ("Hello!", '{"tool_calls": [{"name": "nope", "arguments": {}}]}',
                   '{"tool_calls": [], "x": 1}', text + " and more"):
        assert parse(answer, spec) is None, answer
    assert scan('{"tool_calls": [{"name": "get_time", "arguments": {"zone": tr')[1]
    assert not scan("Sure, here")[1]
