"""The OpenAI API (chat completions, completions, the Responses API and its stored
responses) and vLLM's ``/tokenize`` and ``/detokenize``, each behind the ingress gate
(``Gateway.gated``).

Plain Starlette routes: the endpoints parse their own bodies (pydantic, OpenAI errors), so
FastAPI's per-request dependency solving would be pure overhead on the hot path; their
OpenAPI operations come from ``gateway.openapi``."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gateway.errors import APIError
from gateway.routes import gw


def _through_gate(serve: str):
    """A route handler: the ingress gate, then the ``Service`` method named ``serve``."""

    async def handler(request: Request) -> Response:
        g = gw(request)
        return await g.gated(request, getattr(g.service, serve))

    handler.__name__ = serve
    return handler


def stored(request: Request, response_id: str, allowed: tuple[str, ...] = ()):
    """A stored response (``gateway.responses.ResponseStore``) of the calling tenant: found by
    the tenant that created it only."""
    g = gw(request)
    tenant, _ = g.registry.authenticate(request.headers.get("authorization"))
    extra = sorted(set(request.query_params) - set(allowed))
    if extra:
        raise APIError(400, f"query parameter {extra[0]!r} is not supported here"
                       + (f" (only {', '.join(allowed)})" if allowed else ""), param=extra[0])
    got = g.service.stored_response(tenant, response_id)
    if got is None:
        raise APIError(404, f"No response with id '{response_id}' found (responses are "
                       "kept in this gateway's memory, within TAILSCOPE_RESPONSES_STORE_MB, "
                       "unless created with store: false).", param="response_id",
                       code="not_found")
    return tenant, got


async def get_response(request: Request) -> Response:
    _, got = stored(request, request.path_params["response_id"])
    return JSONResponse(got.response)


async def delete_response(request: Request) -> Response:
    rid = request.path_params["response_id"]
    tenant, _ = stored(request, rid)
    gw(request).service.stored_responses.delete(tenant.name, rid)
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


async def response_input_items(request: Request) -> Response:
    _, got = stored(request, request.path_params["response_id"], ("after", "limit", "order"))
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, "order is 'asc' or 'desc'", param="order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise APIError(400, "limit is an integer from 1 to 100", param="limit")
    items = got.items if order == "asc" else got.items[::-1]
    if "after" in q:
        ids = [it["id"] for it in items]
        if q["after"] not in ids:
            raise APIError(400, f"after: no input item {q['after']!r} in this response",
                           param="after")
        items = items[ids.index(q["after"]) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": len(items) > limit})


ROUTES = (
    ("/v1/chat/completions", _through_gate("chat"), "POST"),
    ("/v1/completions", _through_gate("completions"), "POST"),
    ("/v1/responses", _through_gate("responses"), "POST"),
    ("/v1/responses/{response_id}", get_response, "GET"),
    ("/v1/responses/{response_id}", delete_response, "DELETE"),
    ("/v1/responses/{response_id}/input_items", response_input_items, "GET"),
    ("/tokenize", _through_gate("tokenize"), "POST"),  # vLLM's: the bundled tokenizer
    ("/detokenize", _through_gate("detokenize"), "POST"),
)


def register(app: FastAPI) -> None:
    for path, handler, method in ROUTES:
        app.add_route(path, handler, methods=[method])
