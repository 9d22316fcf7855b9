"""The store's tables, generated from one dataclass per table (``tracing.record`` for requests).

``TABLES`` maps each table of database ``tailscope`` to its columns (name, ClickHouse type),
derived from the dataclass fields by ``_columns`` with a few stated overrides (time columns,
low-cardinality strings); ``Table.create()`` renders a ``CREATE TABLE`` statement and
``MIGRATIONS`` lists the versioned steps applied at start (``tracing.store.migrate``):
migration 1 is frozen literal DDL (``tracing.schema_v1``), and a new column is a new migration
(``ALTER TABLE ... ADD COLUMN IF NOT EXISTS``) appended to the list, never an edit of an
applied one. A test checks that the chain ends exactly at the declarations here.

All tables are MergeTree, partitioned by day and ordered for the drill-down queries (time,
then model/replica); rows expire after ``ttl_days`` (a column, so a tenant's privacy setting
can shorten it per row). ``non_replicated_deduplication_window`` makes a re-sent batch with the
same ``insert_deduplication_token`` a no-op, which is what lets the writer replay spooled
batches without ever duplicating a row.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass

from tracing.record import RecordEvent, RequestRecord
from tracing.schema_v1 import V1

DATABASE = "tailscope"
DEDUP_WINDOW = 10_000  # recent insert tokens remembered per table


@dataclass(slots=True)
class EngineStepRow:
    replica: str
    incarnation: int  # restarts of the replica before this process: step counters restart
    step: int
    ts_us: int  # wall clock at the step start
    duration_ms: float
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    forward_ms: float
    sample_ms: float
    host_ms: float
    running: int = 0
    waiting: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache during the step
    prefix_hits: int = 0  # tokens it served
    evictions: int = 0  # cached blocks evicted
    preemptions: int = 0  # requests preempted
    # Step membership, as parallel arrays on the step's own row rather than a step_members
    # table: a request's steps are read by (replica, time range), the table's sort order, and
    # their members come with them, with no second insert stream and no join; "which steps
    # carried request X" is has(member_traces, X) over that same bounded range.
    member_traces: list[str] = dataclasses.field(default_factory=list)  # trace id per member
    member_prefill: list[int] = dataclasses.field(default_factory=list)  # its prefill tokens
    member_decode: list[int] = dataclasses.field(default_factory=list)  # its decode tokens
    ttl_days: int = 30
    instance: str = ""  # the gateway whose replica ran the step
    # keys its prefill tokens attended to (engine.scheduler.prefill_context); 0 before it was
    # recorded
    prefill_context: int = 0


@dataclass(slots=True)
class EventRow:
    trace_id: str
    ts_us: int
    state: str
    detail: str = ""
    seq: int = 0  # order within the request (timestamps can tie)
    ttl_days: int = 30
    tenant: str = ""  # the request's tenant: a tenant delete never keys on trace ids alone
    instance: str = ""  # the gateway that served the request


@dataclass(slots=True)
class EvalRunRow:
    run_id: str
    ts_us: int
    suite: str
    config_id: str
    config: str = ""  # the resolved config, JSON
    url: str = ""
    cases: int = 0
    passed: int = 0
    ttl_days: int = 365


@dataclass(slots=True)
class EvalResultRow:
    run_id: str
    case_id: str
    trace_id: str
    ts_us: int
    score: float
    passed: bool
    detail: str = ""
    tags: list[str] = dataclasses.field(default_factory=list)
    output: str = ""  # the first choice's text (compare shows what changed)
    finish_reason: str = ""
    weight: float = 1.0
    ttl_days: int = 365


@dataclass(slots=True)
class ConfigRow:
    """One row per config a gateway ran (written once, at its start): what ``config_id``
    stands for, so a record alone names the engine that ran it (``tailscope replay``)."""

    config_id: str
    ts_us: int
    name: str = ""
    config: str = ""  # the resolved config, JSON (gateway.app.resolved_config)
    ttl_days: int = 3650


@dataclass(slots=True)
class BenchRunRow:
    run_id: str
    ts_us: int
    mode: str
    target: str
    config_id: str = ""
    params: str = ""  # JSON
    results: str = ""  # JSON summary
    ttl_days: int = 365


@dataclass(slots=True)
class WhatIfRunRow:
    """One ``tailscope whatif`` / ``tailscope size`` run: the window it replayed, the step-cost
    model it fitted (so the run can be redone), its parameters and its predictions."""

    run_id: str
    ts_us: int
    kind: str  # whatif | size
    window_start_us: int
    window_end_us: int
    replicas: str = ""  # the recorded replicas whose traffic it replayed, comma-separated
    config_id: str = ""  # the recorded config
    params: str = ""  # JSON: candidate settings, replicas, rate scales, SLO
    step_cost: str = ""  # JSON: engine.whatif.StepCost.as_dict()
    results: str = ""  # JSON
    ttl_days: int = 365

    @classmethod
    def from_body(cls, body: dict, ts_us: int) -> WhatIfRunRow:
        """From what ``tailscope.whatif.store_run`` sends (JSON values as objects)."""
        def js(key: str) -> str:
            return json.dumps(body.get(key, {}), default=float)

        return cls(str(body["run_id"])[:64], ts_us, str(body["kind"]),
                   int(body["window_start_us"]), int(body["window_end_us"]),
                   str(body.get("replicas", "")), str(body.get("config_id", "")),
                   js("params"), js("step_cost"), js("results"))


# Strings with few distinct values: stored as LowCardinality(String).
_LOW_CARDINALITY = {"tenant", "api_key_id", "endpoint", "final_state", "finish_reason",
                    "timing_source", "error_type", "model", "model_revision", "engine_version",
                    "tokenizer_revision", "gateway_version", "config_id", "replica", "state",
                    "suite", "mode", "kind", "bench_run", "neighbour_tenant", "detail_reason",
                    "lane", "instance"}
_TIME_COLUMNS = {"ts_us": "ts", "arrival_ts_us": "arrival_ts"}  # µs ints -> DateTime64(6)
_SCALARS = {str: "String", int: "Int64", float: "Float64", bool: "Bool"}
_ARRAYS = {"input_token_ids": "Array(UInt32)", "output_token_ids": "Array(UInt32)",
           "itl_ms": "Array(Float32)", "tags": "Array(LowCardinality(String))",
           "tool_calls": "Array(LowCardinality(String))", "token_steps": "Array(UInt32)",
           "member_traces": "Array(String)", "member_prefill": "Array(UInt32)",
           "member_decode": "Array(UInt32)"}
_NARROW = {"ttl_days": "UInt16", "http_status": "UInt16", "prompt_tokens": "UInt32",
           "cached_tokens": "UInt32", "generated_tokens": "UInt32", "emitted_tokens": "UInt32",
           "n": "UInt16", "retries": "UInt8", "preemptions": "UInt32", "step": "UInt64",
           "incarnation": "UInt32", "seq": "UInt16", "neighbour_prefill_tokens": "UInt32",
           "priority": "Int32", "prompt_index": "UInt16", "prefill_context": "UInt64"}


def _ch_type(name: str, annotation) -> str:
    if name in _TIME_COLUMNS:
        return "DateTime64(6, 'UTC')"
    if name in _ARRAYS:
        return _ARRAYS[name]
    if name in _NARROW:
        return _NARROW[name]
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) and type(None) in args:  # X | None
        inner = next(a for a in args if a is not type(None))
        return f"Nullable({_SCALARS[inner]})"
    base = _SCALARS[annotation]
    return f"LowCardinality({base})" if name in _LOW_CARDINALITY else base


def _columns(cls, skip: tuple[str, ...] = (), types: dict[str, str] | None = None
             ) -> list[tuple[str, str, str]]:
    """(column name, ClickHouse type, dataclass field name) for each stored field; ``types``
    pins a column's type where this table differs from the shared naming rules."""
    hints, types = typing.get_type_hints(cls), types or {}
    return [(_TIME_COLUMNS.get(f.name, f.name),
             types.get(f.name) or _ch_type(f.name, hints[f.name]), f.name)
            for f in dataclasses.fields(cls) if f.name not in skip]


