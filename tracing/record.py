"""The trace record: one row per request (docs/design/record-contract.md), in one place.

``RequestRecord`` holds the contract's columns (plus a few extras); ``RecordEvent`` is one row of
the request's timeline. The gateway assembles them; sinks (``tracing.sinks``) and, later, the
ClickHouse writer consume them. Durations are float milliseconds; timestamps are wall-clock
microseconds since the epoch (UTC), the resolution of ``DateTime64(6, 'UTC')``.

Timing identities, by construction (``RequestTrace.finish`` in the gateway computes them from
integer nanoseconds of one monotonic clock):

    ttft = first content flush - arrival        itl[j] = flush[j] - flush[j-1]
    tail = end of response - last flush          e2e = ttft + sum(itl) + tail

A request that flushed no content (rejected, failed before its first token) has
``ttft_ms = None``, ``itl_ms = []`` and ``tail_ms = e2e_ms``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgspec


class RecordEvent(msgspec.Struct, gc=False):
    """One point of a request's timeline: a gateway stage boundary or an engine state.

    A msgspec Struct the garbage collector does not track (``gc=False``: it holds a number
    and two strings, so it can be in no reference cycle). A record's dozen events live until
    the record writer's flush (``TAILSCOPE_STORE_FLUSH_S``), and as tracked objects each was
    walked by every collection it lived through: with them untracked, a tiny-model gateway's
    collections under load cost 54-66 us of CPU a request against 89 (37 with capture off;
    ``tailscope:gc_pause_seconds``' callback per collection, 2,250 requests)."""

    ts_us: int  # wall clock, microseconds since the epoch
    state: str  # RECEIVED, ADMITTED, TOKENIZED, ROUTED, QUEUED, ..., FIRST_FLUSH, END
    detail: str = ""


@dataclass(slots=True)
class RequestRecord:
    # identity
    trace_id: str
    span_id: str  # the gateway's span for this request (in the response's traceparent)
    request_id: str  # x-request-id: the caller's when sent, else generated
    response_id: str = ""  # the id in the response body the client got (chatcmpl-..., cmpl-...)
    parent_span_id: str = ""  # the caller's span when a traceparent was sent
    tenant: str = ""
    api_key_id: str = ""  # HMAC-SHA256 of the API key (TAILSCOPE_KEY_ID_SECRET): never the key
    endpoint: str = ""  # /v1/chat/completions, ...
    bench_run: str = ""  # the x-tailscope-bench-run header: joins the record to a bench run
    # who the client says the request is for (OpenAI's safety_identifier, else its older user
    # field), and the request's OpenAI metadata (at most 16 string pairs) as a JSON object ("":
    # none): what a client tags its requests with, to find them again
    end_user: str = ""
    metadata: str = ""  # the request's OpenAI metadata as a JSON object ("": none)
    arrival_ts_us: int = 0
    # how it ended
    final_state: str = ""  # FINISHED, CANCELLED, TIMED_OUT, FAILED, REJECTED
    finish_reason: str = ""  # stop, length, stop_string, cancelled, timeout, rejected, error
    http_status: int = 0
    error_type: str = ""  # the OpenAI error code/type when it failed
    error_message: str = ""
    # versions
    model: str = ""
    model_revision: str = ""  # hash of the model's weights file or directory
    engine_version: str = ""  # the engine package version that ran it
    tokenizer_revision: str = ""  # hash of the tokenizer files
    gateway_version: str = ""  # the gateway package version
    config_id: str = ""  # hash of the resolved engine config (see /debug/config)
    # where it ran
    instance: str = ""  # the gateway that served it (TAILSCOPE_INSTANCE_ID)
    replica: str = ""
    route_reason: str = ""  # why the router chose the replica (cost, prefix locality)
    prefix_hit_tokens: int = 0  # leading prompt tokens the chosen replica served recently
    retries: int = 0  # re-submissions after a replica failure before the first token
    tool_calls: list[str] = field(default_factory=list)  # the names of the tools it called
    # where the engine stage columns come from: "engine" (the bundled engine's timeline),
    # "upstream" (an external backend's own report, e.g. llama.cpp's timings), "gateway"
    # (only what the gateway saw: the upstream's time stays unattributed)
    timing_source: str = ""
    # counts
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    generated_tokens: int = 0  # sampled by the engine (all choices)
    emitted_tokens: int = 0  # sent to the client (billing); excludes a stop string's tokens
    n: int = 1  # choices asked for
    # a /v1/completions batch of k prompts is k records (one per prompt, each its own trace id,
    # sharing request_id and response_id): this one's place in the batch (0 when not a batch)
    prompt_index: int = 0
    input_token_ids: list[int] = field(default_factory=list)  # the prompt as the model saw it
    output_token_ids: list[int] = field(default_factory=list)  # choice 0
    # choice 0: the engine step (engine_steps.step on its replica) that produced each token
    token_steps: list[int] = field(default_factory=list)
    # sampling params
    temperature: float | None = None
    top_p: float | None = None  # as requested (None: not given)
    top_k: int | None = None  # as requested (None: not given)
    min_p: float | None = None  # as requested (None: not given)
    seed: int | None = None  # as requested (None: not given)
    max_tokens: int | None = None  # as requested (None: not given)
    stream: bool = False  # whether the response was streamed
    # everything the engine was given besides the prompt, JSON (tracing.replay rebuilds the
    # request from it and input_token_ids): {"engine": SamplingParams fields, "n", "stop",
    # "include_stop_str_in_output", "scoring"}; empty when the record keeps no token ids
    sampling_params: str = ""
    # gateway stages
    ingress_ms: float = 0.0  # arrival -> past the ingress gate and parsed
    tokenize_ms: float = 0.0
    route_ms: float = 0.0
    # engine stages (the replica's durations, choice 0)
    engine_queue_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    preempted_ms: float = 0.0
    preemptions: int = 0  # times the engine preempted it
    backpressured_ms: float = 0.0
    # why it waited (tracing.timing.CAUSES): engine_queue_ms + preempted_ms split by cause
    wait_step_ms: float = 0.0  # the step in progress (and the way to the replica)
    wait_budget_ms: float = 0.0  # the tick's token budget went to others
    wait_kv_ms: float = 0.0  # no free KV blocks
    wait_seqs_ms: float = 0.0  # max_num_seqs requests running
    wait_hol_ms: float = 0.0  # behind the head of the queue
    wait_share_ms: float = 0.0  # held back for other tenants' fair share (fair policy)
    # who shared its steps: the tenant whose requests' prefill chunks brought the most prompt
    # tokens into the engine steps it ran in ("" when none did), and those tokens in all
    neighbour_tenant: str = ""
    neighbour_prefill_tokens: int = 0  # those tokens, summed over its steps
    # tail-based retention (tracing.retention): whether token ids, the ITL array and token
    # steps were kept, and why (all, tail_e2e, tail_ttft, not_finished, warmup, sampled,
    # dropped)
    detail_kept: bool = True
    detail_reason: str = ""  # why detail was kept or dropped
    priority: int = 0  # its place under the priority scheduling policy (lower first)
    # degraded admission (gateway.degrade): "degraded" when the gateway admitted it with
    # reductions under load instead of queueing or refusing it, else "standard"; what changed
    # ("max_tokens 512->64; n 4->1; priority 0->5"), "" when nothing did
    lane: str = "standard"
    degraded: str = ""  # what degraded admission changed ("" when nothing)
    # client-side timings
    ttft_ms: float | None = None
    tpot_ms: float | None = None  # time per output token after the first
    e2e_ms: float = 0.0  # arrival to the end of the response
    tail_ms: float = 0.0  # last content flush to the end of the response
    itl_ms: list[float] = field(default_factory=list)  # gaps between content flushes
    events: list[RecordEvent] = field(default_factory=list)
    ttl_days: int = 30  # how long the store keeps the row (the tenant's privacy setting)

    def keep_detail(self, reason: str) -> None:
        """Tail-based retention's decision (``tracing.retention``): why the detail is kept,
        or "dropped", which empties the token ids, the ITL array and the token steps."""
        self.detail_kept, self.detail_reason = reason != "dropped", reason
        if reason == "dropped":
            self.input_token_ids, self.output_token_ids = [], []
            self.token_steps, self.itl_ms = [], []

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["events"] = [msgspec.structs.asdict(e) for e in self.events]
        return out


RECORD_COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RequestRecord))
