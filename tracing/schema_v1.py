"""Migration 1 as it was first applied (the store's initial tables), frozen as literal DDL.

The tables' declarations (``tracing.schema.TABLES``) keep changing; migration 1 must not, or an
old store and a new one would differ ("the initial tables" would mean different things over
time). Every change since is a later migration; ``tests/tracing/test_store.py`` checks that the
chain ends exactly at the current declarations.
"""

V1 = [
    """CREATE TABLE IF NOT EXISTS tailscope.requests (
    `trace_id` String,
    `span_id` String,
    `request_id` String,
    `parent_span_id` String,
    `tenant` LowCardinality(String),
    `api_key_id` LowCardinality(String),
    `endpoint` LowCardinality(String),
    `arrival_ts` DateTime64(6, 'UTC'),
    `final_state` LowCardinality(String),
    `finish_reason` LowCardinality(String),
    `http_status` UInt16,
    `error_type` LowCardinality(String),
    `error_message` String,
    `model` LowCardinality(String),
    `model_revision` LowCardinality(String),
    `engine_version` LowCardinality(String),
    `tokenizer_revision` LowCardinality(String),
    `gateway_version` LowCardinality(String),
    `config_id` LowCardinality(String),
    `replica` LowCardinality(String),
    `route_reason` String,
    `prefix_hit_tokens` Int64,
    `retries` UInt8,
    `prompt_tokens` UInt32,
    `cached_tokens` UInt32,
    `generated_tokens` UInt32,
    `emitted_tokens` UInt32,
    `n` UInt16,
    `input_token_ids` Array(UInt32),
    `output_token_ids` Array(UInt32),
    `temperature` Nullable(Float64),
    `top_p` Nullable(Float64),
    `top_k` Nullable(Int64),
    `min_p` Nullable(Float64),
    `seed` Nullable(Int64),
    `max_tokens` Nullable(Int64),
    `stream` Bool,
    `ingress_ms` Float64,
    `tokenize_ms` Float64,
    `route_ms` Float64,
    `engine_queue_ms` Float64,
    `prefill_ms` Float64,
    `decode_ms` Float64,
    `preempted_ms` Float64,
    `preemptions` UInt32,
    `backpressured_ms` Float64,
    `ttft_ms` Nullable(Float64),
    `tpot_ms` Nullable(Float64),
    `e2e_ms` Float64,
    `tail_ms` Float64,
    `itl_ms` Array(Float32),
    `ttl_days` UInt16
)
ENGINE = MergeTree
PARTITION BY toDate(arrival_ts)
ORDER BY (toStartOfHour(arrival_ts), model, replica, arrival_ts)
TTL toDateTime(arrival_ts) + toIntervalDay(ttl_days)
SETTINGS non_replicated_deduplication_window = 10000""",
    """CREATE TABLE IF NOT EXISTS tailscope.request_events (
    `trace_id` String,
    `ts` DateTime64(6, 'UTC'),
    `state` LowCardinality(String),
    `detail` String,
    `seq` UInt16,
    `ttl_days` UInt16
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (trace_id, ts, seq)
TTL toDateTime(ts) + toIntervalDay(ttl_days)
SETTINGS non_replicated_deduplication_window = 10000""",
    """CREATE TABLE IF NOT EXISTS tailscope.engine_steps (
    `replica` LowCardinality(String),
    `incarnation` UInt32,
    `step` UInt64,
    `ts` DateTime64(6, 'UTC'),
    `duration_ms` Float64,
    `num_seqs` Int64,
    `prefill_tokens` Int64,
    `decode_tokens` Int64,
    `kv_blocks_used` Int64,
    `kv_blocks_total` Int64,
    `forward_ms` Float64,
    `sample_ms` Float64,
    `host_ms` Float64,
    `running` Int64,
    `waiting` Int64,
    `ttl_days` UInt16
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (replica, ts, incarnation, step)
TTL toDateTime(ts) + toIntervalDay(ttl_days)
SETTINGS non_replicated_deduplication_window = 10000""",
    """CREATE TABLE IF NOT EXISTS tailscope.eval_runs (
    `run_id` String,
    `ts` DateTime64(6, 'UTC'),
    `suite` LowCardinality(String),
    `config_id` LowCardinality(String),
    `config` String,
    `url` String,
    `cases` Int64,
    `passed` Int64,
    `ttl_days` UInt16
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (ts, run_id)
TTL toDateTime(ts) + toIntervalDay(ttl_days)
SETTINGS non_replicated_deduplication_window = 10000""",
    """CREATE TABLE IF NOT EXISTS tailscope.eval_results (
    `run_id` String,
    `case_id` String,
    `trace_id` String,
    `ts` DateTime64(6, 'UTC'),
    `score` Float64,
    `passed` Bool,
    `detail` String,
    `tags` Array(LowCardinality(String)),
    `ttl_days` UInt16
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (run_id, case_id)
TTL toDateTime(ts) + toIntervalDay(ttl_days)
SETTINGS non_replicated_deduplication_window = 10000""",
    """CREATE TABLE IF NOT EXISTS tailscope.bench_runs (
    `run_id` String,
    `ts` DateTime64(6, 'UTC'),
    `mode` LowCardinality(String),
    `target` String,
    `config_id` LowCardinality(String),
    `params` String,
    `results` String,
    `ttl_days` UInt16
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (ts, run_id)
TTL toDateTime(ts) + toIntervalDay(ttl_days)
SETTINGS non_replicated_deduplication_window = 10000""",
]