# Compression codecs where ClickHouse's default (LZ4 alone) leaves most of the bytes: T64 keeps
# the 16 bits a vocabulary this size uses, DoubleDelta takes runs of consecutive ids and times,
# ZSTD the float noise of ITLs; they halve a request's bytes, and inserts take no longer
# (figures: docs/benchmarks/store.md#codecs-and-merges). A column not named keeps the default.
CODECS: dict[str, dict[str, str]] = {
    "requests": {"input_token_ids": "CODEC(T64, LZ4)", "output_token_ids": "CODEC(T64, LZ4)",
                 "token_steps": "CODEC(DoubleDelta, LZ4)", "itl_ms": "CODEC(ZSTD(1))"},
    "request_events": {"ts": "CODEC(DoubleDelta, LZ4)"},
    # a step row names each member's trace: a request is in a step per token it decodes, so
    # its trace id recurs in row after row (ts and step are sorted runs); the table per request
    # in bench/trace_overhead.py's step streams: 863 -> 710 bytes at 8 sequences a step, 301 ->
    # 257 at 32
    "engine_steps": {"ts": "CODEC(DoubleDelta, LZ4)", "step": "CODEC(DoubleDelta, LZ4)",
                     "member_traces": "CODEC(ZSTD(1))"},
}


# ClickHouse's merge selector on the tables the writer fills every few seconds. The selector
# adds a fixed 5 MB to every part's size before it compares them, so to it a growing merged part
# and a gateway's small flushes look alike: at its default base (5) it merged the big part again
# every few inserts, and the rows merges wrote grew with the square of the inserts. Base 50 cuts
# that tenfold (figures: docs/benchmarks/store.md#codecs-and-merges); more parts stand between
# merges, which ClickHouse handles by the thousand, and parts older than an hour still merge
# down as the selector lowers its base with age.
MERGE_SELECTOR_BASE = 50
MERGE_SETTINGS: dict[str, str] = {t: f"merge_selector_base = {MERGE_SELECTOR_BASE}"
                                  for t in ("requests", "request_events", "engine_steps")}


