"""JSON-constrained output from the bundled model, and stop strings ending engine requests."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.constrained import GrammarCompiler
from engine.sampling_params import SamplingParamsError, StructuredOutput
from engine.text import generate_text

pytestmark = pytest.mark.bundled

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False,
    },
    "city": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24},
                       "country": {"type": "string", "maxLength": 24},
                       "capital": {"type": "boolean"}},
        "required": ["city", "country", "capital"], "additionalProperties": False,
    },
    "list": {
        "type": "object",
        "properties": {"colors": {"type": "array", "minItems": 2, "maxItems": 3,
                                  "items": {"type": "string", "enum": ["red", "green",
                                                                      "blue", "yellow"]}}},
        "required": ["colors"], "additionalProperties": False,
    },
}
PROMPTS = {
    "person": "Describe a fictional person as JSON with their name and age.",
    "city": "Describe Paris as JSON: the city, its country, and whether it is a capital.",
    "list": "List two or three colours of a rainbow as JSON.",
}


@pytest.fixture(scope="module")
def engine(bundled_model, bundled_tokenizer):
    grammar = GrammarCompiler.from_tokenizer(bundled_tokenizer, bundled_model.config.vocab_size)
    return Engine(bundled_model, EngineConfig(kv_cache_mb=64), grammar=grammar)


def _chat(tok, text):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_parses_and_validates(name, engine, bundled_tokenizer):
    rf = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}
    params = SamplingParams(max_tokens=80, structured=StructuredOutput.from_response_format(rf))
    result = generate_text(engine, bundled_tokenizer, f"json-{name}",
                           _chat(bundled_tokenizer, PROMPTS[name]), params)
    assert result.finish_reason == "stop", result.text
    jsonschema.validate(json.loads(result.text), SCHEMAS[name])


def test_json_object_with_sampling_is_valid_json(engine, bundled_tokenizer):
    params = SamplingParams(max_tokens=120, temperature=0.8, top_p=0.95, seed=7,
                            structured=StructuredOutput.from_response_format(
                                {"type": "json_object"}))
    result = generate_text(engine, bundled_tokenizer, "json-object",
                           _chat(bundled_tokenizer, "Reply with a tiny JSON object."), params)
    if result.finish_reason == "stop":
        assert isinstance(json.loads(result.text), dict)
    else:  # ran out of tokens: what was produced is still a valid JSON prefix
        assert result.finish_reason == "length" and result.text.lstrip().startswith("{")


def test_invalid_schema_is_rejected_with_reason(engine):
    bad = StructuredOutput("json_schema", json.dumps({"type": "nonsense"}))
    req = engine.add_request("bad-schema", [1, 2, 3], SamplingParams(structured=bad))
    assert req.finish_reason == "rejected" and "invalid response_format" in req.error
    with pytest.raises(SamplingParamsError):
        StructuredOutput.from_response_format({"type": "xml"})


def test_stop_string_finishes_the_engine_request(engine, bundled_tokenizer):
    prompt = bundled_tokenizer.encode("Count: one, two, three,")
    params = SamplingParams(max_tokens=30)
    result = generate_text(engine, bundled_tokenizer, "stop-1", prompt, params, stop=[" five"])
    req = engine.get_request("stop-1")
    assert req.state.name == "FINISHED" and req.finish_reason == "stop"
    assert result.stop_reason == " five" and " five" not in result.text
    assert result.text == " four,"
    assert result.generated_tokens == len(req.output_token_ids) < 30
    assert result.emitted_tokens < result.generated_tokens  # " five" was generated, not emitted
    included = generate_text(engine, bundled_tokenizer, "stop-2", prompt, params,
                             stop=[" five"], include_stop_str_in_output=True)
    assert included.text == " four, five"
