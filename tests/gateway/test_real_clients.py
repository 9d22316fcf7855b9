"""Real clients, as users run them, against a live gateway (the session's ``tiny_server``:
tiny model with the bundled tokenizer, real HTTP): LangChain's ``ChatOpenAI`` (invoke, stream,
bind_tools, with_structured_output) and lm-evaluation-harness's ``local-completions`` model on
a multiple-choice task shipped here (``data/tiny_mc.jsonl``, no download), whose per-choice
loglikelihoods must equal the engine's own dense scoring of the same tokens."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, Field

DATA = Path(__file__).parent / "data"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
def live(tiny_server):
    return tiny_server


@pytest.fixture
def chat(live):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{live.url}/v1", api_key="unused", model=MODEL,
                      temperature=0, max_tokens=12, max_retries=0)


# ---- LangChain --------------------------------------------------------------------------------
def test_langchain_invoke_and_stream_give_the_same_greedy_text(chat):
    whole = chat.invoke("Name a colour.")
    assert isinstance(whole.content, str) and whole.content
    assert whole.response_metadata["finish_reason"] in ("stop", "length")
    assert whole.usage_metadata["output_tokens"] > 0
    pieces = [c.content for c in chat.stream("Name a colour.")]
    assert len([p for p in pieces if p]) > 1 and "".join(pieces) == whole.content


def get_weather(city: Literal["Paris", "Rome", "Oslo"], days: int) -> str:
    """The weather in a city for some days."""
    return "sunny"


def test_langchain_bind_tools_gets_a_parsed_call(chat):
    bound = chat.model_copy(update={"max_tokens": 60}).bind_tools(
        [get_weather], tool_choice="get_weather")
    out = bound.invoke("What is the weather in Paris for 3 days?")
    (call,) = out.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert call["args"]["city"] in ("Paris", "Rome", "Oslo")
    assert isinstance(call["args"]["days"], int)
    assert out.response_metadata["finish_reason"] == "tool_calls"
    streamed = list(bound.stream("What is the weather in Paris for 3 days?"))
    merged = streamed[0]
    for piece in streamed[1:]:
        merged += piece
    assert merged.tool_calls[0]["name"] == "get_weather"
    assert merged.tool_calls[0]["args"] == call["args"]  # greedy: the same call


class Trip(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    nights: int = Field(ge=1, le=9)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_validates(chat, method):
    roomy = chat.model_copy(update={"max_tokens": 40})
    trip = roomy.with_structured_output(Trip, method=method).invoke(
        "Plan two nights in Rome.")
    assert isinstance(trip, Trip) and 1 <= trip.nights <= 9


# ---- lm-evaluation-harness --------------------------------------------------------------------
def lm_eval_pair(tok, context: str, continuation: str) -> tuple[list[int], int]:
    """The tokens lm-eval sends for (context, continuation) and where the continuation starts:
    its own split (trailing spaces of the context move to the continuation; the continuation's
    tokens are those of the whole text after the context's)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    return whole, len(tok.encode(context, add_special_tokens=False))


def test_lm_eval_local_completions_loglikelihoods_equal_the_engines(
        live, tmp_path, tiny49k, bundled_tokenizer, monkeypatch, records_file):
    import lm_eval
    from lm_eval.tasks import TaskManager

    start_us = time.time_ns() // 1000

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    task = (DATA / "tiny_mc.yaml").read_text().replace(
        "DATA_FILE", str(DATA / "tiny_mc.jsonl"))
    (tmp_path / "tiny_mc.yaml").write_text(task)
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{live.url}/v1/completions", "model": MODEL,
                    "tokenizer_backend": "remote",  # our /tokenizer_info and /tokenize
                    # 4 requests per call: a prompt batch of token-id lists (a record each)
                    "num_concurrent": 1, "max_retries": 1, "batch_size": 4},
        tasks=["tailscope_tiny_mc"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True)
    docs = [json.loads(line) for line in (DATA / "tiny_mc.jsonl").read_text().splitlines()]
    samples = sorted(out["samples"]["tailscope_tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(docs)
    correct = 0
    for doc, sample in zip(docs, samples, strict=True):
        context = f"Question: {doc['question']}\nAnswer:"
        expected = []
        for choice in doc["choices"]:
            ids, ctxlen = lm_eval_pair(bundled_tokenizer, context, " " + choice)  # delimiter
            with torch.no_grad():
                logp = torch.log_softmax(tiny49k.dense_forward(torch.tensor(ids)).float(), -1)
            expected.append(sum(float(logp[i - 1, ids[i]]) for i in range(ctxlen, len(ids))))
        got = [ll for ll, _greedy in sample["filtered_resps"]]
        assert got == pytest.approx(expected, abs=1e-3), doc["question"]
        correct += max(range(len(expected)), key=expected.__getitem__) == doc["answer"]
    assert out["results"]["tailscope_tiny_mc"]["acc,none"] == pytest.approx(
        correct / len(docs))
    # its requests were batches of 4 prompts: a record per prompt, each scoring one choice
    records = [r for r in map(json.loads, records_file.read_text().splitlines())
               if r["arrival_ts_us"] >= start_us and r["endpoint"] == "/v1/completions"]
    assert len(records) == sum(len(d["choices"]) for d in docs)
    assert max(r["prompt_index"] for r in records) == 3
    assert all(r["final_state"] == "FINISHED" and r["http_status"] == 200 for r in records)
