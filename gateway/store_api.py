"""The gateway's side of the trace store: opening it, feeding the writer, and the admin read
endpoints (``POST /debug/query``, ``GET /debug/requests/{trace_id}``, tenant deletion).

In embedded mode (chDB) the gateway process owns the store's directory, so every other tool
reads through these endpoints; store calls run in a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.observer import StepStats
from gateway.errors import APIError, bad_request
from gateway.schemas import DebugQuery, WhatIfRunBody
from tracing import queries as Q
from tracing.schema import (
    BenchRunRow,
    ConfigRow,
    EngineStepRow,
    EvalResultRow,
    EvalRunRow,
    WhatIfRunRow,
)
from tracing.store import (
    QueryLimits,
    QueryRefused,
    Store,
    StoreError,
    connect,
    is_embedded,
    jsonable,
    normalise_dsn,
)
from tracing.writer import RecordWriter

log = logging.getLogger("tailscope.store")


class StoreHandle:
    """Opens (and migrates) the store on first use; a server that is down is retried later."""

    def __init__(self, dsn: str, limits: QueryLimits | None = None,
                 key: str | None = None, inbox: Path | None = None) -> None:
        self.dsn = normalise_dsn(dsn)
        self.limits, self.key, self.inbox = limits, key, inbox
        self._store: Store | None = None
        self._lock = threading.Lock()

    def get(self) -> Store:
        with self._lock:
            if self._store is None:
                store = connect(self.dsn, self.limits, self.key, self.inbox)
                store.migrate()
                self._store = store
            return self._store

    @property
    def opened(self) -> bool:
        return self._store is not None

    def cancel_reads(self) -> None:
        """Kill every read in flight (shutdown: nothing should wait on them)."""
        try:
            if self._store is not None:
                self._store.cancel()
        except Exception:  # the store may be down; shutting down goes on regardless
            log.exception("could not cancel the reads in flight")

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


class StoreProcess:
    """The embedded store in a supervised child process (``TAILSCOPE_STORE_PROCESS=1``):
    ``tailscope store serve`` on a private loopback port with a random key, reached through a
    ``tailscope://`` DSN. chDB's memory (its caches, merges, query buffers) then lives outside
    the gateway, and a crash of the store costs no request: the writer spools while the child
    is down and replays once it is back (the same insert tokens: nothing twice). A child that
    exits is started again after ``restart_s``; it exits by itself when the gateway is gone
    (``--parent-pid``)."""

    def __init__(self, dsn: str, restart_s: float = 1.0, start_timeout_s: float = 60.0) -> None:
        import secrets

        from tracing.client import free_port

        self.dsn, self.restart_s, self.start_timeout_s = normalise_dsn(dsn), restart_s, \
            start_timeout_s
        self.port, self.key = free_port(), secrets.token_hex(24)
        # where the writer hands the child its batches as Arrow files (same host: no HTTP body;
        # tracing.store_server), private to this user (mkdtemp: mode 0700)
        self.inbox = Path(tempfile.mkdtemp(prefix="tailscope-store-inbox-"))
        self.url = f"tailscope://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="store-process", daemon=True)

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tailscope.cli", "store", "--dsn", self.dsn, "serve",
             "--port", str(self.port), "--parent-pid", str(os.getpid()),
             "--inbox", str(self.inbox)],
            env={**os.environ, "TAILSCOPE_STORE_KEY": self.key, "PYTHONUNBUFFERED": "1"},
            # a session of its own, as a replica (gateway.replicas: a terminal's Ctrl-C is the
            # gateway's alone, which drains into the child before it stops it)
            start_new_session=True)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self, wait: bool = True) -> None:
        """Start the child and wait until it answers (records before that would only spool);
        ``wait=False``: the caller calls ``wait_ready`` later (the gateway: while its replicas
        load, so the two start-ups overlap)."""
        self._spawn()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Until the child answers; SystemExit where it exits or stays silent."""
        deadline = time.monotonic() + self.start_timeout_s
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                if self.proc.poll() is None:  # up but not answering: not left behind
                    self.proc.kill()
                    self.proc.wait()
                raise SystemExit(f"tailscope: the store process for {self.dsn} did not start "
                                 f"(exit code {self.proc.poll()}); see its log above")
            time.sleep(0.1)
        self._thread.start()
        log.info("trace store in child process %d (%s)", self.proc.pid, self.dsn)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            if self.proc is not None and self.proc.poll() is not None:
                log.error("store process exited with code %s; starting it again in %.0f s "
                          "(records spool meanwhile)", self.proc.returncode, self.restart_s)
                if self._stop.wait(self.restart_s):
                    return
                self.restarts += 1
                self._spawn()

    def describe(self) -> dict:
        return {"pid": self.proc.pid if self.proc else None, "restarts": self.restarts,
                "alive": self.proc is not None and self.proc.poll() is None}

    def close(self) -> None:
        """After the writer has drained into it: stop the child."""
        from tracing.client import stop_process

        self._stop.set()
        if self.proc is not None:
            stop_process(self.proc, 20)
        shutil.rmtree(self.inbox, ignore_errors=True)