@dataclass(frozen=True)
class Table:
    name: str
    row_type: type
    columns: list[tuple[str, str, str]]
    time_column: str
    order_by: str

    @property
    def codecs(self) -> dict[str, str]:
        return CODECS.get(self.name, {})

    def column_defs(self) -> str:
        """Each column with its type and codec, as a CREATE TABLE lists them."""
        return ",\n    ".join(f"`{c}` {t}" + (f" {self.codecs[c]}" if c in self.codecs else "")
                              for c, t, _ in self.columns)

    def settings(self, dedup: str = "non_replicated_deduplication_window") -> str:
        """The table's MergeTree settings, as its SETTINGS clause lists them (``dedup``: the
        name of the insert deduplication window's setting, which a replicated table spells
        without ``non_``)."""
        merge = MERGE_SETTINGS.get(self.name)
        return f"{dedup} = {DEDUP_WINDOW}" + (f", {merge}" if merge else "")

    def create(self, database: str = DATABASE) -> str:
        """The table as declared now (for a migration that adds a table, frozen there)."""
        cols = self.column_defs()
        return (f"CREATE TABLE IF NOT EXISTS {database}.{self.name} (\n    {cols}\n)\n"
                f"ENGINE = MergeTree\nPARTITION BY toDate({self.time_column})\n"
                f"ORDER BY ({self.order_by})\n"
                f"TTL toDateTime({self.time_column}) + toIntervalDay(ttl_days)\n"
                f"SETTINGS {self.settings()}")


TABLES: dict[str, Table] = {t.name: t for t in [
    Table("requests", RequestRecord,
          _columns(RequestRecord, skip=("events",)),
          "arrival_ts", "toStartOfHour(arrival_ts), model, replica, arrival_ts"),
    Table("request_events", EventRow, _columns(EventRow), "ts", "trace_id, ts, seq"),
    # migration 4 added engine_steps.preemptions as Int64 (requests.preemptions is UInt32)
    Table("engine_steps", EngineStepRow, _columns(EngineStepRow, types={"preemptions": "Int64"}),
          "ts", "replica, ts, incarnation, step"),
    Table("eval_runs", EvalRunRow, _columns(EvalRunRow), "ts", "ts, run_id"),
    Table("eval_results", EvalResultRow, _columns(EvalResultRow), "ts", "run_id, case_id"),
    Table("bench_runs", BenchRunRow, _columns(BenchRunRow), "ts", "ts, run_id"),
    Table("configs", ConfigRow, _columns(ConfigRow), "ts", "config_id, ts"),
    Table("whatif_runs", WhatIfRunRow, _columns(WhatIfRunRow), "ts", "ts, run_id"),
]}


