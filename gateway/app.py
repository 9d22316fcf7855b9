"""The FastAPI gateway: OpenAI-compatible endpoints over engine replica processes.

``create_app`` wires the parts: ``TraceMiddleware`` (ids, traceparent, body limit, one record
per request), the ingress gate (tenants: auth, rate and concurrency limits, before any parsing),
``Service`` (validation, tokenizing, routing, streaming), the ``ReplicaPool`` (replica
processes), the record sinks and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import hmac
import json
import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import __version__ as engine_version
from engine.config import EngineConfig
from engine.cpus import replica_cpus
from engine.text import load_tokenizer
from gateway import __version__ as gateway_version
from gateway import replicas, store_api
from gateway.backend import Backend, NoReplicas
from gateway.errors import APIError, api_error_handler, http_error_handler
from gateway.limits import RequestLimits
from gateway.metrics import GatewayMetrics
from gateway.replicas import ReplicaPool
from gateway.schemas import TokenizerInfoResponse
from gateway.serving import Service
from gateway.store_api import StoreProcess, open_store, step_row
from gateway.tenants import TenantRegistry, rate_limit_headers
from gateway.trace import TraceMiddleware
from gateway.upstream import UpstreamConfig, UpstreamPool
from tailscope.keys import check_key, redact_url
from tracing.record import RequestRecord
from tracing.retention import TailRetention
from tracing.sinks import FanoutSink, JsonlSink, MemorySink, RecordSink
from tracing.store import (
    QueryLimits,
    is_embedded,
    normalise_dsn,
    skip_pandas_probe,
    use_arrow_pool,
)

log = logging.getLogger("tailscope.gateway")
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
own_hostname = socket.gethostname().lower()
# traced: one record each (a completions batch: one per prompt)
API_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


@dataclass
class GatewayConfig:
    model: str = "bundled"  # what replicas load
    tokenizer: str | None = None  # defaults to the model path
    served_model_name: str = "SmolLM2-135M-Instruct"
    replicas: int = 1
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)  # every replica's
    max_body_bytes: int = 1 << 20
    tenants_file: str | None = None  # TOML with [[tenants]]; none = open local mode
    max_inflight_per_replica: int | None = None  # load shedding threshold (4 x max_num_seqs)
    queue_timeout_s: float | None = 60.0  # engine queue wait before TIMED_OUT (504)
    max_buffered_deltas: int = 256  # per request, before the replica pauses it
    responses_store_mb: float = 64.0  # /v1/responses kept for previous_response_id (0: none)
    slow_client_timeout_s: float = 30.0  # paused this long: cancelled
    records_jsonl: str | None = None  # append every request record to this file
    record_token_ids: bool = True  # privacy: False leaves token ids out of records
    # tail-based retention (tracing.retention): the share of ordinary requests that keep full
    # detail (1: all of them), the tail quantile that always keeps it, the warm-up
    detail_sample: float = 1.0
    detail_quantile: float = 0.99
    detail_warmup: int = 100
    memory_records: int = 10_000  # the latest records kept for /debug/requests
    store_dsn: str | None = None  # chdb:///path, http(s)://host:8123, tailscope://host:8124
    store_key: str | None = None  # the store process's key (tailscope:// DSNs)
    store_process: bool = True  # an embedded (chDB) store in a supervised child process
    spool_dir: str | None = None  # where batches wait while the store is down
    store_ttl_days: int = 30  # default row TTL (a tenant's ttl_days overrides)
    store_flush_s: float = 5.0  # a batch is inserted when its oldest record is this old
    admin_key: str | None = None  # Bearer key for /debug/* (besides admin tenants' keys)
    fault_store_down_file: str | None = None  # fault injection: inserts fail while it exists
    otlp_endpoint: str | None = None  # export one span per request over OTLP when set
    otlp_protocol: str = "http/protobuf"  # or "grpc"
    # request fields filled in when a request leaves them out / forced on every request
    sampling_defaults: dict = dataclasses.field(default_factory=dict)
    sampling_overrides: dict = dataclasses.field(default_factory=dict)
    config_name: str = ""  # a label (an engine config file's name); not part of config_id
    limits: RequestLimits = dataclasses.field(default_factory=RequestLimits)
    query_limits: QueryLimits = dataclasses.field(default_factory=QueryLimits)
    request_timeout_s: float | None = 600.0  # gateway-side deadline of every request (504)
    heartbeat_timeout_s: float = 30.0  # a replica silent this long is stalled: restarted
    max_queue_mb: int = 256  # the record writer's queue, in estimated bytes
    key_id_secret: str | None = None  # keys api_key_id (default: .tailscope/key-id-secret)
    # external OpenAI-compatible servers, each serving a model name of its own (gateway.upstream)
    backends: tuple[UpstreamConfig, ...] = ()
    # this gateway among several writing into one store (docs/guides/scaling-out.md): on every
    # record, event and step row, and the prefix of its replicas' ids ("<instance>/r0"); ""
    # (one gateway per store) keeps them "r0", "r1", ...
    instance_id: str = ""
    # replicas on other hosts (docs/guides/scaling-out.md): (id, their tcp:// inbox); they connect
    # to replica_outbox (tcp://host:port bound here) and sign every message with replica_key
    remote_replicas: tuple[tuple[str, str], ...] = ()
    replica_outbox: str | None = None
    replica_key: str | None = None
    # TAILSCOPE_REPLICA_CPUS: each local replica's CPUs ("0-3|4-7", one list for all, auto; "":
    # not pinned): engine.cpus
    replica_cpus: str = ""
    freeze_gc: bool = False  # gc.freeze() once started (``tailscope serve`` sets it)
    # with freeze_gc: the collector's generation-0 threshold (0: Python's own, 700)
    gc_threshold: int = 20000
    # browser clients (TAILSCOPE_CORS_ORIGINS): the origins allowed to call the API paths
    # ("*": any); empty: no CORS headers (a browser page of another origin cannot read answers)
    cors_origins: tuple[str, ...] = ()


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


# a backend's settings that change neither outputs nor timings (config ids stay as they were)
NOT_CONFIG = ("api_key_env", "max_response_mb", "max_line_kb")


def resolved_config(config: GatewayConfig) -> dict:
    """What decides the outputs and timings: model, engine settings and sampling policy."""
    engine = config.engine.as_dict()
    for name, default in (("compile_mode", "jit"), ("profile", "exact")):
        if engine[name] == default:  # (absent at its default: earlier config ids stay)
            del engine[name]
    out = {"model": config.model, "served_model_name": config.served_model_name,
           "replicas": config.replicas, "engine": engine,
           "sampling": {"defaults": config.sampling_defaults,
                        "overrides": config.sampling_overrides}}
    if config.remote_replicas:  # (absent otherwise, like backends)
        out["remote_replicas"] = sorted(rid for rid, _ in config.remote_replicas)
    if config.backends:  # (absent otherwise: config ids without backends stay as they were)
        out["backends"] = [{k: redact_url(v) if k == "url" else v
                            for k, v in dataclasses.asdict(b).items() if k not in NOT_CONFIG}
                           for b in config.backends]
    return out


def config_id(config: GatewayConfig) -> str:
    """A stable hash of ``resolved_config`` (key order and the config's name do not count)."""
    data = resolved_config(config)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def prepare_replicas(config: GatewayConfig) -> int:
    """``tailscope serve --prepare-only``: build what the config's local replicas need at
    their start (``gateway.replicas.prepare``) and return; no socket, no store, no tokenizer
    loaded here. Remote replicas and upstream backends prepare on their own hosts."""
    return replicas.prepare(config.model, config.engine,
                            replicas.local_ids(config.instance_id, config.replicas),
                            tokenizer_path(config),
                            replica_cpus(config.replica_cpus, config.replicas))


def tokenizer_path(config: GatewayConfig) -> str:
    """The gateway's tokenizer, which its replicas get too (``--tokenizer``): the config's, or
    the model's own."""
    from engine.loader.paths import resolve_model_path

    return str(config.tokenizer or resolve_model_path(config.model))


def bundled_pool(config: GatewayConfig, tok_path: str) -> Backend:
    """The bundled replicas (local processes and remote ones), or none at all where every
    model is an external backend's: such a gateway starts no replica and loads no model."""
    if config.replicas == 0 and not config.remote_replicas:
        if not config.backends:
            raise ValueError("no replicas and no backends: give --replicas 1 or more, remote "
                             "replicas, or --backend NAME=URL")
        log.info("no bundled replicas: serving the external backends only")
        return NoReplicas()
    from engine.profiles import explain

    log.info("engine profile %s (%s)", config.engine.profile, explain(config.engine))
    return ReplicaPool(config.model, config.engine, config.replicas,
                       config.max_inflight_per_replica, config.max_buffered_deltas,
                       config.slow_client_timeout_s, config.heartbeat_timeout_s,
                       tokenizer=tok_path, instance=config.instance_id,
                       remote=dict(config.remote_replicas),
                       key=(config.replica_key or "").encode() or None,
                       outbox_bind=config.replica_outbox,
                       cpus=replica_cpus(config.replica_cpus, config.replicas))


def create_app(config: GatewayConfig, extra_sinks: list[RecordSink] | None = None,
               backend: Backend | None = None) -> FastAPI:
    """The gateway; ``backend`` replaces the replica processes (tests pass an
    ``InProcessBackend``)."""
    check_key("TAILSCOPE_ADMIN_KEY", config.admin_key)
    check_key("TAILSCOPE_REPLICA_KEY", config.replica_key)
    skip_pandas_probe()  # ~40 MB of RSS (tracing.store)
    use_arrow_pool()  # the writer's conversions without huge-page faults (tracing.store)
    tok_path = tokenizer_path(config)
    tokenizer = load_tokenizer(tok_path)
    pool = backend or bundled_pool(config, tok_path)
    registry = TenantRegistry.from_file(config.tenants_file, config.key_id_secret)
    if registry.open:
        log.warning("no API keys configured: open local mode, every request is tenant 'local'")
    versions = {"engine": engine_version, "gateway": gateway_version,
                "tokenizer": tokenizer.revision or "", "config_id": config_id(config)}
    upstreams = UpstreamPool(config.backends) if config.backends else None
    service = Service(config, tokenizer, pool, registry, versions, upstreams)
    metrics = GatewayMetrics(pool)
    if upstreams is not None:
        metrics.watch_backends(upstreams)
    memory = MemorySink(config.memory_records)
    sinks: list[RecordSink] = [memory]
    if config.records_jsonl:
        sinks.append(JsonlSink(config.records_jsonl))
    handle = writer = store_child = None
    pool.on_step = lambda replica, incarnation, msg: service.note_step(msg.stats)
    if config.store_dsn:
        if config.store_process and is_embedded(normalise_dsn(config.store_dsn)):
            store_child = StoreProcess(config.store_dsn)
            store_child.start(wait=False)  # waited for in lifespan, while the replicas load
        handle, writer = open_store(config.store_dsn, config.spool_dir,
                                    config.fault_store_down_file, config.store_flush_s,
                                    config.query_limits, config.max_queue_mb << 20,
                                    config.store_key, store_child)
        sinks.append(writer)
        def on_step(replica, incarnation, msg) -> None:
            service.note_step(msg.stats)
            writer.emit_step(step_row(replica, incarnation, msg, config.store_ttl_days,
                                      service.trace_of, config.instance_id))

        pool.on_step = on_step
        metrics.watch_writer(writer)
    if config.otlp_endpoint:
        from tracing.otel import OtelSink, make_exporter

        sinks.append(OtelSink(make_exporter(config.otlp_endpoint, config.otlp_protocol)))
        log.info("exporting spans over OTLP (%s) to %s", config.otlp_protocol,
                 config.otlp_endpoint)
    sinks += extra_sinks or []
    sink = FanoutSink(sinks)

    retention = TailRetention(config.detail_sample, config.detail_quantile,
                              warmup=config.detail_warmup)

    def on_record(record: RequestRecord) -> None:
        try:
            metrics.observe(record)  # every ITL, before retention decides what is kept
        except Exception:  # metrics must never take a record (or a response) down with them
            log.exception("metrics failed for trace %s", record.trace_id)
        record.instance = config.instance_id
        retention.decide(record)
        sink.emit(record)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        # the grammar compiler's build holds the GIL ~0.5 s: done while the replicas load
        warm = asyncio.create_task(asyncio.to_thread(service.warm))
        metrics.stalls.start()
        await pool.start()
        if store_child is not None:
            try:
                await asyncio.to_thread(store_child.wait_ready)
            except SystemExit:
                await pool.close()  # nothing left behind by a gateway that cannot start
                store_child.close()
                raise
        # the stored config also says how this gateway admitted requests (not part of the
        # config_id: that hashes resolved_config alone; the first gateway to store it wins)
        config_row = None if handle is None else asyncio.create_task(store_api.store_config(
            handle, versions["config_id"], config.config_name,
            {**resolved_config(config), "admission": {"queue_timeout_s": config.queue_timeout_s}}))
        if upstreams is not None:
            await upstreams.start()  # health probes
        # Everything loaded so far (modules, the tokenizer, the store client) lives as long as
        # the process: keep it out of the collector's full passes, which otherwise walk it all
        # and paused the event loop for 20-150 ms at a time under load (bench --upstream).
        if config.freeze_gc:  # the serving process only: not a test's own process
            gc.collect()
            gc.freeze()
            # Python's generation-0 threshold (700) fires constantly in a gateway whose
            # allocations and frees nearly balance: each collection walks the in-flight
            # requests and frees nothing. 20,000 lets the records queued for a flush pass
            # without one (docs/design/decisions.md; figures: docs/benchmarks/store.md).
            if config.gc_threshold > 0:
                _, older, oldest = gc.get_threshold()
                gc.set_threshold(config.gc_threshold, older, oldest)
        try:
            yield
        finally:
            warm.cancel()
            metrics.stalls.stop()
            if config_row is not None:
                config_row.cancel()
            await pool.close()
            if upstreams is not None:
                await upstreams.close()
            sink.close()  # the writer drains: every record is inserted or spooled
            if handle is not None:
                handle.close()
            if store_child is not None:
                store_child.close()

    app = FastAPI(title="Tailscope gateway", lifespan=lifespan)
    app.state.pool, app.state.tokenizer, app.state.records = pool, tokenizer, memory

    def on_exit_signal() -> None:
        """SIGTERM/SIGINT: kill the store reads in flight (in a thread: this runs on the
        event loop, and the kill waits for the writer's client)."""
        if handle is not None and handle.opened:
            threading.Thread(target=handle.cancel_reads, name="cancel-reads",
                             daemon=True).start()

    app.state.on_exit_signal = on_exit_signal
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_middleware(TraceMiddleware, max_body_bytes=config.max_body_bytes,
                       on_record=on_record, traced_paths=API_PATHS)
    if config.cors_origins:  # outermost: a preflight is answered before tracing and auth
        app.add_middleware(ApiCORS, origins=config.cors_origins)

    def require_admin(request: Request) -> None:
        """/debug/*: the admin key or an admin tenant's key. Open local mode without an admin
        key serves them to loopback clients only (a local, single-user setup); anyone else
        needs ``TAILSCOPE_ADMIN_KEY``."""
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

    def check_host(request: Request) -> None:
        """A loopback client in open local mode may still be a web page: a hostname the page's
        site re-pointed at 127.0.0.1 (DNS rebinding) makes it same-origin with this gateway.
        Such a request names that hostname in Host, so only loopback names and this
        gateway's own addresses are answered."""
        host = (request.headers.get("host") or "").lower()
        name = host[1:host.index("]")] if host.startswith("[") and "]" in host \
            else host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        server = request.scope.get("server") or ("",)
        if name not in LOOPBACK and name not in (str(server[0]).lower(), own_hostname):
            raise APIError(421, f"debug endpoints answer requests for this gateway's own "
                           f"addresses or loopback names only, not Host {host[:100]!r} (a "
                           "browser page on another site?)", "invalid_request_error",
                           code="misdirected_request")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict:
        """vLLM's ``/version`` (``{"version": ...}``), naming the server too: a gateway that
        fronts this one as a backend records it as ``tailscope <version>``."""
        return {"version": gateway_version, "server": "tailscope", "engine": engine_version}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """200 while at least one replica can serve (and the record writer, when there is one,
        is alive); ``all_ready`` says every replica is up (what a benchmark waits for), and
        ``replicas`` each one's state."""
        states = pool.states()
        warmed = service.warmed.is_set()  # the startup work that would pause the event loop
        body = {"ready": pool.ready and warmed,
                "all_ready": warmed and all(s == "ready" for s in states.values()),
                "replicas": states}
        if upstreams is not None:  # beside replicas not needed: they serve other model names
            backends = {n: d["state"] for n, d in upstreams.describe().items()}
            body["backends"] = backends
            if not service.bundled:  # backends only: one that is not ejected can serve
                up = any(state != "ejected" for state in backends.values())
                body["ready"] = warmed and up
                body["all_ready"] = warmed and all(st == "ready" for st in backends.values())
        if writer is not None:
            body["record_writer"] = "alive" if writer.alive else "dead"
            body["ready"] = body["ready"] and writer.alive
        return JSONResponse(body,
                            status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/debug/config")
    async def debug_config() -> dict:
        """The gateway's resolved config, its config_id and versions (the eval runner reads
        them to label a run). Open: it holds no secrets."""
        from engine.config import auto_dtype
        from engine.profiles import explain

        chosen, why = auto_dtype()
        return {"config_id": versions["config_id"], "name": config.config_name,
                "config": resolved_config(config), "versions": versions,
                "dtype_auto": {"chooses": chosen, "because": why},
                "profile": {"name": config.engine.profile, "because": explain(config.engine)},
                **({"store_process": store_child.describe()} if store_child else {})}

    @app.get("/debug/replicas")
    async def debug_replicas(request: Request) -> dict:
        """Each replica's process, restarts, in-flight requests and latest KV usage."""
        require_admin(request)
        return {**pool.describe(), **(upstreams.describe() if upstreams else {})}

    @app.post("/debug/bench-runs/open")
    async def open_bench_run(request: Request) -> dict:
        """A run id and its token: requests of any tenant that send both
        (``x-tailscope-bench-run``, ``x-tailscope-bench-token``) are tagged into the run
        (``tailscope bench`` asks for one when it has the admin key)."""
        require_admin(request)
        body = await store_api.json_body(request)
        run_id = body.get("run_id") if isinstance(body, dict) else None
        if run_id is None:
            run_id = f"bench-{secrets.token_hex(6)}"
        if not isinstance(run_id, str) or not 0 < len(run_id) <= 64:
            raise APIError(400, "run_id must be a string of 1 to 64 characters",
                           param="run_id", code="invalid_value")
        return {"run_id": run_id, "token": registry.bench_token(run_id)}

    store_api.register(app, handle, memory, require_admin, writer, versions["config_id"],
                       config.served_model_name)

    started = int(time.time())

    def model_card(name: str) -> dict:
        """OpenAI's card (``created``: when this gateway started, as vLLM's); the bundled
        model's also has vLLM's ``max_model_len`` (clients size prompts by it)."""
        card = {"id": name, "object": "model", "created": started, "owned_by": "tailscope"}
        if name == service.config.served_model_name and pool.max_model_len:
            card["max_model_len"] = pool.max_model_len
        return card

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(n) for n in service.served_models()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        """OpenAI's ``GET /v1/models/{model}`` (``client.models.retrieve``): one model's card,
        or 404 ``model_not_found`` (a name may hold slashes: ``org/name``)."""
        if model not in service.served_models():
            raise service.model_not_found(model)
        return model_card(model)

    @app.get("/tokenizer_info", response_model=TokenizerInfoResponse, tags=["Utility"])
    async def tokenizer_info(request: Request) -> dict:
        """The bundled model's tokenizer: special tokens and chat template (vLLM's shape)."""
        registry.authenticate(request.headers.get("authorization"))
        tok = tokenizer.tokenizer

        def text(token_id: int | None) -> str | None:
            return tok.id_to_token(token_id) if token_id is not None else None

        return {"tokenizer_class": "tokenizers.Tokenizer", "bos_token": text(
            tokenizer.bos_token_id), "eos_token": text(tokenizer.eos_token_id),
            "pad_token": None, "chat_template": tokenizer.chat_template.source
            if tokenizer.chat_template else None, "model_max_length": pool.max_model_len,
            "vocab_size": tokenizer.vocab_size, "revision": tokenizer.revision or ""}

    trace_owners: OrderedDict[str, str] = OrderedDict()  # recent trace ids -> their tenant

    def own_trace_id(request: Request, trace, tenant) -> None:
        """A client's traceparent may name a trace id another tenant's requests have: its
        record would then stand for theirs (``/debug/requests/{id}``, replay). Such a request
        gets a trace id of its own (its traceparent's stays its parent span)."""
        trace_id = trace.record.trace_id
        owner = trace_owners.get(trace_id)
        if owner is not None and owner != tenant.name and trace.client_trace:
            log.warning("a request of tenant %r named trace %s, which is tenant %r's: it gets "
                        "a trace id of its own", tenant.name, trace_id, owner)
            trace_id = trace.record.trace_id = request.state.trace_id = secrets.token_hex(16)
        trace_owners[trace_id] = tenant.name
        trace_owners.move_to_end(trace_id)
        if len(trace_owners) > 65_536:
            trace_owners.popitem(last=False)

    async def gated(request: Request, handler) -> Response:
        """Ingress gate (auth, request rate, concurrency) before any parsing or tokenizing;
        the tenant's slot is released here on early errors, otherwise by the service."""
        tenant, key_id = registry.authenticate(request.headers.get("authorization"))
        trace = request.state.trace
        if trace is not None:  # /tokenize and /detokenize have no record
            trace.record.tenant, trace.record.api_key_id = tenant.name, key_id
            trace.record.ttl_days = tenant.ttl_days or config.store_ttl_days
            own_trace_id(request, trace, tenant)
            registry.check_bench_run(tenant, trace.record.bench_run,
                                     request.headers.get("x-tailscope-bench-token", ""))
        try:
            registry.admit_request(tenant)
        except APIError as exc:  # a 429 says where the tenant's buckets stand too
            exc.headers.update(rate_limit_headers(tenant))
            raise
        try:
            response = await handler(request, tenant)
        except BaseException as exc:
            if not getattr(request.state, "settled_by_run", False):
                registry.finish(tenant)
            if isinstance(exc, APIError):
                exc.headers.update(rate_limit_headers(tenant))
            raise
        response.headers.update(rate_limit_headers(tenant))
        return response

    async def chat_completions(request: Request) -> Response:
        return await gated(request, service.chat)

    async def completions(request: Request) -> Response:
        return await gated(request, service.completions)

    async def responses(request: Request) -> Response:
        return await gated(request, service.responses)

    async def tokenize(request: Request) -> Response:
        return await gated(request, service.tokenize)

    async def detokenize(request: Request) -> Response:
        return await gated(request, service.detokenize)

    # Stored responses (gateway.responses.ResponseStore): OpenAI's retrieve, delete and
    # input-items list; a response is found by the tenant that created it only
    def stored(request: Request, response_id: str, allowed: tuple[str, ...] = ()):
        tenant, _ = registry.authenticate(request.headers.get("authorization"))
        extra = sorted(set(request.query_params) - set(allowed))
        if extra:
            raise APIError(400, f"query parameter {extra[0]!r} is not supported here"
                           + (f" (only {', '.join(allowed)})" if allowed else ""), param=extra[0])
        got = service.stored_response(tenant, response_id)
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
        service.stored_responses.delete(tenant.name, rid)
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

    # Plain Starlette routes: the endpoints parse their own bodies (pydantic, OpenAI errors), so
    # FastAPI's per-request dependency solving would be pure overhead on the hot path.
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/responses", responses, methods=["POST"])
    app.add_route("/v1/responses/{response_id}", get_response, methods=["GET"])
    app.add_route("/v1/responses/{response_id}", delete_response, methods=["DELETE"])
    app.add_route("/v1/responses/{response_id}/input_items", response_input_items,
                  methods=["GET"])
    # vLLM's utility endpoints (their paths and shapes): the bundled model's tokenizer
    app.add_route("/tokenize", tokenize, methods=["POST"])
    app.add_route("/detokenize", detokenize, methods=["POST"])

    def openapi() -> dict:  # built once, on first request (gateway.openapi)
        if app.openapi_schema is None:
            from gateway import openapi as doc

            app.openapi_schema = doc.build(app, service.served_models(),
                                           config.served_model_name)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