def default_spool_dir(dsn: str) -> Path:
    dsn = normalise_dsn(dsn)
    if is_embedded(dsn):
        return Path(dsn[len("chdb://"):] + "-spool")
    return Path(".tailscope/spool").resolve()


def open_store(dsn: str, spool_dir: str | None, fault_file: str | None,
               flush_s: float = 1.0, limits: QueryLimits | None = None,
               max_queue_bytes: int = 256 << 20, key: str | None = None,
               child: StoreProcess | None = None) -> tuple[StoreHandle, RecordWriter]:
    """The store and its writer; with ``child`` (a started ``StoreProcess``) the writer and the
    debug endpoints reach the store through it, and the spool stays where it would be."""
    handle = StoreHandle(child.url, limits, child.key, child.inbox) if child \
        else StoreHandle(dsn, limits, key)
    if is_embedded(handle.dsn):  # fail fast: e.g. another gateway already owns the directory
        try:
            handle.get()
        except StoreError as exc:
            raise SystemExit(f"tailscope: {exc}") from None
    spool = Path(spool_dir) if spool_dir else default_spool_dir(dsn)
    writer = RecordWriter(handle.get, spool, max_age_s=flush_s, fault_file=fault_file,
                          max_queue_bytes=max_queue_bytes)
    log.info("trace store: %s (spool %s)", handle.dsn, spool)
    return handle, writer


async def store_config(handle: StoreHandle, config_id: str, name: str, config: dict,
                       retry_s: float = 30.0) -> None:
    """Write this gateway's config to the ``configs`` table unless that config_id is there
    already; while the store is down, try again every ``retry_s`` (a task the gateway cancels
    when it stops)."""
    row = ConfigRow(config_id=config_id, ts_us=int(time.time() * 1e6), name=name,
                    config=json.dumps(config, sort_keys=True))

    def once() -> None:
        store = handle.get()
        if store.select(Q.CONFIG_EXISTS, {"c": config_id})[1][0][0] == 0:
            store.insert_rows("configs", [row], token=f"config-{config_id}")

    while True:
        try:
            await asyncio.to_thread(once)
            return
        except Exception as exc:  # the store down or refusing: never the gateway's problem
            log.warning("storing config %s failed (%s); retrying in %.0f s", config_id,
                        str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
                        retry_s)
            await asyncio.sleep(retry_s)


# the engine_steps columns that are the replica's StepStats fields of the same name
_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(EngineStepRow)
                     if f.name in StepStats.__struct_fields__)


def step_row(replica: str, incarnation: int, msg, ttl_days: int,
             trace_of: Callable[[str], str] | None = None, instance: str = "") -> EngineStepRow:
    """The engine_steps row of a StepReport: its StepStats field for field (``_STEP_FIELDS``),
    plus where and when (the replica, its incarnation, the wall clock), the queue lengths, and
    its members (engine request ids turned into trace ids by ``trace_of``), and the gateway
    ``instance``.

    It runs on the event loop for every engine step, so the fields are named one by one: the
    row built from a dict of ``_STEP_FIELDS`` (``**{f: getattr(stats, f) ...}``) cost 4.3 us
    against 3.0 (16 members, offline) and ~30 us in a loaded tiny-model gateway, where every
    Python operation on the loop ran several times slower than offline.
    tests/gateway/test_records.py checks that every field of ``_STEP_FIELDS`` is copied."""
    s = msg.stats
    ms = s.members
    return EngineStepRow(
        replica=replica, incarnation=incarnation, step=s.step, ts_us=s.wall_ns // 1000,
        duration_ms=s.duration_ms, num_seqs=s.num_seqs, prefill_tokens=s.prefill_tokens,
        decode_tokens=s.decode_tokens, kv_blocks_used=s.kv_blocks_used,
        kv_blocks_total=s.kv_blocks_total, forward_ms=s.forward_ms, sample_ms=s.sample_ms,
        host_ms=s.host_ms, running=msg.running, waiting=msg.waiting,
        prefix_queries=s.prefix_queries, prefix_hits=s.prefix_hits, evictions=s.evictions,
        preemptions=s.preemptions, prefill_context=s.prefill_context,
        member_traces=[trace_of(m.request_id) for m in ms] if trace_of else
        [m.request_id for m in ms],
        member_prefill=[m.prefill_tokens for m in ms],
        member_decode=[m.decode_tokens for m in ms], ttl_days=ttl_days, instance=instance)


