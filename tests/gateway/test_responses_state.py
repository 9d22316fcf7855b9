"""Stored responses of OpenAI's Responses API, through the OpenAI SDK over the in-process
backend (the real engine and tokenizer): ``previous_response_id`` continues the conversation
a stored response ended (the same tokens as the whole conversation sent as chat messages),
``retrieve``, ``input_items.list`` and ``delete`` find it, ``store: false`` keeps nothing,
one tenant cannot see another's, and the store keeps to its byte bound."""

from __future__ import annotations

import json

import openai
import pytest

from gateway.responses import ResponseStore
from tests.gateway.conftest import inprocess_client
from tests.gateway.test_responses_api import CFG, MODEL, WEATHER, weather_answered

TENANTS = """
[[tenants]]
name = "alpha"
keys = ["k-alpha"]

[[tenants]]
name = "beta"
keys = ["k-beta"]
"""


@pytest.fixture
def client(tiny49k, bundled_path, bundled_tokenizer, tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    with inprocess_client(tiny49k, bundled_path, CFG, tokenizer=bundled_tokenizer,
                          tenants_file=str(tenants)) as c:
        yield c


def sdk(client, key: str = "k-alpha") -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client,
                         max_retries=0)


def chat(client, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"model": MODEL, **body},
                    headers={"Authorization": "Bearer k-alpha"})
    assert r.status_code == 200, r.text
    return r.json()


