"""The gateway's side of the trace store: opening it (in a supervised child process for an
embedded store), feeding the writer (step rows, the config row) and what its admin endpoints
share (``gateway.routes.store``). In embedded mode (chDB) the gateway process owns the store's
directory, so every other tool reads through those endpoints.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from fastapi import Request

from engine.observer import StepStats
from gateway.errors import APIError, bad_request
from tracing import queries as Q
from tracing.schema import (
    ConfigRow,
    EngineStepRow,
)
from tracing.store import (
    QueryLimits,
    Store,
    StoreError,
    connect,
    is_embedded,
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
