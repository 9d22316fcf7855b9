"""A scripted OpenAI-compatible upstream for the external-backend tests: a FAULT INJECTOR, not a
model. ``python tests/gateway/fault_upstream.py PORT``; what it does is chosen by the request's
``model`` (the gateway rewrites it to the backend's ``upstream_model``):

- ``echo``: a normal completion whose text is the JSON of the body it received;
- ``stall-first-byte``: sleeps 30 s before answering; ``stall-mid``: streams one chunk, then
  sleeps 30 s; ``close-mid``: streams one chunk, then drops the connection;
- ``error-500`` / ``error-429``: an OpenAI-style error body with that status;
- ``malformed``: a stream whose second event is not JSON; ``not-json``: a 200 with a text body;
- ``slow-stream``: a chunk every 0.1 s for 20 s; ``GET /stats`` says how many such streams were
  cut off by the caller (``{"cancelled": n}``).
"""

from __future__ import annotations

import asyncio
import json
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


async def completions(request: Request):
    body = await request.json()
    mode = body.get("model")
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


app = Starlette(routes=[Route("/stats", stats),
                        Route("/v1/completions", completions, methods=["POST"]),
                        Route("/v1/chat/completions", completions, methods=["POST"])])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