def own_url(request: Request) -> str:
    """This gateway, at the local address of the caller's connection."""
    host, port = request.scope["server"]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def json_body(request: Request):
    """A debug POST's JSON body. Only ``application/json`` is taken: a browser sends that
    type cross-site only after a CORS preflight this gateway never grants, so a page the
    operator visits cannot post here (a ``text/plain`` form post is refused)."""
    ctype = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if ctype != "application/json":
        raise APIError(415, f"content-type must be application/json, not {ctype!r}",
                       code="unsupported_media_type")
    try:
        return await request.json()
    except (ValueError, RecursionError):
        raise bad_request("request body is not valid JSON") from None


def register(app: FastAPI, handle: StoreHandle | None, memory, require_admin,
             writer: RecordWriter | None = None, config_id: str = "",
             served_model: str = "") -> None:
    """``config_id`` (this gateway's) is stored with a bench run that names none: the run
    measured this gateway. ``served_model``: the model name replays are sent as."""
    async def in_thread(fn, *args):
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

    async def read_until_gone(request: Request, fn):
        """Run the read ``fn(query_id)`` in a thread; if the client leaves first, stop the
        query in the store (KILL QUERY) instead of letting it run to its time limit."""
        query_id = uuid.uuid4().hex
        task = asyncio.ensure_future(in_thread(fn, query_id))
        while not (await asyncio.wait({task}, timeout=0.2))[0]:
            if await request.is_disconnected():
                log.info("client left; cancelling read query %s", query_id)
                await asyncio.to_thread(handle.get().cancel, query_id)
                await asyncio.wait({task})
                task.exception()  # retrieved: the cancelled query's error is expected
                raise APIError(499, "the client closed the request", code="client_closed")
        return task.result()

    @app.post("/debug/query")
    async def debug_query(request: Request) -> Response:
        """A read-only SELECT: {"sql": ..., "params": {...}, "format": "json" | "arrow"}."""
        require_admin(request)
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
                request, lambda qid: handle.get().select_arrow(body["sql"], params, qid))
            sink = io.BytesIO()
            with ipc.new_stream(sink, table.schema) as w:
                w.write_table(table)
            return Response(sink.getvalue(), media_type="application/vnd.apache.arrow.stream")
        cols, rows = await read_until_gone(
            request, lambda qid: handle.get().select(body["sql"], params, qid))
        return JSONResponse({"columns": cols, "rows": jsonable([list(r) for r in rows])})

    def _lookup(trace_id: str) -> dict:
        store = handle.get()
        cols, rows = store.select(Q.TRACE_RECORD, {"t": trace_id})
        record = dict(zip(cols, rows[0], strict=True)) if rows else None
        cols, rows = store.select(Q.TRACE_EVENTS, {"t": trace_id})
        events = [dict(zip(cols, r, strict=True)) for r in rows]
        return {"record": record, "events": events}

    def _steps(replica: str, start_us: int, end_us: int) -> list[dict]:
        cols, rows = handle.get().select(Q.STEPS_BETWEEN,
                                         {"r": replica, "a": start_us, "b": end_us})
        return [dict(zip(cols, r, strict=True)) for r in rows]

    @app.get("/debug/requests/{trace_id}")
    async def debug_request(trace_id: str, request: Request, top: int = 5) -> dict:
        """The request's record, its state events, and its replica's overlapping steps."""
        require_admin(request)
        trace_id = trace_id.lower()
        mem = memory.find(trace_id)
        out: dict = {"record": None, "events": [], "engine_steps": [], "source": "memory"}
        if mem is not None:
            d = mem.to_dict()
            out["events"] = d.pop("events")
            out["record"] = d
        if handle is not None:
            stored = await in_thread(_lookup, trace_id)
            if out["record"] is None and stored["record"] is not None:
                out.update(record=stored["record"], events=stored["events"], source="store")
            elif stored["record"] is not None:
                out["source"] = "memory+store"
        rec = out["record"]
        if rec is None:
            raise APIError(404, f"no record for trace {trace_id}", code="not_found")
        if handle is not None and rec.get("replica"):
            start = rec.get("arrival_ts_us")
            if start is None:
                start = int(rec["arrival_ts"].timestamp() * 1e6)
            end = start + int((rec.get("e2e_ms") or 0) * 1000) + 1
            out["engine_steps"] = await in_thread(_steps, rec["replica"], start, end)
            if rec.get("token_steps") and out["source"] != "memory":  # its steps are stored
                gaps, sentence = await in_thread(Q.why, handle.get(), trace_id,
                                                 max(1, min(top, 100)))
                out["why"] = {"sentence": sentence, "gaps": json.loads(
                    gaps.drop(columns=["neighbours"]).to_json(orient="records"))}
        return jsonable(out)

    @app.post("/debug/replay")
    async def debug_replay(request: Request) -> dict:
        """Run a recorded request again on this gateway (``tracing.replay``):
        ``{"trace_id": ..., "n": 1, "background": 0}``. The replays go through this gateway's
        own ``/v1/completions`` (at the socket address the call came in on, never the Host
        header's, which the caller writes; with the caller's key), so
        each gets a record of its own; the answer is the report (identical or not, the first
        divergence, texts and stage timings side by side, the replays' trace ids)."""
        from tracing import replay as R

        require_admin(request)
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
        mem = memory.find(trace_id)
        record = mem.to_dict() if mem is not None else None
        if record is None and handle is not None:
            record = (await in_thread(_lookup, trace_id))["record"]
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
            report = await R.replay(url, record, served_model, copies, background, key, key)
        except httpx.HTTPError as exc:  # this gateway did not answer on its own address
            raise APIError(502, f"the replay could not reach {url}: {exc!r}",
                           "server_error", code="replay_failed") from None
        report["replayed_on_config_id"] = config_id
        return jsonable(report)

    @app.post("/debug/bench-runs")
    async def record_bench_run(request: Request) -> dict:
        """Store a load-generator run (``tailscope bench`` posts its results here)."""
        require_admin(request)
        body = await json_body(request)
        try:
            row = BenchRunRow(run_id=str(body["run_id"])[:64], ts_us=int(time.time() * 1e6),
                              mode=str(body["mode"]), target=str(body.get("target", "")),
                              config_id=str(body.get("config_id") or config_id),
                              params=json.dumps(body.get("params", {})),
                              results=json.dumps(body.get("results", {})))
        except (ValueError, KeyError, TypeError) as exc:
            raise bad_request(f"bench run: {exc}") from None
        await in_thread(lambda: handle.get().insert_rows("bench_runs", [row]))
        return {"run_id": row.run_id, "stored": True}

    @app.post("/debug/whatif-runs")
    async def record_whatif_run(request: Request) -> dict:
        """Store a what-if or sizing run (``tailscope whatif`` / ``size`` post it here)."""
        require_admin(request)
        try:
            body = WhatIfRunBody.model_validate(await json_body(request))
        except pydantic.ValidationError as exc:
            raise bad_request(f"what-if run: {exc}") from None
        row = WhatIfRunRow.from_body(body.model_dump(), int(time.time() * 1e6))
        await in_thread(lambda: handle.get().insert_rows("whatif_runs", [row]))
        return {"run_id": row.run_id, "stored": True}

    @app.post("/debug/eval-runs")
    async def record_eval_run(request: Request) -> dict:
        """Store an eval run and its per-case results (``tailscope eval run`` posts here):
        ``{"run": {run_id, suite, config_id, config, url}, "results": [{case_id, trace_id,
        score, passed, detail, tags, output, finish_reason, weight}, ...]}``."""
        require_admin(request)
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
            store = handle.get()
            store.insert_rows("eval_results", results, token=f"eval-results-{run_id}")
            store.insert_rows("eval_runs", [row], token=f"eval-run-{run_id}")

        await in_thread(insert)
        return {"run_id": run_id, "stored": True, "cases": row.cases, "passed": row.passed}

    @app.delete("/debug/tenants/{tenant}/records")
    async def delete_tenant(tenant: str, request: Request) -> dict:
        """Remove every stored row of a tenant (requests and their events). Rows still in the
        writer's queue or spool are written first, so none of them lands after the delete."""
        require_admin(request)

        def run() -> int:
            if writer is not None and not writer.flush():
                raise StoreError("the record writer could not write its queue and spool; "
                                 "nothing was deleted (is the store down?)")
            if writer is not None and writer.spool_files():
                raise StoreError(f"{len(writer.spool_files())} spooled batches are not in the "
                                 "store yet; nothing was deleted (is the store down?)")
            return handle.get().delete_tenant(tenant)

        return {"tenant": tenant, "deleted_requests": await in_thread(run)}

