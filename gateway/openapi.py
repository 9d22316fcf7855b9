"""The published OpenAPI document (``GET /openapi.json``, ``/docs``).

The OpenAI endpoints are plain Starlette routes (FastAPI's per-request dependency solving would
be pure overhead on the hot path), so FastAPI's generator does not see them: their operations
are added here from the same pydantic models the endpoints validate with (``gateway.schemas``),
and the debug endpoints that read raw bodies get theirs from the models they validate with. The
document is built once, on first request; nothing here runs per API request.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway import schemas as S

_REF = "#/components/schemas/{model}"


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model="ErrorResponse")}}}}


def _operation(summary: str, body: type[BaseModel], answer: str, stream: bool = False,
               tag: str = "OpenAI API", example: dict | None = None) -> dict:
    content: dict[str, Any] = {"application/json": {"schema": {"$ref": _REF.format(
        model=answer)}}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string", "description": (
            "SSE: event: <type> / data: <event JSON> per typed event, from response.created to "
            "response.completed" if answer == "ResponseObject" else
            "SSE: data: <chunk JSON> ... data: [DONE]")}}
    return {"post": {
        "summary": summary, "tags": [tag],
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model=body.__name__)},
            **({"example": example} if example is not None else {})}}},
        "responses": {"200": {"description": "OK", "content": content},
                      "400": _error("invalid request (OpenAI error body, naming the field)"),
                      "401": _error("missing or unknown API key"),
                      "404": _error("unknown model"),
                      "413": _error("body too large"),
                      "429": _error("rate or concurrency limit"),
                      "503": _error("no replica can take it now"),
                      "504": _error("the gateway's deadline passed")}}}


# (path, summary, request model, response model, streams, tag)
_MANUAL = [
    ("/v1/chat/completions", "Chat completion (tools, logprobs, response_format, streaming)",
     S.ChatCompletionRequest, "ChatCompletionResponse", True, "OpenAI API"),
    ("/v1/completions", "Text completion (echo, logprobs, streaming)", S.CompletionRequest,
     "CompletionResponse", True, "OpenAI API"),
    ("/v1/responses", "OpenAI's Responses API (previous_response_id, function tools, "
     "text.format, streamed typed events)", S.ResponsesRequest, "ResponseObject", True,
     "OpenAI API"),
    ("/tokenize", "Token ids of a prompt or of chat messages (vLLM's shape)",
     S.TokenizeRequest, "TokenizeResponse", False, "Utility"),
    ("/detokenize", "Text of token ids (vLLM's shape)", S.DetokenizeRequest,
     "DetokenizeResponse", False, "Utility"),
]
def _stored_operations() -> dict[str, dict]:
    """The stored responses' retrieve, delete and input-items list (OpenAI's shapes)."""
    rid = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    errors = {"400": _error("a query parameter it does not take"),
              "401": _error("missing or unknown API key"),
              "404": _error("no such response kept for this tenant")}

    def op(summary: str, answer: dict, params: list[dict] = ()) -> dict:
        return {"summary": summary, "tags": ["OpenAI API"], "parameters": [rid, *params],
                "responses": {"200": {"description": "OK", "content": {
                    "application/json": {"schema": answer}}}, **errors}}

    obj = {"$ref": _REF.format(model="ResponseObject")}
    deleted = {"type": "object", "required": ["id", "object", "deleted"], "properties": {
        "id": {"type": "string"}, "object": {"const": "response"},
        "deleted": {"type": "boolean"}}}
    listed = {"type": "object", "required": ["object", "data", "has_more"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object"}},
        "first_id": {"type": ["string", "null"]}, "last_id": {"type": ["string", "null"]},
        "has_more": {"type": "boolean"}}}
    query = [{"name": "limit", "in": "query", "schema": {
                 "type": "integer", "minimum": 1, "maximum": 100, "default": 20}},
             {"name": "order", "in": "query", "schema": {
                 "type": "string", "enum": ["asc", "desc"], "default": "desc"}},
             {"name": "after", "in": "query", "schema": {"type": "string"}}]
    return {"/v1/responses/{response_id}": {
                "get": op("A stored response (created without store: false)", obj),
                "delete": op("Delete a stored response", deleted)},
            "/v1/responses/{response_id}/input_items": {
                "get": op("A stored response's input items", listed, query)}}


# debug endpoints whose handlers validate a raw body with these models
_BODIES = {"/debug/query": S.DebugQuery, "/debug/bench-runs": S.BenchRunBody,
           "/debug/bench-runs/open": S.BenchRunOpenBody,
           "/debug/eval-runs": S.EvalRunBody, "/debug/whatif-runs": S.WhatIfRunBody}


def build(app: FastAPI, models: list[str], bundled: str) -> dict:
    """``models``: every served model name (the ``model`` of an API request is one of them);
    ``bundled``: the bundled replicas' (the only one ``/tokenize`` knows)."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="Tailscope gateway: the OpenAI API over the bundled engine "
                      "and external backends, every request recorded.")
    documented = [m for _, _, m, _, _, _ in _MANUAL] + list(_BODIES.values()) + [
        S.ChatCompletionResponse, S.CompletionResponse, S.ResponseObject, S.TokenizeResponse,
        S.DetokenizeResponse, S.ErrorResponse]
    _, defs = models_json_schema([(m, "validation") for m in documented], ref_template=_REF)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs.get("$defs", {}))
    for name in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest"):  # served
        components[name]["properties"]["model"] = {"type": "string", "enum": models,
                                                   "title": "Model"}
    for name in ("TokenizeRequest", "DetokenizeRequest"):
        components[name]["properties"]["model"] = {"anyOf": [
            {"type": "string", "enum": [bundled]}, {"type": "null"}], "title": "Model"}
    paths = doc.setdefault("paths", {})
    # a request each operation answers (shown in /docs; a fuzzer's explicit case)
    examples = {
        "/v1/chat/completions": {"model": bundled, "max_tokens": 8,
                                 "messages": [{"role": "user", "content": "Hello!"}]},
        "/v1/completions": {"model": bundled, "prompt": "Once upon a time", "max_tokens": 8},
        "/v1/responses": {"model": bundled, "input": "Hello!", "max_output_tokens": 8},
        "/tokenize": {"prompt": "Hello!"}, "/detokenize": {"tokens": [19556, 17]}}
    for path, summary, body, answer, stream, tag in _MANUAL:
        paths[path] = _operation(summary, body, answer, stream, tag, examples.get(path))
    paths.update(_stored_operations())
    for path, body in _BODIES.items():
        op = paths.get(path, {}).get("post")
        if op is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": _REF.format(model=body.__name__)}}}}
            op.setdefault("responses", {})["400"] = _error("invalid body")
    return doc
