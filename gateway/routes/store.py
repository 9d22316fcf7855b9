"""The store's admin endpoints: a read-only query (``POST /debug/query``), one request with
its events, steps and ``why`` (``GET /debug/requests/{trace_id}``), a replay, the bench,
what-if and eval runs the CLI posts, and a tenant's deletion. Store calls run in a worker
thread, never on the event loop; a read whose client leaves is killed in the store."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
import uuid

import httpx
import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.errors import APIError, bad_request
from gateway.routes import gw
from gateway.schemas import DebugQuery, WhatIfRunBody
from gateway.store_api import json_body, own_url
from tracing import queries as Q
from tracing.arrow import jsonable
from tracing.schema import BenchRunRow, EvalResultRow, EvalRunRow, WhatIfRunRow
from tracing.store import QueryRefused, StoreError
from tracing.why import why

log = logging.getLogger("tailscope.store")

router = APIRouter()


async def in_thread(handle, fn, *args):
    if handle is None:
        raise APIError(503, "no trace store is configured (TAILSCOPE_STORE_DSN)",
                       "server_error", code="no_store")
    try:
        return await asyncio.to_thread(fn, *args)
    except QueryRefused as exc:
        raise bad_request(str(exc), "sql") from None
    except StoreError as exc:
        raise APIError(503, str(exc), "server_error", code="store_unavailable") from None
    except Exception as exc:  # ClickHouse's own errors: bad SQL, unknown column, ...
        raise bad_request(f"query failed: {str(exc).splitlines()[0][:500]}", "sql") from None


async def read_until_gone(handle, request: Request, fn):
    """Run the read ``fn(query_id)`` in a thread; if the client leaves first, stop the
    query in the store (KILL QUERY) instead of letting it run to its time limit."""
    query_id = uuid.uuid4().hex
    task = asyncio.ensure_future(in_thread(handle, fn, query_id))
    while not (await asyncio.wait({task}, timeout=0.2))[0]:
        if await request.is_disconnected():
            log.info("client left; cancelling read query %s", query_id)
            await asyncio.to_thread(handle.get().cancel, query_id)
            await asyncio.wait({task})
            task.exception()  # retrieved: the cancelled query's error is expected
            raise APIError(499, "the client closed the request", code="client_closed")
    return task.result()


@router.post("/debug/query")
async def debug_query(request: Request) -> Response:
    """A read-only SELECT: {"sql": ..., "params": {...}, "format": "json" | "arrow"}."""
    g = gw(request)
    g.require_admin(request)
    try:
        query = DebugQuery.model_validate(await json_body(request))
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or "sql"
        raise bad_request(f"{param}: {err['msg']} (body: {{\"sql\": \"SELECT ...\", "
                          "\"params\": {...}, \"format\": \"json\" | \"arrow\"})",
                          param) from None
    body, params, fmt = {"sql": query.sql}, query.params or {}, query.format
    if fmt == "arrow":
        import pyarrow.ipc as ipc

        table = await read_until_gone(
            g.handle, request, lambda qid: g.handle.get().select_arrow(body["sql"], params, qid))
        sink = io.BytesIO()
        with ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        return Response(sink.getvalue(), media_type="application/vnd.apache.arrow.stream")
    cols, rows = await read_until_gone(
        g.handle, request, lambda qid: g.handle.get().select(body["sql"], params, qid))
    return JSONResponse({"columns": cols, "rows": jsonable([list(r) for r in rows])})


def _lookup(store, trace_id: str) -> dict:
    cols, rows = store.select(Q.TRACE_RECORD, {"t": trace_id})
    record = dict(zip(cols, rows[0], strict=True)) if rows else None
    cols, rows = store.select(Q.TRACE_EVENTS, {"t": trace_id})
    events = [dict(zip(cols, r, strict=True)) for r in rows]
    return {"record": record, "events": events}


def _steps(store, replica: str, start_us: int, end_us: int) -> list[dict]:
    cols, rows = store.select(Q.STEPS_BETWEEN,
                                     {"r": replica, "a": start_us, "b": end_us})
    return [dict(zip(cols, r, strict=True)) for r in rows]


@router.get("/debug/requests/{trace_id}")
async def debug_request(trace_id: str, request: Request, top: int = 5) -> dict:
    """The request's record, its state events, and its replica's overlapping steps."""
    g = gw(request)
    g.require_admin(request)
    trace_id = trace_id.lower()
    mem = g.memory.find(trace_id)
    out: dict = {"record": None, "events": [], "engine_steps": [], "source": "memory"}
    if mem is not None:
        d = mem.to_dict()
        out["events"] = d.pop("events")
        out["record"] = d
    if g.handle is not None:
        stored = await in_thread(g.handle, lambda: _lookup(g.handle.get(), trace_id))
        if out["record"] is None and stored["record"] is not None:
            out.update(record=stored["record"], events=stored["events"], source="store")
        elif stored["record"] is not None:
            out["source"] = "memory+store"
    rec = out["record"]
    if rec is None:
        raise APIError(404, f"no record for trace {trace_id}", code="not_found")
    if g.handle is not None and rec.get("replica"):
        start = rec.get("arrival_ts_us")
        if start is None:
            start = int(rec["arrival_ts"].timestamp() * 1e6)
        end = start + int((rec.get("e2e_ms") or 0) * 1000) + 1
        out["engine_steps"] = await in_thread(
            g.handle, lambda: _steps(g.handle.get(), rec["replica"], start, end))
        if rec.get("token_steps") and out["source"] != "memory":  # its steps are stored
            gaps, sentence = await in_thread(g.handle, why, g.handle.get(), trace_id,
                                             max(1, min(top, 100)))
            out["why"] = {"sentence": sentence, "gaps": json.loads(
                gaps.drop(columns=["neighbours"]).to_json(orient="records"))}
    return jsonable(out)


@router.post("/debug/replay")
async def debug_replay(request: Request) -> dict:
    """Run a recorded request again on this gateway (``tracing.replay``):
    ``{"trace_id": ..., "n": 1, "background": 0}``. The replays go through this gateway's
    own ``/v1/completions`` (at the socket address the call came in on, never the Host
    header's, which the caller writes; with the caller's key), so
    each gets a record of its own; the answer is the report (identical or not, the first
    divergence, texts and stage timings side by side, the replays' trace ids)."""
    from tracing import replay as R

    g = gw(request)
    g.require_admin(request)
    body = await json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("trace_id"), str):
        raise bad_request("body: {\"trace_id\": \"...\", \"n\": 1, \"background\": 0}",
                          "trace_id")
    copies, background = body.get("n", 1), body.get("background", 0)
    for name, value, hi in (("n", copies, 16), ("background", background, 8)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= hi:
            raise bad_request(f"{name} must be an integer in [{int(name == 'n')}, {hi}]",
                              name)
    if copies < 1:
        raise bad_request("n must be an integer in [1, 16]", "n")
    trace_id = body["trace_id"].strip().lower()
    mem = g.memory.find(trace_id)
    record = mem.to_dict() if mem is not None else None
    if record is None and g.handle is not None:
        record = (await in_thread(g.handle, lambda: _lookup(g.handle.get(), trace_id)))["record"]
    if record is None:
        raise APIError(404, f"no record for trace {trace_id}", code="not_found")
    try:
        R.replay_params(record)
    except R.ReplayRefused as exc:
        raise APIError(422, str(exc), param="trace_id", code="not_replayable") from None
    auth = request.headers.get("authorization") or ""
    key = auth[7:] if auth.lower().startswith("bearer ") else None
    url = own_url(request)
    try:
        report = await R.replay(url, record, g.config.served_model_name, copies, background,
                                key, key)
    except httpx.HTTPError as exc:  # this gateway did not answer on its own address
        raise APIError(502, f"the replay could not reach {url}: {exc!r}",
                       "server_error", code="replay_failed") from None
    report["replayed_on_config_id"] = g.versions["config_id"]
    return jsonable(report)


@router.post("/debug/bench-runs")
async def record_bench_run(request: Request) -> dict:
    """Store a load-generator run (``tailscope bench`` posts its results here)."""
    g = gw(request)
    g.require_admin(request)
    body = await json_body(request)
    try:
        row = BenchRunRow(run_id=str(body["run_id"])[:64], ts_us=int(time.time() * 1e6),
                          mode=str(body["mode"]), target=str(body.get("target", "")),
                          config_id=str(body.get("config_id") or g.versions["config_id"]),
                          params=json.dumps(body.get("params", {})),
                          results=json.dumps(body.get("results", {})))
    except (ValueError, KeyError, TypeError) as exc:
        raise bad_request(f"bench run: {exc}") from None
    await in_thread(g.handle, lambda: g.handle.get().insert_rows("bench_runs", [row]))
    return {"run_id": row.run_id, "stored": True}


@router.post("/debug/whatif-runs")
async def record_whatif_run(request: Request) -> dict:
    """Store a what-if or sizing run (``tailscope whatif`` / ``size`` post it here)."""
    g = gw(request)
    g.require_admin(request)
    try:
        body = WhatIfRunBody.model_validate(await json_body(request))
    except pydantic.ValidationError as exc:
        raise bad_request(f"what-if run: {exc}") from None
    row = WhatIfRunRow.from_body(body.model_dump(), int(time.time() * 1e6))
    await in_thread(g.handle, lambda: g.handle.get().insert_rows("whatif_runs", [row]))
    return {"run_id": row.run_id, "stored": True}


@router.post("/debug/eval-runs")
async def record_eval_run(request: Request) -> dict:
    """Store an eval run and its per-case results (``tailscope eval run`` posts here):
    ``{"run": {run_id, suite, config_id, config, url}, "results": [{case_id, trace_id,
    score, passed, detail, tags, output, finish_reason, weight}, ...]}``."""
    g = gw(request)
    g.require_admin(request)
    now = int(time.time() * 1e6)
    body = await json_body(request)
    try:
        run, items = body["run"], body["results"]
        run_id = str(run["run_id"])[:64]
        results = [EvalResultRow(
            run_id=run_id, case_id=str(r["case_id"]), trace_id=str(r.get("trace_id", "")),
            ts_us=now, score=float(r["score"]), passed=bool(r["passed"]),
            detail=str(r.get("detail", "")), tags=[str(t) for t in r.get("tags", [])],
            output=str(r.get("output", "")), finish_reason=str(r.get("finish_reason", "")),
            weight=float(r.get("weight", 1.0))) for r in items]
        row = EvalRunRow(run_id=run_id, ts_us=now, suite=str(run["suite"]),
                         config_id=str(run.get("config_id", "")),
                         config=json.dumps(run.get("config", {})),
                         url=str(run.get("url", "")), cases=len(results),
                         passed=sum(r.passed for r in results))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise bad_request(f"eval run: {exc!r}") from None

    def insert() -> None:
        store = g.handle.get()
        store.insert_rows("eval_results", results, token=f"eval-results-{run_id}")
        store.insert_rows("eval_runs", [row], token=f"eval-run-{run_id}")

    await in_thread(g.handle, insert)
    return {"run_id": run_id, "stored": True, "cases": row.cases, "passed": row.passed}


@router.delete("/debug/tenants/{tenant}/records")
async def delete_tenant(tenant: str, request: Request) -> dict:
    """Remove every stored row of a tenant (requests and their events). Rows still in the
    writer's queue or spool are written first, so none of them lands after the delete."""
    g = gw(request)
    g.require_admin(request)

    def run() -> int:
        if g.writer is not None and not g.writer.flush():
            raise StoreError("the record writer could not write its queue and spool; "
                             "nothing was deleted (is the store down?)")
        if g.writer is not None and g.writer.spool_files():
            raise StoreError(f"{len(g.writer.spool_files())} spooled batches are not in the "
                             "store yet; nothing was deleted (is the store down?)")
        return g.handle.get().delete_tenant(tenant)

    return {"tenant": tenant, "deleted_requests": await in_thread(g.handle, run)}

