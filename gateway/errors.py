"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


async def api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    trace = getattr(request.state, "trace", None)
    if trace is not None and not trace.record.final_state:  # the record says how it ended
        if exc.status == 504:
            final, reason = "TIMED_OUT", "timeout"
        elif exc.status >= 500 and exc.status != 503:
            final, reason = "FAILED", "error"
        else:  # 4xx and load shedding: refused before any token was generated
            final, reason = "REJECTED", "rejected"
        trace.fail(final, reason, exc.code or exc.type, exc.message)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (no route, a method the route does not take) in the OpenAI
    shape, so a client's SDK reports them like every other error (it reads ``error.message``;
    FastAPI's default is ``{"detail": ...}``)."""
    if exc.status_code == 404:
        message, code = (f"no endpoint {request.url.path} on this gateway (its endpoints are "
                         "listed in /openapi.json)"), "not_found"
    elif exc.status_code == 405:
        allow = {k.lower(): v for k, v in (exc.headers or {}).items()}.get("allow", "")
        message, code = (f"{request.method} is not allowed on {request.url.path} (allowed: "
                         f"{allow})"), "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    return JSONResponse(APIError(exc.status_code, message, code=code).body(),
                        status_code=exc.status_code, headers=exc.headers)
