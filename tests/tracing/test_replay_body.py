"""The request a replay sends is rebuilt from the record's sampling parameters, every field
that changes the tokens or the text included (older records lack the newer ones)."""

from __future__ import annotations

import dataclasses
import json

from engine.sampling_params import SamplingParams
from tracing.replay import completion_body


def _record(**extra) -> dict:
    engine = dataclasses.asdict(SamplingParams(max_tokens=9, min_tokens=4, seed=3,
                                                allowed_token_ids=(5, 8)))
    return {"trace_id": "t" * 32, "input_token_ids": [5, 6, 7],
            "sampling_params": json.dumps({"engine": engine, "n": 1, "stop": ["x"],
                                           "include_stop_str_in_output": False,
                                           "scoring": False, **extra})}


def test_the_replay_body_carries_min_tokens_allowed_ids_and_skip_special_tokens():
    body = completion_body(_record(skip_special_tokens=False), "m")
    assert body["min_tokens"] == 4 and body["skip_special_tokens"] is False
    assert body["allowed_token_ids"] == [5, 8]
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 9 and body["seed"] == 3
    older = completion_body(_record(), "m")  # recorded before skip_special_tokens was kept
    assert older["skip_special_tokens"] is True


def test_the_replay_body_sends_a_regex_or_choice_grammar_as_structured_outputs():
    from engine.sampling_params import StructuredOutput

    def body_for(so: dict) -> dict:
        engine = dataclasses.asdict(SamplingParams(
            structured=StructuredOutput.from_structured_outputs(so)))
        return completion_body({"input_token_ids": [5], "sampling_params": json.dumps(
            {"engine": engine, "n": 1, "stop": [], "scoring": False})}, "m")

    assert body_for({"choice": ["a", "b"]})["structured_outputs"] == {"choice": ["a", "b"]}
    assert body_for({"regex": "[0-9]+"})["structured_outputs"] == {"regex": "[0-9]+"}
    assert body_for({"json_object": True})["response_format"] == {"type": "json_object"}
