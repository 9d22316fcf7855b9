"""Every TAILSCOPE_* environment variable, in one typed place."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _env(name: str, default: str) -> str:
    return os.environ.get(f"TAILSCOPE_{name}", default)


@dataclass(frozen=True)
class Settings:
    model: str = "bundled"  # TAILSCOPE_MODEL: 'bundled', 'tiny', a .gguf file or an HF dir
    dtype: str = "float32"  # TAILSCOPE_DTYPE: float32 | bfloat16 | float16
    kv_cache_mb: int = 512  # TAILSCOPE_KV_CACHE_MB: paged KV budget per replica
    block_size: int = 16  # TAILSCOPE_BLOCK_SIZE: tokens per KV block
    max_num_seqs: int = 64  # TAILSCOPE_MAX_NUM_SEQS: running sequences per tick
    max_batched_tokens: int = 512  # TAILSCOPE_MAX_BATCHED_TOKENS: token budget per tick
    prefix_caching: bool = True  # TAILSCOPE_PREFIX_CACHING: 0 turns the prefix cache off
    preemption: str = "recompute"  # TAILSCOPE_PREEMPTION: recompute | swap | auto | off
    threads: int = 0  # TAILSCOPE_THREADS: torch intra-op threads (0 = torch's default)
    config: str = ""  # TAILSCOPE_CONFIG: gateway TOML (tenants, API keys, limits)
    queue_timeout_s: float = 60.0  # TAILSCOPE_QUEUE_TIMEOUT_S: engine queue wait -> 504 (0 = none)
    max_buffered_deltas: int = 256  # TAILSCOPE_MAX_BUFFERED_DELTAS: per request, then pause
    slow_client_timeout_s: float = 30.0  # TAILSCOPE_SLOW_CLIENT_TIMEOUT_S: paused -> cancelled
    records_jsonl: str = ""  # TAILSCOPE_RECORDS_JSONL: append each request record here
    record_token_ids: bool = True  # TAILSCOPE_RECORD_TOKEN_IDS: 0 keeps ids out of records
    store_dsn: str = "chdb://./.tailscope/store"  # TAILSCOPE_STORE_DSN ("none": no store)
    spool_dir: str = ""  # TAILSCOPE_SPOOL_DIR: failed batches wait here (default beside store)
    store_ttl_days: int = 30  # TAILSCOPE_STORE_TTL_DAYS: default row TTL
    store_flush_s: float = 5.0  # TAILSCOPE_STORE_FLUSH_S: oldest record waits this long at most
    admin_key: str = ""  # TAILSCOPE_ADMIN_KEY: Bearer key for /debug/* endpoints
    gateway_url: str = "http://127.0.0.1:8000"  # TAILSCOPE_GATEWAY_URL: for `tailscope store`
    otlp_endpoint: str = ""  # TAILSCOPE_OTLP_ENDPOINT: OTLP collector (spans off when empty)
    otlp_protocol: str = "http/protobuf"  # TAILSCOPE_OTLP_PROTOCOL: http/protobuf | grpc

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            model=_env("MODEL", cls.model),
            dtype=_env("DTYPE", cls.dtype),
            kv_cache_mb=int(_env("KV_CACHE_MB", str(cls.kv_cache_mb))),
            block_size=int(_env("BLOCK_SIZE", str(cls.block_size))),
            max_num_seqs=int(_env("MAX_NUM_SEQS", str(cls.max_num_seqs))),
            max_batched_tokens=int(_env("MAX_BATCHED_TOKENS", str(cls.max_batched_tokens))),
            prefix_caching=_env("PREFIX_CACHING", "1").lower() not in ("0", "false", "no"),
            preemption=_env("PREEMPTION", cls.preemption),
            threads=int(_env("THREADS", str(cls.threads))),
            config=_env("CONFIG", cls.config),
            queue_timeout_s=float(_env("QUEUE_TIMEOUT_S", str(cls.queue_timeout_s))),
            max_buffered_deltas=int(_env("MAX_BUFFERED_DELTAS", str(cls.max_buffered_deltas))),
            slow_client_timeout_s=float(_env("SLOW_CLIENT_TIMEOUT_S",
                                             str(cls.slow_client_timeout_s))),
            records_jsonl=_env("RECORDS_JSONL", cls.records_jsonl),
            record_token_ids=_env("RECORD_TOKEN_IDS", "1").lower() not in ("0", "false", "no"),
            store_dsn=_env("STORE_DSN", cls.store_dsn),
            spool_dir=_env("SPOOL_DIR", cls.spool_dir),
            store_ttl_days=int(_env("STORE_TTL_DAYS", str(cls.store_ttl_days))),
            store_flush_s=float(_env("STORE_FLUSH_S", str(cls.store_flush_s))),
            admin_key=_env("ADMIN_KEY", cls.admin_key),
            gateway_url=_env("GATEWAY_URL", cls.gateway_url),
            otlp_endpoint=_env("OTLP_ENDPOINT", cls.otlp_endpoint),
            otlp_protocol=_env("OTLP_PROTOCOL", cls.otlp_protocol),
        )
