"""Scoring with echo (lm-evaluation-harness's loglikelihood requests: ``echo``, ``logprobs``,
``max_tokens: 0``) and the unknown-field rule, over the in-process backend with the real
engine and tokenizer. The echoed logprobs must equal the engine's own dense scoring."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from engine import EngineConfig
from tests.gateway.conftest import inprocess_client

CFG = EngineConfig(num_kv_blocks=64, block_size=16, max_batched_tokens=16)  # chunked prompts
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
def client(tiny49k, bundled_path):
    with inprocess_client(tiny49k, bundled_path, CFG) as c:
        yield c


def dense_logprobs(tiny49k, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logp = torch.log_softmax(tiny49k.dense_forward(torch.tensor(ids)).float(), -1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def test_echo_with_max_tokens_0_scores_the_prompt_like_the_engine(client, tiny49k):
    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "echo": True,
                                             "logprobs": 2, "max_tokens": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    rec = client.sink.find(r.headers["x-tailscope-trace-id"])
    ids = rec.input_token_ids
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(dense_logprobs(tiny49k, ids), abs=1e-4)
    assert all(len(top) <= 2 for top in lp["top_logprobs"][1:])
    assert r.json()["usage"]["completion_tokens"] == 0 and rec.emitted_tokens == 0


def test_echo_with_a_completion_streamed_and_not(client):
    body = {"model": MODEL, "prompt": "Hello there", "echo": True, "logprobs": 0,
            "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts[0] == "Hello there" and "".join(texts) == whole["text"]
    assert whole["text"].startswith("Hello there") and len(whole["text"]) > len("Hello there")
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and len(first["tokens"]) >= 2
    n_prompt = len(first["tokens"])
    assert len(whole["logprobs"]["tokens"]) == n_prompt + 3
    # OpenAI's text_offset: where each token starts in the choice's text (echo included),
    # carried across a stream's chunks
    lp = whole["logprobs"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(n_prompt + 3)]
    assert lp["text_offset"][n_prompt] == len("Hello there")
    streamed = [o for c in chunks if c["choices"][0]["logprobs"]
                for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == lp["text_offset"]
    plain = client.post("/v1/completions", json={**body, "echo": False}).json()["choices"][0]
    assert plain["logprobs"]["text_offset"][0] == 0  # without echo, from the completion


def test_the_openai_sdk_scores_with_echo(client):
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    out = sdk.completions.create(model=MODEL, prompt="One two three", echo=True, logprobs=1,
                                 max_tokens=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == "One two three" and lp.token_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:])


@pytest.mark.parametrize("body,status,code,param", [
    ({"max_tokens": 0}, 400, None, "max_tokens"),  # 0 only with echo
    ({"reasoning_effort": "high"}, 400, "unknown_parameter", "reasoning_effort"),
    ({"prompt_logprobs": 1, "stream": True}, 400, "unsupported_parameter", "prompt_logprobs"),
    ({"suffix": "end"}, 400, "unsupported_parameter", "suffix"),
    ({"best_of": 3}, 400, "unsupported_parameter", "best_of"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400,  # chat only
     "unknown_parameter", "tools"),
    ({"service_tier": "flex"}, 400, None, "service_tier"),  # one tier: auto / default
    ({"stream_options": {"include_obfuscation": True}}, 400, "unsupported_parameter",
     "stream_options"),  # streams only
    # accepted: they change nothing in the answer
    ({"metadata": {"k": "v"}, "store": False, "user": "u"}, 200, None, None),
    ({"safety_identifier": "u-1", "prompt_cache_key": "k", "service_tier": "auto"}, 200, None,
     None),
])
def test_the_unknown_field_rule(client, body, status, code, param):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                             **body})
    assert r.status_code == status, r.text
    if status == 400:
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == code, err


@pytest.mark.parametrize("modalities,status", [(["text"], 200), (["text", "audio"], 400),
                                                ([], 400)])
def test_chat_modalities_text_is_accepted_and_audio_refused(client, modalities, status):
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "modalities": modalities})
    assert r.status_code == status, r.text
    if status == 400:
        err = r.json()["error"]
        assert err["param"] == "modalities" and err["code"] == "unsupported_parameter", err
    else:
        assert r.json()["choices"][0]["message"]["content"]


def _sse_data(r) -> list[bytes]:
    """The raw JSON of each ``data:`` event of a streamed answer (not ``[DONE]``)."""
    return [frame[6:] for frame in r.read().split(b"\n\n") if frame.startswith(b"data: {")]


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_include_obfuscation_pads_every_chunk_and_changes_nothing_else(client, endpoint):
    """OpenAI's ``stream_options.include_obfuscation``: with true, every chunk of a choice
    carries random characters in ``obfuscation`` that make its JSON a multiple of
    ``OBFUSCATION_BLOCK`` bytes (a token's length no longer shows on the wire); the text,
    finish and usage are the same as without; false (and unset) adds nothing."""
    from gateway.responses import OBFUSCATION_BLOCK

    prompt = {"messages": [{"role": "user", "content": "Count to five"}]} \
        if endpoint.endswith("chat/completions") else {"prompt": "Count to five:"}
    body = {"model": MODEL, **prompt, "max_tokens": 8, "ignore_eos": True, "temperature": 0,
            "stream": True}
    runs = {}
    for flag in (True, False, None):
        opts = {"include_usage": True} | ({} if flag is None else {"include_obfuscation": flag})
        with client.stream("POST", endpoint, json={**body, "stream_options": opts}) as r:
            assert r.status_code == 200
            runs[flag] = _sse_data(r)
    padded = [json.loads(d) for d in runs[True]]
    choice_chunks = [(raw, c) for raw, c in zip(runs[True], padded, strict=True) if c["choices"]]
    assert len(choice_chunks) >= 8
    for raw, c in choice_chunks:
        assert len(raw) % OBFUSCATION_BLOCK == 0, raw
        assert set(c["obfuscation"]) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                            "0123456789-_")
    assert "obfuscation" not in padded[-1]  # the usage chunk carries no delta

    def text(chunks):
        return "".join(c["choices"][0]["delta"].get("content") or ""
                       if "delta" in c["choices"][0] else c["choices"][0]["text"]
                       for c in chunks if c["choices"])

    for flag in (False, None):
        plain = [json.loads(d) for d in runs[flag]]
        assert not any("obfuscation" in c for c in plain)
        assert text(plain) == text(padded) and len(text(plain)) > 0
        assert plain[-1]["usage"] == padded[-1]["usage"]
        assert [c["choices"][0]["finish_reason"] for c in plain if c["choices"]] == \
            [c["choices"][0]["finish_reason"] for c in padded if c["choices"]]


def test_include_obfuscation_on_the_responses_api_and_through_the_sdk(client):
    """The Responses API pads its delta events the same way; the OpenAI SDK takes the padded
    chunks (chat and Responses) as it takes any."""
    from gateway.responses import OBFUSCATION_BLOCK

    body = {"model": MODEL, "input": "Count to five", "max_output_tokens": 6, "stream": True,
            "temperature": 0}
    with client.stream("POST", "/v1/responses",
                       json={**body, "stream_options": {"include_obfuscation": True}}) as r:
        assert r.status_code == 200
        events = [frame.split(b"\ndata: ", 1) for frame in r.read().split(b"\n\n") if frame]
    deltas = [data for kind, data in events if kind.endswith(b".delta")]
    assert len(deltas) >= 6
    assert all(len(d) % OBFUSCATION_BLOCK == 0 and "obfuscation" in json.loads(d)
               for d in deltas)
    assert not any("obfuscation" in json.loads(d) for kind, d in events
                   if not kind.endswith(b".delta"))
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    streamed = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five"}], max_tokens=6,
        temperature=0, stream=True, stream_options={"include_obfuscation": True})
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    whole = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five"}], max_tokens=6,
        temperature=0)
    assert text == whole.choices[0].message.content and text
    final = [e for e in sdk.responses.create(
        model=MODEL, input="Count to five", max_output_tokens=6, temperature=0, stream=True,
        stream_options={"include_obfuscation": True}) if e.type.startswith("response.incomplete")
        or e.type == "response.completed"][0].response
    assert final.output_text == json.loads(
        [d for kind, d in events if kind in (b"event: response.completed",
                                             b"event: response.incomplete")][0]
    )["response"]["output"][0]["content"][0]["text"]


def test_message_fields_follow_the_rule_too(client):
    msg = {"role": "user", "content": "Hi"}
    ok = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                   "messages": [{**msg, "name": "ann"}]})
    assert ok.status_code == 200, ok.text
    bad = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                    "messages": [{**msg, "refusal": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages.0.refusal"


def test_tokenize_and_detokenize_in_vllms_shapes(client):
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "Hello world",
                                       "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) >= 2 and body["max_model_len"] > 0
    assert "".join(body["token_strs"]) == "Hello world"
    back = client.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.json() == {"prompt": "Hello world"}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    plain = client.post("/tokenize", json={"prompt": "Hi"}).json()
    assert chat.status_code == 200 and chat.json()["count"] > plain["count"]
    # the chat prompt is what /v1/chat/completions sends to the engine
    r = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1,
                                                  "messages": [{"role": "user", "content": "Hi"}]})
    assert r.json()["usage"]["prompt_tokens"] == chat.json()["count"]
    for path, body, param in (("/tokenize", {"prompt": "x", "messages": []}, "prompt"),
                              ("/tokenize", {"prompt": "x", "extra": 1}, "extra"),
                              ("/detokenize", {"tokens": [10**8]}, "tokens"),
                              ("/detokenize", {"tokens": [1], "model": "nope"}, "model")):
        bad = client.post(path, json=body)
        assert bad.status_code in (400, 404) and bad.json()["error"]["param"] == param, bad.text


def test_tokenizer_info_in_vllms_shape(client, bundled_tokenizer):
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == bundled_tokenizer.tokenizer.id_to_token(
        bundled_tokenizer.eos_token_id)
    assert info["chat_template"] == bundled_tokenizer.chat_template.source
    assert info["vocab_size"] == bundled_tokenizer.vocab_size and info["model_max_length"] > 0


def test_a_batch_of_one_prompt_is_that_prompt(client):
    one = {"model": MODEL, "max_tokens": 4, "temperature": 0, "logprobs": 0}
    ids = client.post("/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    plain = client.post("/v1/completions", json={**one, "prompt": "Hello there"}).json()
    for prompt in (["Hello there"], [ids], ids):
        got = client.post("/v1/completions", json={**one, "prompt": prompt})
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == plain["choices"][0]["text"]
        assert got.json()["usage"] == plain["usage"]
        assert "x-tailscope-trace-ids" not in got.headers


BATCH = ["Hello there", "The sky is", "Once upon a time, in a land far away"]


def test_a_batch_runs_every_prompt_and_keeps_a_record_per_prompt(client):
    """OpenAI's prompt arrays (texts or token lists): choice k * n + j is prompt k's sample j,
    each the answer that prompt gets alone; usage sums the prompts; a record per prompt, each
    with its own trace id (all in x-tailscope-trace-ids), sharing request and response id."""
    common = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True}
    alone = [client.post("/v1/completions", json={**common, "prompt": p}).json()
             for p in BATCH]
    ids = client.post("/tokenize", json={"prompt": BATCH[1]}).json()["tokens"]
    for prompt in (BATCH, [BATCH[0], BATCH[1], BATCH[2]]):
        r = client.post("/v1/completions", json={**common, "prompt": prompt, "n": 2})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == list(range(6))
        for k, single in enumerate(alone):
            for j in range(2):
                c = body["choices"][2 * k + j]
                assert c["text"] == single["choices"][0]["text"]
                assert c["token_ids"] == single["choices"][0]["token_ids"]
                assert c["prompt_token_ids"] == single["choices"][0]["prompt_token_ids"]
        assert body["choices"][2]["prompt_token_ids"] == ids
        assert body["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
        assert body["usage"]["completion_tokens"] == 3 * 2 * 4
        traces = r.headers["x-tailscope-trace-ids"].split(",")
        assert len(set(traces)) == 3 and traces[0] == r.headers["x-tailscope-trace-id"]
        records = [client.sink.find(t) for t in traces]
        for k, rec in enumerate(records):
            assert rec.prompt_index == k and rec.final_state == "FINISHED"
            assert rec.input_token_ids == body["choices"][2 * k]["prompt_token_ids"]
            assert rec.output_token_ids == body["choices"][2 * k]["token_ids"]
            assert rec.prompt_tokens == len(rec.input_token_ids) and rec.n == 2
            assert rec.generated_tokens == 8 and rec.http_status == 200
            assert rec.request_id == records[0].request_id
            assert rec.response_id == body["id"]
            assert (rec.tenant, rec.ttl_days, rec.arrival_ts_us) == (
                records[0].tenant, records[0].ttl_days, records[0].arrival_ts_us) and rec.tenant
            assert rec.ttft_ms is not None and rec.e2e_ms > 0


def test_a_streamed_batch_gives_each_choice_its_own_text(client):
    common = {"model": MODEL, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
              "prompt": BATCH, "echo": True}
    whole = client.post("/v1/completions", json=common).json()
    with client.stream("POST", "/v1/completions", json={
            **common, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        traces = r.headers["x-tailscope-trace-ids"].split(",")
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    texts = {}
    for ch in chunks[:-1]:
        (c,) = ch["choices"]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(3)] == [c["text"] for c in whole["choices"]]
    for i, prompt in enumerate(BATCH):  # echo: each choice starts with its own prompt
        assert texts[i].startswith(prompt) and len(texts[i]) > len(prompt)
    assert chunks[-1]["usage"] == whole["usage"]
    for k, t in enumerate(traces):
        rec = client.sink.find(t)
        assert rec.prompt_index == k and rec.stream and rec.generated_tokens == 5
        assert rec.ttft_ms is not None and len(rec.itl_ms) >= 1


def test_a_batch_is_refused_whole_naming_the_prompt_at_fault(client):
    body = {"model": MODEL, "max_tokens": 2}
    before = client.sink.emitted
    for prompt, says in ((["Hi", ""], "prompt.1 is empty"),
                         ([[1, 2], [10**8]], "prompt.1 has token ids outside"),
                         (["Hi"] * 65, "65 sequences; at most 64"),
                         (["Hi", [1, 2]], "prompt")):
        bad = client.post("/v1/completions", json={**body, "prompt": prompt})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt", bad.text
        assert says in bad.json()["error"]["message"], bad.text
        assert "x-tailscope-trace-ids" not in bad.headers
    many = client.post("/v1/completions", json={**body, "prompt": ["a"] * 8, "n": 9})
    assert many.status_code == 400 and "72 sequences" in many.json()["error"]["message"]
    assert client.sink.emitted == before + 5  # a refused batch is one record


def test_prompt_logprobs_on_a_completions_batch_are_per_choice(client, tiny49k):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": BATCH[:2],
                                             "max_tokens": 1, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    assert "prompt_logprobs" not in r.json()  # vLLM's completions: in each choice
    traces = r.headers["x-tailscope-trace-ids"].split(",")
    for c, t in zip(r.json()["choices"], traces, strict=True):
        ids = client.sink.find(t).input_token_ids
        plp = c["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        got = [entry[str(ids[i])]["logprob"] for i, entry in enumerate(plp[1:], start=1)]
        assert got == pytest.approx(dense_logprobs(tiny49k, ids), abs=1e-4)


def test_prompt_logprobs_vllm_extra_on_chat(client, tiny49k):
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    rec = client.sink.find(r.headers["x-tailscope-trace-id"])
    ids = rec.input_token_ids
    assert len(plp) == len(ids) == r.json()["usage"]["prompt_tokens"] and plp[0] is None
    dense = dense_logprobs(tiny49k, ids)
    for i, entry in enumerate(plp[1:], start=1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(dense[i - 1], abs=1e-4)
        ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
        assert ranks == [1, 2] and len(entry) in (2, 3)


def test_priority_is_refused_under_fcfs_and_recorded_under_the_priority_policy(
        client, tiny49k, bundled_path):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "priority": -3}
    bad = client.post("/v1/completions", json=body)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    assert bad.json()["error"]["code"] == "unsupported_parameter"
    assert client.post("/v1/completions", json={**body, "priority": 0}).status_code == 200
    cfg = EngineConfig(num_kv_blocks=64, block_size=16, scheduling_policy="priority")
    with inprocess_client(tiny49k, bundled_path, cfg) as prio:
        r = prio.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert prio.sink.find(r.headers["x-tailscope-trace-id"]).priority == -3
        out = prio.post("/v1/completions", json={**body, "priority": 10**7})
        assert out.status_code == 400 and out.json()["error"]["param"] == "priority"


def test_a_tenant_cannot_ask_for_a_priority_more_urgent_than_its_min_priority(
        tiny49k, bundled_path, tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenants]]\nname = "batch"\nkeys = ["sk-batch-0123456789abcdef"]\n'
                       'priority = 5\n\n[[tenants]]\nname = "ops"\n'
                       'keys = ["sk-ops-0123456789abcdef"]\npriority = 5\nmin_priority = -10\n')
    cfg = EngineConfig(num_kv_blocks=64, block_size=16, scheduling_policy="priority")
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    with inprocess_client(tiny49k, bundled_path, cfg, tenants_file=str(tenants)) as prio:
        def post(key: str, **extra):
            return prio.post("/v1/completions", json={**body, **extra},
                             headers={"Authorization": f"Bearer {key}"})
        jump = post("sk-batch-0123456789abcdef", priority=0)  # ahead of its own 5
        assert jump.status_code == 400 and jump.json()["error"]["param"] == "priority"
        assert jump.json()["error"]["code"] == "priority_not_allowed"
        for key, priority in (("sk-batch-0123456789abcdef", 7), ("sk-ops-0123456789abcdef", -3)):
            r = post(key, priority=priority)
            assert r.status_code == 200, r.text
            assert prio.sink.find(r.headers["x-tailscope-trace-id"]).priority == priority
        r = post("sk-batch-0123456789abcdef")  # none asked: the tenant's own
        assert prio.sink.find(r.headers["x-tailscope-trace-id"]).priority == 5


def test_an_answer_is_charged_by_its_size_echo_and_logprobs_included(tiny49k, bundled_path,
                                                                      tmp_path):
    """A 27 KB request once got a 22 MB answer for the charge of its prompt and max_tokens:
    logprobs, echo and prompt logprobs are charged as tokens; /tokenize and /detokenize are
    under the tenant's request rate and tokens per minute too."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenants]]\nname = "t"\nkeys = ["sk-t-0123456789abcdef"]\n'
                       'tokens_per_minute = 1000\n\n[[tenants]]\nname = "r"\n'
                       'keys = ["sk-r-0123456789abcdef"]\nrequests_per_minute = 2\n')
    cfg = EngineConfig(num_kv_blocks=64, block_size=16)
    prompt = "one two three four five six seven eight nine ten " * 10  # ~100 tokens
    with inprocess_client(tiny49k, bundled_path, cfg, tenants_file=str(tenants)) as gw:
        def post(path: str, key: str = "sk-t-0123456789abcdef", **body):
            return gw.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
        plain = post("/v1/completions", model=MODEL, prompt=prompt, max_tokens=40, n=2)
        assert plain.status_code == 200, plain.text
        big = post("/v1/completions", model=MODEL, prompt=prompt, max_tokens=40, n=2,
                   echo=True, logprobs=20)  # (40 x 21 + ~100) x 2: past 1,000 a minute
        assert big.status_code == 429 and "tokens/min" in big.json()["error"]["message"]
        long = post("/tokenize", model=MODEL, prompt=prompt * 20)  # ~2,000 tokens
        assert long.status_code == 429, long.text
        for i in range(3):  # two a minute
            r = post("/detokenize", "sk-r-0123456789abcdef", model=MODEL, tokens=[1, 2])
            assert r.status_code == (200 if i < 2 else 429), r.text


