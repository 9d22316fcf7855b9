"""Health, version, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine import __version__ as engine_version
from gateway import __version__ as gateway_version
from gateway.routes import gw

router = APIRouter()


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/version")
async def version() -> dict:
    """vLLM's ``/version`` (``{"version": ...}``), naming the server too: a gateway that
    fronts this one as a backend records it as ``tailscope <version>``."""
    return {"version": gateway_version, "server": "tailscope", "engine": engine_version}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 while at least one replica can serve (and the record writer, when there is one,
    is alive); ``all_ready`` says every replica is up (what a benchmark waits for), and
    ``replicas`` each one's state."""
    g = gw(request)
    states = g.pool.states()
    warmed = g.service.warmed.is_set()  # the startup work that would pause the event loop
    body = {"ready": g.pool.ready and warmed,
            "all_ready": warmed and all(s == "ready" for s in states.values()),
            "replicas": states}
    if g.upstreams is not None:  # beside replicas not needed: they serve other model names
        backends = {n: d["state"] for n, d in g.upstreams.describe().items()}
        body["backends"] = backends
        if not g.service.bundled:  # backends only: one that is not ejected can serve
            body["ready"] = warmed and any(st != "ejected" for st in backends.values())
            body["all_ready"] = warmed and all(st == "ready" for st in backends.values())
    if g.writer is not None:
        body["record_writer"] = "alive" if g.writer.alive else "dead"
        body["ready"] = body["ready"] and g.writer.alive
    return JSONResponse(body, status_code=200 if body["ready"] else 503)


@router.get("/metrics")
async def metrics_endpoint(request: Request) -> Response:
    return Response(gw(request).metrics.render(), media_type="text/plain; version=0.0.4")
