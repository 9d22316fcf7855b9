"""The FastAPI gateway: OpenAI-compatible endpoints over engine replica processes and
external backends.

``create_app`` only wires: the running gateway's parts (``gateway.runtime.Gateway``: the
``Service``, the replicas, the tenants, the record sinks, ``/metrics``) behind
``TraceMiddleware`` (ids, traceparent, body limit, one record per request) and CORS, the error
handlers, and the route modules (``gateway.routes``). The
configuration is ``gateway.config`` (re-exported here).
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.backend import Backend
from gateway.config import (  # noqa: F401  (re-exported: the CLI's and tests' names)
    NOT_CONFIG,
    GatewayConfig,
    bundled_pool,
    config_id,
    prepare_replicas,
    resolved_config,
    tokenizer_path,
)
from gateway.errors import APIError, api_error_handler, http_error_handler
from gateway.routes import api, debug, models, ops, store
from gateway.runtime import Gateway
from gateway.trace import TraceMiddleware
from tailscope.keys import check_key
from tracing.arrow import skip_pandas_probe, use_arrow_pool
from tracing.sinks import RecordSink

# traced: one record each (a completions batch: one per prompt)
API_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


# Headers a browser page may read from an answer (the trace id is how a user finds their
# request in the drill-down)
CORS_EXPOSED = ("x-tailscope-trace-id", "x-tailscope-trace-ids", "x-tailscope-replica",
                "x-request-id", "retry-after", *(f"x-ratelimit-{what}-{kind}" for what in (
                    "limit", "remaining", "reset") for kind in ("requests", "tokens")))


class ApiCORS:
    """CORS (Starlette's ``CORSMiddleware``) for what a browser client calls: the OpenAI API
    (``/v1/...``), ``/tokenize``, ``/detokenize``, ``/tokenizer_info``, ``/health``,
    ``/ready`` and ``/version``. Never ``/debug/*`` nor ``/metrics``: in open local mode those
    answer loopback clients without a key, and a browser's request to ``localhost`` comes from
    loopback, so with CORS there any web page the user visits could read the records (prompts,
    outputs) through the user's browser. Credentials (cookies) are not allowed: a client sends
    its API key in ``Authorization``, which a page must hold itself."""

    PATHS = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info", "/health", "/ready",
             "/version")

    def __init__(self, app, origins: tuple[str, ...]) -> None:
        from starlette.middleware.cors import CORSMiddleware

        self.app = app
        self.cors = CORSMiddleware(app, allow_origins=list(origins), allow_methods=["*"],
                                   allow_headers=["*"], expose_headers=list(CORS_EXPOSED),
                                   allow_credentials=False, max_age=600)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.PATHS):
            await self.cors(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def create_app(config: GatewayConfig, extra_sinks: list[RecordSink] | None = None,
               backend: Backend | None = None) -> FastAPI:
    """The gateway; ``backend`` replaces the replica processes (tests pass an
    ``InProcessBackend``)."""
    check_key("TAILSCOPE_ADMIN_KEY", config.admin_key)
    check_key("TAILSCOPE_REPLICA_KEY", config.replica_key)
    skip_pandas_probe()  # ~40 MB of RSS (tracing.store)
    use_arrow_pool()  # the writer's conversions without huge-page faults (tracing.store)
    gw = Gateway.build(config, extra_sinks, backend)
    app = FastAPI(title="Tailscope gateway", lifespan=gw.lifespan)
    app.state.gw = gw
    app.state.pool, app.state.tokenizer, app.state.records = gw.pool, gw.tokenizer, gw.memory
    app.state.on_exit_signal = gw.on_exit_signal
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_middleware(TraceMiddleware, max_body_bytes=config.max_body_bytes,
                       on_record=gw.on_record, traced_paths=API_PATHS,
                       instance=config.instance_id)
    if config.cors_origins:  # outermost: a preflight is answered before tracing and auth
        app.add_middleware(ApiCORS, origins=config.cors_origins)
    for family in (ops, debug, store, models):
        app.include_router(family.router)
    api.register(app)

    def openapi() -> dict:  # built once, on first request (gateway.openapi)
        if app.openapi_schema is None:
            from gateway import openapi as doc

            app.openapi_schema = doc.build(app, gw.service.served_models(),
                                           config.served_model_name)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
