"""Every TAILSCOPE_* setting, in one typed place (read through ``tailscope.env``).

The engine settings are not repeated here: ``engine`` is an ``EngineConfig`` whose every field
is read from ``TAILSCOPE_<FIELD NAME>`` (e.g. ``TAILSCOPE_MAX_NUM_SEQS``), like the fields below.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import EngineConfig, setting
from tailscope import env
from tailscope.env import PROCESS_VARIABLES

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
        raw = env.setting(name)
        if raw is not None:
            out[name] = parse_env(name, raw, kind, optional)
    return out


@dataclass(frozen=True)
class Settings:
    """The gateway's and the CLI's settings, each read from ``TAILSCOPE_<FIELD NAME>``; the
    help in each field's metadata is what the settings reference in the docs shows."""

    model: str = setting("bundled", "the model: `bundled`, `tiny:<vocab>` (a random test "
                          "model), a `.gguf` file or a Hugging Face directory")
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)  # its own fields
    threads: int = setting(0, "torch intra-op threads of each replica (0: torch's default)")
    replica_cpus: str = setting("", "CPUs of each local replica: `0-3|4-7` (a list per "
                                 "replica), one list for all, or `auto`; empty: not pinned")
    config: str = setting("", "the gateway's TOML file: tenants, API keys and limits")
    queue_timeout_s: float = setting(60.0, "seconds a request may wait in an engine queue "
                                      "before it ends TIMED_OUT with a 504 (0: no limit)")
    max_buffered_deltas: int = setting(256, "token deltas buffered for a slow client before "
                                        "its request is paused in the engine")
    slow_client_timeout_s: float = setting(30.0, "seconds a request may stay paused for a "
                                            "slow client before it is cancelled")
    records_jsonl: str = setting("", "append every request's record to this file, one JSON "
                                  "object a line")
    record_token_ids: bool = setting(True, "keep prompt and output token ids in records "
                                      "(false: counts only)")
    detail_sample: float = setting(1.0, "share of requests outside the tail that keep their "
                                    "token ids, ITLs and steps (tail-based retention)")
    detail_quantile: float = setting(0.99, "a request at or above this latency quantile of "
                                      "its model always keeps its detail")
    detail_warmup: int = setting(100, "a model's first requests all keep their detail")
    store_dsn: str = setting("chdb://./.tailscope/store", "where records go: `chdb://DIR` "
                              "(embedded), `http://user:pw@host:8123/db` (a ClickHouse "
                              "server), `tailscope://…` (a store process) or `none`")
    store_key: str = setting("", "the key a store process (`tailscope://` DSN) requires")
    store_process: bool = setting(True, "run the embedded store in a child process")
    spool_dir: str = setting("", "where batches wait while the store is down (default: "
                              "beside the chDB directory, or `.tailscope/spool`)")
    store_ttl_days: int = setting(30, "days a stored row lives unless its tenant says less")
    store_flush_s: float = setting(5.0, "seconds the oldest queued record waits at most "
                                    "before its batch is inserted")
    admin_key: str = setting("", "Bearer key for the `/debug/*` endpoints")
    instance_id: str = setting("auto", "this gateway's id on every record, event and step "
                                "row, and the prefix of its replica ids; `auto`: "
                                "`<host name>:<port>`; empty: none (one gateway per store)")
    remote_replicas: str = setting("", "replicas on other hosts: `ID=tcp://HOST:PORT,…` "
                                    "(their inboxes)")
    replica_outbox: str = setting("", "`tcp://HOST:PORT` the remote replicas connect to")
    replica_key: str = setting("", "signs every replica message (HMAC-SHA256); needed for "
                                "tcp:// replicas")
    gateway_url: str = setting("http://127.0.0.1:8000", "the gateway the CLI's `store`, "
                                "`why`, `drill` and `eval` commands talk to")
    otlp_endpoint: str = setting("", "OTLP collector for a span per request (off when empty)")
    otlp_protocol: str = setting("http/protobuf", "OTLP protocol: `http/protobuf` or `grpc`")
    request_timeout_s: float = setting(600.0, "the gateway's own deadline for a request "
                                        "(504 past it)")
    heartbeat_timeout_s: float = setting(30.0, "seconds of replica silence before it is "
                                          "restarted")
    max_body_bytes: int = setting(1 << 20, "largest request body (413 over it)")
    max_messages: int = setting(2048, "most messages in a chat request")
    max_stop_strings: int = setting(16, "most stop strings in a request")
    max_stop_chars: int = setting(256, "longest stop string, in characters")
    max_logit_bias: int = setting(1024, "most `logit_bias` entries")
    max_stop_token_ids: int = setting(1024, "most `stop_token_ids`")
    max_allowed_token_ids: int = setting(4096, "most `allowed_token_ids`")
    max_json_depth: int = setting(64, "deepest nesting of a request body")
    max_schema_bytes: int = setting(65536, "largest `response_format` JSON schema, in bytes")
    max_batch_prompts: int = setting(64, "most prompts × `n` in one completions request")
    responses_store_mb: float = setting(64.0, "memory for stored `/v1/responses` (0: none "
                                         "kept)")
    query_max_execution_s: float = setting(30.0, "`/debug/query`: seconds a query may run")
    query_max_result_rows: int = setting(500_000, "`/debug/query`: most rows returned")
    query_max_rows_to_read: int = setting(2_000_000_000, "`/debug/query`: most rows read")
    query_max_memory_mb: int = setting(2048, "`/debug/query`: most memory a query may use")
    store_max_queue_mb: int = setting(256, "the record writer's queue, in MB (records past "
                                       "it are dropped and counted)")
    gc_threshold: int = setting(20000, "the gateway's generation-0 collection threshold "
                                 "(0: Python's 700)")
    key_id_secret: str = setting("", "keys the HMAC that turns an API key into the "
                                  "record's `api_key_id`")
    cors_origins: str = setting("", "origins (comma-separated, or `*`) whose browser pages "
                                 "may call the API paths; empty: none")

    @classmethod
    def from_env(cls) -> Settings:
        """Each field from ``TAILSCOPE_<FIELD NAME>``, parsed by its type."""
        values: dict = {"engine": EngineConfig(**engine_env())}
        for f in dataclasses.fields(cls):
            raw = env.setting(f.name)
            if raw is not None and f.name != "engine":
                values[f.name] = parse_env(f.name, raw, _TYPES[f.type])
        return cls(**values)


def variables() -> dict[str, str]:
    """Every TAILSCOPE_* variable and its help: the gateway's settings, the engine's, and the
    process-level ones (``tailscope.env.PROCESS_VARIABLES``)."""
    out = {f"TAILSCOPE_{f.name.upper()}": f.metadata["help"]
           for f in dataclasses.fields(Settings) if f.name != "engine"}
    out.update({f"TAILSCOPE_{f.name.upper()}": f.metadata["help"]
                for f in dataclasses.fields(EngineConfig)})
    out.update(PROCESS_VARIABLES)
    return out
