"""A scripted OpenAI-compatible upstream for the external-backend tests: a FAULT INJECTOR, not a
model. ``python tests/gateway/fault_upstream.py PORT``; what it does is chosen by the request's
``model`` (the gateway rewrites it to the backend's ``upstream_model``):

- ``echo``: a normal completion whose text is the JSON of the body it received;
- ``stall-first-byte``: sleeps 30 s before answering; ``stall-mid``: streams one chunk, then
  sleeps 30 s; ``close-mid``: streams one chunk, then drops the connection;
- ``error-500`` / ``error-429``: an OpenAI-style error body with that status;
- ``malformed``: a stream whose second event is not JSON; ``not-json``: a 200 with a text body;
- ``slow-stream``: a chunk every 0.1 s for 20 s; ``GET /stats`` says how many such streams were
  cut off by the caller (``{"cancelled": n}``);
- ``llama``: a three-token answer with llama.cpp's ``timings`` object, streamed or not;
- ``vllm``: a three-token answer like vLLM with ``--enable-per-request-metrics`` (``usage``,
  ``metrics``, ``return_token_ids``, ``token_id:N`` logprobs); ``GET /stats`` has the last
  body it received (``last_vllm_body``).

- lying answers (``LYING``): ``bad-usage``, ``big-usage``, ``choices-int``, ``big-body``,
  ``long-line``, ``odd-finish``, each described where it is defined.

It also answers health probes like vLLM: ``GET /health``, ``GET /v1/models`` (``root`` names
scripted weights) and ``GET /version``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route


def chunk(text: str, finish: str | None = None) -> str:
    return "data: " + json.dumps({"id": "cmpl-fault", "object": "text_completion",
                                  "choices": [{"index": 0, "text": text,
                                               "finish_reason": finish}]}) + "\n\n"


STATS = {"cancelled": 0}


async def stats(request: Request):
    return JSONResponse(STATS)


TIMINGS = {"prompt_n": 5, "prompt_ms": 40.0, "predicted_n": 3, "predicted_ms": 100.0,
           "cache_n": 2, "prompt_per_second": 125.0, "predicted_per_second": 30.0}


async def health(request: Request):
    return JSONResponse({"status": "ok"})


async def models(request: Request):
    return JSONResponse({"object": "list", "data": [
        {"id": "echo", "object": "model", "root": "scripted/echo-weights@rev1"},
        {"id": "llama", "object": "model", "root": "scripted/llama-weights@rev2"},
        {"id": "vllm", "object": "model", "root": "scripted/vllm-weights@rev3"}]})


async def version(request: Request):
    return JSONResponse({"version": "fault-1.0"})


VLLM_USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
              "prompt_tokens_details": {"cached_tokens": 2}}
VLLM_METRICS = {"time_to_first_token_ms": 40.0, "generation_time_ms": 100.0,
                "queue_time_ms": 5.0, "mean_itl_ms": 50.0, "tokens_per_second": 21.4}
VLLM_PROMPT, VLLM_OUTPUT = [11, 12, 13, 14, 15, 16, 17], [21, 22, 23]


async def vllm(body: dict):
    STATS["last_vllm_body"] = body
    ids = bool(body.get("return_token_ids"))
    await asyncio.sleep(0.15)
    def logprobs(toks: list[int]) -> dict:
        return {"tokens": [f"token_id:{t}" for t in toks], "token_logprobs": [-0.5] * len(toks),
                "top_logprobs": None, "text_offset": [0] * len(toks)}

    if not body.get("stream"):
        choice = {"index": 0, "text": "a b c", "finish_reason": "length"}
        if body.get("logprobs") is not None:
            choice["logprobs"] = logprobs(VLLM_OUTPUT)
        if ids:
            choice.update(prompt_token_ids=VLLM_PROMPT, token_ids=VLLM_OUTPUT)
        return JSONResponse({"id": "cmpl-vllm", "object": "text_completion", "choices": [choice],
                             "usage": VLLM_USAGE, "metrics": VLLM_METRICS})

    async def events():
        for i, t in enumerate(("a", " b", " c")):
            c = json.loads(chunk(t, "length" if i == 2 else None)[6:])
            if body.get("logprobs") is not None:
                c["choices"][0]["logprobs"] = logprobs([VLLM_OUTPUT[i]])
            if ids:
                c["choices"][0]["token_ids"] = [VLLM_OUTPUT[i]]
                if i == 0:
                    c["choices"][0]["prompt_token_ids"] = VLLM_PROMPT
            yield "data: " + json.dumps(c) + "\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            yield "data: " + json.dumps({"id": "cmpl-fault", "object": "text_completion",
                                         "choices": [], "usage": VLLM_USAGE,
                                         "metrics": VLLM_METRICS}) + "\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


def _stream(*events: str) -> StreamingResponse:
    async def gen():
        for e in events:
            yield e
    return StreamingResponse(gen(), media_type="text/event-stream")


def _data(obj) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


def bad_usage(body: dict):
    """Usage that is not a count: a string when streamed, -5 and 1e20 when not."""
    if body.get("stream"):
        return _stream(chunk("hi"), chunk("", "stop"),
                       _data({"id": "x", "choices": [], "usage": {"prompt_tokens": "lots"}}),
                       "data: [DONE]\n\n")
    return JSONResponse({"id": "x", "choices": [{"index": 0, "text": "hi", "finish_reason":
                                                 "stop"}],
                         "usage": {"prompt_tokens": -5, "completion_tokens": 1e20}})


def big_usage(body: dict):
    """An answer whose usage is far more than its tokens (what the tenant's bucket is told)."""
    return JSONResponse({"id": "x", "choices": [{"index": 0, "text": "hi", "finish_reason":
                                                 "length"}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 5000}})


LYING = {
    "bad-usage": bad_usage,
    "big-usage": big_usage,
    # "choices" that is not a list
    "choices-int": lambda body: JSONResponse({"id": "x", "choices": 5}),
    # a 3 MB body (a backend set to max_response_mb below it must refuse it)
    "big-body": lambda body: JSONResponse({"id": "x", "pad": "x" * (3 << 20), "choices": []}),
    # one SSE line of 512 KiB (past a backend's max_line_kb of 64)
    "long-line": lambda body: _stream(chunk("first "), chunk("y" * (512 << 10))),
    # a finish reason no client knows, different every time
    "odd-finish": lambda body: JSONResponse({"id": "x", "choices": [
        {"index": 0, "text": "hi", "finish_reason": f"banana-{os.getpid()}-{id(body)}"}]}),
}


async def completions(request: Request):
    body = await request.json()
    mode = body.get("model")
    if mode == "vllm":
        return await vllm(body)
    if mode == "llama":
        await asyncio.sleep(0.15)
        if body.get("stream"):
            async def llama():
                for t in ("a", " b", " c"):
                    yield chunk(t)
                last = json.loads(chunk("", "length")[6:])
                last["timings"] = TIMINGS
                yield "data: " + json.dumps(last) + "\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(llama(), media_type="text/event-stream")
        return JSONResponse({"id": "cmpl-llama", "object": "text_completion",
                             "choices": [{"index": 0, "text": "a b c", "finish_reason": "length"}],
                             "timings": TIMINGS})
    if mode == "slow-stream":
        async def slow():
            try:
                for i in range(200):
                    yield chunk(f"t{i} ")
                    await asyncio.sleep(0.1)
            except (asyncio.CancelledError, GeneratorExit):
                STATS["cancelled"] += 1
                raise
        return StreamingResponse(slow(), media_type="text/event-stream")
    if mode == "echo":
        text = json.dumps(body, sort_keys=True)
        if body.get("stream"):
            async def events():
                yield chunk(text)
                yield chunk("", "stop")
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"id": "cmpl-echo", "object": "text_completion", "model": "echo",
                             "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 3, "completion_tokens": 7,
                                       "total_tokens": 10}, "vendor_field": {"x": 1}})
    if mode in LYING:
        return LYING[mode](body)
    if mode == "stall-first-byte":
        await asyncio.sleep(30)
    if mode in ("error-500", "error-429"):
        status = int(mode[-3:])
        return JSONResponse({"error": {"message": f"scripted {status}", "type": "server_error",
                                       "code": f"scripted_{status}"}}, status_code=status)
    if mode == "not-json":
        return PlainTextResponse("this is not json")
    if mode in ("stall-mid", "close-mid", "malformed"):
        async def events():
            yield chunk("first ")
            if mode == "stall-mid":
                await asyncio.sleep(30)
            elif mode == "close-mid":
                raise RuntimeError("scripted: drop the connection mid-stream")
            else:
                yield "data: {not json\n\n"
            yield chunk("never", "stop")
        return StreamingResponse(events(), media_type="text/event-stream")
    return JSONResponse({"error": {"message": f"unknown mode {mode!r}"}}, status_code=400)


app = Starlette(routes=[Route("/stats", stats), Route("/health", health),
                        Route("/v1/models", models), Route("/version", version),
                        Route("/v1/completions", completions, methods=["POST"]),
                        Route("/v1/chat/completions", completions, methods=["POST"])])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
