"""The gateway's own debug endpoints: its resolved config, its replicas and backends, and
bench-run tokens (the store's endpoints are ``gateway.routes.store``)."""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Request

from gateway import store_api
from gateway.config import resolved_config
from gateway.errors import APIError
from gateway.routes import gw

router = APIRouter()


@router.get("/debug/config")
async def debug_config(request: Request) -> dict:
    """The gateway's resolved config, its config_id and versions (the eval runner reads them
    to label a run). Open: it holds no secrets."""
    from engine.config import auto_dtype
    from engine.profiles import explain

    g = gw(request)
    chosen, why = auto_dtype()
    return {"config_id": g.versions["config_id"], "name": g.config.config_name,
            "config": resolved_config(g.config), "versions": g.versions,
            "dtype_auto": {"chooses": chosen, "because": why},
            "profile": {"name": g.config.engine.profile, "because": explain(g.config.engine)},
            **({"store_process": g.store_child.describe()} if g.store_child else {})}


@router.get("/debug/replicas")
async def debug_replicas(request: Request) -> dict:
    """Each replica's process, restarts, in-flight requests and latest KV usage."""
    g = gw(request)
    g.require_admin(request)
    return {**g.pool.describe(), **(g.upstreams.describe() if g.upstreams else {})}


@router.post("/debug/bench-runs/open")
async def open_bench_run(request: Request) -> dict:
    """A run id and its token: requests of any tenant that send both
    (``x-tailscope-bench-run``, ``x-tailscope-bench-token``) are tagged into the run
    (``tailscope bench`` asks for one when it has the admin key)."""
    g = gw(request)
    g.require_admin(request)
    body = await store_api.json_body(request)
    run_id = body.get("run_id") if isinstance(body, dict) else None
    if run_id is None:
        run_id = f"bench-{secrets.token_hex(6)}"
    if not isinstance(run_id, str) or not 0 < len(run_id) <= 64:
        raise APIError(400, "run_id must be a string of 1 to 64 characters",
                       param="run_id", code="invalid_value")
    return {"run_id": run_id, "token": g.registry.bench_token(run_id)}