def test_end_user_and_metadata_go_on_the_record_and_find_it_in_the_store(client, store):
    """OpenAI's ``safety_identifier`` (else ``user``) and ``metadata`` are recorded
    (``end_user``, ``metadata`` as a JSON object) on chat, completions and Responses requests;
    written to the store, the query library finds the requests by either; metadata past
    OpenAI's bounds is a 400 naming it."""
    import datetime as dt
    import secrets

    from tracing import queries as Q
    from tracing.arrow import records_to_arrow

    team = secrets.token_hex(4)  # this run's requests only, in the session's store
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    sent = [
        ("/v1/chat/completions", {**chat, "safety_identifier": "sid-1", "user": "u-old",
                                  "metadata": {"team": team, "run": "a"}}, "sid-1"),
        ("/v1/chat/completions", {**chat, "user": "u-2", "metadata": {"team": team}}, "u-2"),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "user": "u-3",
                             "metadata": {"team": team, "run": "b"}}, "u-3"),
        ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                           "safety_identifier": "sid-4", "metadata": {"team": team}}, "sid-4"),
        ("/v1/chat/completions", chat, ""),
    ]
    records = []
    for path, body, end_user in sent:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        rec = client.sink.find(r.headers["x-tailscope-trace-id"])
        assert rec.end_user == end_user
        assert (json.loads(rec.metadata) if rec.metadata else None) == body.get("metadata")
        records.append(rec)
    batch = client.post("/v1/completions", json={  # a record per prompt, each tagged
        "model": MODEL, "prompt": ["Hi", "Yo"], "max_tokens": 2, "user": "u-5",
        "metadata": {"team": team}})
    assert batch.status_code == 200, batch.text
    tagged = [client.sink.find(t) for t in batch.headers["x-tailscope-trace-ids"].split(",")]
    assert len(tagged) == 2 and all(
        rec.end_user == "u-5" and json.loads(rec.metadata) == {"team": team} for rec in tagged)
    requests, events = records_to_arrow(records)
    store.insert("requests", requests)
    store.insert("request_events", events)
    start = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    end = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=1)

    def found(**filters) -> set[str]:
        return set(Q.slowest(store, start, end, limit=100, filters=filters)["trace_id"])

    ids = [rec.trace_id for rec in records]
    assert found(**{"metadata.team": team}) == set(ids[:4])
    assert found(**{"metadata.team": team, "metadata.run": "b"}) == {ids[2]}
    assert found(**{"metadata.team": team, "end_user": "sid-4"}) == {ids[3]}
    by_user = Q.percentiles(store, start, end, by="end_user", filters={"metadata.team": team})
    assert sorted(by_user["end_user"]) == ["sid-1", "sid-4", "u-2", "u-3"]
    too_many = client.post("/v1/chat/completions", json={
        **chat, "metadata": {f"k{i}": "v" for i in range(17)}})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "metadata"
    long_value = client.post("/v1/responses", json={
        "model": MODEL, "input": "Hi", "metadata": {"k": "v" * 513}})
    assert long_value.status_code == 400 and long_value.json()["error"]["param"] == "metadata"


def test_top_k_zero_is_off_as_vllm_takes_it(client):
    """vLLM takes ``top_k: 0`` as off (as -1): the same seeded sample as -1, recorded as -1."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0,
            "seed": 11}
    outs = {}
    for k in (0, -1, 1):
        r = client.post("/v1/completions", json={**body, "top_k": k})
        assert r.status_code == 200, r.text
        outs[k] = r.json()["choices"][0]["text"]
        assert client.sink.find(r.headers["x-tailscope-trace-id"]).top_k == (k or -1)
    assert outs[0] == outs[-1] != outs[1]  # top_k 1 is greedy: another sample here


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "system", "content": None},
                                     {"role": "tool", "tool_call_id": "call_1"}])
def test_a_message_without_content_is_a_400_unless_an_assistant_turn(client, message):
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [message, {"role": "user", "content": "Hi"}],
        "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages.0" and "needs content" in err["message"], err
    ok = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant"},
        {"role": "user", "content": "Hi"}]})
    assert ok.status_code == 200, ok.text
