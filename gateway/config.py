"""The gateway's configuration: what ``tailscope serve`` resolved (``GatewayConfig``), what of
it decides outputs and timings (``resolved_config``, hashed into ``config_id``), and the
replicas it implies (``bundled_pool``, ``prepare_replicas``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.cpus import replica_cpus
from gateway import replicas
from gateway.backend import Backend, NoReplicas
from gateway.limits import RequestLimits
from gateway.replicas import ReplicaPool
from gateway.upstream_config import UpstreamConfig
from tailscope.keys import redact_url
from tracing.store import QueryLimits

log = logging.getLogger("tailscope.gateway")


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

    @classmethod
    def from_settings(cls, settings, **given) -> GatewayConfig:
        """The config that ``settings`` (``tailscope.settings.Settings``: the environment over
        the defaults) make, with ``given`` (what the command line and the deployment file
        decided) on top. A setting is the field of the same name (``RENAMED``: another
        name); the request and query limits are built from theirs; a field that may be None
        is None where its setting is empty, ``none`` or 0 (no limit); the ``PARSED``
        settings must be given, parsed."""
        missing = [name for name in PARSED if name not in given]
        if missing:
            raise TypeError(f"from_settings needs {missing} given, parsed")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict = {}
        for f in dataclasses.fields(settings):
            name = RENAMED.get(f.name, f.name)
            if name in given or name not in fields:
                continue
            value = getattr(settings, f.name)
            if "None" in str(fields[name].type) and (
                    value in ("", 0) or str(value).lower() == "none"):
                value = None
            values[name] = value
        values["limits"] = RequestLimits(**{
            f.name: getattr(settings, f.name) for f in dataclasses.fields(RequestLimits)})
        values["query_limits"] = QueryLimits(**{
            f.name: getattr(settings, "query_" + f.name)
            for f in dataclasses.fields(QueryLimits)})
        return cls(**{**values, **given})


# Settings that GatewayConfig holds under another name; those the command line parses into
# another type first (``from_settings`` needs them given); those that are not the gateway's
# (the CLI's, and the replicas' own, which they read from the environment they inherit)
RENAMED = {"config": "tenants_file", "store_max_queue_mb": "max_queue_mb"}
PARSED = ("remote_replicas", "cors_origins", "instance_id")
NOT_GATEWAY = ("threads", "gateway_url")


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


