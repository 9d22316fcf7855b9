"""Every TAILSCOPE_* environment variable, in one typed place.

The engine settings are not repeated here: ``engine`` is an ``EngineConfig`` whose every field
is read from ``TAILSCOPE_<FIELD NAME>`` (e.g. ``TAILSCOPE_MAX_NUM_SEQS``), like the fields below.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from engine.config import EngineConfig

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def parse_env(name: str, raw: str, kind: type, optional: bool = False):
    """``raw`` (the value of ``TAILSCOPE_<NAME>``) as ``kind``; booleans are false for 0,
    false, no; an optional setting is None for '' or none."""
    if optional and raw.strip().lower() in ("", "none"):
        return None
    if kind is bool:
        return raw.strip().lower() not in ("0", "false", "no")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"TAILSCOPE_{name.upper()}={raw!r} is not a {kind.__name__}") from None


def engine_env() -> dict:
    """The engine settings given in the environment (only those)."""
    out = {}
    for name, (kind, optional, _) in EngineConfig.setting_types().items():
        raw = os.environ.get(f"TAILSCOPE_{name.upper()}")
        if raw is not None:
            out[name] = parse_env(name, raw, kind, optional)
    return out


@dataclass(frozen=True)
class Settings:
    model: str = "bundled"  # TAILSCOPE_MODEL: 'bundled', 'tiny', a .gguf file or an HF dir
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)  # see the doc
    threads: int = 0  # TAILSCOPE_THREADS: torch intra-op threads (0 = torch's default)
    # TAILSCOPE_REPLICA_CPUS: CPUs of each local replica ("0-3|4-7", one list for all, auto)
    replica_cpus: str = ""
    config: str = ""  # TAILSCOPE_CONFIG: gateway TOML (tenants, API keys, limits)
    queue_timeout_s: float = 60.0  # TAILSCOPE_QUEUE_TIMEOUT_S: engine queue wait -> 504 (0 = none)
    max_buffered_deltas: int = 256  # TAILSCOPE_MAX_BUFFERED_DELTAS: per request, then pause
    slow_client_timeout_s: float = 30.0  # TAILSCOPE_SLOW_CLIENT_TIMEOUT_S: paused -> cancelled
    records_jsonl: str = ""  # TAILSCOPE_RECORDS_JSONL: append each request record here
    record_token_ids: bool = True  # TAILSCOPE_RECORD_TOKEN_IDS: 0 keeps ids out of records
    detail_sample: float = 1.0  # TAILSCOPE_DETAIL_SAMPLE: share of non-tail requests keeping detail
    detail_quantile: float = 0.99  # TAILSCOPE_DETAIL_QUANTILE: at/above it, detail is kept
    detail_warmup: int = 100  # TAILSCOPE_DETAIL_WARMUP: first requests per model all kept
    store_dsn: str = "chdb://./.tailscope/store"  # TAILSCOPE_STORE_DSN ("none": no store)
    store_key: str = ""  # TAILSCOPE_STORE_KEY: a store process's key (tailscope:// DSNs)
    store_process: bool = True  # TAILSCOPE_STORE_PROCESS: the embedded store in a child process
    spool_dir: str = ""  # TAILSCOPE_SPOOL_DIR: failed batches wait here (default beside store)
    store_ttl_days: int = 30  # TAILSCOPE_STORE_TTL_DAYS: default row TTL
    store_flush_s: float = 5.0  # TAILSCOPE_STORE_FLUSH_S: oldest record waits this long at most
    admin_key: str = ""  # TAILSCOPE_ADMIN_KEY: Bearer key for /debug/* endpoints
    # TAILSCOPE_INSTANCE_ID: this gateway's id on every record, event and step row and the
    # prefix of its replica ids; "auto" is <host name>:<port>, "" none (one gateway per store)
    instance_id: str = "auto"
    # replicas on other hosts (README "Scaling out")
    remote_replicas: str = ""  # TAILSCOPE_REMOTE_REPLICAS: "ID=tcp://HOST:PORT,..." (inboxes)
    replica_outbox: str = ""  # TAILSCOPE_REPLICA_OUTBOX: tcp://HOST:PORT they connect to
    replica_key: str = ""  # TAILSCOPE_REPLICA_KEY: signs every replica message (HMAC-SHA256)
    gateway_url: str = "http://127.0.0.1:8000"  # TAILSCOPE_GATEWAY_URL: for `tailscope store`
    otlp_endpoint: str = ""  # TAILSCOPE_OTLP_ENDPOINT: OTLP collector (spans off when empty)
    otlp_protocol: str = "http/protobuf"  # TAILSCOPE_OTLP_PROTOCOL: http/protobuf | grpc

    # limits (README "Security and limits")
    request_timeout_s: float = 600.0  # TAILSCOPE_REQUEST_TIMEOUT_S: gateway deadline -> 504
    heartbeat_timeout_s: float = 30.0  # TAILSCOPE_HEARTBEAT_TIMEOUT_S: silent replica restarted
    max_body_bytes: int = 1 << 20  # TAILSCOPE_MAX_BODY_BYTES: request body -> 413
    max_messages: int = 2048  # TAILSCOPE_MAX_MESSAGES
    max_stop_strings: int = 16  # TAILSCOPE_MAX_STOP_STRINGS
    max_stop_chars: int = 256  # TAILSCOPE_MAX_STOP_CHARS: per stop string
    max_logit_bias: int = 1024  # TAILSCOPE_MAX_LOGIT_BIAS: entries
    max_stop_token_ids: int = 1024  # TAILSCOPE_MAX_STOP_TOKEN_IDS
    max_allowed_token_ids: int = 4096  # TAILSCOPE_MAX_ALLOWED_TOKEN_IDS
    max_json_depth: int = 64  # TAILSCOPE_MAX_JSON_DEPTH: nesting of a request body
    max_schema_bytes: int = 65536  # TAILSCOPE_MAX_SCHEMA_BYTES: response_format schema
    max_batch_prompts: int = 64  # TAILSCOPE_MAX_BATCH_PROMPTS: a completions batch x n
    responses_store_mb: float = 64.0  # TAILSCOPE_RESPONSES_STORE_MB: kept /v1/responses
    query_max_execution_s: float = 30.0  # TAILSCOPE_QUERY_MAX_EXECUTION_S: /debug/query
    query_max_result_rows: int = 500_000  # TAILSCOPE_QUERY_MAX_RESULT_ROWS
    query_max_rows_to_read: int = 2_000_000_000  # TAILSCOPE_QUERY_MAX_ROWS_TO_READ
    query_max_memory_mb: int = 2048  # TAILSCOPE_QUERY_MAX_MEMORY_MB
    store_max_queue_mb: int = 256  # TAILSCOPE_STORE_MAX_QUEUE_MB: record writer queue
    # TAILSCOPE_GC_THRESHOLD: the gateway's generation-0 collection threshold (0: Python's 700)
    gc_threshold: int = 20000
    key_id_secret: str = ""  # TAILSCOPE_KEY_ID_SECRET: keys the api_key_id hash
    # TAILSCOPE_CORS_ORIGINS: origins (comma-separated, or "*") whose browser pages may call the
    # API paths; empty: none (README "Security and limits")
    cors_origins: str = ""

    @classmethod
    def from_env(cls) -> Settings:
        """Each field from ``TAILSCOPE_<FIELD NAME>``, parsed by its type."""
        values: dict = {"engine": EngineConfig(**engine_env())}
        for f in dataclasses.fields(cls):
            raw = os.environ.get(f"TAILSCOPE_{f.name.upper()}")
            if raw is not None and f.name != "engine":
                values[f.name] = parse_env(f.name, raw, _TYPES[f.type])
        return cls(**values)
