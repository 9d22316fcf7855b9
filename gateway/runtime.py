"""A running gateway's parts and what ties them together, for ``create_app`` to wire and the
route modules (``gateway.routes``) to use.

``Gateway.build`` makes the parts from a ``GatewayConfig``: the tokenizer, the bundled
replicas (``gateway.config.bundled_pool``) and external backends, the tenants, the
``Service`` that serves requests, ``/metrics``, and where records go (memory, JSON lines, the
trace store through its writer, OTLP), with tail-based retention in front. ``lifespan`` starts
and stops them; ``gated`` is the ingress gate of the API routes, ``require_admin`` the gate of
``/debug/*``.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import Response

from engine import __version__ as engine_version
from engine.text import load_tokenizer
from gateway import __version__ as gateway_version
from gateway import store_api
from gateway.backend import Backend
from gateway.config import GatewayConfig, bundled_pool, config_id, resolved_config, tokenizer_path
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.serving import Service
from gateway.session import RequestSession
from gateway.store_api import StoreProcess, open_store, step_row
from gateway.tenants import Tenant, TenantRegistry, rate_limit_headers
from gateway.upstream import UpstreamPool
from tracing.record import RequestRecord
from tracing.retention import TailRetention
from tracing.sinks import FanoutSink, JsonlSink, MemorySink, RecordSink
from tracing.store import is_embedded, normalise_dsn

log = logging.getLogger("tailscope.gateway")

LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
own_hostname = socket.gethostname().lower()
MAX_TRACE_OWNERS = 65_536  # recent trace ids whose tenant is remembered (own_trace_id)


@dataclass
class Gateway:
    config: GatewayConfig
    tokenizer: object
    pool: Backend
    registry: TenantRegistry
    versions: dict[str, str]
    upstreams: UpstreamPool | None
    service: Service
    metrics: GatewayMetrics
    memory: MemorySink
    retention: TailRetention
    sink: FanoutSink | None = None  # every record's way out (build sets it)
    handle: object = None  # the store client (None: no store)
    writer: object = None  # the record writer (None: no store)
    store_child: StoreProcess | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    trace_owners: OrderedDict[str, str] = field(default_factory=OrderedDict)

    @classmethod
    def build(cls, config: GatewayConfig, extra_sinks: list[RecordSink] | None = None,
              backend: Backend | None = None) -> Gateway:
        """The parts; ``backend`` replaces the replica processes (tests pass an
        ``InProcessBackend``)."""
        tok_path = tokenizer_path(config)
        tokenizer = load_tokenizer(tok_path)
        pool = backend or bundled_pool(config, tok_path)
        registry = TenantRegistry.from_file(config.tenants_file, config.key_id_secret)
        if registry.open:
            log.warning("no API keys configured: open local mode, every request is tenant "
                        "'local'")
        versions = {"engine": engine_version, "gateway": gateway_version,
                    "tokenizer": tokenizer.revision or "", "config_id": config_id(config)}
        upstreams = UpstreamPool(config.backends) if config.backends else None
        service = Service(config, tokenizer, pool, registry, versions, upstreams)
        metrics = GatewayMetrics(pool)
        if upstreams is not None:
            metrics.watch_backends(upstreams)
        memory = MemorySink(config.memory_records)
        retention = TailRetention(config.detail_sample, config.detail_quantile,
                                  warmup=config.detail_warmup)
        gw = cls(config, tokenizer, pool, registry, versions, upstreams, service, metrics,
                 memory, retention)
        gw.sink = FanoutSink(gw._sinks(extra_sinks or []))
        return gw

    def _sinks(self, extra: list[RecordSink]) -> list[RecordSink]:
        """Where records go, and the engine steps' path to the store."""
        config, service = self.config, self.service
        sinks: list[RecordSink] = [self.memory]
        if config.records_jsonl:
            sinks.append(JsonlSink(config.records_jsonl))
        self.pool.on_step = lambda replica, incarnation, msg: service.note_step(msg.stats)
        if config.store_dsn:
            if config.store_process and is_embedded(normalise_dsn(config.store_dsn)):
                self.store_child = StoreProcess(config.store_dsn)
                self.store_child.start(wait=False)  # waited for in lifespan
            self.handle, writer = open_store(
                config.store_dsn, config.spool_dir, config.fault_store_down_file,
                config.store_flush_s, config.query_limits, config.max_queue_mb << 20,
                config.store_key, self.store_child)
            self.writer = writer
            sinks.append(writer)

            def on_step(replica, incarnation, msg) -> None:
                service.note_step(msg.stats)
                writer.emit_step(step_row(replica, incarnation, msg, config.store_ttl_days,
                                          service.trace_of, config.instance_id))

            self.pool.on_step = on_step
            self.metrics.watch_writer(writer)
        if config.otlp_endpoint:
            from tracing.otel import OtelSink, make_exporter

            sinks.append(OtelSink(make_exporter(config.otlp_endpoint, config.otlp_protocol)))
            log.info("exporting spans over OTLP (%s) to %s", config.otlp_protocol,
                     config.otlp_endpoint)
        return sinks + extra

    def on_record(self, record: RequestRecord) -> None:
        try:
            self.metrics.observe(record)  # every ITL, before retention decides what is kept
        except Exception:  # metrics must never take a record (or a response) down with them
            log.exception("metrics failed for trace %s", record.trace_id)
        self.retention.decide(record)
        self.sink.emit(record)

    @asynccontextmanager
    async def lifespan(self, _: FastAPI):
        config = self.config
        # the grammar compiler's build holds the GIL ~0.5 s: done while the replicas load
        warm = asyncio.create_task(asyncio.to_thread(self.service.warm))
        self.metrics.stalls.start()
        await self.pool.start()
        if self.store_child is not None:
            try:
                await asyncio.to_thread(self.store_child.wait_ready)
            except SystemExit:
                await self.pool.close()  # nothing left behind by a gateway that cannot start
                self.store_child.close()
                raise
        # the stored config also says how this gateway admitted requests (not part of the
        # config_id: that hashes resolved_config alone; the first gateway to store it wins)
        config_row = None if self.handle is None else asyncio.create_task(
            store_api.store_config(self.handle, self.versions["config_id"], config.config_name,
                                   {**resolved_config(config), "admission": {
                                       "queue_timeout_s": config.queue_timeout_s}}))
        if self.upstreams is not None:
            await self.upstreams.start()  # health probes
        if config.freeze_gc:  # the serving process only: not a test's own process
            freeze_gc(config.gc_threshold)
        try:
            yield
        finally:
            warm.cancel()
            self.metrics.stalls.stop()
            if config_row is not None:
                config_row.cancel()
            await self.pool.close()
            if self.upstreams is not None:
                await self.upstreams.close()
            self.sink.close()  # the writer drains: every record is inserted or spooled
            if self.handle is not None:
                self.handle.close()
            if self.store_child is not None:
                self.store_child.close()

    def on_exit_signal(self) -> None:
        """SIGTERM/SIGINT: kill the store reads in flight (in a thread: this runs on the
        event loop, and the kill waits for the writer's client)."""
        if self.handle is not None and self.handle.opened:
            threading.Thread(target=self.handle.cancel_reads, name="cancel-reads",
                             daemon=True).start()

    def require_admin(self, request: Request) -> None:
        """/debug/*: the admin key or an admin tenant's key. Open local mode without an admin
        key serves them to loopback clients only (a local, single-user setup); anyone else
        needs ``TAILSCOPE_ADMIN_KEY``."""
        config, registry = self.config, self.registry
        auth = request.headers.get("authorization") or ""
        if config.admin_key and hmac.compare_digest(auth.encode(),
                                                    f"Bearer {config.admin_key}".encode()):
            return
        if registry.open and not config.admin_key:
            host = request.client.host if request.client else ""
            if host in LOOPBACK:
                check_host(request)
                return
            raise APIError(403, "debug endpoints are served only to loopback clients when no "
                           "admin key is set (TAILSCOPE_ADMIN_KEY)", "permission_error",
                           code="forbidden")
        if registry.open:
            raise APIError(401, "this endpoint needs the admin key", "authentication_error",
                           code="invalid_api_key")
        tenant, _ = registry.authenticate(auth)
        if not tenant.admin:
            raise APIError(403, f"tenant {tenant.name!r} is not an admin",
                           "permission_error", code="forbidden")

    def own_trace_id(self, request: Request, trace, tenant: Tenant) -> None:
        """A client's traceparent may name a trace id another tenant's requests have: its
        record would then stand for theirs (``/debug/requests/{id}``, replay). Such a request
        gets a trace id of its own (its traceparent's stays its parent span)."""
        owners = self.trace_owners
        trace_id = trace.record.trace_id
        owner = owners.get(trace_id)
        if owner is not None and owner != tenant.name and trace.client_trace:
            log.warning("a request of tenant %r named trace %s, which is tenant %r's: it gets "
                        "a trace id of its own", tenant.name, trace_id, owner)
            trace_id = request.state.trace_id = secrets.token_hex(16)
            trace.renamed(trace_id)
        owners[trace_id] = tenant.name
        owners.move_to_end(trace_id)
        if len(owners) > MAX_TRACE_OWNERS:
            owners.popitem(last=False)

    async def gated(self, request: Request, handler) -> Response:
        """Ingress gate (auth, request rate, concurrency) before any parsing or tokenizing; the
        handler gets the request's session, which holds the tenant's slot from here on. The
        slot is released here on an error (once: a no-op when the handler already did),
        otherwise by whoever ends the answer."""
        registry = self.registry
        tenant, key_id = registry.authenticate(request.headers.get("authorization"))
        trace = request.state.trace
        if trace is not None:  # /tokenize and /detokenize have no record
            trace.admitted(tenant.name, key_id, tenant.ttl_days or self.config.store_ttl_days)
            self.own_trace_id(request, trace, tenant)
            registry.check_bench_run(tenant, trace.record.bench_run,
                                     request.headers.get("x-tailscope-bench-token", ""))
        try:
            registry.admit_request(tenant)
        except APIError as exc:  # a 429 says where the tenant's buckets stand too
            exc.headers.update(rate_limit_headers(tenant))
            raise
        session = RequestSession(request, tenant, registry, trace)
        try:
            response = await handler(session)
        except BaseException as exc:
            session.release()
            if isinstance(exc, APIError):
                exc.headers.update(rate_limit_headers(tenant))
            raise
        response.headers.update(rate_limit_headers(tenant))
        return response