# (version, name, statements). Applied in order, each once; statements are idempotent too.
MIGRATIONS: list[tuple[int, str, list[str]]] = [
    (1, "initial tables", V1),
    (2, "requests.bench_run", [f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS "
                               "bench_run LowCardinality(String) AFTER endpoint"]),
    (3, "eval_results.output, finish_reason, weight", [
        f"ALTER TABLE {DATABASE}.eval_results ADD COLUMN IF NOT EXISTS output String",
        f"ALTER TABLE {DATABASE}.eval_results ADD COLUMN IF NOT EXISTS "
        "finish_reason LowCardinality(String)",
        f"ALTER TABLE {DATABASE}.eval_results ADD COLUMN IF NOT EXISTS weight Float64 "
        "DEFAULT 1"]),
    (4, "engine_steps prefix cache and preemption counters", [
        f"ALTER TABLE {DATABASE}.engine_steps ADD COLUMN IF NOT EXISTS {c} Int64 "
        "AFTER waiting" for c in ("preemptions", "evictions", "prefix_hits", "prefix_queries")]),
    (5, "request_events.tenant", [
        f"ALTER TABLE {DATABASE}.request_events ADD COLUMN IF NOT EXISTS tenant "
        "LowCardinality(String)"]),
    (6, "requests.response_id", [f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS "
                                 "response_id String AFTER request_id"]),
    (7, "requests.timing_source", [f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS "
                                   "timing_source LowCardinality(String) AFTER retries"]),
    (8, "requests.tool_calls", [f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS "
                                "tool_calls Array(LowCardinality(String)) AFTER retries"]),
    (9, "step membership: requests.token_steps, engine_steps.member_*", [
        f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS token_steps Array(UInt32) "
        "AFTER output_token_ids",
        f"ALTER TABLE {DATABASE}.engine_steps ADD COLUMN IF NOT EXISTS member_traces "
        "Array(String) AFTER preemptions",
        f"ALTER TABLE {DATABASE}.engine_steps ADD COLUMN IF NOT EXISTS member_prefill "
        "Array(UInt32) AFTER member_traces",
        f"ALTER TABLE {DATABASE}.engine_steps ADD COLUMN IF NOT EXISTS member_decode "
        "Array(UInt32) AFTER member_prefill"]),
    (10, "why it waited, who shared its steps, detail retention: requests.wait_*_ms, "
         "neighbour_*, detail_*", [
        *(f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS {c} Float64 "
          "AFTER backpressured_ms" for c in reversed(
              ("wait_step_ms", "wait_budget_ms", "wait_kv_ms", "wait_seqs_ms", "wait_hol_ms"))),
        f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS neighbour_tenant "
        "LowCardinality(String) AFTER wait_hol_ms",
        f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS neighbour_prefill_tokens "
        "UInt32 AFTER neighbour_tenant",
        f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS detail_kept Bool DEFAULT "
        "true AFTER neighbour_prefill_tokens",
        f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS detail_reason "
        "LowCardinality(String) AFTER detail_kept"]),
    (11, "requests.priority", [f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS "
                               "priority Int32 AFTER detail_reason"]),
    (12, "requests.sampling_params, the configs table", [
        f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS sampling_params String "
        "AFTER stream",
        f"CREATE TABLE IF NOT EXISTS {DATABASE}.configs (\n    `config_id` LowCardinality(String),"
        "\n    `ts` DateTime64(6, 'UTC'),\n    `name` String,\n    `config` String,\n    "
        "`ttl_days` UInt16\n)\nENGINE = MergeTree\nPARTITION BY toDate(ts)\n"
        "ORDER BY (config_id, ts)\nTTL toDateTime(ts) + toIntervalDay(ttl_days)\n"
        f"SETTINGS non_replicated_deduplication_window = {DEDUP_WINDOW}"]),
    (13, "fair share and degraded admission: requests.wait_share_ms, lane, degraded", [
        f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS wait_share_ms Float64 "
        "AFTER wait_hol_ms",
        f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS lane LowCardinality(String) "
        "DEFAULT 'standard' AFTER priority",
        f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS degraded String AFTER lane"]),
    (14, "the whatif_runs table", [
        f"CREATE TABLE IF NOT EXISTS {DATABASE}.whatif_runs (\n    `run_id` String,\n    "
        "`ts` DateTime64(6, 'UTC'),\n    `kind` LowCardinality(String),\n    "
        "`window_start_us` Int64,\n    `window_end_us` Int64,\n    `replicas` String,\n    "
        "`config_id` LowCardinality(String),\n    `params` String,\n    `step_cost` String,\n"
        "    `results` String,\n    `ttl_days` UInt16\n)\nENGINE = MergeTree\n"
        "PARTITION BY toDate(ts)\nORDER BY (ts, run_id)\n"
        "TTL toDateTime(ts) + toIntervalDay(ttl_days)\n"
        f"SETTINGS non_replicated_deduplication_window = {DEDUP_WINDOW}"]),
    (15, "the gateway instance on requests, request_events and engine_steps", [
        f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS instance "
        "LowCardinality(String) AFTER config_id",
        f"ALTER TABLE {DATABASE}.request_events ADD COLUMN IF NOT EXISTS instance "
        "LowCardinality(String) AFTER tenant",
        f"ALTER TABLE {DATABASE}.engine_steps ADD COLUMN IF NOT EXISTS instance "
        "LowCardinality(String) AFTER ttl_days"]),
    (16, "requests.prompt_index (a /v1/completions batch is a record per prompt)", [
        f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS prompt_index UInt16 "
        "AFTER n"]),
    (17, "engine_steps.prefill_context (the what-if step cost)", [
        f"ALTER TABLE {DATABASE}.engine_steps ADD COLUMN IF NOT EXISTS prefill_context UInt64 "
        "AFTER instance"]),
    # CODECS as of this version (frozen here: a later change of codec is a migration of its
    # own); new parts are written with them, older parts keep LZ4 until a merge rewrites them
    (18, "column codecs: token ids T64, token steps and times DoubleDelta, ITLs and step "
         "members ZSTD", [
        f"ALTER TABLE {DATABASE}.{table} MODIFY COLUMN {col} {codec}" for table, col, codec in (
            ("requests", "input_token_ids", "CODEC(T64, LZ4)"),
            ("requests", "output_token_ids", "CODEC(T64, LZ4)"),
            ("requests", "token_steps", "CODEC(DoubleDelta, LZ4)"),
            ("requests", "itl_ms", "CODEC(ZSTD(1))"),
            ("request_events", "ts", "CODEC(DoubleDelta, LZ4)"),
            ("engine_steps", "ts", "CODEC(DoubleDelta, LZ4)"),
            ("engine_steps", "step", "CODEC(DoubleDelta, LZ4)"),
            ("engine_steps", "member_traces", "CODEC(ZSTD(1))"))]),
    # MERGE_SETTINGS as of this version (frozen here)
    (19, "merge_selector_base 50 on requests, request_events and engine_steps", [
        f"ALTER TABLE {DATABASE}.{table} MODIFY SETTING merge_selector_base = 50"
        for table in ("requests", "request_events", "engine_steps")]),
    (20, "requests.end_user, metadata (OpenAI's safety_identifier / user and metadata)", [
        f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS end_user String "
        "AFTER bench_run",
        f"ALTER TABLE {DATABASE}.requests ADD COLUMN IF NOT EXISTS metadata String "
        "AFTER end_user"]),
]

__all__ = ["DATABASE", "TABLES", "MIGRATIONS", "ConfigRow", "EngineStepRow", "EventRow",
           "EvalRunRow", "EvalResultRow", "BenchRunRow", "WhatIfRunRow", "RecordEvent"]