def test_previous_response_id_continues_the_conversation(client):
    api = sdk(client)
    first = api.responses.create(model=MODEL, instructions="Answer briefly.",
                                 input="My name is Ada. Say hello.", max_output_tokens=8,
                                 temperature=0)
    assert first.store is True and first.previous_response_id is None
    second = api.responses.create(model=MODEL, previous_response_id=first.id,
                                  input="What is my name?", max_output_tokens=8,
                                  temperature=0)
    assert second.previous_response_id == first.id and second.id != first.id
    # the same as the whole conversation sent at once; the instructions are not carried over
    same = chat(client, max_completion_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "My name is Ada. Say hello."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.usage.input_tokens == same["usage"]["prompt_tokens"]
    assert second.output_text == same["choices"][0]["message"]["content"] != ""
    # a third turn over a stream: the stored history is both earlier turns
    events = list(api.responses.create(model=MODEL, previous_response_id=second.id,
                                       input="And again?", max_output_tokens=6,
                                       temperature=0, stream=True))
    third = events[-1].response
    assert third.previous_response_id == second.id
    same = chat(client, max_completion_tokens=6, temperature=0, messages=[
        {"role": "user", "content": "My name is Ada. Say hello."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "And again?"}])
    assert third.usage.input_tokens == same["usage"]["prompt_tokens"]
    assert third.output_text == same["choices"][0]["message"]["content"]
    # the streamed response was kept too, and each record names its response
    assert api.responses.retrieve(third.id).output_text == third.output_text
    ids = [r.response_id for r in client.sink.records if r.endpoint == "/v1/responses"]
    assert ids == [first.id, second.id, third.id]


def test_retrieve_list_input_items_and_delete(client):
    api = sdk(client)
    items = [{"role": "developer", "content": "Be terse."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Name a colour."}]}]
    out = api.responses.create(model=MODEL, input=items, max_output_tokens=5, temperature=0)
    got = api.responses.retrieve(out.id)
    assert got.model_dump() == out.model_dump()
    listed = api.responses.input_items.list(out.id)  # newest first, as at OpenAI
    assert [i.role for i in listed.data] == ["user", "developer"]
    assert listed.data[1].content[0].text == "Be terse."  # a string became a text part
    assert all(i.id.startswith("msg_") for i in listed.data) and not listed.has_more
    asc = api.responses.input_items.list(out.id, order="asc", limit=1)
    assert [i.role for i in asc.data] == ["developer"] and asc.has_more
    rest = api.responses.input_items.list(out.id, order="asc", after=asc.data[0].id)
    assert [i.role for i in rest.data] == ["user"]
    r = client.get(f"/v1/responses/{out.id}/input_items?limit=0",
                   headers={"Authorization": "Bearer k-alpha"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    r = client.get(f"/v1/responses/{out.id}?stream=true",
                   headers={"Authorization": "Bearer k-alpha"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    # deleted: gone for retrieval and for continuing
    assert api.responses.delete(out.id) is None  # the SDK returns nothing on success
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(out.id)
    with pytest.raises(openai.BadRequestError) as exc:
        api.responses.create(model=MODEL, previous_response_id=out.id, input="Hi")
    err = exc.value.body
    assert (err["code"], err["param"]) == ("previous_response_not_found",
                                           "previous_response_id")
    assert out.id in err["message"]


def test_store_false_keeps_nothing_and_tenants_see_only_their_own(client):
    alpha, beta = sdk(client), sdk(client, "k-beta")
    unstored = alpha.responses.create(model=MODEL, input="Hi", max_output_tokens=3,
                                      temperature=0, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        alpha.responses.retrieve(unstored.id)
    kept = alpha.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0)
    assert alpha.responses.retrieve(kept.id).id == kept.id
    with pytest.raises(openai.NotFoundError):  # another tenant: as if it did not exist
        beta.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        beta.responses.delete(kept.id)
    with pytest.raises(openai.BadRequestError):
        beta.responses.create(model=MODEL, previous_response_id=kept.id, input="Hi")
    assert alpha.responses.retrieve(kept.id).id == kept.id  # beta's delete did nothing
    r = client.get(f"/v1/responses/{kept.id}")  # no key at all
    assert r.status_code == 401


def test_a_function_call_is_continued_with_its_output(client):
    api = sdk(client)
    call = api.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"},
                                max_output_tokens=60, temperature=0)
    (fc,) = [o for o in call.output if o.type == "function_call"]
    follow = api.responses.create(model=MODEL, previous_response_id=call.id, tools=[WEATHER],
                                  max_output_tokens=6, temperature=0, input=[
                                      {"type": "function_call_output", "call_id": fc.call_id,
                                       "output": "18C, sunny"}])
    same = chat(client, max_completion_tokens=6, temperature=0,
                **weather_answered(fc.call_id, fc.arguments))
    assert follow.usage.input_tokens == same["usage"]["prompt_tokens"]
    assert follow.output_text == same["choices"][0]["message"]["content"]


def test_the_store_keeps_to_its_byte_bound_least_recently_used_first():
    def response(i: int) -> dict:
        return {"id": f"resp_{i}", "status": "completed", "output": [], "text": "x" * 100}

    size = len(json.dumps([response(0), [], []]))
    store = ResponseStore(max_bytes=3 * size)
    for i in range(3):
        assert store.put("t", response(i), [], [])
    assert store.get("t", "resp_0") is not None  # used: now the most recent
    store.put("t", response(3), [], [])
    assert len(store) == 3 and store.bytes <= store.max_bytes
    assert store.get("t", "resp_1") is None  # the least recently used went
    assert {i for i in range(4) if store.get("t", f"resp_{i}")} == {0, 2, 3}
    assert store.get("other", "resp_0") is None  # another tenant's lookup finds nothing
    assert not store.put("t", {**response(9), "text": "x" * 4 * size}, [], [])  # too big
    assert store.get("t", "resp_9") is None and len(store) == 3
    assert store.delete("t", "resp_0") and not store.delete("t", "resp_0")
    assert store.bytes == 2 * size


def test_one_tenants_flood_evicts_its_own_responses_not_the_others():
    def response(i: int) -> dict:
        return {"id": f"resp_{i}", "text": "x" * 100}
    size = len(json.dumps([response(0), [], []]))
    store = ResponseStore(max_bytes=4 * size)
    store.put("quiet", response(0), [], [])
    for i in range(1, 50):  # the flood: far more than the whole store
        assert store.put("flood", response(i), [], [])
    assert store.get("quiet", "resp_0") is not None
    assert store.held("quiet") == size and store.bytes <= store.max_bytes
    kept = sorted(i for i in range(50) if store.get("flood", f"resp_{i}"))
    assert kept and kept == list(range(kept[0], 50))  # its most recent, as many as fit
