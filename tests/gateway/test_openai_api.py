"""The official openai SDK against `tailscope serve` over real loopback HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)


def test_models_health_ready(tiny_server, client):
    assert [m.id for m in client.models.list().data] == [tiny_server.model]
    assert httpx.get(f"{tiny_server.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{tiny_server.url}/ready")
    assert ready.status_code == 200 and ready.json()["replicas"] == {"r0": "ready"}


def test_models_retrieve_and_openai_shaped_route_errors(tiny_server, client):
    card = client.models.retrieve(tiny_server.model)
    assert card.id == tiny_server.model and card.created > 0
    info = httpx.get(f"{tiny_server.url}/tokenizer_info").json()
    assert card.model_extra["max_model_len"] == info["model_max_length"] > 0  # vLLM's field
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.body["code"] == "model_not_found" and "gpt-4" in missing.value.message
    # no route and a wrong method: the OpenAI error shape, not FastAPI's {"detail": ...}
    with pytest.raises(openai.NotFoundError) as no_route:
        client.embeddings.create(model=tiny_server.model, input="hi")
    assert no_route.value.body["code"] == "not_found" and "/v1/embeddings" in \
        no_route.value.message
    r = httpx.delete(f"{tiny_server.url}/v1/models")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert "allowed: GET" in r.json()["error"]["message"]


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "text"},  # a text part without its text
])
def test_content_parts_the_engine_cannot_read_are_refused_not_dropped(tiny_server, client,
                                                                       part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=tiny_server.model, messages=messages,
                                       max_tokens=2)
    assert refused.value.body["param"].startswith("messages.0.content.1.")
    r = httpx.post(f"{tiny_server.url}/tokenize", json={"messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0.content.1")
    # text parts alone are read, joined, like a string content
    text = [{"role": "user", "content": [{"type": "text", "text": "What is "},
                                         {"type": "text", "text": "this?"}]}]
    plain = [{"role": "user", "content": "What is this?"}]
    ids = [httpx.post(f"{tiny_server.url}/tokenize", json={"messages": m}).json()["tokens"]
           for m in (text, plain)]
    assert ids[0] == ids[1]


def test_options_that_need_another_option_are_refused(tiny_server, client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=tiny_server.model, max_tokens=2, top_logprobs=2,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.body["param"] == "top_logprobs"
    ok = client.chat.completions.create(model=tiny_server.model, max_tokens=2, top_logprobs=0,
                                        messages=[{"role": "user", "content": "Hi"}])
    assert ok.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as refused:  # it would change nothing
        client.completions.create(model=tiny_server.model, prompt="Hi", max_tokens=2,
                                  stream_options={"include_usage": True})
    assert refused.value.body["param"] == "stream_options"
    with pytest.raises(openai.BadRequestError) as refused:  # named as /v1/completions calls it
        client.completions.create(model=tiny_server.model, prompt="Hi", max_tokens=2,
                                  logprobs=21)
    assert refused.value.body["param"] == "logprobs" and "top_logprobs" not in \
        refused.value.message


def test_chat_completion_non_streaming(tiny_server, client):
    resp = client.chat.completions.create(
        model=tiny_server.model, messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert resp.usage.completion_tokens <= 8 and resp.usage.prompt_tokens > 5


def test_completion_streaming_matches_non_streaming(tiny_server, client):
    kw = dict(model=tiny_server.model, prompt="Once upon a time", max_tokens=12,
              temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streaming_with_usage_and_n(tiny_server, client):
    stream = client.chat.completions.create(
        model=tiny_server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
        temperature=1.0, seed=3, n=2, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert finishes == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens <= 12


def test_prompt_as_token_ids_and_seeded_sampling(tiny_server, client):
    kw = dict(model=tiny_server.model, prompt=[5, 6, 7, 8], max_tokens=10, temperature=0.9,
              seed=42, extra_body={"ignore_eos": True, "top_k": 20})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_headers_on_success_and_error(tiny_server):
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = f"00-{trace}-00f067aa0ba902b7-01"
    ok = httpx.post(f"{tiny_server.url}/v1/completions", headers={"traceparent": parent},
                    json={"model": tiny_server.model, "prompt": "a", "max_tokens": 1})
    assert ok.status_code == 200
    assert ok.headers["x-tailscope-trace-id"] == trace
    assert ok.headers["traceparent"].startswith(f"00-{trace}-")
    assert ok.headers["traceparent"].split("-")[2] != "00f067aa0ba902b7"  # our own span
    bad = httpx.post(f"{tiny_server.url}/v1/completions", content=b"{not json")
    assert bad.status_code == 400 and bad.headers["x-request-id"]
    assert len(bad.headers["x-tailscope-trace-id"]) == 32


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ({"model": "M", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": "M", "prompt": "hi", "top_p": 2}, 400, "top_p"),
    ({"model": "M", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "M", "prompt": "hi", "max_tokens": 10_000_000}, 400, "max_tokens"),
    ({"model": "M", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"model": "M", "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"model": "M", "prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"model": "M", "prompt": ""}, 400, "prompt"),
    ({"model": "M", "prompt": "hi", "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"model": "M", "prompt": "hi", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     400, "response_format"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_requests_get_openai_errors(tiny_server, body, status, param):
    if isinstance(body, dict) and body.get("model") == "M":
        body = {**body, "model": tiny_server.model}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{tiny_server.url}/v1/completions", content=content,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] is not None and param in err["param"]


def test_chat_needs_messages_and_body_limit(tiny_server):
    r = httpx.post(f"{tiny_server.url}/v1/chat/completions",
                   json={"model": tiny_server.model, "messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["param"]
    big = "x" * (2 << 20)
    r = httpx.post(f"{tiny_server.url}/v1/completions",
                   json={"model": tiny_server.model, "prompt": big})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


@pytest.mark.bundled
def test_bundled_model_chat_completion_says_paris():
    from tests.gateway.conftest import start_server, stop_server

    server = start_server()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        resp = client.chat.completions.create(
            model=server.model, max_tokens=24, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in resp.choices[0].message.content
        assert resp.choices[0].finish_reason == "stop"
    finally:
        stop_server(server)


def test_logprobs_in_chat_and_completions(tiny_server, client):
    resp = client.chat.completions.create(
        model=tiny_server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy = top-1
    assert "".join(e.token for e in content) == resp.choices[0].message.content
    comp = client.completions.create(model=tiny_server.model, prompt="Hi", max_tokens=3,
                                     temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 3 and len(lp.top_logprobs[0]) <= 2


def test_json_object_response_format_through_the_gateway(tiny_server, client):
    """Even the random tiny model emits only JSON under the grammar mask."""
    resp = client.chat.completions.create(
        model=tiny_server.model, messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=40, temperature=0, response_format={"type": "json_object"})
    text = resp.choices[0].message.content
    assert text.lstrip().startswith("{")
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_streamed_logprobs_match_non_streamed(tiny_server, client):
    kwargs = dict(model=tiny_server.model, messages=[{"role": "user", "content": "Hi"}],
                  max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed, text = [], ""
    for ev in client.chat.completions.create(stream=True, **kwargs):
        choice = ev.choices[0]
        if choice.logprobs is not None:
            streamed += choice.logprobs.content
        text += choice.delta.content or ""
    assert [e.token for e in streamed] == [e.token for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-5)
    assert all(len(e.top_logprobs) == 2 for e in streamed)
    assert "".join(e.token for e in streamed) == text
    # completions: token lists per chunk add up to the generated tokens
    tokens = []
    for ev in client.completions.create(model=tiny_server.model, prompt="Hi", max_tokens=5,
                                        temperature=0, logprobs=1, stream=True,
                                        extra_body={"ignore_eos": True}):
        if ev.choices and ev.choices[0].logprobs is not None:
            tokens += ev.choices[0].logprobs.tokens
    assert len(tokens) == 5


def test_min_tokens_holds_off_stop_strings_in_its_tokens_text(tiny_server, client):
    """vLLM's ``min_tokens``: a stop string is matched only where it ends in the text of a
    token after the first ``min_tokens`` (the sampler holds off EOS and stop_token_ids)."""
    kwargs = dict(model=tiny_server.model, prompt="Once upon a time", temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=16, **kwargs).choices[0].text
    k = 4
    head = client.completions.create(max_tokens=k, **kwargs).choices[0].text
    assert full.startswith(head) and len(head) < len(full)
    stop = head.strip()[:1] or head[:1]  # a character of the first k tokens' text
    assert stop
    plain = client.completions.create(max_tokens=16, stop=[stop], **kwargs).choices[0]
    assert plain.text == full[:full.index(stop)]  # the stop string in the head ends it
    held = client.completions.create(
        max_tokens=16, stop=[stop], **{**kwargs, "extra_body": {"ignore_eos": True,
                                                                 "min_tokens": k}}).choices[0]
    later = full.find(stop, len(head))
    assert held.text == (full if later < 0 else full[:later])
    assert held.finish_reason == ("length" if later < 0 else "stop")
    for bad in ({"min_tokens": 17}, {"min_tokens": -1}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(max_tokens=16, **{**kwargs, "extra_body": bad})
        assert refused.value.body["param"] == "min_tokens"


def test_chat_template_extras_continue_final_message_and_kwargs(tiny_server, client):
    """vLLM's chat extras: the last (assistant) message left open for the model to continue,
    the same prompt on /tokenize and on chat completions; template variables passed on."""
    messages = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "My favourite colour is"}]
    extras = {"add_generation_prompt": False, "continue_final_message": True}
    tok = httpx.post(f"{tiny_server.url}/tokenize", json={"messages": messages, **extras})
    assert tok.status_code == 200, tok.text
    ids = tok.json()["tokens"]
    text = httpx.post(f"{tiny_server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.endswith("My favourite colour is")  # no end-of-turn, no new assistant turn
    closed = httpx.post(f"{tiny_server.url}/tokenize", json={"messages": messages}).json()
    assert closed["count"] > len(ids)
    resp = client.chat.completions.create(
        model=tiny_server.model, messages=messages, max_tokens=2, temperature=0,
        extra_body={**extras, "return_token_ids": True,
                    "chat_template_kwargs": {"enable_thinking": False}})
    assert resp.model_extra["prompt_token_ids"] == ids
    assert resp.usage.prompt_tokens == len(ids)
    for body, param in (({"continue_final_message": True}, "continue_final_message"),
                        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=tiny_server.model, messages=messages,
                                           max_tokens=2, extra_body=body)
        assert refused.value.body["param"] == param
        r = httpx.post(f"{tiny_server.url}/tokenize", json={"messages": messages, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny_server, client):
    """vLLM's ``truncate_prompt_tokens``: left truncation after tokenizing (and after the chat
    template); the ids the model saw are the ones returned, counted and echoed."""
    prompt = "one two three four five six seven eight nine ten"
    ids = httpx.post(f"{tiny_server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert len(ids) > 4
    kwargs = dict(model=tiny_server.model, prompt=prompt, max_tokens=2, temperature=0)
    cut = client.completions.create(**kwargs, echo=True, extra_body={
        "truncate_prompt_tokens": 4, "return_token_ids": True, "ignore_eos": True})
    assert cut.usage.prompt_tokens == 4
    assert cut.choices[0].model_extra["prompt_token_ids"] == ids[-4:]
    echoed = httpx.post(f"{tiny_server.url}/detokenize", json={"tokens": ids[-4:]}).json()
    assert cut.choices[0].text.startswith(echoed["prompt"])
    whole = client.completions.create(**kwargs, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)  # shorter than the context: all of it
    chat = client.chat.completions.create(
        model=tiny_server.model, messages=[{"role": "user", "content": prompt}], max_tokens=1,
        extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    for k in (0, -2, 10 ** 9):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(**kwargs, extra_body={"truncate_prompt_tokens": k})
        assert refused.value.body["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_ends_the_text_before_it_unless_included(tiny_server, client, include):
    """stop_token_ids as vLLM answers them: the stop token is counted in usage and in the
    choice's token ids, and its text is left out unless include_stop_str_in_output."""
    kwargs = dict(model=tiny_server.model, prompt="Once upon a time", temperature=0,
                  max_tokens=8)
    free = client.completions.create(**kwargs, extra_body={
        "ignore_eos": True, "return_token_ids": True}).choices[0]
    ids = free.model_extra["token_ids"]
    stop = ids[2]
    k = ids.index(stop)  # its first occurrence ends the request
    got = client.completions.create(**kwargs, extra_body={
        "ignore_eos": True, "return_token_ids": True, "stop_token_ids": [stop],
        "include_stop_str_in_output": include})
    choice = got.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["token_ids"] == ids[:k + 1]
    assert got.usage.completion_tokens == k + 1
    shown = ids[:k + 1] if include else ids[:k]
    text = httpx.post(f"{tiny_server.url}/detokenize", json={"tokens": shown}).json()["prompt"]
    assert choice.text == text