def check_host(request: Request) -> None:
    """A loopback client in open local mode may still be a web page: a hostname the page's
    site re-pointed at 127.0.0.1 (DNS rebinding) makes it same-origin with this gateway.
    Such a request names that hostname in Host, so only loopback names and this gateway's own
    addresses are answered."""
    host = (request.headers.get("host") or "").lower()
    name = host[1:host.index("]")] if host.startswith("[") and "]" in host \
        else host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    server = request.scope.get("server") or ("",)
    if name not in LOOPBACK and name not in (str(server[0]).lower(), own_hostname):
        raise APIError(421, f"debug endpoints answer requests for this gateway's own "
                       f"addresses or loopback names only, not Host {host[:100]!r} (a "
                       "browser page on another site?)", "invalid_request_error",
                       code="misdirected_request")


def freeze_gc(threshold: int) -> None:
    """Everything loaded so far (modules, the tokenizer, the store client) lives as long as
    the process: keep it out of the collector's full passes, which otherwise walk it all and
    paused the event loop for 20-150 ms at a time under load. Python's generation-0 threshold
    (700) fires constantly in a gateway whose allocations and frees nearly balance, each
    collection walking the in-flight requests and freeing nothing: ``threshold`` (20,000 by
    default) lets the records queued for a flush pass without one (docs/design/decisions.md;
    figures: docs/benchmarks/store.md)."""
    gc.collect()
    gc.freeze()
    if threshold > 0:
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(threshold, older, oldest)