def test_continuous_usage_stats_in_every_chunk(tiny_server, client):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far; an
    unknown stream option is a 400 naming it, not ignored."""
    kwargs = dict(model=tiny_server.model, prompt="Hi there", max_tokens=5, temperature=0,
                  stream=True, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(
        **kwargs, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 5 and counts[0] <= 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    plain = list(client.completions.create(**kwargs, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 5
    for options, param in (({"continuous_usage_stats": True},
                            "stream_options.continuous_usage_stats"),
                           ({"include_usage": True, "usage_every": 1}, "usage_every")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(**kwargs, stream_options=options)
        assert param in refused.value.body["param"]


def test_skip_special_tokens_false_renders_them(tiny_server, client):
    """vLLM's skip_special_tokens: special tokens are left out of the text by default and
    rendered with false (here one forced by logit_bias, past ignore_eos)."""
    special = httpx.post(f"{tiny_server.url}/tokenize",
                         json={"prompt": "<|im_start|>", "add_special_tokens": False}).json()
    assert special["count"] == 1
    tok = special["tokens"][0]
    kwargs = dict(model=tiny_server.model, prompt="Hi", max_tokens=3, temperature=0,
                  logit_bias={str(tok): 100})
    hidden = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    shown = client.completions.create(**kwargs, extra_body={"ignore_eos": True,
                                                            "skip_special_tokens": False})
    assert hidden.choices[0].text == "" and shown.choices[0].text == "<|im_start|>" * 3
    assert hidden.usage.completion_tokens == shown.usage.completion_tokens == 3


def test_allowed_token_ids_restrict_every_sampled_token(tiny_server, client):
    allowed = [300, 301, 302]
    resp = client.completions.create(
        model=tiny_server.model, prompt="Pick", max_tokens=6, temperature=1.0, seed=4,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True, "return_token_ids": True})
    ids = resp.choices[0].model_extra["token_ids"]
    assert len(ids) == 6 and set(ids) <= set(allowed)
    for bad in ([], [10 ** 6], list(range(5000))):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=tiny_server.model, prompt="Pick", max_tokens=2,
                                      extra_body={"allowed_token_ids": bad})
        assert refused.value.body["param"] == "allowed_token_ids"


def test_vllm_structured_outputs_choice_regex_grammar_json(tiny_server, client):
    """vLLM's structured_outputs, enforced by the grammar engine even on the random tiny model:
    the text is one of the choices, matches the regex, derives from the Lark grammar, parses
    as the schema's JSON."""
    import re

    def ask(so: dict, max_tokens: int = 24, **kw):
        return client.chat.completions.create(
            model=tiny_server.model, messages=[{"role": "user", "content": "Answer"}],
            max_tokens=max_tokens, temperature=1.0, seed=5,
            extra_body={"structured_outputs": so}, **kw).choices[0]

    choice = ask({"choice": ["alpha", "beta \"gamma\""]})
    assert choice.message.content in ("alpha", 'beta "gamma"') and choice.finish_reason == "stop"
    digits = ask({"regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", digits.message.content)
    lark = ask({"grammar": 'start: "ok " DIGIT\nDIGIT: /[0-9]/'})
    assert re.fullmatch("ok [0-9]", lark.message.content)
    obj = ask({"json": {"type": "object", "properties": {"n": {"type": "integer"}},
                        "required": ["n"], "additionalProperties": False}}, max_tokens=40)
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content)["n"], int)
    else:
        assert obj.message.content.startswith('{"n":')
    comp = client.completions.create(model=tiny_server.model, prompt="Pick", max_tokens=10,
                                     extra_body={"structured_outputs": {"choice": ["x", "y"]}})
    assert comp.choices[0].text in ("x", "y")
    for so, param in (({"choice": ["a"], "regex": "a"}, "structured_outputs"),
                      ({"whitespace_pattern": " "}, "structured_outputs.whitespace_pattern"),
                      ({"choice": []}, "structured_outputs.choice"),
                      ({"regex": "(unclosed"}, "structured_outputs")):
        with pytest.raises(openai.BadRequestError) as refused:
            ask(so)
        assert refused.value.body["param"] == param, refused.value.body
    with pytest.raises(openai.BadRequestError) as refused:
        ask({"choice": ["a"]}, response_format={"type": "json_object"})
    assert refused.value.body["param"] == "structured_outputs"
